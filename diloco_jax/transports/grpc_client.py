"""The learner's gRPC client of the syncer: the `Transport` protocol over the wire.

It implements `protocol.Transport`, like `transports/inprocess.py`, so the learner's background worker
does not know which one it holds. Calls block; the worker calls them, never the inner loop.

* Retries: while the syncer is unreachable or busy a call is retried with exponential backoff and jitter,
  and fails with `SyncerUnreachable` only after `unreachable_deadline_s` (a syncer restart from a
  checkpoint takes seconds to minutes; learners keep training meanwhile). Retried: UNAVAILABLE (down,
  restarting, network gone; also an emulated link that is cut off), RESOURCE_EXHAUSTED (rate limit,
  long-call slots full; not an oversize payload), DEADLINE_EXCEEDED (an attempt that took longer than
  `call_timeout_s`) and CANCELLED (a stream the syncer cut, or a syncer stopping) unless this client was
  closed. Every call may be repeated: pushes carry an idempotency key, so a retried push is merged once.
  Other failures are not retried: a refusal by the core is re-raised as the core's `Rejected` with the
  same reason, a bad token as `AuthError`.
* `close()` ends the calls in flight and any retry wait at once (they raise `SyncerUnreachable`): a
  learner shutting down is never held by the network.
* Byte counters: `bytes_sent` / `bytes_received` count every gRPC message of every call, exactly as
  `msg.ByteSize() + 5` (the serialized protobuf plus gRPC's 5-byte length-prefix frame header). Not counted:
  HTTP/2 frame headers (9 bytes per DATA frame, i.e. < 0.01% at 1 MiB chunks), HPACK-compressed call
  headers and metadata (tens of bytes per call after the first), TLS records and TCP/IP headers. Retried
  attempts count again: they crossed the wire again.
* WAN emulation: an optional `wan.WanLink` paces every chunk on its way out and in, and, with a cut-off
  file, drops calls while the link is down (retried as if the syncer were unreachable), on either plane.
* Data plane: when the syncer's Join names a data port (`syncer/dataplane.py`, framing in `wire.py`),
  push and pull payloads travel over a raw TCP connection to it (TLS with the same certificates when the
  channel has them; the token proven by an HMAC of the server's nonce), at socket speed, counted byte for
  byte as sent and received (the hello, request, replies and payload) and paced by the WAN emulation like
  gRPC chunks. A push carries the same header there, idempotency key included. If the data plane fails
  (refused connection, reset, timeout, an unreadable reply), the same attempt goes over gRPC, and gRPC
  carries the payloads until the next Join offers the data plane again; a push whose reply was lost is
  then merged once (its key). The data plane's refusals are retried and translated as gRPC's are (a busy
  or rate-limited syncer is retried, the core's refusals raise `Rejected`), and `close()` ends its
  transfers in flight too.
"""

from __future__ import annotations

import json
import logging
import pathlib
import random
import socket
import ssl
import threading
import time
from typing import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from diloco_jax.protocol import wire
from diloco_jax.protocol.messages import REASON_METADATA_KEY, REASONS, EpochRecord, ProtocolError, Published, Push
from diloco_jax.protocol.messages import PushReceipt, Reassembler, Rejected, Versions, chunks, shorten
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.transports import wan as wan_lib

log = logging.getLogger(__name__)

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message: 1 byte compressed flag + 4 bytes length
DEFAULT_CHUNK_BYTES = 1 << 20


class SyncerUnreachable(ConnectionError):
  """The syncer did not answer within the retry deadline."""


class AuthError(PermissionError):
  """The syncer refused the run token."""


class SyncerError(RuntimeError):
  """Any other failure of a syncer call (carries the gRPC status code)."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(f"{code.name}: {message}")
    self.code = code


_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
            grpc.StatusCode.CANCELLED)


def _message_bytes(msg) -> int:
  return msg.ByteSize() + GRPC_FRAME_BYTES


def _reason(e: grpc.RpcError) -> str | None:
  """The `diloco-reason` trailing metadata of a failed call, if any."""
  for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
    if key == REASON_METADATA_KEY:
      return value
  return None


def _retryable(e: grpc.RpcError) -> bool:
  code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
  if code not in _RETRIED:
    return False
  if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # busy, yes; a message over a size limit stays over it
    details = (e.details() if hasattr(e, "details") else "") or ""
    return _reason(e) != "oversize" and "larger than max" not in details
  return True


class _LinkDownError(grpc.RpcError):
  """An emulated WAN link that is cut off (`wan.LinkDown`), shaped like an UNAVAILABLE call: retried."""

  def __init__(self, message: str):
    super().__init__(message)
    self._message = message

  def code(self):
    return grpc.StatusCode.UNAVAILABLE

  def details(self):
    return self._message

  def trailing_metadata(self):
    return ()


class _DataPlaneRefusal(grpc.RpcError):
  """A refusal answered on the data plane, shaped like a failed gRPC call (status code, details, the
  reason as `diloco-reason` trailing metadata): retries and translation treat both planes alike."""

  _CODES = {"unauthenticated": grpc.StatusCode.UNAUTHENTICATED, "rate_limit": grpc.StatusCode.RESOURCE_EXHAUSTED,
            "busy": grpc.StatusCode.RESOURCE_EXHAUSTED, "oversize": grpc.StatusCode.RESOURCE_EXHAUSTED}

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self._reason, self._message = reason, message

  def code(self) -> grpc.StatusCode:
    return self._CODES.get(self._reason, grpc.StatusCode.INVALID_ARGUMENT)

  def details(self) -> str:
    return self._message

  def trailing_metadata(self):
    return ((REASON_METADATA_KEY, self._reason),)


_FELL_BACK = object()  # a data-plane transfer that failed: the attempt goes over gRPC


class GrpcTransport:
  """A learner's connection to the gRPC syncer; implements `transport.Transport`. Thread-safe.

  Args:
    target: `host:port` of the syncer.
    token: the run's shared token (read it with `server.read_token`, never from argv).
    learner_id: this learner's id.
    fingerprint: the run fingerprint, sent on calls whose Transport signature has none (pull, heartbeat).
      Defaults to the one last passed to `join`.
    tls_ca: PEM CA that signed the syncer's certificate (enables TLS).
    tls_cert, tls_key: PEM client certificate and key (mutual TLS).
    tls_server_name: expected name in the syncer certificate, if not the target's host.
    wan: emulate a WAN link (bandwidth cap, latency) on this client's chunks.
    chunk_bytes: Push chunk size (must stay under the syncer's message limit).
    unreachable_deadline_s: keep retrying an unreachable syncer this long before raising.
    backoff_s, max_backoff_s: first and largest retry delay.
    call_timeout_s: deadline of one attempt (a Pull adds its long-poll time).
    sleep: how to wait between retries (tests); default: a wait that `close()` ends.
    data_plane: use the syncer's data plane for payloads when its Join offers one.
    max_pull_bytes: the largest pulled payload accepted (a declared size beyond it is refused unread).
  """

  def __init__(self, target: str, token: str, learner_id: int, *, fingerprint: str | None = None,
               tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
               tls_server_name: str | None = None, wan: wan_lib.WanLink | wan_lib.WanSpec | None = None,
               chunk_bytes: int = DEFAULT_CHUNK_BYTES, max_message_bytes: int = 4 << 20,
               unreachable_deadline_s: float = 300.0, backoff_s: float = 0.1, max_backoff_s: float = 5.0,
               call_timeout_s: float = 120.0, sleep: Callable[[float], None] | None = None,
               data_plane: bool = True, max_pull_bytes: int = 2 << 30):
    if not token:
      raise ValueError("GrpcTransport needs the run token")
    if chunk_bytes < 1 or chunk_bytes + 64 > max_message_bytes:
      raise ValueError(f"chunk_bytes ({chunk_bytes}) must be in [1, max_message_bytes - 64]")
    self.target = target
    self.learner_id = int(learner_id)
    self.fingerprint = fingerprint
    self.chunk_bytes = chunk_bytes
    self.unreachable_deadline_s = unreachable_deadline_s
    self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
    self.call_timeout_s = call_timeout_s
    self.wan = wan_lib.WanLink(wan) if isinstance(wan, wan_lib.WanSpec) else wan
    self._closed = threading.Event()
    self._sleep = sleep or self._closed.wait
    self._metadata = (("authorization", f"Bearer {token}"),)
    self._token = token
    self._use_data_plane = data_plane
    self.data_port = 0  # from the last Join (0: the syncer offers no data plane)
    self.max_pull_bytes = max_pull_bytes
    self._pull_pool = wire.BufferPool(256 << 20)  # pulled payloads, reused once decoded
    self._data_host = target.rsplit(":", 1)[0].strip("[]")
    self._data_ssl, self._data_server_name = None, None
    self._data_socks: set = set()  # data-plane sockets in flight (`close` shuts them down)
    self._lock = threading.Lock()
    self._sent = 0
    self._received = 0
    self.retries = 0
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes),
               # A connection of its own (not shared with other clients of this process): the syncer
               # tells callers apart by their connection.
               ("grpc.use_local_subchannel_pool", 1),
               # The channel's own reconnect backoff (default: up to 120 s) must not outlast ours: a
               # restarted syncer is reached within max_backoff_s of serving again.
               ("grpc.initial_reconnect_backoff_ms", max(1, int(backoff_s * 1000))),
               ("grpc.min_reconnect_backoff_ms", max(1, int(backoff_s * 1000))),
               ("grpc.max_reconnect_backoff_ms", max(1, int(max_backoff_s * 1000)))]
    if tls_ca or tls_cert:
      read = lambda p: pathlib.Path(p).read_bytes() if p else None
      creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
      self._data_ssl = ssl.create_default_context(cafile=tls_ca)
      if tls_cert:
        self._data_ssl.load_cert_chain(tls_cert, tls_key)
      self._data_server_name = tls_server_name or self._data_host
      if tls_server_name:
        options.append(("grpc.ssl_target_name_override", tls_server_name))
      self._channel = grpc.secure_channel(target, creds, options=options)
    else:
      self._channel = grpc.insecure_channel(target, options=options)
    self._stub = pb_grpc.SyncerStub(self._channel)

  @classmethod
  def from_config(cls, config, target: str, token: str, learner_id: int, **tls) -> "GrpcTransport":
    """A client configured from `config.comms` (retries, chunks), `config.emulation` (WAN emulation) and
    `config.syncer` (message size); `tls`: tls_ca, tls_cert, tls_key, tls_server_name."""
    c, em = config.comms, config.emulation
    wan = None
    cutoff = str(em.cutoff_file).replace("{learner}", str(learner_id))
    if em.wan_gbps > 0 or em.wan_latency_ms > 0 or cutoff:
      wan = wan_lib.WanSpec.from_gbps(float(em.wan_gbps), latency_ms=float(em.wan_latency_ms), cutoff_file=cutoff)
    return cls(target, token, learner_id, wan=wan, chunk_bytes=int(c.chunk_kb) * 1024,
               max_message_bytes=int(config.syncer.max_message_mb) << 20,
               unreachable_deadline_s=float(c.unreachable_deadline_s), backoff_s=float(c.backoff_s),
               max_backoff_s=float(c.max_backoff_s), call_timeout_s=float(c.call_timeout_s), **tls)

  # --- byte accounting and WAN pacing -------------------------------------------------------------------

  @property
  def bytes_sent(self) -> int:
    with self._lock:
      return self._sent

  @property
  def bytes_received(self) -> int:
    with self._lock:
      return self._received

  def _out(self, msg, first: bool):
    n = _message_bytes(msg)
    if self.wan is not None:
      self.wan.send(n, first=first)
    with self._lock:
      self._sent += n
    return msg

  def _in(self, msg, first: bool):
    n = _message_bytes(msg)
    with self._lock:
      self._received += n
    if self.wan is not None:
      self.wan.receive(n, first=first)
    return msg

  def _arrived(self) -> None:
    # An idempotent answer is lost if the emulated link went down while it travelled (retried).
    if self.wan is not None:
      self.wan.check_link()

  # --- retries and error translation ----------------------------------------------------------------------

  def _call(self, name: str, attempt: Callable[[float], object]):
    """Run `attempt(timeout)`, retrying while the syncer is unreachable or busy; translate failures."""
    start = time.monotonic()
    delay = self.backoff_s
    while True:
      if self._closed.is_set():
        raise SyncerUnreachable(f"{name}: the connection to {self.target} was closed")
      try:
        if self.wan is not None:
          self.wan.check_link()
        return attempt(self.call_timeout_s)
      except (grpc.RpcError, wan_lib.LinkDown) as e:
        if self._closed.is_set():
          raise SyncerUnreachable(f"{name}: the connection to {self.target} was closed") from None
        if isinstance(e, wan_lib.LinkDown):
          e = _LinkDownError(str(e))
        if not _retryable(e):
          raise self._translate(name, e) from None
        code = e.code()
        waited = time.monotonic() - start
        if waited + delay > self.unreachable_deadline_s:
          raise SyncerUnreachable(f"syncer at {self.target} unreachable or busy for {waited:.1f}s ({name}; "
                                  f"last: {code.name} {shorten(e.details() or '', 200)})") from None
        with self._lock:
          self.retries += 1
        log.info("%s: syncer %s answered %s, retrying in %.2fs", name, self.target, code.name, delay)
        self._sleep(delay * random.uniform(0.8, 1.2))
        delay = min(delay * 2, self.max_backoff_s)

  def _translate(self, name: str, e: grpc.RpcError) -> Exception:
    code, details = e.code(), e.details() or ""
    reason = _reason(e)
    if code == grpc.StatusCode.UNAUTHENTICATED:
      return AuthError(f"{name}: syncer refused the run token: {details}")
    if reason in REASONS:
      prefix = f"rejected ({reason}): "
      return Rejected(reason, details[len(prefix):] if details.startswith(prefix) else details)
    return SyncerError(code, f"{name}: {details}")

  # --- the Transport protocol ----------------------------------------------------------------------------

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    """Enter the quorum; returns {fragment: version} of the global model."""
    self.fingerprint = fingerprint
    request = pb.JoinRequest(learner_id=learner_id, fingerprint=fingerprint)

    def attempt(timeout):
      self._out(request, True)
      response = self._in(self._stub.Join(request, timeout=timeout, metadata=self._metadata), True)
      self._arrived()
      self.data_port = int(response.data_port) if self._use_data_plane else 0
      history = tuple(EpochRecord(int(h.epoch), tuple(int(x) for x in h.start_rounds),
                                  tuple(int(x) for x in h.version_offsets)) for h in response.history)
      return Versions({int(k): int(v) for k, v in response.versions.items()}, epoch=int(response.epoch),
                      history=history)

    return self._call("join", attempt)

  def leave(self, learner_id: int | None = None) -> None:
    """Leave the quorum cleanly (a silent learner loses its lease instead)."""
    request = pb.LeaveRequest(learner_id=self.learner_id if learner_id is None else learner_id,
                              fingerprint=self.fingerprint or "")

    def attempt(timeout):
      self._out(request, True)
      self._in(self._stub.Leave(request, timeout=timeout, metadata=self._metadata), True)

    self._call("leave", attempt)

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease, reporting the recent inner-step time, the step counter (None: unknown) and
    whether the learner waits on the syncer; returns the syncer's epoch."""
    request = pb.HeartbeatRequest(learner_id=learner_id, fingerprint=self.fingerprint or "",
                                  step_time_s=float(step_time_s), blocked=bool(blocked))
    if step is not None:
      request.step = int(step)

    def attempt(timeout):
      self._out(request, True)
      epoch = int(self._in(self._stub.Heartbeat(request, timeout=timeout, metadata=self._metadata), True).epoch)
      self._arrived()
      return epoch

    return self._call("heartbeat", attempt)

  def status(self) -> dict:
    """The syncer's status (members, versions, counters; `server`: the service's own counters)."""
    request = pb.StatusRequest()

    def attempt(timeout):
      self._out(request, True)
      response = self._in(self._stub.Status(request, timeout=timeout, metadata=self._metadata), True)
      return json.loads(response.json)

    return self._call("status", attempt)

  def push(self, push: Push) -> PushReceipt:
    """Send one outer gradient in chunks; returns the syncer's receipt."""
    header = pb.PushHeader(learner_id=push.learner_id, fingerprint=push.fingerprint, fragment=push.fragment,
                           base_version=push.base_version, steps=push.steps, tokens=push.tokens,
                           codec=push.codec, checksum=push.checksum, total_size=len(push.payload),
                           incarnation=push.incarnation, sequence=push.sequence, base_epoch=push.base_epoch)

    def attempt(timeout):
      if self.data_port:
        receipt = self._data_call("push", wire.OP_PUSH, header, push.payload)
        if receipt is not _FELL_BACK:
          return receipt
      response = self._stub.Push(self._push_chunks(header, push.payload), timeout=timeout,
                                 metadata=self._metadata)
      response = self._in(response, True)
      return PushReceipt(fragment=response.fragment, round=response.round, late=response.late,
                         epoch=int(response.epoch), version=response.version)

    return self._call("push", attempt)

  def _push_chunks(self, header, payload: bytes) -> Iterator[pb.PushChunk]:
    yield self._out(pb.PushChunk(header=header), True)
    for offset, data in chunks(payload, self.chunk_bytes):
      yield self._out(pb.PushChunk(data=data, offset=offset), False)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The global fragment once its version is >= min_version, waiting up to `timeout_s` on the syncer
    (long-poll); None if it did not come in time. `have_version`, `have_epoch`: the version whose reference
    this learner holds (-1: none) and the syncer epoch it came from; the answer may then be a delta."""
    request = pb.PullRequest(learner_id=self.learner_id, fingerprint=self.fingerprint or "",
                             fragment=fragment, min_version=min_version, timeout_s=float(timeout_s))
    if have_version >= 0:  # unset means "nothing usable": a full answer
      request.have_version = have_version
      request.have_epoch = have_epoch

    def attempt(timeout):
      if self.data_port:
        pulled = self._data_call("pull", wire.OP_PULL, request, None, wait_s=float(timeout_s))
        if pulled is not _FELL_BACK:
          return pulled
      self._out(request, True)
      stream = self._stub.Pull(request, timeout=timeout + float(timeout_s), metadata=self._metadata)
      first = next(stream, None)
      if first is None or first.WhichOneof("kind") != "header":
        raise SyncerError(grpc.StatusCode.INTERNAL, "pull: the syncer's answer did not start with a header")
      h = self._in(first, True).header
      if not h.found:
        for _ in stream:  # drain: nothing should follow
          pass
        self._arrived()
        return None
      if h.kind not in ("", "full", "delta"):
        raise SyncerError(grpc.StatusCode.INTERNAL, f"pull: unknown fragment kind {shorten(h.kind)}")
      payload = Reassembler(h.total_size, f"pulled fragment {h.fragment}")
      try:
        for msg in stream:
          payload.add(self._in(msg, False).offset, msg.data)
        data = payload.finish()
      except ProtocolError as e:
        raise SyncerError(grpc.StatusCode.DATA_LOSS, f"pull: {e}") from None
      self._arrived()
      if h.kind == "delta":
        return Published(fragment=h.fragment, version=h.version, codec=h.codec, payload=data,
                         checksum=h.checksum, kind="delta", base_version=h.base_version, epoch=h.epoch)
      return Published(fragment=h.fragment, version=h.version, codec=h.codec, payload=data,
                       checksum=h.checksum, epoch=h.epoch)

    return self._call("pull", attempt)

  # --- the data plane ------------------------------------------------------------------------------------

  def _data_call(self, name: str, op: bytes, header, payload: bytes | None, wait_s: float = 0.0):
    """One transfer over the data plane: the PushReceipt (push), the Published or None (pull). A refusal
    raises `_DataPlaneRefusal` (retried or translated by `_call`, as gRPC's); a broken transfer returns
    `_FELL_BACK` after logging (the attempt goes over gRPC), or raises SyncerUnreachable once closed."""
    port = self.data_port
    sock = None
    try:
      raw = socket.create_connection((self._data_host, port), timeout=min(self.call_timeout_s, 10.0))
      try:
        raw.settimeout(self.call_timeout_s)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = (self._data_ssl.wrap_socket(raw, server_hostname=self._data_server_name)
                if self._data_ssl is not None else raw)
      except BaseException:
        raw.close()
        raise
      with self._lock:
        self._data_socks.add(sock)
      if self._closed.is_set():  # closed meanwhile: `close` may have missed this socket
        raise OSError("the transport was closed")
      nonce = wire.parse_hello(self._data_recv(sock, wire.HELLO_BYTES, first=True))
      self._data_send(sock, wire.request(self._token, nonce, op, header.SerializeToString()), first=True)
      if op == wire.OP_PUSH:
        wire.send_payload(sock, payload, lambda n: self._data_count_out(n, first=False))
        r = pb.PushResponse.FromString(self._data_reply(sock, name))
        return PushReceipt(fragment=r.fragment, round=r.round, late=r.late, epoch=int(r.epoch),
                           version=r.version)
      sock.settimeout(self.call_timeout_s + wait_s)  # the reply waits for the long-poll
      h = pb.PullHeader.FromString(self._data_reply(sock, name))
      sock.settimeout(self.call_timeout_s)
      pulled = self._data_pulled(sock, h)
      self._arrived()
      return pulled
    except wan_lib.LinkDown:  # the emulated link is down on either plane: retried by `_call`
      raise
    except (OSError, wire.WireError, ssl.SSLError, ProtocolError, DecodeError) as e:
      if self._closed.is_set():
        raise SyncerUnreachable(f"{name}: the connection to {self.target} was closed") from None
      # gRPC carries the payloads until the next Join offers the data plane again.
      log.warning("%s: data plane to %s:%d failed (%s); using gRPC", name, self._data_host, port, e)
      self.data_port = 0
      return _FELL_BACK
    finally:
      if sock is not None:
        with self._lock:
          self._data_socks.discard(sock)
        sock.close()

  def _data_pulled(self, sock, h) -> Published | None:
    if not h.found:
      return None
    if h.kind not in ("", "full", "delta"):
      raise SyncerError(grpc.StatusCode.INTERNAL, f"pull: unknown fragment kind {shorten(h.kind)}")
    if h.total_size > self.max_pull_bytes:
      raise SyncerError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"pull: declared payload of {h.total_size} bytes "
                        f"exceeds this client's limit of {self.max_pull_bytes}")
    data = wire.recv_payload(sock, h.total_size, f"pulled fragment {h.fragment}",
                             lambda n: self._data_count_in(n, first=False), self._pull_pool)
    kind = {"base_version": h.base_version, "kind": "delta"} if h.kind == "delta" else {}
    return Published(fragment=h.fragment, version=h.version, codec=h.codec, payload=data, checksum=h.checksum,
                     epoch=h.epoch, **kind)

  def _data_reply(self, sock, name: str) -> bytes:
    status, body = wire.recv_frame(sock, f"{name} reply")
    self._data_count_in(5 + len(body), first=False)
    if status == wire.OK:
      return body
    raise _DataPlaneRefusal(*wire.parse_refusal(body))

  def _data_send(self, sock, data: bytes, first: bool) -> None:
    self._data_count_out(len(data), first)
    sock.sendall(data)

  def _data_recv(self, sock, n: int, first: bool) -> bytes:
    data = wire.recv_exact(sock, n, "hello")
    self._data_count_in(n, first)
    return data

  def _data_count_out(self, n: int, first: bool) -> None:
    if self.wan is not None:
      self.wan.send(n, first=first)
    with self._lock:
      self._sent += n

  def _data_count_in(self, n: int, first: bool) -> None:
    with self._lock:
      self._received += n
    if self.wan is not None:
      self.wan.receive(n, first=first)

  def close(self) -> None:
    """Close the connection: calls in flight (data-plane transfers too) and retry waits end at once
    (`SyncerUnreachable`)."""
    self._closed.set()
    with self._lock:
      socks = list(self._data_socks)
    for sock in socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:  # already closed by its transfer
        pass
    self._channel.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

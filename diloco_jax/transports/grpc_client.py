"""The learner's gRPC client of the syncer: the `Transport` protocol over the wire.

It implements `protocol.Transport`, like `transports/inprocess.py`, so the learner's background worker
does not know which one it holds. Calls block; the worker calls them, never the inner loop.

* Retries (`retry.py`): an unreachable or busy syncer is retried with backoff until
  `unreachable_deadline_s`; errors are the transports' own (`errors.py`), on both planes alike.
* `close()` ends the calls in flight and any retry wait at once: a learner shutting down is never held by
  the network.
* Byte counters (`traffic.Traffic`): every gRPC message of every call, retries included (`bytes_sent`).
* WAN emulation: an optional `wan.WanLink` paces every chunk and, with a cut-off file, drops calls while
  the link is down, on either plane.
* Data plane (`dataplane_client.py`): when the syncer's Join names a data port, push and pull payloads
  travel over raw TCP at socket speed; if a transfer breaks, the same attempt goes over gRPC.
"""

from __future__ import annotations

import logging
import pathlib
import threading
from collections.abc import Callable, Iterator

import grpc

from diloco_jax.protocol import convert
from diloco_jax.protocol.chunking import ProtocolError, Reassembler
from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.reasons import REASON_METADATA_KEY, shorten
from diloco_jax.transports import wan as wan_lib
from diloco_jax.transports.dataplane_client import FELL_BACK, DataPlaneClient
from diloco_jax.transports.errors import CallFailed, SyncerError
from diloco_jax.transports.retry import Retrier
from diloco_jax.transports.traffic import Traffic

log = logging.getLogger(__name__)

GRPC_FRAME_BYTES = 5  # gRPC length-prefixed message: 1 byte compressed flag + 4 bytes length
DEFAULT_CHUNK_BYTES = 1 << 20


def _message_bytes(msg) -> int:
  return msg.ByteSize() + GRPC_FRAME_BYTES


def _failed(e: grpc.RpcError) -> CallFailed:
  """A failed gRPC call as the transports' own error: its status code, `diloco-reason` and details."""
  code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
  details = (e.details() if hasattr(e, "details") else "") or ""
  metadata = (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ()
  reason = next((value for key, value in metadata if key == REASON_METADATA_KEY), None)
  return CallFailed(code.name, reason, details)


def _channel(target: str, *, tls_ca, tls_cert, tls_key, tls_server_name, max_message_bytes: int,
             backoff_s: float, max_backoff_s: float) -> grpc.Channel:
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
  if not (tls_ca or tls_cert):
    return grpc.insecure_channel(target, options=options)
  read = lambda p: pathlib.Path(p).read_bytes() if p else None
  creds = grpc.ssl_channel_credentials(read(tls_ca), read(tls_key), read(tls_cert))
  if tls_server_name:
    options.append(("grpc.ssl_target_name_override", tls_server_name))
  return grpc.secure_channel(target, creds, options=options)


class GrpcTransport:
  """A learner's connection to the gRPC syncer; implements `protocol.Transport`. Thread-safe.

  Errors: a refusal by the core raises the core's `Rejected`, a bad token `AuthError`, a syncer still
  unreachable at `unreachable_deadline_s` (or a closed client) `SyncerUnreachable`, anything else
  `SyncerError`. A failed gRPC call becomes an `errors.CallFailed`, as a data-plane refusal does, so both
  planes are retried and translated alike. An emulated link that is cut off drops calls, which are retried
  as if the syncer were unreachable.

  Args:
    target: `host:port` of the syncer.
    token: the run's shared token (read it with `protocol.run_token.read_token`, never from argv).
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
    max_pull_bytes: the largest pulled payload accepted over the data plane (a declared size beyond it
      is refused unread).
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
    self.call_timeout_s = call_timeout_s
    self.wan = wan_lib.WanLink(wan) if isinstance(wan, wan_lib.WanSpec) else wan
    self._closed = threading.Event()
    self._traffic = Traffic(self.wan)
    self._retry = Retrier(target, deadline_s=unreachable_deadline_s, backoff_s=backoff_s,
                          max_backoff_s=max_backoff_s, closed=self._closed, sleep=sleep,
                          check_link=self._traffic.check_link)
    self._metadata = (("authorization", f"Bearer {token}"),)
    self._use_data_plane = data_plane
    tls = dict(tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, tls_server_name=tls_server_name)
    self._data = DataPlaneClient(target, token, self._traffic, closed=self._closed, call_timeout_s=call_timeout_s,
                                 max_pull_bytes=max_pull_bytes, **tls)
    self._channel = _channel(target, max_message_bytes=max_message_bytes, backoff_s=backoff_s,
                             max_backoff_s=max_backoff_s, **tls)
    self._stub = pb_grpc.SyncerStub(self._channel)

  @classmethod
  def from_config(cls, config, target: str, token: str, learner_id: int, **tls) -> GrpcTransport:
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

  # --- byte accounting, WAN pacing, retries -------------------------------------------------------------

  @property
  def bytes_sent(self) -> int:
    """Bytes of every gRPC message of every call, exactly as `msg.ByteSize() + 5` (the serialized protobuf
    plus gRPC's 5-byte length-prefix frame header), and of the data plane's framing and payloads. Not
    counted: HTTP/2 frame headers (9 bytes per DATA frame, i.e. < 0.01% at 1 MiB chunks), HPACK-compressed
    call headers and metadata (tens of bytes per call after the first), TLS records and TCP/IP headers.
    Retried attempts count again: they crossed the wire again. `bytes_received` likewise."""
    return self._traffic.bytes_sent

  @property
  def bytes_received(self) -> int:
    return self._traffic.bytes_received

  @property
  def retries(self) -> int:
    """Attempts repeated so far (both planes)."""
    return self._retry.retries

  @property
  def data_port(self) -> int:
    """The syncer's data plane as offered by the last Join (0: none, or it refused as busy since)."""
    return self._data.port

  @property
  def data_connections(self) -> int:
    """Data-plane connections this client opened so far (each reused for transfer after transfer)."""
    return self._data.connections

  def _out(self, msg, first: bool):
    self._traffic.sent(_message_bytes(msg), first)
    return msg

  def _in(self, msg, first: bool):
    self._traffic.received(_message_bytes(msg), first)
    return msg

  def _arrived(self) -> None:
    # An idempotent answer is lost if the emulated link went down while it travelled (retried).
    self._traffic.check_link()

  def _call(self, name: str, attempt: Callable[[float], object]):
    """Run `attempt(timeout)` until it answers (`retry.Retrier`), a failed gRPC call as a `CallFailed`."""

    def once():
      try:
        return attempt(self.call_timeout_s)
      except grpc.RpcError as e:
        raise _failed(e) from None

    return self._retry.call(name, once)

  # --- the Transport protocol ----------------------------------------------------------------------------

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Enter the quorum; returns the versions of the global model, with the syncer's epoch and history."""
    self.fingerprint = fingerprint
    request = convert.join_request(learner_id, fingerprint)

    def attempt(timeout):
      self._out(request, True)
      response = self._in(self._stub.Join(request, timeout=timeout, metadata=self._metadata), True)
      self._arrived()
      self._data.offered(int(response.data_port) if self._use_data_plane else 0)
      return convert.versions_from(response)

    return self._call("join", attempt)

  def leave(self, learner_id: int | None = None) -> None:
    """Leave the quorum cleanly (a silent learner loses its lease instead)."""
    request = convert.leave_request(self.learner_id if learner_id is None else learner_id, self.fingerprint or "")

    def attempt(timeout):
      self._out(request, True)
      self._in(self._stub.Leave(request, timeout=timeout, metadata=self._metadata), True)

    self._call("leave", attempt)

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease, reporting the recent inner-step time, the step counter (None: unknown) and
    whether the learner waits on the syncer; returns the syncer's epoch."""
    request = convert.heartbeat_request(learner_id, self.fingerprint or "", step_time_s, step, blocked)

    def attempt(timeout):
      self._out(request, True)
      epoch = convert.epoch_from(self._in(self._stub.Heartbeat(request, timeout=timeout, metadata=self._metadata),
                                          True))
      self._arrived()
      return epoch

    return self._call("heartbeat", attempt)

  def status(self) -> dict:
    """The syncer's status (members, versions, counters; `server`: the service's own counters)."""
    request = convert.status_request()

    def attempt(timeout):
      self._out(request, True)
      return convert.status_from(self._in(self._stub.Status(request, timeout=timeout, metadata=self._metadata),
                                          True))

    return self._call("status", attempt)

  def push(self, push: Push) -> PushReceipt:
    """Send one outer gradient in chunks; returns the syncer's receipt."""
    header = convert.push_header(push)

    def attempt(timeout):
      if self._data.usable:
        receipt = self._data.push(header, push.payload)
        if receipt is not FELL_BACK:
          return receipt
      response = self._stub.Push(self._push_chunks(header, push.payload), timeout=timeout,
                                 metadata=self._metadata)
      return convert.receipt_from(self._in(response, True))

    return self._call("push", attempt)

  def _push_chunks(self, header, payload: bytes) -> Iterator:
    for k, message in enumerate(convert.push_chunks(header, payload, self.chunk_bytes)):
      yield self._out(message, k == 0)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The global fragment once its version is >= min_version, waiting up to `timeout_s` on the syncer
    (long-poll); None if it did not come in time. `have_version`, `have_epoch`: the version whose reference
    this learner holds (-1: none) and the syncer epoch it came from; the answer may then be a delta."""
    request = convert.pull_request(self.learner_id, self.fingerprint or "", fragment, min_version, timeout_s,
                                   have_version, have_epoch)

    def attempt(timeout):
      if self._data.usable:
        pulled = self._data.pull(request, float(timeout_s))
        if pulled is not FELL_BACK:
          return pulled
      self._out(request, True)
      return self._pulled(self._stub.Pull(request, timeout=timeout + float(timeout_s), metadata=self._metadata))

    return self._call("pull", attempt)

  def _pulled(self, stream) -> Published | None:
    """A Pull stream's answer: a header, then (if found) the payload's chunks."""
    first = next(stream, None)
    if first is None or first.WhichOneof("kind") != "header":
      raise SyncerError("INTERNAL", "pull: the syncer's answer did not start with a header")
    h = self._in(first, True).header
    if not h.found:
      for _ in stream:  # drain: nothing should follow
        pass
      self._arrived()
      return None
    if convert.pulled_kind(h) is None:
      raise SyncerError("INTERNAL", f"pull: unknown fragment kind {shorten(h.kind)}")
    payload = Reassembler(h.total_size, f"pulled fragment {h.fragment}")
    try:
      for msg in stream:
        payload.add(self._in(msg, False).offset, msg.data)
      data = payload.finish()
    except ProtocolError as e:
      raise SyncerError("DATA_LOSS", f"pull: {e}") from None
    self._arrived()
    return convert.published_from(h, data)

  def close(self) -> None:
    """Close the connection: calls in flight (data-plane transfers too) and retry waits end at once
    (`SyncerUnreachable`)."""
    self._closed.set()
    self._data.close()
    self._channel.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

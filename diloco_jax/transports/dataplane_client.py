"""The learner's client of the syncer's raw-TCP data plane (`syncer/server/dataplane.py`, framing in
`protocol/wire.py`): push and pull payloads at socket speed, one connection per transfer.

TLS with the same certificates as the gRPC channel when it has them; the run token proven by an HMAC of
the server's nonce. Every byte is counted as sent or received (the hello, request, replies and payload)
and paced by the WAN emulation like gRPC chunks (`traffic.Traffic`). A push carries the gRPC PushHeader,
idempotency key included. A refusal raises `errors.CallFailed` (retried or translated by `retry.py`, as
gRPC's failures are). A broken transfer (refused connection, reset, timeout, an unreadable reply) returns
`FELL_BACK` after logging: the same attempt goes over gRPC, and gRPC carries the payloads until the next
Join offers the data plane again (`port` is 0 meanwhile). So does a data plane that refuses as busy or
over its rate (its slots may be held by another holder of the token: gRPC's are this connection's), or
that stalls: the connection, TLS and hello must come within `HANDSHAKE_S`. `close()` ends the transfers
in flight.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading

from google.protobuf.message import DecodeError

from diloco_jax.protocol import convert, wire
from diloco_jax.protocol.chunking import BufferPool, ProtocolError
from diloco_jax.protocol.messages import Published, PushReceipt
from diloco_jax.protocol.reasons import Reason, shorten, status_of
from diloco_jax.transports.errors import CallFailed, LinkDown, SyncerError, SyncerUnreachable
from diloco_jax.transports.traffic import Traffic

log = logging.getLogger(__name__)

FELL_BACK = object()  # a data-plane transfer that failed: the attempt goes over gRPC
HANDSHAKE_S = 10.0  # the connection, TLS handshake and hello must come within this (at most the call timeout)
FALL_BACK_REASONS = (Reason.BUSY, Reason.RATE_LIMIT)  # data-plane refusals that send the attempt over gRPC


class DataPlaneClient:
  """Transfers to the data plane on the syncer's host, at `port` (0: none offered; set from each Join).
  Thread-safe.

  Args:
    target: the syncer's gRPC `host:port` (the data plane listens on the same host).
    token: the run token.
    traffic: the client's byte counters and WAN pacing, shared with its gRPC calls.
    closed: set when the transport closes: a transfer that fails then raises `SyncerUnreachable`.
    call_timeout_s: the timeout of every socket operation (a pull's reply adds its long-poll time).
    max_pull_bytes: the largest pulled payload accepted (a declared size beyond it is refused unread).
    tls_ca, tls_cert, tls_key, tls_server_name: as the gRPC channel's (TLS when tls_ca or tls_cert).
  """

  def __init__(self, target: str, token: str, traffic: Traffic, *, closed: threading.Event,
               call_timeout_s: float, max_pull_bytes: int, tls_ca: str | None = None, tls_cert: str | None = None,
               tls_key: str | None = None, tls_server_name: str | None = None):
    self.target, self.host, self.port = target, target.rsplit(":", 1)[0].strip("[]"), 0
    self._token, self._traffic, self._closed = token, traffic, closed
    self.call_timeout_s, self.max_pull_bytes = call_timeout_s, max_pull_bytes
    self._ssl, self._server_name = None, None
    if tls_ca or tls_cert:
      self._ssl = ssl.create_default_context(cafile=tls_ca)
      if tls_cert:
        self._ssl.load_cert_chain(tls_cert, tls_key)
      self._server_name = tls_server_name or self.host
    self._pool = BufferPool(256 << 20)  # pulled payloads, reused once decoded
    self._socks: set = set()  # sockets in flight (`close` shuts them down)
    self._lock = threading.Lock()

  def push(self, header, payload) -> PushReceipt | object:
    """Push `payload` under its PushHeader: the receipt, or FELL_BACK."""
    return self._transfer("push", wire.OP_PUSH, header, payload)

  def pull(self, request, wait_s: float) -> Published | None | object:
    """A PullRequest's answer (None: not found within its long-poll of `wait_s`), or FELL_BACK."""
    return self._transfer("pull", wire.OP_PULL, request, None, wait_s)

  def _connect(self):
    raw = socket.create_connection((self.host, self.port), timeout=min(self.call_timeout_s, HANDSHAKE_S))
    try:
      raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      return self._ssl.wrap_socket(raw, server_hostname=self._server_name) if self._ssl is not None else raw
    except BaseException:
      raw.close()
      raise

  def _transfer(self, name: str, op: bytes, header, payload, wait_s: float = 0.0):
    port = self.port
    sock = None
    try:
      sock = self._connect()
      with self._lock:
        self._socks.add(sock)
      if self._closed.is_set():  # closed meanwhile: `close` may have missed this socket
        raise OSError("the transport was closed")
      nonce = wire.parse_hello(self._recv(sock, wire.HELLO_BYTES))
      sock.settimeout(self.call_timeout_s)
      self._send(sock, wire.request(self._token, nonce, op, header.SerializeToString()))
      if op == wire.OP_PUSH:
        wire.send_payload(sock, payload, lambda n: self._traffic.sent(n, first=False))
        return convert.parse_receipt(self._reply(sock, name))
      sock.settimeout(self.call_timeout_s + wait_s)  # the reply waits for the long-poll
      h = convert.parse_pull_header(self._reply(sock, name))
      sock.settimeout(self.call_timeout_s)
      pulled = self._pulled(sock, h)
      self._traffic.check_link()  # an answer that arrived while the emulated link went down is lost
      return pulled
    except LinkDown:  # the emulated link is down on either plane: retried
      raise
    except CallFailed as e:
      if e.reason not in FALL_BACK_REASONS or self._closed.is_set():
        raise
      log.warning("%s: data plane to %s:%d refused (%s); using gRPC", name, self.host, port, e.reason)
      self.port = 0
      return FELL_BACK
    except (OSError, wire.WireError, ssl.SSLError, ProtocolError, DecodeError) as e:
      if self._closed.is_set():
        raise SyncerUnreachable(f"{name}: the connection to {self.target} was closed") from None
      # gRPC carries the payloads until the next Join offers the data plane again.
      log.warning("%s: data plane to %s:%d failed (%s); using gRPC", name, self.host, port, e)
      self.port = 0
      return FELL_BACK
    finally:
      if sock is not None:
        with self._lock:
          self._socks.discard(sock)
        sock.close()

  def _pulled(self, sock, h) -> Published | None:
    if not h.found:
      return None
    if convert.pulled_kind(h) is None:
      raise SyncerError("INTERNAL", f"pull: unknown fragment kind {shorten(h.kind)}")
    if h.total_size > self.max_pull_bytes:
      raise SyncerError("RESOURCE_EXHAUSTED", f"pull: declared payload of {h.total_size} bytes exceeds this "
                        f"client's limit of {self.max_pull_bytes}")
    data = wire.recv_payload(sock, h.total_size, f"pulled fragment {h.fragment}",
                             lambda n: self._traffic.received(n, first=False), self._pool)
    return convert.published_from(h, data)

  def _reply(self, sock, name: str) -> bytes:
    status, body = wire.recv_frame(sock, f"{name} reply")
    self._traffic.received(5 + len(body), first=False)
    if status == wire.OK:
      return body
    reason, message = wire.parse_refusal(body)
    raise CallFailed(status_of(reason), reason, message)

  def _send(self, sock, data: bytes) -> None:
    self._traffic.sent(len(data), first=True)
    sock.sendall(data)

  def _recv(self, sock, n: int) -> bytes:
    data = wire.recv_exact(sock, n, "hello")
    self._traffic.received(n, first=True)
    return data

  def close(self) -> None:
    """End the transfers in flight (set `closed` first: they raise `SyncerUnreachable`)."""
    with self._lock:
      socks = list(self._socks)
    for sock in socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:  # already closed by its transfer
        pass

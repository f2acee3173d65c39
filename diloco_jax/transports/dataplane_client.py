"""The learner's client of the syncer's raw-TCP data plane (`syncer/server/dataplane.py`, framing in
`protocol/wire.py`): push and pull payloads at socket speed over persistent connections.

A pool of connections, each set up (TCP, TLS with the gRPC channel's certificates, the run token proven
by an HMAC of the server's nonce) once and reused for transfer after transfer, one at a time; as many as
transfers overlap, at most `MAX_IDLE` kept between them. Every byte is counted and paced by the WAN
emulation (`traffic.Traffic`), set-up round trips included. A push carries the gRPC PushHeader,
idempotency key included. A refusal raises `errors.CallFailed` (retried or translated by `retry.py`) and
ends its connection. A broken transfer (reset, timeout, an unreadable reply) on a reused connection is
tried once more on a fresh one (the syncer may have closed it idle); else it returns `FELL_BACK` after
logging: the same attempt goes over gRPC, which carries the payloads until the backoff (`BACKOFF_S`,
doubling to `MAX_BACKOFF_S`) lets the data plane be tried again. A data plane that refuses as busy or
over its rate (its slots may be another token holder's: gRPC's are this connection's) sends the attempt
over gRPC until the next Join (`port` is 0 meanwhile); so does one that stalls: the connection, TLS and
hello must come within `HANDSHAKE_S`. `close()` ends the transfers in flight and the idle connections.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time

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
MAX_IDLE = 4  # connections kept open between transfers (4 learners on a host: 16 of its 32 per address)
BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0  # after a broken transfer, gRPC carries the payloads this long (doubling)


class _Connection:
  """One data-plane connection: its socket, and the server's nonce until the token is proven."""

  def __init__(self, sock, nonce: bytes):
    self.sock, self.nonce = sock, nonce

  def request(self, token: str, op: bytes, header: bytes) -> bytes:
    """The next request's bytes: the token's proof with the first only."""
    if self.nonce is None:
      return wire.next_request(op, header)
    data, self.nonce = wire.request(token, self.nonce, op, header), None
    return data

  def stale(self) -> bool:
    """Whether an idle connection was closed by the syncer (or sent what it should not have): readable."""
    try:
      return self.sock.fileno() < 0 or bool(select.select([self.sock], [], [], 0)[0])
    except (OSError, ValueError):
      return True


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
    self._socks: set = set()  # every open socket (`close` shuts them down)
    self._idle: list[_Connection] = []  # connections between transfers, newest last
    self._lock = threading.Lock()
    self._backoff_s, self._retry_at = BACKOFF_S, 0.0
    self.connections = 0  # connections opened so far (diagnostics, tests)

  @property
  def usable(self) -> bool:
    """Whether transfers go over the data plane now: one is offered and no backoff is running."""
    return bool(self.port) and time.monotonic() >= self._retry_at

  def offered(self, port: int) -> None:
    """A Join's offer: the data plane at `port` (0: none); clears the backoff."""
    self.port, self._backoff_s, self._retry_at = int(port), BACKOFF_S, 0.0

  def push(self, header, payload) -> PushReceipt | object:
    """Push `payload` under its PushHeader: the receipt, or FELL_BACK."""
    return self._transfer("push", wire.OP_PUSH, header, payload)

  def pull(self, request, wait_s: float) -> Published | None | object:
    """A PullRequest's answer (None: not found within its long-poll of `wait_s`), or FELL_BACK."""
    return self._transfer("pull", wire.OP_PULL, request, None, wait_s)

  def _connect(self, port: int) -> _Connection:
    """A new connection, up to the server's hello (the set-up round trips paid on the emulated link)."""
    raw = socket.create_connection((self.host, port), timeout=min(self.call_timeout_s, HANDSHAKE_S))
    try:
      raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      sock = self._ssl.wrap_socket(raw, server_hostname=self._server_name) if self._ssl is not None else raw
    except BaseException:
      raw.close()
      raise
    with self._lock:
      self._socks.add(sock)
      self.connections += 1
    try:
      if self._closed.is_set():  # closed meanwhile: `close` may have missed this socket
        raise OSError("the transport was closed")
      self._traffic.connected(tls=self._ssl is not None)
      return _Connection(sock, wire.parse_hello(self._recv(sock, wire.HELLO_BYTES)))
    except BaseException:
      self._drop(sock)
      raise

  def _take(self, port: int) -> tuple[_Connection, bool]:
    """(a connection, whether it is reused): an idle one that is still open, else a new one."""
    while True:
      with self._lock:
        conn = self._idle.pop() if self._idle else None
      if conn is None:
        return self._connect(port), False
      if not conn.stale():
        return conn, True
      self._drop(conn.sock)

  def _give_back(self, conn: _Connection) -> None:
    with self._lock:
      if len(self._idle) < MAX_IDLE and not self._closed.is_set():
        self._idle.append(conn)
        return
    self._drop(conn.sock)

  def _drop(self, sock) -> None:
    with self._lock:
      self._socks.discard(sock)
    sock.close()

  def _transfer(self, name: str, op: bytes, header, payload, wait_s: float = 0.0):
    port = self.port
    for attempt in range(2):
      conn, reused = None, False
      try:
        conn, reused = self._take(port)
        result = self._exchange(conn, name, op, header, payload, wait_s)
        self._give_back(conn)
        conn, self._backoff_s = None, BACKOFF_S
        return result
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
        if reused and attempt == 0:  # closed idle by the syncer meanwhile: once more on a fresh connection
          continue
        log.warning("%s: data plane to %s:%d failed (%s); using gRPC for %.0f s", name, self.host, port, e,
                    self._backoff_s)
        self._retry_at = time.monotonic() + self._backoff_s
        self._backoff_s = min(2 * self._backoff_s, MAX_BACKOFF_S)
        return FELL_BACK
      finally:
        if conn is not None:  # broken or refused: the server ends it too
          self._drop(conn.sock)
    raise AssertionError("unreachable")

  def _exchange(self, conn: _Connection, name: str, op: bytes, header, payload, wait_s: float):
    """One request and its answer on `conn`."""
    sock = conn.sock
    sock.settimeout(self.call_timeout_s)
    self._send(sock, conn.request(self._token, op, header.SerializeToString()))
    if op == wire.OP_PUSH:
      wire.send_payload(sock, payload, lambda n: self._traffic.sent(n, first=False),
                        self._traffic.piece_bytes(wire.IO_CHUNK))
      return convert.parse_receipt(self._reply(sock, name))
    sock.settimeout(self.call_timeout_s + wait_s)  # the reply waits for the long-poll
    h = convert.parse_pull_header(self._reply(sock, name))
    sock.settimeout(self.call_timeout_s)
    pulled = self._pulled(sock, h)
    self._traffic.check_link()  # an answer that arrived while the emulated link went down is lost
    return pulled

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
    self._traffic.received(5 + len(body), first=True)  # the reply crosses the link: its latency
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
    """End the transfers in flight and close the idle connections (set `closed` first: the transfers
    raise `SyncerUnreachable`)."""
    with self._lock:
      socks, idle, self._idle = list(self._socks), self._idle, []
    for conn in idle:
      self._drop(conn.sock)
    for sock in socks:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:  # already closed by its transfer
        pass

"""The syncer's raw-TCP data plane (framing: `protocol/wire.py`): Push and Pull payloads at socket speed,
beside the gRPC service, which stays the control plane (join, leave, heartbeat, status) and the fallback.

Every decision is the gate's (`gate.py`), as for the gRPC front-end: the same core, limits, fingerprint
check, learner-id bounds and counters; a push's header is the gRPC PushHeader (`protocol.convert`),
idempotency key included, so a push retried over gRPC after its data-plane reply was lost is merged once.
The core's and the gate's refusals travel back with their reason.

What this shell adds is the care a listening socket needs: the run token proven once per connection, which
then carries the learner's transfers one after another; TLS when the service has it, a bounded number of
connections (per peer address too, idle ones included), deadlines from the first byte (the handshake and
each request header, then the transfer) and an idle timeout between transfers, enforced by shutting the
socket whatever the peer trickles, bounded headers and payload memory that grows only with what arrived
(`DataPlaneServer`).
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import select
import socket
import ssl
import struct
import threading
import time

from google.protobuf.message import DecodeError

from diloco_jax.protocol import convert, wire
from diloco_jax.protocol.chunking import BufferPool
from diloco_jax.protocol.messages import OBSERVER_ID, Published, PullCall
from diloco_jax.protocol.reasons import Reason, Rejected
from diloco_jax.syncer.server.auth import identity_of
from diloco_jax.syncer.server.gate import GateRefusal, SyncerGate
from diloco_jax.syncer.server.slots import Busy, Slots

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DataPlaneLimits:
  max_connections: int = 64
  per_address: int = 32  # connections from one peer address at once (idle ones too), counted before auth
  handshake_timeout_s: float = 5.0  # from accept to a read request header (TLS, hello, token proof, header),
  # and from a later request's first byte to its whole header
  idle_timeout_s: float = 120.0  # a connection with no request for this long is closed (the client reconnects)
  pool_bytes: int = 1 << 30  # push payload buffers kept for reuse (`chunking.BufferPool`)
  io_timeout_s: float = 10.0  # one read or write (the service's stream_stall_s)
  transfer_timeout_s: float = 600.0  # one whole transfer, a pull's long-poll not counted (stream_deadline_s)
  pull_poll_s: float = 1.0  # a pull's long-poll checks this often whether its client went away

  @classmethod
  def from_service(cls, limits) -> DataPlaneLimits:
    """The data plane's limits from the gRPC service's `Limits`: the same stall and deadline."""
    return cls(io_timeout_s=float(limits.stream_stall_s), transfer_timeout_s=float(limits.stream_deadline_s))


class DataPlaneServer:
  """Listens on `host:port` (0: any free port) and serves transfers through `gate`. `push_slots`,
  `pull_slots`: this plane's transfers in flight.

  Callers. A connection carries one caller's transfers one at a time; a caller's source here is (its authenticated
  identity, `auth.identity_of`: the client certificate under mutual TLS, else the token; the peer's host;
  the learner id its header claims, ids outside the run refused by the gate first): rate limits and slots
  are keyed by it, with slots of this plane's own (`slots.Slots`: at most `Limits.pushes_per_caller` pushes
  and `Limits.pulls_per_caller` pulls in flight per source; its threads are bounded by `max_connections`).
  A token holder on a learner's host may take that learner's slots here (without per-learner certificates
  nothing tells them apart): the learner's client then falls back to gRPC, whose slots are its
  connection's. The gate's limits: the largest push, the long-poll cap, the call rate; observers (learner
  id `messages.OBSERVER_ID`) may pull.

  Socket care: the run token proven once per connection (HMAC of a fresh nonce, constant-time compare);
  TLS when the service has it (the same certificate, and client certificates with mutual TLS); at most
  `max_connections` connections at once and `per_address` from one address, idle ones included (more are
  closed at once); a timeout on every read (`io_timeout_s`: the service's `stream_stall_s`), a deadline
  from accept to the first request header and from a later request's first byte to its header
  (`handshake_timeout_s`), one per transfer (`transfer_timeout_s`: its `stream_deadline_s`, a pull's
  long-poll not counted) and one between transfers (`idle_timeout_s`), enforced by the accept loop
  shutting the socket, so a peer trickling a byte at a time or idling cannot hold a thread past them; a
  refusal ends its connection (what the peer sent after its header is never parsed as a request); `stop`
  shuts every connection, idle or not; a pull's
  long-poll ends when its client closes the connection; bounded headers, declared sizes checked before a
  byte is read, and payload memory that grows only with what arrived."""

  def __init__(self, gate: SyncerGate, token: str, host: str = "127.0.0.1", port: int = 0, *, tls=None,
               limits: DataPlaneLimits = DataPlaneLimits()):
    if not token:
      raise ValueError("the data plane needs the run token")
    self.gate, self._token, self.limits = gate, token, limits
    self._ssl = None
    if tls is not None:
      ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
      ctx.load_cert_chain(tls.cert, tls.key)
      if tls.client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(tls.client_ca)
      self._ssl = ctx
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    self._sock = socket.socket(family, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((host, port))
    self._sock.listen(limits.max_connections)
    self._sock.settimeout(0.5)  # the accept loop checks for stop this often
    self.port = self._sock.getsockname()[1]
    self._slots = threading.BoundedSemaphore(limits.max_connections)
    service_limits = gate.limits
    self.push_slots = Slots("data-plane pushes", limits.max_connections, service_limits.pushes_per_caller)
    self.pull_slots = Slots("data-plane pulls", limits.max_connections, service_limits.pulls_per_caller)
    self._pool = BufferPool(limits.pool_bytes)
    self._deadlines: dict[socket.socket, tuple[float, str]] = {}  # connection -> when the accept loop shuts
    # it, and the counter that says why
    self._open: set[socket.socket] = set()  # every connection being served (`stop` shuts them)
    self._per_address: dict[str, int] = {}
    self._conn_lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="syncer-data-plane")
    self._thread.start()

  def stop(self) -> None:
    """Stop listening and shut every connection (idle, mid-transfer or long-polling): their threads end."""
    self._stop.set()
    self._thread.join(5.0)
    self._sock.close()
    with self._conn_lock:
      conns = list(self._open)
    for conn in conns:
      _shut(conn)

  @property
  def open_connections(self) -> int:
    """Connections being served now, idle ones included."""
    with self._conn_lock:
      return len(self._open)

  def _accept_loop(self) -> None:
    while not self._stop.is_set():
      self._reap()
      try:
        conn, peer = self._sock.accept()
      except TimeoutError:
        continue
      except OSError:
        if self._stop.is_set():
          return
        continue
      host = peer[0]
      if not self._slots.acquire(blocking=False):
        self.gate.count("data_refused_busy")
        conn.close()
        continue
      if not self._enter(host):
        self._slots.release()
        self.gate.count("data_refused_address")
        conn.close()
        continue
      self.gate.count("data_connections")
      with self._conn_lock:
        self._open.add(conn)
      self._arm(conn, time.monotonic() + self.limits.handshake_timeout_s)
      threading.Thread(target=self._serve, args=(conn, host), daemon=True, name="syncer-data").start()

  def _enter(self, host: str) -> bool:
    with self._conn_lock:
      if self._per_address.get(host, 0) >= self.limits.per_address:
        return False
      self._per_address[host] = self._per_address.get(host, 0) + 1
      return True

  def _leave(self, conn, host: str) -> None:
    with self._conn_lock:
      self._deadlines.pop(conn, None)
      self._open.discard(conn)
      left = self._per_address.pop(host, 1) - 1
      if left > 0:
        self._per_address[host] = left

  def _arm(self, conn, deadline: float | None, why: str = "data_deadline_cut") -> None:
    """Shut `conn` at `deadline` (monotonic; None: no deadline, while a pull long-polls), counting `why`."""
    with self._conn_lock:
      if deadline is None:
        self._deadlines.pop(conn, None)
      else:
        self._deadlines[conn] = (deadline, why)

  def _reap(self) -> None:
    """Shut the connections past their deadline: their blocked reads and writes end at once."""
    now = time.monotonic()
    with self._conn_lock:
      due = [(conn, why) for conn, (deadline, why) in self._deadlines.items() if now >= deadline]
      for conn, _ in due:
        del self._deadlines[conn]
    for conn, why in due:
      _shut(conn)  # before the count: a counted close is one that happened (a request sent after it fails)
      self.gate.count(why)

  def _serve(self, raw: socket.socket, host: str) -> None:
    conn = raw
    try:
      raw.settimeout(self.limits.io_timeout_s)
      raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      if self._ssl is not None:
        conn = self._ssl.wrap_socket(raw, server_side=True)
      identity = identity_of(conn.getpeercert(binary_form=True) if self._ssl is not None else None)
      if self._authenticated(conn):
        self._transfers(conn, raw, (identity, host))
    except (OSError, wire.WireError, ssl.SSLError) as e:  # a peer that went away or broke the framing
      log.info("data plane: connection dropped: %s", e)
      self.gate.count("data_dropped")
    except Exception:  # noqa: BLE001 - a bug must not take the listener down
      log.exception("data plane: transfer failed")
    finally:
      self._leave(raw, host)
      try:
        conn.close()
      finally:
        self._slots.release()

  def _authenticated(self, conn) -> bool:
    """The hello, then the token's proof within the handshake deadline (armed at accept)."""
    nonce = secrets.token_bytes(wire.NONCE_BYTES)
    conn.sendall(wire.hello(nonce))
    if hmac.compare_digest(wire.recv_exact(conn, wire.MAC_BYTES, "request"), wire.mac(self._token, nonce)):
      return True
    self.gate.count("refused_unauthenticated")
    conn.sendall(wire.refusal(Reason.UNAUTHENTICATED, "invalid run token"))
    return False

  def _transfers(self, conn, raw, peer: tuple[str, str]) -> None:
    """The connection's transfers, one after another, until the peer closes it, idles past
    `idle_timeout_s`, or is refused; the first request's header is due by the handshake deadline, a
    later one's within `handshake_timeout_s` of its first byte."""
    first = True
    while not self._stop.is_set():
      if not first:
        self._arm(raw, time.monotonic() + self.limits.idle_timeout_s, "data_idle_closed")
        conn.settimeout(self.limits.idle_timeout_s + self.limits.io_timeout_s)  # the idle deadline comes first
        op = conn.recv(1)
        if not op:  # the client closed it, or the idle deadline did
          return
        self._arm(raw, time.monotonic() + self.limits.handshake_timeout_s)
        conn.settimeout(self.limits.io_timeout_s)
        head = op + wire.recv_exact(conn, 4, "request")
      else:
        head = wire.recv_exact(conn, 5, "request")
      first = False
      if not self._transfer(conn, peer, head[:1], struct.unpack("<I", head[1:])[0],
                            lambda deadline: self._arm(raw, deadline)):
        return

  def _transfer(self, conn, peer: tuple[str, str], op: bytes, length: int, arm) -> bool:
    """One transfer: its header, then the push or pull within `transfer_timeout_s` (`arm(deadline)` moves
    the shut-down time). Whether the connection may carry another (False after a refusal)."""
    if op not in (wire.OP_PUSH, wire.OP_PULL) or length > wire.MAX_HEADER_BYTES:
      conn.sendall(wire.refusal(Reason.PROTOCOL, f"bad request: op {op!r}, header of {length} bytes"))
      return False
    header = wire.recv_exact(conn, length, "request header")
    deadline = time.monotonic() + self.limits.transfer_timeout_s
    arm(deadline)
    try:
      if op == wire.OP_PUSH:
        self._push(conn, peer, header, deadline)
      else:
        return self._pull(conn, peer, header, deadline, arm)
      return True
    except Rejected as e:
      conn.sendall(wire.refusal(e.reason, e.message))
    except Busy as e:
      self.gate.count("data_refused_busy")
      conn.sendall(wire.refusal(e.reason, str(e)))
    except DecodeError as e:
      self.gate.count("data_refused_protocol")
      conn.sendall(wire.refusal(Reason.PROTOCOL, f"unreadable request header: {e}"))
    except GateRefusal as e:
      self.gate.count(f"data_refused_{e.reason}")
      conn.sendall(wire.refusal(e.reason, e.message))
    return False

  def _caller(self, peer: tuple[str, str], learner_id) -> tuple[tuple, object]:
    """(source, claimed id): the identity, the peer host and the id if the run may have it or it is the
    observer's (else all ids outside the run share one source, refused by the gate after spending its
    rate)."""
    identity, host = peer
    valid = self.gate.valid_id(learner_id) or learner_id == OBSERVER_ID
    return (identity, f"data:{host}", learner_id if valid else "invalid"), learner_id

  def _push(self, conn, peer: tuple[str, str], header: bytes, deadline: float) -> None:
    h = convert.parse_push_header(header)
    caller = self._caller(peer, h.learner_id)
    total = int(h.total_size)
    self.gate.check_push(caller, total, where=f"from {caller[0][1]}")
    self.push_slots.acquire(caller[0])
    try:
      payload = wire.recv_payload(conn, total, "push payload", lambda n: _check_deadline(deadline), self._pool)
      receipt = self.gate.push(convert.push_from(h, payload))
    finally:
      self.push_slots.release(caller[0])
    self.gate.count("data_pushes")
    conn.sendall(wire.reply(wire.OK, convert.receipt_response(receipt).SerializeToString()))

  def _pull(self, conn, peer: tuple[str, str], header: bytes, deadline: float, arm) -> bool:
    """Serve a pull; whether it was answered (False: its client went away during the long-poll)."""
    call = convert.parse_pull_call(header)
    caller = self._caller(peer, call.learner_id)
    timeout = self.gate.open_pull(caller, call, where=f"from {caller[0][1]}")
    self.pull_slots.acquire(caller[0])
    try:
      # The core's answer within `timeout`, waited for in slices: a client that closed its connection
      # frees this thread within `pull_poll_s`. The long-poll is not the transfer's time.
      give_up = time.monotonic() + timeout
      published = self.gate.pull(call)
      if published is None:
        arm(None)
        published = self.gate.long_poll(call, give_up, self.limits.pull_poll_s, lambda: _gone(conn))
        deadline = time.monotonic() + self.limits.transfer_timeout_s
        arm(deadline)
      if published is None and _gone(conn):
        return False
      self._answer(conn, call, published, deadline)
      return True
    finally:
      self.pull_slots.release(caller[0])

  def _answer(self, conn, call: PullCall, published: Published | None, deadline: float) -> None:
    if published is None:
      header = convert.not_found_header(call.fragment, self.gate.epoch)
      conn.sendall(wire.reply(wire.OK, header.SerializeToString()))
      return
    self.gate.pulled(published)
    self.gate.count("data_pulls")
    conn.sendall(wire.reply(wire.OK, convert.pull_header(published).SerializeToString()))
    wire.send_payload(conn, published.payload, lambda n: _check_deadline(deadline))


def _check_deadline(deadline: float) -> None:
  if time.monotonic() > deadline:
    raise wire.WireError("transfer deadline passed")


def _shut(conn) -> None:
  """Shut `conn` down both ways: its thread's blocked read or write ends at once."""
  try:
    conn.shutdown(socket.SHUT_RDWR)
  except OSError:  # closed by its thread meanwhile
    pass


def _gone(conn) -> bool:
  """Whether a waiting pull's client closed its connection: an honest client sends nothing after its
  request, so a readable socket (end of stream, or bytes it had no business sending) ends the wait."""
  try:
    return bool(select.select([conn], [], [], 0)[0])
  except (OSError, ValueError):  # closed under us
    return True

"""The gRPC syncer service: translates the wire to `protocol.SyncerAPI` calls, and back.

The service only moves bytes and checks the protocol; every decision about the global model is the core's
(`syncer/core.py`), shared with the in-process transport. What this shell adds:

* Chunking: fragments travel as a header message plus chunks (`protocol.chunks` / `protocol.Reassembler`),
  so any size passes under the per-message limit (`max_message_bytes`, gRPC's 4 MiB default).
* Validation and limits: chunks in order, totals as declared and under the largest valid payload, a
  per-caller call rate; the core's `Rejected` becomes a status code with the reason in the details and in
  the `diloco-reason` trailing metadata. A bad call is answered with an error, never crashes the server,
  and never reaches (so never changes) the core's state. Wire strings are quoted only through
  `protocol.shorten`.
* Callers. A caller is (the connection's peer address, the learner id it claims): rate limits and the
  per-caller slots below are keyed by it, so a flood under a victim's learner id from another connection
  spends its own budget, never the victim's. The peer address is set by the transport (the TCP
  connection), not by the request; the TLS identity is not used because learners usually share one
  client certificate, so it would not tell a victim from an attacker.
* Threads. The sync gRPC server serves calls on one pool of `max_workers` threads. Calls that can hold a
  thread long, Push streams and Pulls (their long-poll and their chunk stream), need a slot: at most
  `max_workers // 4` Pushes and `max_workers // 2` Pulls at once, `Limits.pulls_per_caller` Pulls per
  caller and `Limits.pushes_per_caller` Pushes per connection (a Push's slot is taken before its
  header, which names the learner, arrives). A call over its cap is refused at once with
  RESOURCE_EXHAUSTED (the client backs off and retries), so at least a quarter of the threads always
  serve Join, Heartbeat, Leave and Status. `workers_for(config)` sizes the pool for the run's learners.
* Streams. A Push or Pull stream that moves no payload bytes for `Limits.stream_stall_s` (a stalled
  client, or one sending empty chunks), or lasts longer than `stream_deadline_s` (not counting a Pull's
  long-poll wait), is cut (`_StreamWatch` cancels it; counted as "streams_cut"). Push payloads are
  reassembled from what arrived (`protocol.Reassembler`), never allocated from the declared size.
* Authentication and TLS come from `syncer/auth.py`; the process around it is `syncer/app.py`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hmac
import json
import logging
import threading
import time
from typing import Any

import grpc

from diloco_jax.protocol.messages import (OBSERVER_ID, REASON_METADATA_KEY, ProtocolError, Push, Reassembler, Rejected, SyncerAPI, chunks, shorten)
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.ratelimit import RateLimiter
from diloco_jax.syncer.server.slots import Busy, Slots
from diloco_jax.syncer.server.auth import AuthInterceptor, TlsConfig, check_bind
from diloco_jax.syncer.server.dataplane import DataPlaneLimits, DataPlaneServer

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive limit
_MAX_STEP = 1 << 53  # a reported inner step beyond this is garbage (and would lose precision as JSON)

# The core's rejection reasons, by status code. FAILED_PRECONDITION: the learner must (re)join first;
# PERMISSION_DENIED: it belongs to another run; INVALID_ARGUMENT: the contribution itself is malformed.
_REASON_CODES = {
    "unknown_learner": grpc.StatusCode.FAILED_PRECONDITION,
    "not_member": grpc.StatusCode.FAILED_PRECONDITION,
    "future_version": grpc.StatusCode.FAILED_PRECONDITION,
    "fingerprint": grpc.StatusCode.PERMISSION_DENIED,
    "learner_id": grpc.StatusCode.PERMISSION_DENIED,
}


def status_code_for(reason: str) -> grpc.StatusCode:
  """The gRPC status code a core rejection reason travels as."""
  return _REASON_CODES.get(reason, grpc.StatusCode.INVALID_ARGUMENT)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one call may ask of the server."""

  chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Pull chunk size
  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # per gRPC message, both directions
  max_push_bytes: int = 2 << 30  # declared payload size of one Push (also capped by the core's largest)
  rate_per_s: float = 50.0  # calls per second per caller (sustained)
  rate_burst: float = 200.0  # calls a caller may make at once
  max_pull_wait_s: float = 60.0  # long-poll cap: a Pull holds a worker thread at most this long
  stream_stall_s: float = 10.0  # a stream that moves no payload bytes this long is cut
  stream_deadline_s: float = 600.0  # no stream lasts longer (a Pull's long-poll wait not counted)
  pushes_per_caller: int = 4  # Push streams one connection may have in flight
  pulls_per_caller: int = 4  # Pulls one caller may have in flight

  @classmethod
  def from_config(cls, config) -> "Limits":
    s = config.syncer
    in_flight = 2 * _learner_in_flight(config)  # a learner's comms workers, and a retry of each
    return cls(
        chunk_bytes=int(s.chunk_kb) * 1024,
        max_message_bytes=int(s.max_message_mb) << 20,
        max_push_bytes=int(s.max_push_mb) << 20,
        rate_per_s=float(s.rate_limit_per_s),
        rate_burst=float(s.rate_limit_burst),
        max_pull_wait_s=float(s.max_pull_wait_s),
        stream_stall_s=float(s.stream_stall_s),
        stream_deadline_s=float(s.stream_deadline_s),
        pushes_per_caller=in_flight,
        pulls_per_caller=in_flight,
    )


class _Abort(Exception):
  """A refusal decided by the shell: answered with `code` and `message`, the core never sees the call."""

  def __init__(self, code: grpc.StatusCode, message: str, reason: str = "protocol"):
    super().__init__(message)
    self.code, self.message, self.reason = code, message, reason


# Refusals that a busy or flooded server answers many times a second: counted, logged at debug level only.
_QUIET_REASONS = ("rate_limit", "busy")


def _rpc(response_type=None):
  """Run a servicer method; turn refusals and unexpected errors into a status (the server stays up).

  `response_type`: the method's unary response message, answered empty when the client went away
  mid-call (returning None would make gRPC log an "Exception serializing message!" traceback); None for
  a response stream (an empty stream).
  """

  def decorate(method):
    @functools.wraps(method)
    def wrapper(self, request, context):
      name = method.__name__
      try:
        return method(self, request, context)
      except _Abort as e:
        code, message, reason = e.code, e.message, e.reason
      except Busy as e:
        code, message, reason = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.reason
      except ProtocolError as e:
        code, message, reason = grpc.StatusCode.INVALID_ARGUMENT, str(e), e.reason
      except Rejected as e:
        code, message, reason = status_code_for(e.reason), f"rejected ({e.reason}): {e.message}", e.reason
      except Exception as e:  # a bug or an unexpected input: answer it, log it, keep serving
        if not context.is_active():
          code, message, reason = grpc.StatusCode.CANCELLED, "", "cancelled"
        else:
          log.exception("%s failed", name)
          code, reason = grpc.StatusCode.INTERNAL, "internal"
          message = f"{name} failed: {type(e).__name__}: {shorten(str(e), 200)}"
      if not context.is_active():
        # The client went away (or the stream watch cut it): nobody to answer, nothing worth a traceback.
        self._count("client_gone")
        log.debug("%s: client gone (%s %s)", name, code.name, message)
        return iter(()) if response_type is None else response_type()
      self._count(f"refused_{code.name.lower()}")
      log.log(logging.DEBUG if reason in _QUIET_REASONS else logging.INFO, "%s refused: %s %s", name,
              code.name, message)
      context.set_trailing_metadata(((REASON_METADATA_KEY, reason),))
      context.abort(code, message)

    return wrapper

  return decorate


class _Stream:
  """One watched stream: when it last moved payload bytes, and whether the watch cut it."""

  def __init__(self, context, now: float):
    self.context = context
    self.started = self.progressed = now
    self.waiting = False  # a Pull's long-poll wait: bounded by max_pull_wait_s, not watched
    self.cut: str | None = None

  def progress(self) -> None:
    self.progressed = time.monotonic()


class _StreamWatch:
  """One daemon thread that cancels streams that stall (no payload bytes for `stall_s`) or outlive
  `deadline_s`; a cancelled stream's request iterator ends and its handler answers nobody."""

  def __init__(self, stall_s: float, deadline_s: float, on_cut, poll_s: float = 0.2):
    self.stall_s, self.deadline_s, self._on_cut, self._poll = stall_s, deadline_s, on_cut, poll_s
    self._streams: set[_Stream] = set()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="syncer-stream-watch", daemon=True)
    self._thread.start()

  def watch(self, context) -> _Stream:
    stream = _Stream(context, time.monotonic())
    with self._lock:
      self._streams.add(stream)
    return stream

  def done(self, stream: _Stream) -> None:
    with self._lock:
      self._streams.discard(stream)

  def _run(self) -> None:
    while not self._stop.wait(self._poll):
      now = time.monotonic()
      with self._lock:
        streams = list(self._streams)
      for st in streams:
        if st.cut or st.waiting:
          continue
        if now - st.progressed > self.stall_s:
          st.cut = f"no payload bytes for {self.stall_s:g}s"
        elif now - st.started > self.deadline_s:
          st.cut = f"longer than {self.deadline_s:g}s"
        if st.cut:
          self._on_cut()
          st.context.cancel()

  def stop(self) -> None:
    self._stop.set()


class SyncerServicer(pb_grpc.SyncerServicer):
  """The gRPC methods, each a translation to one `SyncerAPI` call."""

  def __init__(self, core: SyncerAPI, limits: Limits = Limits(), fingerprint: str | None = None,
               max_workers: int = 32):
    self.core = core
    self.limits = limits
    self.fingerprint = fingerprint  # if set, Pull/Heartbeat/Leave from another run are refused too
    self._rate = RateLimiter(limits.rate_per_s, limits.rate_burst)
    # No valid push is larger than the core's largest payload: never accept a declaration beyond it.
    self._max_push_bytes = min(limits.max_push_bytes, core.max_payload_bytes())
    self._counters: dict[str, int] = {}
    self._lock = threading.Lock()
    self.data_port = 0  # the data plane's port, told to learners at Join (0: none)
    self._push_slots = Slots("pushes", max_workers // 4, limits.pushes_per_caller)
    self._pull_slots = Slots("pulls", max_workers // 2, limits.pulls_per_caller)
    self._watch = _StreamWatch(limits.stream_stall_s, limits.stream_deadline_s,
                               lambda: self._count("streams_cut"))

  def close(self) -> None:
    """Stop the stream watch (the server has stopped)."""
    self._watch.stop()

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._counters[name] = self._counters.get(name, 0) + n

  def counters(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counters)

  @staticmethod
  def _caller(context, learner_id) -> tuple[str, Any]:
    """Who is calling: the connection's peer address (set by the transport, not the request) and the
    learner id the request claims."""
    return context.peer(), learner_id

  def _admit(self, caller) -> None:
    if not self._rate.allow(caller):
      raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"learner {caller[1]} on this connection exceeds {self.limits.rate_per_s:g} calls/s",
                   "rate_limit")

  def _check_fingerprint(self, fingerprint: str) -> None:
    if self.fingerprint is not None and not hmac.compare_digest(fingerprint.encode(), self.fingerprint.encode()):
      raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                   f"rejected (fingerprint): run/config fingerprint {shorten(fingerprint)} is not this run's",
                   "fingerprint")

  @_rpc(pb.JoinResponse)
  def Join(self, request, context):
    self._admit(self._caller(context, request.learner_id))
    versions = self.core.join(request.learner_id, request.fingerprint)
    self._count("joins")
    history = [pb.Lifetime(epoch=h.epoch, start_rounds=h.start_rounds, version_offsets=h.version_offsets)
               for h in getattr(versions, "history", ())]
    return pb.JoinResponse(versions={int(k): int(v) for k, v in versions.items()}, data_port=self.data_port,
                           epoch=getattr(versions, "epoch", 0), history=history)

  @_rpc(pb.LeaveResponse)
  def Leave(self, request, context):
    self._admit(self._caller(context, request.learner_id))
    self._check_fingerprint(request.fingerprint)
    self.core.leave(request.learner_id)
    return pb.LeaveResponse()

  @_rpc(pb.HeartbeatResponse)
  def Heartbeat(self, request, context):
    self._admit(self._caller(context, request.learner_id))
    self._check_fingerprint(request.fingerprint)
    step_time = float(request.step_time_s)
    if not (step_time >= 0 and step_time < float("inf")):  # also refuses NaN
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"step_time_s must be finite and >= 0, got {step_time}")
    step = request.step if request.HasField("step") else None
    if step is not None and not 0 <= step < _MAX_STEP:
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"step must be in [0, {_MAX_STEP}), got {step}")
    epoch = self.core.heartbeat(request.learner_id, step_time, step=step, blocked=bool(request.blocked))
    return pb.HeartbeatResponse(epoch=int(epoch or 0))

  @_rpc(pb.StatusResponse)
  def Status(self, request, context):
    self._admit(self._caller(context, "status"))
    status = dict(self.core.status())
    status["server"] = {**self.counters(), "pushes_in_flight": self._push_slots.in_use,
                        "pulls_in_flight": self._pull_slots.in_use}
    return pb.StatusResponse(json=json.dumps(status, default=str))

  @_rpc(pb.PushResponse)
  def Push(self, request_iterator, context):
    # The slot is the connection's (its header, with the claimed id, has not arrived yet): a stream
    # that stalls before its header holds a slot too, never a thread beyond the push quota.
    connection = self._caller(context, "push")
    self._push_slots.acquire(connection)
    stream = self._watch.watch(context)
    try:
      return self._push(request_iterator, context, stream)
    finally:
      self._watch.done(stream)
      self._push_slots.release(connection)

  def _push(self, request_iterator, context, stream: _Stream):
    first = next(request_iterator, None)
    if stream.cut:
      raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Push stream cut: {stream.cut}", "stalled")
    if first is None or first.WhichOneof("kind") != "header":
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a Push stream must start with a header message")
    h = first.header
    caller = self._caller(context, h.learner_id)
    self._admit(caller)
    total = int(h.total_size)
    if total > self._max_push_bytes:
      raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"declared payload of {total} bytes exceeds the limit of {self._max_push_bytes}",
                   "oversize")
    payload = Reassembler(total, "push payload")
    stream.progress()  # the header counts: the stall clock of the payload starts now
    for msg in request_iterator:
      if msg.WhichOneof("kind") != "data":
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one Push stream")
      payload.add(msg.offset, msg.data)
      if msg.data:  # only bytes are progress: empty chunks do not keep a stream alive
        stream.progress()
    if stream.cut:
      raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Push stream cut: {stream.cut}", "stalled")
    push = Push(learner_id=h.learner_id, fingerprint=h.fingerprint, fragment=h.fragment,
                base_version=h.base_version, steps=h.steps, tokens=h.tokens, codec=h.codec,
                payload=payload.finish(), checksum=h.checksum, incarnation=h.incarnation,
                sequence=h.sequence, base_epoch=h.base_epoch)
    receipt = self.core.push(push)
    self._count("pushes")
    self._count("push_bytes", total)
    return pb.PushResponse(fragment=receipt.fragment, round=receipt.round, late=receipt.late,
                           epoch=receipt.epoch, version=receipt.version)

  @_rpc(None)
  def Pull(self, request, context):
    caller = self._caller(context, request.learner_id)
    self._admit(caller)
    self._check_fingerprint(request.fingerprint)
    if request.learner_id != OBSERVER_ID:  # observers (the global model's evaluator) pull, never join
      self.core.check_learner_id(request.learner_id)
    timeout = float(request.timeout_s)
    if not (timeout >= 0 and timeout < float("inf")):
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s must be finite and >= 0, got {timeout}")
    timeout = min(timeout, self.limits.max_pull_wait_s)
    remaining = context.time_remaining()
    if remaining is not None:
      timeout = min(timeout, max(0.0, remaining - 0.05))  # answer "not found" before the client gives up
    deadline = time.monotonic() + timeout
    # A learner that says nothing of what it holds (unset fields) gets the full fragment.
    have_version = request.have_version if request.HasField("have_version") else -1
    have_epoch = request.have_epoch if request.HasField("have_epoch") else 0
    published = self.core.pull(request.fragment, request.min_version, 0.0, have_version, have_epoch)
    if published is None and timeout <= 0:
      return iter([pb.PullChunk(header=pb.PullHeader(found=False, fragment=request.fragment,
                                                     epoch=self.core.epoch))])
    # The slot is held through the long-poll wait and the chunk stream (released when the stream ends).
    self._pull_slots.acquire(caller)
    stream = self._watch.watch(context)
    try:
      stream.waiting = True
      # Long-poll in slices so that a client that went away frees its worker thread within a second.
      while published is None and context.is_active():
        left = deadline - time.monotonic()
        if left <= 0:
          break
        published = self.core.pull(request.fragment, request.min_version, min(left, 1.0), have_version,
                                   have_epoch)
      stream.waiting = False
      stream.started = stream.progressed = time.monotonic()
    except BaseException:
      self._watch.done(stream)
      self._pull_slots.release(caller)
      raise
    if published is None:
      answer = iter([pb.PullChunk(header=pb.PullHeader(found=False, fragment=request.fragment,
                                                       epoch=self.core.epoch))])
    else:
      self._count("pulls")
      self._count("pull_bytes", len(published.payload))
      answer = self._pull_chunks(published, stream)
    return self._released(answer, stream, caller)

  def _released(self, messages, stream: _Stream, caller):
    """Yield `messages`, then free the Pull's slot and watch (also when the client goes away)."""
    try:
      yield from messages
    finally:
      self._watch.done(stream)
      self._pull_slots.release(caller)

  def _pull_chunks(self, published, stream: _Stream):
    header = pb.PullHeader(found=True, fragment=published.fragment, version=published.version,
                           codec=published.codec, checksum=published.checksum,
                           total_size=len(published.payload), epoch=published.epoch)
    if published.kind == "delta":  # a full answer leaves both unset (fewer bytes)
      header.kind, header.base_version = "delta", published.base_version
    yield pb.PullChunk(header=header)
    for offset, data in chunks(published.payload, self.limits.chunk_bytes):
      yield pb.PullChunk(data=data, offset=offset)
      stream.progress()  # gRPC asks for the next message once this one is on its way


@dataclasses.dataclass
class ServerHandle:
  """A running syncer service. `port` is the bound port (useful with port 0)."""

  server: grpc.Server
  port: int
  servicer: SyncerServicer
  data_plane: DataPlaneServer | None = None

  def stop(self, grace: float | None = 1.0) -> None:
    """Stop accepting calls; let calls in flight finish for up to `grace` seconds."""
    if self.data_plane is not None:
      self.data_plane.stop()
    self.server.stop(grace).wait()
    self.servicer.close()

  def wait(self, timeout: float | None = None) -> bool:
    return self.server.wait_for_termination(timeout)


def workers_for(config) -> int:
  """Worker threads for a run: a Pull and a Push slot for each comms worker of every learner (twice, for
  retries), plus as many for the control calls; at least 32."""
  return max(32, 4 * int(config.learners.num) * _learner_in_flight(config))


def _learner_in_flight(config) -> int:
  """A learner's comms workers: its fragments in flight (`outer.max_in_flight` of the run's resolved spec)."""
  return int(config.outer.max_in_flight)


def serve(core: SyncerAPI, bind: str = "127.0.0.1:0", *, token: str, tls: TlsConfig | None = None,
          limits: Limits = Limits(), fingerprint: str | None = None, max_workers: int = 32,
          allow_remote: bool = False, data_plane: bool = True) -> ServerHandle:
  """Start the syncer service for `core` on `bind` in a thread pool; return at once.

  Args:
    core: the `SyncerAPI` to serve (a `SyncerCore`).
    bind: `host:port`; port 0 picks a free port (see `ServerHandle.port`).
    token: the run's shared token; every call must carry it.
    tls: serve TLS (and mutual TLS if `tls.client_ca`); None = plaintext.
    limits: message sizes, push size, rate limits, long-poll cap.
    fingerprint: the run fingerprint; if given, Pull/Heartbeat/Leave must carry it too (Join and Push are
      checked by the core).
    max_workers: threads serving calls; a quarter may serve Pushes and a half Pulls (module docstring).
    allow_remote: permit a non-loopback bind.
    data_plane: also serve Push and Pull payloads on a raw-TCP port of the same host
      (`syncer/dataplane.py`), which Join tells learners; gRPC stays the control plane and the fallback.
  """
  check_bind(bind, allow_remote=allow_remote, tls=tls)
  if max_workers < 4:
    raise ValueError(f"max_workers must be >= 4 (pushes, pulls and control calls each need threads), got "
                     f"{max_workers}")
  servicer = SyncerServicer(core, limits, fingerprint, max_workers=max_workers)
  options = [
      ("grpc.max_receive_message_length", limits.max_message_bytes),
      ("grpc.max_send_message_length", limits.max_message_bytes),
      ("grpc.so_reuseport", 0),  # two syncers on one port is a mistake, not load balancing
      ("grpc.max_concurrent_streams", 256),  # calls per connection (a learner needs a handful)
  ]
  server = grpc.server(
      concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
      interceptors=[AuthInterceptor(token, lambda: servicer._count("refused_unauthenticated"))],
      options=options,
      # Calls accepted at once (queued or running). The slots refuse long calls over their caps at once,
      # so this only bounds the queue's memory: a burst of refused calls must not crowd out a heartbeat.
      maximum_concurrent_rpcs=64 * max_workers,
  )
  pb_grpc.add_SyncerServicer_to_server(servicer, server)
  if tls is not None:
    port = server.add_secure_port(bind, tls.credentials())
  else:
    port = server.add_insecure_port(bind)
  if port == 0:
    raise OSError(f"could not bind {bind!r}")
  server.start()
  plane = None
  if data_plane:
    plane = DataPlaneServer(servicer, token, bind.rsplit(":", 1)[0].strip("[]") or "127.0.0.1", tls=tls,
                            limits=DataPlaneLimits.from_service(limits))
    servicer.data_port = plane.port
  log.info("syncer serving on %s (port %d, %s)%s", bind, port, "TLS" if tls else "plaintext",
           f", data plane on port {plane.port}" if plane else "")
  return ServerHandle(server=server, port=port, servicer=servicer, data_plane=plane)

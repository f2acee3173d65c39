"""The gRPC syncer service: translates the wire to `protocol.SyncerAPI` calls, and back.

The service only moves bytes and checks the protocol; every decision about the global model is the core's
(`syncer/core.py`), shared with the in-process transport. What this shell adds:

* Chunking: fragments travel as a header message plus chunks (`protocol.chunks` / `protocol.Reassembler`),
  so any size passes under the per-message limit (`max_message_bytes`, gRPC's 4 MiB default).
* Validation and limits: chunks in order, totals as declared and under the largest valid payload, a
  per-learner call rate; the core's `Rejected` becomes a status code with the reason in the details and in
  the `diloco-reason` trailing metadata. A bad call is answered with an error, never crashes the server,
  and never reaches (so never changes) the core's state.
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

import grpc

from diloco_jax.protocol import REASON_METADATA_KEY, ProtocolError, Push, Rejected, SyncerAPI, chunks
from diloco_jax.protocol import Reassembler
from diloco_jax.proto import diloco_pb2 as pb
from diloco_jax.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.ratelimit import RateLimiter
from diloco_jax.syncer.auth import AuthInterceptor, TlsConfig, check_bind

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive limit

# The core's rejection reasons, by status code. FAILED_PRECONDITION: the learner must (re)join first;
# PERMISSION_DENIED: it belongs to another run; INVALID_ARGUMENT: the contribution itself is malformed.
_REASON_CODES = {
    "unknown_learner": grpc.StatusCode.FAILED_PRECONDITION,
    "not_member": grpc.StatusCode.FAILED_PRECONDITION,
    "future_version": grpc.StatusCode.FAILED_PRECONDITION,
    "fingerprint": grpc.StatusCode.PERMISSION_DENIED,
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
  rate_per_s: float = 50.0  # calls per second per learner (sustained)
  rate_burst: float = 200.0  # calls a learner may make at once
  max_pull_wait_s: float = 60.0  # long-poll cap: a Pull holds a worker thread at most this long

  @classmethod
  def from_config(cls, config) -> "Limits":
    s = config.syncer
    return cls(
        chunk_bytes=int(s.chunk_kb) * 1024,
        max_message_bytes=int(s.max_message_mb) << 20,
        max_push_bytes=int(s.max_push_mb) << 20,
        rate_per_s=float(s.rate_limit_per_s),
        rate_burst=float(s.rate_limit_burst),
        max_pull_wait_s=float(s.max_pull_wait_s),
    )


class _Abort(Exception):
  """A refusal decided by the shell: answered with `code` and `message`, the core never sees the call."""

  def __init__(self, code: grpc.StatusCode, message: str, reason: str = "protocol"):
    super().__init__(message)
    self.code, self.message, self.reason = code, message, reason


def _rpc(method):
  """Run a servicer method; turn refusals and unexpected errors into a status (the server stays up)."""

  @functools.wraps(method)
  def wrapper(self, request, context):
    name = method.__name__
    try:
      return method(self, request, context)
    except _Abort as e:
      code, message, reason = e.code, e.message, e.reason
    except ProtocolError as e:
      code, message, reason = grpc.StatusCode.INVALID_ARGUMENT, str(e), e.reason
    except Rejected as e:
      code, message, reason = status_code_for(e.reason), f"rejected ({e.reason}): {e.message}", e.reason
    except Exception as e:  # a bug or an unexpected input: answer it, log it, keep serving
      if not context.is_active():
        return None  # the client went away mid-call; nobody to answer
      log.exception("%s failed", name)
      code, message, reason = grpc.StatusCode.INTERNAL, f"{name} failed: {type(e).__name__}: {e}", "internal"
    self._count(f"refused_{code.name.lower()}")
    log.info("%s refused: %s %s", name, code.name, message)
    context.set_trailing_metadata(((REASON_METADATA_KEY, reason),))
    context.abort(code, message)

  return wrapper


class SyncerServicer(pb_grpc.SyncerServicer):
  """The gRPC methods, each a translation to one `SyncerAPI` call."""

  def __init__(self, core: SyncerAPI, limits: Limits = Limits(), fingerprint: str | None = None):
    self.core = core
    self.limits = limits
    self.fingerprint = fingerprint  # if set, Pull/Heartbeat/Leave from another run are refused too
    self._rate = RateLimiter(limits.rate_per_s, limits.rate_burst)
    # No valid push is larger than the core's largest payload: never accept a declaration beyond it.
    self._max_push_bytes = min(limits.max_push_bytes, core.max_payload_bytes())
    self._counters: dict[str, int] = {}
    self._lock = threading.Lock()

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._counters[name] = self._counters.get(name, 0) + n

  def counters(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counters)

  def _admit(self, learner_id) -> None:
    if not self._rate.allow(learner_id):
      raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"learner {learner_id} exceeds {self.limits.rate_per_s:g} calls/s", "rate_limit")

  def _check_fingerprint(self, fingerprint: str) -> None:
    if self.fingerprint is not None and not hmac.compare_digest(fingerprint, self.fingerprint):
      raise _Abort(grpc.StatusCode.PERMISSION_DENIED,
                   f"rejected (fingerprint): run/config fingerprint {fingerprint!r} is not this run's",
                   "fingerprint")

  @_rpc
  def Join(self, request, context):
    self._admit(request.learner_id)
    versions = self.core.join(request.learner_id, request.fingerprint)
    self._count("joins")
    return pb.JoinResponse(versions={int(k): int(v) for k, v in versions.items()})

  @_rpc
  def Leave(self, request, context):
    self._admit(request.learner_id)
    self._check_fingerprint(request.fingerprint)
    self.core.leave(request.learner_id)
    return pb.LeaveResponse()

  @_rpc
  def Heartbeat(self, request, context):
    self._admit(request.learner_id)
    self._check_fingerprint(request.fingerprint)
    step_time = float(request.step_time_s)
    if not (step_time >= 0 and step_time < float("inf")):  # also refuses NaN
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"step_time_s must be finite and >= 0, got {step_time}")
    self.core.heartbeat(request.learner_id, step_time)
    return pb.HeartbeatResponse()

  @_rpc
  def Status(self, request, context):
    self._admit("status")
    status = dict(self.core.status())
    status["server"] = self.counters()
    return pb.StatusResponse(json=json.dumps(status, default=str))

  @_rpc
  def Push(self, request_iterator, context):
    first = next(request_iterator, None)
    if first is None or first.WhichOneof("kind") != "header":
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a Push stream must start with a header message")
    h = first.header
    self._admit(h.learner_id)
    total = int(h.total_size)
    if total > self._max_push_bytes:
      raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                   f"declared payload of {total} bytes exceeds the limit of {self._max_push_bytes}",
                   "oversize")
    payload = Reassembler(total, "push payload")
    for msg in request_iterator:
      if msg.WhichOneof("kind") != "data":
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one Push stream")
      payload.add(msg.offset, msg.data)
    push = Push(learner_id=h.learner_id, fingerprint=h.fingerprint, fragment=h.fragment,
                base_version=h.base_version, steps=h.steps, tokens=h.tokens, codec=h.codec,
                payload=payload.finish(), checksum=h.checksum)
    receipt = self.core.push(push)
    self._count("pushes")
    self._count("push_bytes", total)
    return pb.PushResponse(fragment=receipt.fragment, round=receipt.round, late=receipt.late,
                           version=receipt.version)

  @_rpc
  def Pull(self, request, context):
    self._admit(request.learner_id)
    self._check_fingerprint(request.fingerprint)
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
    # Long-poll in slices so that a client that went away frees its worker thread within a second.
    while published is None and context.is_active():
      left = deadline - time.monotonic()
      if left <= 0:
        break
      published = self.core.pull(request.fragment, request.min_version, min(left, 1.0), have_version,
                                 have_epoch)
    if published is None:
      return iter([pb.PullChunk(header=pb.PullHeader(found=False, fragment=request.fragment))])
    self._count("pulls")
    self._count("pull_bytes", len(published.payload))
    return self._pull_chunks(published)

  def _pull_chunks(self, published):
    header = pb.PullHeader(found=True, fragment=published.fragment, version=published.version,
                           codec=published.codec, checksum=published.checksum,
                           total_size=len(published.payload), epoch=published.epoch)
    if published.kind == "delta":  # a full answer leaves both unset (fewer bytes)
      header.kind, header.base_version = "delta", published.base_version
    yield pb.PullChunk(header=header)
    for offset, data in chunks(published.payload, self.limits.chunk_bytes):
      yield pb.PullChunk(data=data, offset=offset)


@dataclasses.dataclass
class ServerHandle:
  """A running syncer service. `port` is the bound port (useful with port 0)."""

  server: grpc.Server
  port: int
  servicer: SyncerServicer

  def stop(self, grace: float | None = 1.0) -> None:
    """Stop accepting calls; let calls in flight finish for up to `grace` seconds."""
    self.server.stop(grace).wait()

  def wait(self, timeout: float | None = None) -> bool:
    return self.server.wait_for_termination(timeout)


def serve(core: SyncerAPI, bind: str = "127.0.0.1:0", *, token: str, tls: TlsConfig | None = None,
          limits: Limits = Limits(), fingerprint: str | None = None, max_workers: int = 16,
          allow_remote: bool = False) -> ServerHandle:
  """Start the syncer service for `core` on `bind` in a thread pool; return at once.

  Args:
    core: the `SyncerAPI` to serve (a `SyncerCore`).
    bind: `host:port`; port 0 picks a free port (see `ServerHandle.port`).
    token: the run's shared token; every call must carry it.
    tls: serve TLS (and mutual TLS if `tls.client_ca`); None = plaintext.
    limits: message sizes, push size, rate limits, long-poll cap.
    fingerprint: the run fingerprint; if given, Pull/Heartbeat/Leave must carry it too (Join and Push are
      checked by the core).
    max_workers: threads serving calls (a long-poll Pull holds one while it waits).
    allow_remote: permit a non-loopback bind.
  """
  check_bind(bind, allow_remote=allow_remote, tls=tls)
  servicer = SyncerServicer(core, limits, fingerprint)
  options = [
      ("grpc.max_receive_message_length", limits.max_message_bytes),
      ("grpc.max_send_message_length", limits.max_message_bytes),
      ("grpc.so_reuseport", 0),  # two syncers on one port is a mistake, not load balancing
  ]
  server = grpc.server(
      concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
      interceptors=[AuthInterceptor(token, lambda: servicer._count("refused_unauthenticated"))],
      options=options,
      maximum_concurrent_rpcs=4 * max_workers,  # beyond this, RESOURCE_EXHAUSTED rather than a queue
  )
  pb_grpc.add_SyncerServicer_to_server(servicer, server)
  if tls is not None:
    port = server.add_secure_port(bind, tls.credentials())
  else:
    port = server.add_insecure_port(bind)
  if port == 0:
    raise OSError(f"could not bind {bind!r}")
  server.start()
  log.info("syncer serving on %s (port %d, %s)", bind, port, "TLS" if tls else "plaintext")
  return ServerHandle(server=server, port=port, servicer=servicer)

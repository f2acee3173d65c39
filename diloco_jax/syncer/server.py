"""The gRPC syncer service: a thin shell around `SyncerCore`.

    python -m diloco_jax syncer --config configs/tiny_cpu.py --workdir runs/syncer \\
        --bind 127.0.0.1:50051 --token-file secrets/run.token

The service only moves bytes and checks the protocol; every decision about the global model is the core's
(`syncer/core.py`), shared with the in-process transport. What the shell adds:

* Authentication: every call must carry `authorization: Bearer <token>` (the run's shared token), compared
  in constant time. The token comes from `--token-file` or `$DILOCO_TOKEN`, never from the command line
  (argv is visible to every user of the machine).
* Transport security: optional TLS (`--tls-cert/--tls-key`) and mutual TLS (`--tls-client-ca`). The
  server binds loopback only unless `--allow-remote`.
* Chunking: fragments travel as a header message plus chunks of `chunk_bytes`, so any size passes under
  the per-message limit (`max_message_bytes`, gRPC's 4 MiB default).
* Validation and limits: chunks in order, totals as declared and under `max_push_bytes`, a per-learner call
  rate; the core's `Rejected` becomes a status code with the reason in the details and in the
  `diloco-reason` trailing metadata. A bad call is answered with an error, never crashes the server, and
  never reaches (so never changes) the core's state.
* Persistence: an orbax checkpoint every `syncer.checkpoint_every_rounds` closed rounds and at shutdown
  (SIGTERM/SIGINT); a restarted syncer resumes from the latest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any, Callable

import grpc

from diloco_jax.proto import diloco_pb2 as pb
from diloco_jax.proto import diloco_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

TOKEN_ENV = "DILOCO_TOKEN"
REASON_KEY = "diloco-reason"  # trailing metadata: the machine-readable reason of a refusal
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
class TlsConfig:
  """Server TLS: PEM files. With `client_ca`, clients must present a certificate it signed (mutual TLS)."""

  cert: str
  key: str
  client_ca: str | None = None

  def credentials(self) -> grpc.ServerCredentials:
    key, cert = pathlib.Path(self.key).read_bytes(), pathlib.Path(self.cert).read_bytes()
    ca = pathlib.Path(self.client_ca).read_bytes() if self.client_ca else None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one call may ask of the server."""

  chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Pull chunk size
  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # per gRPC message, both directions
  max_push_bytes: int = 2 << 30  # declared payload size of one Push
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


class RateLimiter:
  """Per-key token buckets without debt: `allow(key)` spends one token or refuses. Thread-safe."""

  def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic):
    self.rate, self.burst, self._clock = rate_per_s, max(burst, 1.0), clock
    self._buckets: dict[Any, tuple[float, float]] = {}
    self._lock = threading.Lock()

  def allow(self, key) -> bool:
    if self.rate <= 0:
      return True  # 0 = unlimited
    with self._lock:
      now = self._clock()
      tokens, last = self._buckets.get(key, (self.burst, now))
      tokens = min(self.burst, tokens + (now - last) * self.rate)
      ok = tokens >= 1.0
      self._buckets[key] = (tokens - 1.0 if ok else tokens, now)
      return ok


class _Abort(Exception):
  """A refusal decided by the shell: answered with `code` and `message`, the core never sees the call."""

  def __init__(self, code: grpc.StatusCode, message: str, reason: str = "protocol"):
    super().__init__(message)
    self.code, self.message, self.reason = code, message, reason


def _rpc(method):
  """Run a servicer method; turn refusals and unexpected errors into a status (the server stays up)."""

  @functools.wraps(method)
  def wrapper(self, request, context):
    from diloco_jax.syncer import core as core_lib

    name = method.__name__
    try:
      return method(self, request, context)
    except _Abort as e:
      code, message, reason = e.code, e.message, e.reason
    except core_lib.Rejected as e:
      reason = getattr(e, "reason", "rejected")
      code = status_code_for(reason)
      message = f"rejected ({reason}): {getattr(e, 'message', None) or e}"
    except Exception as e:  # a bug or an unexpected input: answer it, log it, keep serving
      if not context.is_active():
        return None  # the client went away mid-call; nobody to answer
      log.exception("%s failed", name)
      code, message, reason = grpc.StatusCode.INTERNAL, f"{name} failed: {type(e).__name__}: {e}", "internal"
    self._count(f"refused_{code.name.lower()}")
    log.info("%s refused: %s %s", name, code.name, message)
    context.set_trailing_metadata(((REASON_KEY, reason),))
    context.abort(code, message)

  return wrapper


class SyncerServicer(pb_grpc.SyncerServicer):
  """The gRPC methods, each a translation to one core call."""

  def __init__(self, core, limits: Limits = Limits(), fingerprint: str | None = None):
    self.core = core
    self.limits = limits
    self.fingerprint = fingerprint  # if set, Pull/Heartbeat/Leave from another run are refused too
    self._rate = RateLimiter(limits.rate_per_s, limits.rate_burst)
    self._max_push_bytes = limits.max_push_bytes
    settings = getattr(core, "settings", None)
    if settings is not None and getattr(settings, "sizes", None):
      # No valid push is larger than the largest fragment in fp32 (+ block scales): never buffer more.
      from diloco_jax import codec as codec_lib

      largest = max(codec_lib.encoded_size(n, c, settings.block) for n in settings.sizes for c in codec_lib.CODECS)
      self._max_push_bytes = min(self._max_push_bytes, largest)
    self._counters: dict[str, int] = {}
    self._lock = threading.Lock()

  def _count(self, name: str, n: int = 1) -> None:
    with self._lock:
      self._counters[name] = self._counters.get(name, 0) + n

  def counters(self) -> dict[str, int]:
    with self._lock:
      return dict(self._counters)

  def _admit(self, learner_id: int) -> None:
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
    from diloco_jax.syncer import core as core_lib

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
    # Preallocated at the declared size (capped above): one copy per chunk, no regrowth.
    buf = bytearray(total)
    view = memoryview(buf)
    received = 0
    for msg in request_iterator:
      if msg.WhichOneof("kind") != "data":
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "a second header in one Push stream")
      if msg.offset != received:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"chunk out of sequence: offset {msg.offset}, expected {received}", "sequence")
      n = len(msg.data)
      if received + n > total:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                     f"payload exceeds its declared size of {total} bytes", "oversize")
      view[received:received + n] = msg.data
      received += n
    if received != total:
      raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                   f"truncated stream: declared {total} bytes, received {received}", "truncated")
    del view
    push = core_lib.Push(learner_id=h.learner_id, fingerprint=h.fingerprint, fragment=h.fragment,
                         base_version=h.base_version, steps=h.steps, tokens=h.tokens, codec=h.codec,
                         payload=bytes(buf), checksum=h.checksum)
    del buf
    receipt = self.core.push(push)
    self._count("pushes")
    self._count("push_bytes", total)
    return pb.PushResponse(fragment=receipt.fragment, round=receipt.round, late=receipt.late)

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
    # Passed on only when the learner says what it holds, so cores without delta downlinks (and old
    # clients, which never set them) keep the plain call.
    have = {"have_version": request.have_version} if request.HasField("have_version") else {}
    if request.HasField("have_epoch"):
      have["have_epoch"] = request.have_epoch
    published = self.core.pull(request.fragment, request.min_version, 0.0, **have)
    # Long-poll in slices so that a client that went away frees its worker thread within a second.
    while published is None and context.is_active():
      left = deadline - time.monotonic()
      if left <= 0:
        break
      published = self.core.pull(request.fragment, request.min_version, min(left, 1.0), **have)
    if published is None:
      return iter([pb.PullChunk(header=pb.PullHeader(found=False, fragment=request.fragment))])
    self._count("pulls")
    self._count("pull_bytes", len(published.payload))
    return self._pull_chunks(published)

  def _pull_chunks(self, published):
    payload = published.payload
    header = pb.PullHeader(found=True, fragment=published.fragment, version=published.version,
                           codec=published.codec, checksum=published.checksum, total_size=len(payload),
                           epoch=getattr(published, "epoch", 0))
    if getattr(published, "kind", "full") == "delta":  # a full answer leaves both unset (fewer bytes)
      header.kind, header.base_version = "delta", published.base_version
    yield pb.PullChunk(header=header)
    view = memoryview(payload)
    step = self.limits.chunk_bytes
    for offset in range(0, len(payload), step):
      yield pb.PullChunk(data=bytes(view[offset:offset + step]), offset=offset)


class _AuthInterceptor(grpc.ServerInterceptor):
  """Refuses every call that lacks the run token, before any servicer code runs."""

  def __init__(self, token: str, on_refusal: Callable[[], None] = lambda: None):
    if not token:
      raise ValueError("the syncer needs a non-empty run token")
    self._expected = f"Bearer {token}".encode()
    self._on_refusal = on_refusal

  def intercept_service(self, continuation, handler_call_details):
    got = None
    for key, value in handler_call_details.invocation_metadata or ():
      if key == "authorization":
        got = value.encode() if isinstance(value, str) else value
    handler = continuation(handler_call_details)
    if got is not None and hmac.compare_digest(got, self._expected):
      return handler
    if handler is None:
      return None  # unknown method: gRPC answers UNIMPLEMENTED
    self._on_refusal()
    message = ("missing run token (metadata 'authorization: Bearer <token>')" if got is None
               else "invalid run token")

    def refuse(request, context):
      context.set_trailing_metadata(((REASON_KEY, "unauthenticated"),))
      context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
      return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
      return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
      return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def is_loopback(bind: str) -> bool:
  """Whether `host:port` (or `[v6]:port`) binds a loopback address only."""
  host = bind.rsplit(":", 1)[0].strip("[]")
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False  # a hostname or a wildcard: may be reachable from outside


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


def serve(core, bind: str = "127.0.0.1:0", *, token: str, tls: TlsConfig | None = None,
          limits: Limits = Limits(), fingerprint: str | None = None, max_workers: int = 16,
          allow_remote: bool = False) -> ServerHandle:
  """Start the syncer service for `core` on `bind` in a thread pool; return at once.

  Args:
    core: a `SyncerCore` (anything with its join/leave/heartbeat/push/pull/status methods).
    bind: `host:port`; port 0 picks a free port (see `ServerHandle.port`).
    token: the run's shared token; every call must carry it.
    tls: serve TLS (and mutual TLS if `tls.client_ca`); None = plaintext.
    limits: message sizes, push size, rate limits, long-poll cap.
    fingerprint: the run fingerprint; if given, Pull/Heartbeat/Leave must carry it too (Join and Push are
      checked by the core).
    max_workers: threads serving calls (a long-poll Pull holds one while it waits).
    allow_remote: permit a non-loopback bind.
  """
  if not is_loopback(bind) and not allow_remote:
    raise ValueError(f"refusing to bind {bind!r}: not a loopback address (pass allow_remote / "
                     "--allow-remote to serve other hosts, preferably with TLS)")
  if not is_loopback(bind) and tls is None:
    log.warning("serving %s without TLS: the run token and fragments cross the network in clear", bind)
  servicer = SyncerServicer(core, limits, fingerprint)
  options = [
      ("grpc.max_receive_message_length", limits.max_message_bytes),
      ("grpc.max_send_message_length", limits.max_message_bytes),
      ("grpc.so_reuseport", 0),  # two syncers on one port is a mistake, not load balancing
  ]
  server = grpc.server(
      concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="syncer-rpc"),
      interceptors=[_AuthInterceptor(token, lambda: servicer._count("refused_unauthenticated"))],
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


def read_token(token_file: str | None = None) -> str:
  """The run token from `token_file`, else from $DILOCO_TOKEN. Raises ValueError if there is none."""
  if token_file:
    path = pathlib.Path(token_file)
    mode = path.stat().st_mode
    if mode & 0o077:
      log.warning("token file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    token = path.read_text().strip()
    if not token:
      raise ValueError(f"token file {path} is empty")
    return token
  token = os.environ.get(TOKEN_ENV, "").strip()
  if not token:
    raise ValueError(f"no run token: pass --token-file or set ${TOKEN_ENV}")
  return token


# ---------------------------------------------------------------------------------------------------------
# The process: build the core from a config, resume, serve, checkpoint, shut down on a signal.


def build_core(config, run_id: str = ""):
  """A fresh SyncerCore for `config`: the global fragments start from the learners' initial params."""
  from diloco_jax import config as config_lib
  from diloco_jax import fragments
  from diloco_jax import model
  from diloco_jax.syncer import core as core_lib

  params = model.init_params_host(config)
  o = config.outer
  plan = fragments.make_plan(params, o.num_fragments, o.sync_every, o.fragment_plan)
  initial = [fragments.gather(plan, params, p) for p in range(plan.num_fragments)]
  fingerprint = config_lib.fingerprint(config, run_id)
  settings = core_lib.SyncerSettings.from_config(config, plan, fingerprint)
  return core_lib.SyncerCore(settings, initial), fingerprint


def total_rounds(core) -> int:
  """Rounds closed so far over all fragments (the sum of the fragment versions)."""
  versions = core.status().get("versions", {})
  values = versions.values() if isinstance(versions, dict) else versions
  return int(sum(int(v) for v in values))


class PeriodicCheckpointer:
  """A daemon thread that checkpoints the core every `every_rounds` closed rounds (0 = only at stop)."""

  def __init__(self, checkpointer, core, every_rounds: int, poll_s: float = 1.0):
    self._ckpt, self._core, self._every, self._poll = checkpointer, core, every_rounds, poll_s
    self._last = total_rounds(core)
    self._stop = threading.Event()
    self._lock = threading.Lock()  # one save at a time (the thread and the final save)
    self._thread = threading.Thread(target=self._run, name="syncer-checkpoint", daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.wait(self._poll):
      if self._every > 0 and total_rounds(self._core) - self._last >= self._every:
        try:
          self.save()
        except Exception:  # a full disk must not kill the syncer; the next attempt may succeed
          log.exception("syncer checkpoint failed")

  def save(self) -> int:
    from diloco_jax.syncer import checkpoint

    with self._lock:
      rounds = total_rounds(self._core)
      step = checkpoint.save_core(self._ckpt, self._core, rounds=rounds)
      self._last = rounds
      return step

  def stop(self) -> int:
    """Stop the thread, write a final checkpoint and wait until it is on disk; return its step."""
    self._stop.set()
    self._thread.join()
    step = self.save()
    self._ckpt.wait()
    return step


def _define_flags(fv):
  from absl import flags

  flags.DEFINE_string("workdir", None, "where syncer checkpoints and the port file go", flag_values=fv)
  flags.DEFINE_string("bind", "127.0.0.1:50051", "host:port to serve on (port 0: any free port)",
                      flag_values=fv)
  flags.DEFINE_string("token-file", None, f"file holding the run token (else ${TOKEN_ENV})", flag_values=fv)
  flags.DEFINE_string("run-id", "", "run id, part of the fingerprint every learner must match",
                      flag_values=fv)
  flags.DEFINE_string("tls-cert", None, "PEM server certificate (enables TLS)", flag_values=fv)
  flags.DEFINE_string("tls-key", None, "PEM private key of --tls-cert", flag_values=fv)
  flags.DEFINE_string("tls-client-ca", None, "PEM CA: require client certificates it signed (mutual TLS)",
                      flag_values=fv)
  flags.DEFINE_bool("allow-remote", False, "permit binding a non-loopback address", flag_values=fv)
  flags.DEFINE_integer("max-workers", 32, "RPC worker threads", flag_values=fv)
  flags.DEFINE_bool("resume", True, "resume from the latest checkpoint in --workdir", flag_values=fv)


def main(argv) -> int:
  """`python -m diloco_jax syncer --config ... --workdir ... [--bind ...]`; see the module docstring."""
  from diloco_jax import cli
  from diloco_jax import transport
  from diloco_jax.syncer import checkpoint

  fv = cli.parse(argv, _define_flags, doc=__doc__)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  if fv.workdir is None:
    print("--workdir is required", file=sys.stderr)
    return 2
  config = cli.validated(fv.config, None, learners=True)
  tls = None
  if fv["tls-cert"].value or fv["tls-key"].value:
    if not (fv["tls-cert"].value and fv["tls-key"].value):
      print("--tls-cert and --tls-key go together", file=sys.stderr)
      return 2
    tls = TlsConfig(fv["tls-cert"].value, fv["tls-key"].value, fv["tls-client-ca"].value)
  elif fv["tls-client-ca"].value:
    print("--tls-client-ca needs --tls-cert and --tls-key", file=sys.stderr)
    return 2
  try:
    token = read_token(fv["token-file"].value)
  except (OSError, ValueError) as e:
    print(f"syncer: {e}", file=sys.stderr)
    return 2
  bind = fv.bind
  if not is_loopback(bind) and not fv["allow-remote"].value:
    print(f"syncer: refusing to bind {bind!r} (not loopback) without --allow-remote", file=sys.stderr)
    return 2

  workdir = pathlib.Path(fv.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  s = config.syncer
  run_id = fv["run-id"].value
  core, fingerprint = build_core(config, run_id)
  ckpt = checkpoint.SyncerCheckpointer(workdir / "syncer_checkpoints", keep=int(s.keep_checkpoints))
  if fv.resume:
    info = checkpoint.restore_core(ckpt, core)
    if info:
      print(f"syncer: resumed from checkpoint step {info['step']} ({info['rounds']} rounds)", flush=True)

  stop = threading.Event()
  received = []

  def on_signal(signum, frame):
    del frame
    received.append(signum)
    stop.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)

  ticker = transport.Ticker(core)
  handle = serve(core, bind, token=token, tls=tls, limits=Limits.from_config(config), fingerprint=fingerprint,
                 max_workers=fv["max-workers"].value, allow_remote=fv["allow-remote"].value)
  periodic = PeriodicCheckpointer(ckpt, core, int(s.checkpoint_every_rounds))
  host = bind.rsplit(":", 1)[0]
  (workdir / "syncer.port").write_text(f"{handle.port}\n")  # for launchers that bound port 0
  print(f"syncer: serving {host}:{handle.port} fingerprint {fingerprint} "
        f"({'TLS' if tls else 'plaintext'}); workdir {workdir}", flush=True)
  while not stop.wait(1.0):
    pass
  print(f"syncer: signal {received[0] if received else '?'}: stopping", flush=True)
  handle.stop(grace=float(s.shutdown_grace_s))
  ticker.stop()
  step = periodic.stop()
  ckpt.close()
  print(f"syncer: final checkpoint step {step} in {ckpt.directory}; versions {core.status()['versions']}",
        flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))

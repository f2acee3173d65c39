r"""The syncer process: `python -m diloco_jax syncer`.

    python -m diloco_jax syncer --config configs/tiny_cpu.py --workdir runs/syncer \
        --bind 127.0.0.1:50051 --token-file secrets/run.token --run-id r1

It builds the core from the config (`syncer/build.py`: the global fragments start from the learners'
initial parameters), resumes from the latest checkpoint in `--workdir` and from its journal, serves it over
gRPC (`syncer/server/grpc_service.py`, with the token, TLS and bind rules of `syncer/server/auth.py`),
closes rounds on time (`syncer/ticker.py`), and checkpoints every `syncer.checkpoint_every_rounds` closed
rounds and at shutdown (SIGTERM/SIGINT). The bound port is written to `WORKDIR/syncer.port`. What else it
writes, shutdown and recovery: docs/operations.md, "Start" and "Checkpoints and recovery".

A sharded syncer is S of these processes, `--shard I --shards S` (I = 0..S-1), each with its own
`--workdir` and port. Learners list every shard's address, in shard order: `learner --syncer
HOST0:PORT0,HOST1:PORT1`. docs/operations.md, "A sharded syncer".
"""

from __future__ import annotations

import errno
import logging
import pathlib
import socket
import threading

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.protocol import run_token
from diloco_jax.syncer import checkpoint
from diloco_jax.syncer.build import build_core
from diloco_jax.syncer.core import SyncerCore
from diloco_jax.syncer.monitor import SyncerMonitor
from diloco_jax.syncer.server.auth import TlsConfig, check_bind
from diloco_jax.syncer.server.grpc_service import serve
from diloco_jax.syncer.server.limits import Limits, workers_for
from diloco_jax.syncer.tape import Tape
from diloco_jax.syncer.ticker import Ticker

log = logging.getLogger(__name__)


class PeriodicCheckpointer:
  """A daemon thread that checkpoints the core every `every_rounds` closed rounds (0 = only at stop)."""

  def __init__(self, checkpointer: checkpoint.SyncerCheckpointer, core: SyncerCore, every_rounds: int,
               poll_s: float = 1.0):
    self._ckpt, self._core, self._every, self._poll = checkpointer, core, every_rounds, poll_s
    self._last = core.rounds_closed()
    self._stop = threading.Event()
    self._lock = threading.Lock()  # one save at a time (the thread and the final save)
    self._thread = threading.Thread(target=self._run, name="syncer-checkpoint", daemon=True)
    self._thread.start()

  def _run(self):
    while not self._stop.wait(self._poll):
      if self._every > 0 and self._core.rounds_closed() - self._last >= self._every:
        try:
          self.save()
        except Exception:  # a full disk must not kill the syncer; the next attempt may succeed
          log.exception("syncer checkpoint failed")

  def save(self) -> int:
    with self._lock:
      rounds = self._core.rounds_closed()
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


def _tls_from_flags(fv) -> TlsConfig | None:
  cert, key, client_ca = fv["tls-cert"].value, fv["tls-key"].value, fv["tls-client-ca"].value
  if cert or key:
    if not (cert and key):
      raise cli.UsageError("--tls-cert and --tls-key go together")
    return TlsConfig(cert, key, client_ca)
  if client_ca:
    raise cli.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
  return None


def _checked(fv):
  """The validated config, the run token and TLS settings, or a usage error naming the bad flag or field."""
  config = cli.validated(fv.config, None, learners=True, data=False)  # the syncer reads no data
  tls = _tls_from_flags(fv)
  try:
    token = run_token.read_token(fv["token-file"].value)
    check_bind(fv.bind, allow_remote=fv["allow-remote"].value, tls=tls)
    check_port_free(fv.bind)
  except (OSError, ValueError) as e:
    raise cli.UsageError(f"syncer: {e}") from None
  shard, shards = fv.shard, fv.shards
  if not 0 <= shard < shards or shards > config.outer.num_fragments:
    raise cli.UsageError(f"syncer: --shard ({shard}) must be in [0, --shards) and --shards ({shards}) in "
                         f"[1, outer.num_fragments={config.outer.num_fragments}]")
  return config, token, tls


def check_port_free(bind: str) -> None:
  """Raise ValueError when the port of `bind` (host:port; 0: any free one, always fine) is taken on its
  host, naming the fix: checked before the syncer writes anything (gRPC would only fail at serving)."""
  host, _, port = bind.rpartition(":")
  host = host.strip("[]")
  if not port.isdigit() or int(port) == 0:
    return
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to serve on
    try:
      sock.bind((host or "0.0.0.0", int(port)))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # e.g. a host name this check cannot bind: gRPC says what it makes of it
      raise ValueError(f"--bind {bind}: the port is in use (another syncer?); stop what holds it or choose "
                       "another port (--bind HOST:0 picks a free one)") from None


def _restored(config, fv, workdir: pathlib.Path):
  """The core (resumed from its checkpoint and journal with --resume), its checkpointer and journal."""
  tape = Tape(fv["record-tape"].value) if fv["record-tape"].value else None
  core, fingerprint = build_core(config, fv["run-id"].value, shard=fv.shard, shards=fv.shards, tape=tape)
  ckpt = checkpoint.SyncerCheckpointer(workdir / "syncer_checkpoints", keep=int(config.syncer.keep_checkpoints))
  journal = checkpoint.Journal(workdir / "journal.json", timeline=workdir / "versions.jsonl")
  record = None
  if fv.resume:
    info = checkpoint.restore_core(ckpt, core)
    if info:
      print(f"syncer: resumed from checkpoint step {info['step']} ({info['rounds']} rounds)", flush=True)
    record = journal.read()
  restored_versions = list(core.status()["versions"])
  try:
    core.attach_journal(journal, record)
  except ValueError as e:
    raise cli.UsageError(f"syncer: {e} (another run's workdir? use --no-resume or a new --workdir)") from None
  if record is not None:
    counters = core.counters
    print(f"syncer: restart {counters['restarts']} (epoch {core.epoch}): versions {core.status()['versions']} "
          f"(checkpoint {restored_versions}, journal {record['versions']}); lost to crashes so far: "
          f"{counters['rounds_rolled_back']} rounds, {counters['contributions_lost_open']} open-round "
          "contributions (the learners push that work again)", flush=True)
  return core, fingerprint, ckpt, journal


class _Serving:
  """The threads around a serving core: gRPC (and the data plane), the ticker, the periodic checkpointer,
  the decision log and the monitor; `stop` ends them in order."""

  def __init__(self, core: SyncerCore, config, fv, workdir: pathlib.Path, token: str, tls, fingerprint: str,
               ckpt: checkpoint.SyncerCheckpointer):
    self.core, self.ckpt = core, ckpt
    self.ticker = Ticker(core)
    self.handle = serve(core, fv.bind, token=token, tls=tls, limits=Limits.from_config(config),
                        data_plane=bool(config.syncer.data_plane), fingerprint=fingerprint,
                        max_workers=fv["max-workers"].value or workers_for(config),
                        allow_remote=fv["allow-remote"].value)
    self.periodic = PeriodicCheckpointer(ckpt, core, int(config.syncer.checkpoint_every_rounds))
    self.rounds_log = metrics_lib.DrainLog(core.drain_decisions, workdir, "rounds")
    self.metrics_log = metrics_lib.MetricsLog(workdir, tags=metrics_lib.SYNCER_TAGS)
    self.monitor = SyncerMonitor(core, self.metrics_log)

  def stop(self, grace_s: float) -> int:
    """Stop serving (calls in flight get `grace_s`), merge what the open rounds hold, write the final
    checkpoint and wait for it; returns its step."""
    self.handle.stop(grace=grace_s)
    self.ticker.stop()
    closed = self.core.close_open_rounds()  # merge what the open rounds hold rather than drop it
    if closed:
      print(f"syncer: closed the open rounds of fragments {closed} with what they held", flush=True)
    self.rounds_log.close()  # after the last rounds closed: their decisions are written too
    self.monitor.stop()
    self.metrics_log.close()
    step = self.periodic.stop()
    self.core.close_tape()
    self.ckpt.close()
    return step


def run_syncer_process(argv) -> int:
  """`python -m diloco_jax syncer --config ... --workdir ... [--bind ...]`; see the module docstring."""
  fv = cli.parse(argv, command_flags.syncer, doc=__doc__)
  cli.configure_logging(logging.INFO)
  config, token, tls = _checked(fv)
  workdir = pathlib.Path(fv.workdir)
  if fv.resume:  # a fresh start (--no-resume) may reuse another run's workdir
    cli.check_workdir(config, workdir, fv["run-id"].value)
  workdir.mkdir(parents=True, exist_ok=True)
  config_lib.save_resolved(config, workdir, fv["run-id"].value)
  core, fingerprint, ckpt, journal = _restored(config, fv, workdir)
  with cli.StopSignals("syncer", exit_on_second=False) as signals:
    serving = _Serving(core, config, fv, workdir, token, tls, fingerprint, ckpt)
    (workdir / "syncer.port").write_text(f"{serving.handle.port}\n")
    owned = f"shard {fv.shard}/{fv.shards}, fragments {core.status()['owned']}; " if fv.shards > 1 else ""
    print(f"syncer: serving {fv.bind.rsplit(':', 1)[0]}:{serving.handle.port} {owned}fingerprint {fingerprint} "
          f"({'TLS' if tls else 'plaintext'}); workdir {workdir}", flush=True)
    signals.wait()
    step = serving.stop(float(config.syncer.shutdown_grace_s))
  journal.close()
  print(f"syncer: final checkpoint step {step} in {ckpt.directory}; versions {core.status()['versions']}",
        flush=True)
  return 0

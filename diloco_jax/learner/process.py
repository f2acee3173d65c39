r"""One learner process talking to a gRPC syncer: `python -m diloco_jax learner`.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
    python -m diloco_jax learner --config configs/tiny_cpu.py --syncer 127.0.0.1:50051 --learner-id 0 \
        --workdir runs/l0 --token-file run.token --run-id r1

It trains on its own devices (the first `learners.devices`: locally fake CPU devices set by XLA_FLAGS, on a
TPU VM the host's chips) and reaches the syncer through `GrpcTransport`, which retries while the syncer is
unreachable (a sharded syncer: every shard's address, in shard order). The config (with its overrides) and
`--run-id` must be the syncer's. SIGTERM or SIGINT: flush, checkpoint, leave, exit 0 within
`comms.shutdown_grace_s`; a second signal exits at once. The same `--learner-id` and `--workdir` resume.
A learner spanning several processes runs this on every host with `--distributed` (or `--coordinator`,
`--num-processes`, `--process-id`). docs/operations.md, "A learner process" and "multi-host".
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

import jax

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.compute import multihost, plans
from diloco_jax.learner import group as group_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.learner import summary as summary_lib
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.transports import client_flags, sharded
from diloco_jax.transports import retry as retry_lib
from diloco_jax.transports.errors import AuthError, SyncerUnreachable
from diloco_jax.transports.grpc_client import GrpcTransport

EXIT_FAILED = cli.EXIT_FAILED


class ShutdownWatchdog:
  """Once armed (at the first stop signal), calls `abandon()` if the learner has not finished within
  `grace_s`: the waits on the network that held it then end with an error."""

  def __init__(self, grace_s: float, abandon: Callable[[], None]):
    self.grace_s, self._abandon = grace_s, abandon
    self.fired = threading.Event()
    self._timer: threading.Timer | None = None

  def arm(self) -> None:
    if self._timer is None:
      self._timer = threading.Timer(self.grace_s, self._fire)
      self._timer.daemon = True
      self._timer.start()

  def _fire(self) -> None:
    print(f"learner: still waiting on the syncer {self.grace_s:g}s after the stop signal "
          "(comms.shutdown_grace_s): abandoning the syncs in flight", file=sys.stderr, flush=True)
    self.fired.set()
    self._abandon()

  def fire_now(self, why: str) -> None:
    """Abandon at once (a stop signal with nothing to wait for): says `why`."""
    print(f"learner: stopping now: {why}", file=sys.stderr, flush=True)
    self.fired.set()
    self._abandon()

  def disarm(self) -> None:
    if self._timer is not None:
      self._timer.cancel()


def _say_started(config, learner, learner_id: int, k: int, devices, targets: list[str], fingerprint: str,
                 channel, *, leader: bool, quiet: bool) -> None:
  """The start lines: one on every process of a multi-host learner (launch/tpu/host.sh waits for it), and
  the leader's device, syncer and resume line with what it waits for while it joins."""
  start_step = learner.trainer.step
  if not leader:
    print(f"learner {learner_id} process {jax.process_index()}: started at step {start_step}", file=sys.stderr,
          flush=True)
    return
  if quiet:
    return
  spans = f" over {jax.process_count()} processes" if channel is not None else ""
  print(f"learner {learner_id}: {k} {devices[0].platform} device(s){spans}, syncer {','.join(targets)}, fingerprint "
        f"{fingerprint}, " + (f"resumed at step {start_step}" if learner.restored else "fresh start"),
        file=sys.stderr, flush=True)
  print(f"learner {learner_id}: joining the syncer at {','.join(targets)}: waiting until it answers (a line "
        f"per retry; gives up after comms.unreachable_deadline_s = {config.comms.unreachable_deadline_s:g}s)",
        file=sys.stderr, flush=True)


def run(config, *, targets: list[str], learner_id: int, workdir: str, token: str, run_id: str = "",
        num_devices: int | None = None, tls: dict | None = None, quiet: bool = False,
        checkpoint_dir: str | None = None) -> dict:
  """Train one learner against the syncer at `targets` (one address per shard) until `train.steps` or a
  signal; returns the summary (also written to `<workdir>/summary.json`)."""
  t0 = time.perf_counter()
  k = num_devices or config.learners.device_counts[learner_id]
  devices = _devices(learner_id, k)
  fingerprint = config_lib.fingerprint(config, run_id)
  watch, channel, exit_hooks = _start_group(config, k, devices)
  leader = jax.process_index() == 0  # process 0 of a multi-host learner, or a one-process learner
  quiet = quiet or not leader
  transport = None
  if leader:
    transport = sharded.connect(
        targets, lambda target: GrpcTransport.from_config(config, target, token, learner_id, **(tls or {})),
        lambda shards: plans.config_owners(config, shards))
  built = []  # the learner, once built: its comms leave (heartbeats stop first, so none rejoins it)
  if channel is not None and leader:
    # A learner out of the run leaves its quorum.
    exit_hooks.append(lambda: built[0].comms.leave() if built else transport.leave(learner_id))
  metrics_log = None
  if leader:
    config_lib.save_resolved(config, workdir, run_id)
    metrics_log = metrics_lib.MetricsLog(workdir, tags=metrics_lib.LEARNER_TAGS)
  learner = loop_lib.Learner(config, learner_id, devices[:k], transport, fingerprint, workdir,
                             metrics_log=metrics_log, checkpoint_dir=checkpoint_dir,
                             strategy=None if channel is None else group_lib.ProcessGroup(channel))
  built.append(learner)
  start_step = learner.trainer.step
  _say_started(config, learner, learner_id, k, devices, targets, fingerprint, channel, leader=leader, quiet=quiet)
  summary, stopped, abandoned = _train(learner, transport, watch, metrics_log, quiet=quiet, t0=t0)
  if not leader:
    print(f"learner {learner_id} process {jax.process_index()}: done at step {summary['steps']}",
          file=sys.stderr, flush=True)
    return summary
  summary.update(learner.strategy.stats())
  summary.update({
      "process_wall_s": time.perf_counter() - t0, "start_step": start_step, "restored": learner.restored,
      "stopped_by_signal": stopped, "completed": summary["steps"] >= config.train.steps and not abandoned,
      "flush_abandoned": abandoned,
      "retries": transport.retries, "fingerprint": fingerprint, "devices": k,
  })
  metrics_lib.write_summary(workdir, summary)
  if not quiet:
    print(f"learner {learner_id}: {'stopped' if stopped else 'done'} at step {summary['steps']}, "
          f"{summary['syncs']} syncs, {summary['adopted']} adopted, "
          f"{(summary['bytes_sent'] + summary['bytes_received']) / 2**20:.2f} MiB on the wire; "
          f"summary in {workdir}/summary.json", file=sys.stderr, flush=True)
  return summary


def _devices(learner_id: int, k: int) -> list:
  """This process's devices, at least the `k` learner `learner_id` trains on."""
  devices = jax.devices()
  if len(devices) < k:
    raise cli.UsageError(
        f"learner {learner_id} needs {k} devices (config.learners.devices / --devices) but this process sees "
        f"{len(devices)} {devices[0].platform} device(s); for fake CPU devices start it with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={k} (python -m diloco_jax local does this)")
  return devices


def _train(learner: loop_lib.Learner, transport, watch, metrics_log, *, quiet: bool, t0: float
           ) -> tuple[dict, bool, bool]:
  """`run_learner` until done or stopped by a signal, within `comms.shutdown_grace_s` of the first one
  (the module docstring); then everything closes. Returns (summary, stopped by a signal, flush abandoned)."""
  config, learner_id = learner.config, learner.learner_id
  bar = None if quiet else metrics_lib.progress(config.train.steps, initial=learner.trainer.step,
                                                desc=f"learner {learner_id}")
  summary = None

  def abandon():
    if learner.comms is not None:
      learner.comms.abandon()
    if transport is not None:
      transport.close()  # ends calls in flight and retry waits at once

  watchdog = ShutdownWatchdog(float(config.comms.shutdown_grace_s), abandon)

  def on_signal():
    if learner.comms is not None and not learner.comms.joined.is_set():
      watchdog.fire_now("the syncer never answered, so there is nothing to flush")
    else:
      watchdog.arm()

  abandoned = False
  try:
    with cli.StopSignals("learner", "stopping after this step", on_first=on_signal,
                         exiting="exiting without a final checkpoint") as stop:
      try:
        summary = loop_lib.run_learner(learner, on_step=(lambda: bar.update(1)) if bar else None,
                                       should_stop=stop)
      except Exception:
        if not watchdog.fired.is_set():
          raise
        # The grace ran out while the learner waited on the network: keep what it has.
        abandoned = True
        learner.trainer.save({"learner": learner_id})
        summary = summary_lib.learner_summary(learner, time.perf_counter() - t0, None)
      finally:
        watchdog.disarm()
    stopped = bool(stop.received) or learner.strategy.stop_agreed
  except Exception:
    if watch is not None:
      watch.wait_for_verdict()  # a collective that failed with a dead peer: exit as the watch decides
    raise
  finally:
    if bar is not None:
      bar.close()
    # Leave only after a clean finish: a crashed learner keeps its membership until its lease lapses.
    learner.close(leave=summary is not None and not abandoned)
    if watch is not None:
      watch.stop(done=summary is not None)
    if transport is not None:
      transport.close()
    if metrics_log is not None:
      metrics_log.close()
  return summary, stopped, abandoned


def _start_group(config, k: int, devices) -> tuple:
  """For a learner spanning several processes: checks its devices and starts the watch between its
  processes and the channel from process 0. Returns (watch, channel, exit_hooks), all None/[] on one
  process; `exit_hooks` run when the watch finds a process lost, before this one exits."""
  if jax.process_count() == 1:
    return None, None, []
  if len(devices) != k:
    raise cli.UsageError(f"a learner spanning {jax.process_count()} processes trains on all their devices, "
                         f"{len(devices)} here, but config.learners.devices (or --devices) is {k}")
  exit_hooks = []
  watch = multihost.PeerWatch(jax.process_index(), jax.process_count(), timeout_s=config.learners.peer_timeout_s,
                              on_lost=lambda message: multihost.exit_peer_lost(message, exit_hooks)).start()
  return watch, multihost.HostChannel(jax.process_index(), jax.process_count(), watch=watch), exit_hooks


def run_learner_process(argv) -> int:
  """`python -m diloco_jax learner --config CFG --syncer HOST:PORT --learner-id N --workdir DIR`."""
  fv = cli.parse(argv, command_flags.learner, doc=__doc__)
  # A line per retry of an unreachable or busy syncer: what it waits for.
  cli.configure_logging(logging.WARNING, info_loggers=(retry_lib.log,))
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack
  config = fv.config
  learner_id = fv["learner-id"].value
  if not 0 <= learner_id < config.learners.num:
    raise cli.UsageError(f"--learner-id must be in [0, config.learners.num={config.learners.num}), "
                         f"got {learner_id}")
  targets = client_flags.targets(fv)
  if fv.devices:
    if config.learners.device_counts:
      counts = list(config.learners.device_counts)
      counts[learner_id] = fv.devices
      config.learners.device_counts = tuple(counts)
    else:
      config.learners.devices = fv.devices
  counts = config_lib.resolve(config).learners.device_counts  # sized before validating (resolve never raises)
  k = counts[learner_id]
  try:
    spec = multihost.spec_from_flags(fv)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  if spec.enabled:  # before anything starts a jax backend (the plan check below does)
    multihost.initialize(spec, peer_timeout_s=config.learners.peer_timeout_s,
                         init_timeout_s=fv["init-timeout-s"].value)
  # Validate as one learner of the run: the device total is checked in `run`, per process.
  config = cli.validated(config, sum(counts), learners=True)  # the run's RunSpec from here on
  cli.check_workdir(config, fv.workdir, fv["run-id"].value)
  try:
    run(config, targets=targets, learner_id=learner_id, workdir=fv.workdir, token=client_flags.token(fv),
        run_id=fv["run-id"].value, num_devices=k, tls=client_flags.tls(fv), checkpoint_dir=fv["checkpoint-dir"].value)
  except (SyncerUnreachable, AuthError) as e:
    print(f"learner {learner_id}: {e}", file=sys.stderr)
    return EXIT_FAILED
  except Rejected as e:
    print(f"learner {learner_id}: refused by the syncer: {e}", file=sys.stderr)
    return EXIT_FAILED
  return 0

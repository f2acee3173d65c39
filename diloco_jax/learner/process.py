"""One learner process talking to a gRPC syncer: `python -m diloco_jax learner`.

    umask 077; openssl rand -hex 32 > run.token
    python -m diloco_jax syncer  --config configs/tiny_cpu.py --workdir runs/s --token-file run.token \\
        --bind 127.0.0.1:50051 --run-id r1
    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
    python -m diloco_jax learner --config configs/tiny_cpu.py --syncer 127.0.0.1:50051 --learner-id 0 \\
        --workdir runs/l0 --token-file run.token --run-id r1

The process trains on its own devices (the first `learners.devices` of `jax.devices()`: locally fake CPU
devices, whose count must be set with XLA_FLAGS before jax starts, as `python -m diloco_jax local` does; on
a TPU VM the host's chips). It reaches the syncer through `GrpcTransport`, which retries while the syncer
is unreachable, so learners may start before the syncer, and survive its restart.

* The run token comes from `--token-file` or $DILOCO_TOKEN, never from the command line.
* The config (with its `--config.x=y` overrides) and `--run-id` must be the syncer's: both enter the run
  fingerprint, and a learner with another one is refused at Join.
* SIGTERM or SIGINT: finish the current step, flush (push every fragment's pending work and adopt the
  merged results), checkpoint, leave the quorum, write the summary, exit 0. A second signal exits at once
  (status 1) and keeps the last checkpoint.
* Restarting with the same `--learner-id` and `--workdir` resumes from the learner's checkpoint (every
  `train.checkpoint_every` steps and at the end) and rejoins: the learner pulls every current global
  fragment before its first step.

Output in `--workdir`: `checkpoints/`, `metrics.jsonl`, and `summary.json` (run_learner's summary plus the
process's wall time, payload byte counts and retries). Progress lines go to stderr.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

import jax
from absl import flags

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import protocol
from diloco_jax.learner import loop as loop_lib
from diloco_jax.transports.grpc import AuthError, GrpcTransport, SyncerUnreachable

EXIT_FAILED = 1


class StopSignals:
  """SIGTERM/SIGINT set `stop`; the training loop polls it between steps. A second signal exits at once
  (the training thread may be blocked on the network, e.g. flushing to a dead syncer)."""

  def __init__(self):
    self.received: list[int] = []
    self._previous = {}

  def __enter__(self):
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.received.append(signum)
    if len(self.received) > 1:
      print(f"learner: second signal {signum}: exiting without a final checkpoint", file=sys.stderr, flush=True)
      os._exit(EXIT_FAILED)
    print(f"learner: signal {signum}: stopping after this step", file=sys.stderr, flush=True)

  def __call__(self) -> bool:
    return bool(self.received)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("syncer", None, "host:port of the syncer", flag_values=fv, required=True)
  flags.DEFINE_integer("learner-id", None, "this learner's id, in [0, learners.num)", flag_values=fv,
                       required=True)
  flags.DEFINE_string("workdir", None, "this learner's directory (checkpoints, metrics, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_string("token-file", None, "file holding the run token (else $DILOCO_TOKEN)", flag_values=fv)
  flags.DEFINE_string("run-id", "", "run id: must be the syncer's (it enters the fingerprint)", flag_values=fv)
  flags.DEFINE_integer("devices", None, "devices of this learner (default learners.device_counts[id], else "
                       "learners.devices)",
                       flag_values=fv)
  flags.DEFINE_string("tls-ca", None, "PEM CA that signed the syncer's certificate (enables TLS)",
                      flag_values=fv)
  flags.DEFINE_string("tls-cert", None, "PEM client certificate (mutual TLS)", flag_values=fv)
  flags.DEFINE_string("tls-key", None, "PEM private key of --tls-cert", flag_values=fv)
  flags.DEFINE_string("tls-server-name", None, "name expected in the syncer's certificate, if not the "
                      "--syncer host", flag_values=fv)


def run(config, *, target: str, learner_id: int, workdir: str, token: str, run_id: str = "",
        num_devices: int | None = None, tls: dict | None = None, quiet: bool = False) -> dict:
  """Train one learner against the syncer at `target` until `train.steps` or a signal; returns the
  summary (also written to `<workdir>/summary.json`)."""
  t0 = time.perf_counter()
  k = num_devices or config_lib.learner_devices(config, learner_id)
  devices = jax.devices()
  if len(devices) < k:
    raise cli.UsageError(
        f"learner {learner_id} needs {k} devices (config.learners.devices / --devices) but this process sees "
        f"{len(devices)} {devices[0].platform} device(s); for fake CPU devices start it with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={k} (python -m diloco_jax local does this)")
  fingerprint = config_lib.fingerprint(config, run_id)
  transport = GrpcTransport.from_config(config, target, token, learner_id, **(tls or {}))
  metrics_log = metrics_lib.MetricsLog(workdir)
  learner = loop_lib.Learner(config, learner_id, devices[:k], transport, fingerprint, workdir,
                             metrics_log=metrics_log)
  start_step = learner.trainer.step
  if not quiet:
    print(f"learner {learner_id}: {k} {devices[0].platform} device(s), syncer {target}, fingerprint "
          f"{fingerprint}, " + (f"resumed at step {start_step}" if learner.restored else "fresh start"),
          file=sys.stderr, flush=True)
  bar = None if quiet else metrics_lib.progress(config.train.steps, initial=start_step,
                                                desc=f"learner {learner_id}")
  summary = None
  try:
    with StopSignals() as stop:
      summary = loop_lib.run_learner(learner, on_step=(lambda: bar.update(1)) if bar else None,
                                     should_stop=stop)
    stopped = bool(stop.received)
  finally:
    if bar is not None:
      bar.close()
    # Leave only after a clean finish: a crashed learner keeps its membership until its lease lapses.
    learner.close(leave=summary is not None)
    transport.close()
    metrics_log.close()
  summary.update({
      "process_wall_s": time.perf_counter() - t0, "start_step": start_step, "restored": learner.restored,
      "stopped_by_signal": stopped, "completed": summary["steps"] >= config.train.steps,
      "retries": transport.retries, "fingerprint": fingerprint, "devices": k,
  })
  metrics_lib.write_summary(workdir, summary)
  if not quiet:
    print(f"learner {learner_id}: {'stopped' if stopped else 'done'} at step {summary['steps']}, "
          f"{summary['syncs']} syncs, {summary['adopted']} adopted, "
          f"{(summary['bytes_sent'] + summary['bytes_received']) / 2**20:.2f} MiB on the wire; "
          f"summary in {workdir}/summary.json", file=sys.stderr, flush=True)
  return summary


def main(argv) -> int:
  """`python -m diloco_jax learner --config CFG --syncer HOST:PORT --learner-id N --workdir DIR`."""
  fv = cli.parse(argv, _define_flags, doc=__doc__)
  logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
  config = fv.config
  learner_id = fv["learner-id"].value
  if not 0 <= learner_id < config.learners.num:
    raise cli.UsageError(f"--learner-id must be in [0, config.learners.num={config.learners.num}), "
                         f"got {learner_id}")
  host, _, port = fv.syncer.rpartition(":")
  if not host or not port.isdigit():
    raise cli.UsageError(f"--syncer must be host:port, got {fv.syncer!r}")
  if fv.devices:
    if config.learners.device_counts:
      counts = list(config.learners.device_counts)
      counts[learner_id] = fv.devices
      config.learners.device_counts = tuple(counts)
    else:
      config.learners.devices = fv.devices
  k = config_lib.learner_devices(config, learner_id)
  # Validate as one learner of the run: the device total is checked in `run`, per process.
  cli.validated(config, sum(config_lib.learner_devices(config, i) for i in range(config.learners.num)),
                learners=True)
  try:
    token = protocol.read_token(fv["token-file"].value)
  except (OSError, ValueError) as e:
    raise cli.UsageError(str(e)) from None
  tls = {"tls_ca": fv["tls-ca"].value, "tls_cert": fv["tls-cert"].value, "tls_key": fv["tls-key"].value,
         "tls_server_name": fv["tls-server-name"].value}
  try:
    run(config, target=fv.syncer, learner_id=learner_id, workdir=fv.workdir, token=token,
        run_id=fv["run-id"].value, num_devices=k, tls=tls)
  except (SyncerUnreachable, AuthError) as e:
    print(f"learner {learner_id}: {e}", file=sys.stderr)
    return EXIT_FAILED
  except protocol.Rejected as e:
    print(f"learner {learner_id}: refused by the syncer: {e}", file=sys.stderr)
    return EXIT_FAILED
  return 0

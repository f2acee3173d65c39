r"""The global model's eval curve in a multi-process run: `python -m diloco_jax evaluator`.

    python -m diloco_jax evaluator --config configs/tiny_cpu.py --syncer 127.0.0.1:50051 \
        --workdir runs/r/global --token-file run.token --run-id r1

An observer of the syncer (`evaluator/loop.py`): it reads the status and pulls the global fragments without
joining (`protocol.messages.OBSERVER_ID`), so it never counts toward a quorum, and evaluates on its own
devices every `train.eval_every` steps of progress. With a sharded syncer, `--syncer` lists every shard in
shard order. The config (with its overrides) and `--run-id` must be the syncer's. SIGTERM or SIGINT: one
last eval if the model moved, then exit 0; a second signal exits at once. Output in `--workdir`:
`metrics.jsonl`, TensorBoard event files, `config.json` and `summary.json` (docs/observability.md).
"""

from __future__ import annotations

import logging
import sys
import threading

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.compute import plans
from diloco_jax.evaluator import loop
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.transports import client_flags, sharded
from diloco_jax.transports.errors import AuthError, SyncerUnreachable
from diloco_jax.transports.grpc_client import GrpcTransport

EXIT_FAILED = cli.EXIT_FAILED


def run(config, *, targets: list[str], workdir: str, token: str, run_id: str = "", tls: dict | None = None,
        poll_s: float = 1.0, stop: threading.Event | None = None, quiet: bool = False) -> dict:
  """Evaluate the global model of the syncer at `targets` (one address per shard) on schedule until `stop` is
  set; then once more if it moved. Returns the summary (also `<workdir>/summary.json`)."""
  stop = stop or threading.Event()
  devices = cli.devices(config.learners.devices, "evaluator")[:config.learners.devices]
  config_lib.save_resolved(config, workdir, run_id)
  global_eval = loop.GlobalEval(config, devices)
  plan = global_eval.plan
  fingerprint = config_lib.fingerprint(config, run_id)

  def connect(target: str) -> GrpcTransport:
    transport = GrpcTransport.from_config(config, target, token, protocol.OBSERVER_ID, **(tls or {}))
    transport.fingerprint = fingerprint  # an observer never joins: its pulls carry the run's fingerprint
    return transport

  transport = sharded.connect(targets, connect, lambda shards: plans.config_owners(config, shards))
  metrics_log = metrics_lib.MetricsLog(workdir, tags=metrics_lib.GLOBAL_EVAL_TAGS)
  source = loop.TransportSource(transport, [plan.size(p) for p in range(plan.num_fragments)],
                                config.outer.codec_block)
  evaluator = loop.GlobalEvaluator(global_eval, source, loop.EvalSchedule.from_config(config), metrics_log,
                                   poll_s=poll_s)
  if not quiet:
    print(f"evaluator: {len(devices)} {devices[0].platform} device(s), syncer {','.join(targets)}, every "
          f"{config.train.eval_every} steps of progress", file=sys.stderr, flush=True)
  evals = 0
  try:
    while not stop.is_set():
      try:
        record = evaluator.poll()
      except (AuthError, Rejected):  # another run, or a wrong token: looking again cannot help
        raise
      except Exception as e:  # noqa: BLE001 - the syncer may be restarting; look again at the next poll
        print(f"evaluator: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        record = None
      if record is not None:
        evals += 1
        if not quiet:
          print(f"evaluator: step {record['step']} ({record['tokens']:,.0f} tokens merged), versions "
                f"{record['versions']}: eval loss {record['eval_loss']:.4f}", file=sys.stderr, flush=True)
      stop.wait(poll_s)
    before = evaluator.latest
    last = evaluator.stop(final=True)
    evals += int(last is not before and not last.get("repeat"))
  finally:
    metrics_log.close()
    transport.close()
  summary = {"evals": evals, "latest": last, "final_eval_loss": None if last is None else last["eval_loss"]}
  metrics_lib.write_summary(workdir, summary)
  if not quiet:
    print(f"evaluator: done after {evals} evals; last: "
          + ("none" if last is None else f"eval loss {last['eval_loss']:.4f} at versions {last['versions']}"),
          file=sys.stderr, flush=True)
  return summary


def run_evaluator_process(argv) -> int:
  """`python -m diloco_jax evaluator --config C --syncer HOST:PORT --workdir D`; see the module docstring."""
  fv = cli.parse(argv, command_flags.evaluator, doc=__doc__)
  cli.configure_logging(logging.WARNING)
  config = cli.validated(fv.config, None, learners=True)
  cli.check_workdir(config, fv.workdir, fv["run-id"].value)
  targets, token = client_flags.targets(fv), client_flags.token(fv)
  # A second signal exits at once: the final eval may be stuck on a dead syncer.
  with cli.StopSignals("evaluator", "a last eval, then exit", exiting=None) as signals:
    try:
      run(config, targets=targets, workdir=fv.workdir, token=token, run_id=fv["run-id"].value,
          tls=client_flags.tls(fv), poll_s=fv["poll-s"].value, stop=signals.stopped)
    except (SyncerUnreachable, AuthError, Rejected) as e:
      print(f"evaluator: {e}", file=sys.stderr, flush=True)
      return EXIT_FAILED
  return 0

r"""A syncer, the global model's evaluator and N learner processes on this machine: `python -m diloco_jax local`.

    python -m diloco_jax local --config configs/tiny_cpu.py --learners 2 --workdir runs/local \
        [--config.train.steps=200 ...] [--syncer-shards S] [--hosts-per-learner H]

Each child is its own process with its own fake CPU devices, talking over gRPC on loopback as on separate
hosts, sharing a fresh run token (`WORKDIR/token`); every child logs to `WORKDIR/logs/<name>.log`. When the
learners are done the launcher stops the evaluator and the syncer (final checkpoint), evaluates and exports
the global model (`WORKDIR/model`) and writes `WORKDIR/summary.json` and `WORKDIR/plots/`. Rerunning on the
same workdir resumes. Ctrl-C stops every child in order (learners first) and exits 128 + the signal; a
failing child is named with its log tail and the launcher exits 1. docs/operations.md, "The local
launcher".
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

# jax only serves the final eval, on devices this launcher sets up in `launch` before the backend starts.
import jax

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.evaluator import loop as eval_loop
from diloco_jax.outer import merge as outer_lib
from diloco_jax.runs import children as children_lib
from diloco_jax.runs import export as export_lib
from diloco_jax.runs import plots as plot_lib
from diloco_jax.runs.launcher import Launcher

EXIT_FAILED = cli.EXIT_FAILED
# The figures of a summary that each segment of a resumed run counts for itself (the rest are the run's so far).
SEGMENT_FIELDS = ("wall_s", "bytes_sent", "bytes_received", "payload_bytes_sent", "payload_bytes_received",
                  "comm_bytes")


def evaluate_global(config, syncer_dirs: list[pathlib.Path], run_id: str, export_dir: pathlib.Path | None = None
                    ) -> float | None:
  """Eval loss of the global model in the syncer's latest checkpoint (every shard's), on this process's CPU
  devices; with `export_dir`, that model is exported there too (`export.py`). None when the syncer left no
  checkpoint."""
  found = export_lib.syncer_params(config, syncer_dirs, run_id)
  if found is None:
    return None
  params, info = found
  loss = eval_loop.GlobalEval(config, jax.devices()[:config_lib.resolve(config).learners.device_counts[0]]).loss(params)
  if export_dir is not None:
    export_lib.export(export_dir, config, params, source="local", run_id=run_id,
                      syncer_checkpoint_step=info["step"], rounds=info["rounds"], versions=info["versions"],
                      final_eval_loss=loss)
  return loss


def merged_summary(workdir: pathlib.Path, num: int, status: dict | None, wall_s: float, run_id: str,
                   num_fragments: int = 1) -> dict:
  learners = []
  for i in range(num):
    path = workdir / f"learner_{i}" / "summary.json"
    learners.append(json.loads(path.read_text()) if path.exists() else {"learner": i, "missing": True})
  done = [s for s in learners if not s.get("missing")]
  tokens = sum(s["tokens"] for s in done)
  summary = {
      "mode": "local", "run_id": run_id, "wall_s": wall_s, "learners": learners, "tokens": tokens,
      "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
      "bytes_sent": sum(s["bytes_sent"] for s in done),
      "bytes_received": sum(s["bytes_received"] for s in done),
      "payload_bytes_sent": sum(s["payload_bytes_sent"] for s in done),
      "payload_bytes_received": sum(s["payload_bytes_received"] for s in done),
      "comm_bytes": sum(s["bytes_sent"] + s["bytes_received"] for s in done) / max(len(done), 1),
      "syncer": status,
  }
  if status:
    counters = status["counters"]
    summary.update(versions=status["versions"], outer_rounds=counters["rounds"],
                   contributions_merged=counters["contributions_merged"],
                   contributions_rejected=counters["contributions_rejected"],
                   tokens_merged=outer_lib.tokens_merged(counters["tokens_merged"],
                                                         num_fragments))
  return summary


def launch(argv) -> int:
  """`python -m diloco_jax local --config CFG --learners N --workdir DIR`; see the module docstring."""
  fv = cli.parse(argv, command_flags.local, doc=__doc__)
  config, config_argv, counts = _run_config(fv, argv)
  hosts, shards = fv["hosts-per-learner"].value, fv["syncer-shards"].value
  # The launcher's own jax (the final eval) gets learner 0's CPU devices; set before first use.
  os.environ.update({k: v for k, v in children_lib.child_env(counts[0]).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  workdir = pathlib.Path(fv.workdir)
  run_id = fv["run-id"].value
  cli.check_workdir(config, workdir, run_id)  # before anything is written there
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  children_lib.write_token(workdir / "token")
  config_lib.save_resolved(config, workdir, run_id)
  # A signal (any number of them) stops the children in order (`Launcher.stop_all`); the launcher says so after.
  with cli.StopSignals("local", doing=None, exit_on_second=False) as signals:
    launcher = Launcher(config, config_argv, workdir, run_id, stop_timeout_s=fv["stop-timeout-s"].value,
                        start_timeout_s=fv["start-timeout-s"].value, hosts_per_learner=hosts, syncer_shards=shards,
                        signals=signals.received)
    t0 = time.perf_counter()
    per = f"{counts if len(set(counts)) > 1 else counts[0]}"
    shape = f"{hosts} processes x {per} / {hosts}" if hosts > 1 else per
    print(f"local: {config.learners.num} learners x {shape} CPU devices, run id {run_id!r}, "
          f"logs in {workdir / 'logs'}", file=sys.stderr, flush=True)
    status, failed, codes = _run_children(launcher, with_evaluator=fv.eval)
    if failed is not None:
      tail = (f"; last lines of {failed.child.log_path}:\n{failed.child.tail()}"
              if isinstance(failed, children_lib.ChildFailed) else "")
      print(f"local: {failed}{tail}", file=sys.stderr)
      return EXIT_FAILED
    if launcher.signals:
      print(f"local: stopped by signal {launcher.signals[0]}; children exited {codes}", file=sys.stderr)
      return 128 + launcher.signals[0]
    _finish(launcher, status, codes, t0, evaluate=fv.eval, export=fv.export)
  return 0


def _run_config(fv, argv: list[str]) -> tuple:
  """The run's RunSpec (validated), the config arguments every child gets, and each learner's devices."""
  config = fv.config
  config_argv = children_lib.config_args(argv)
  if fv.learners:
    config.learners.num = fv.learners
    config_argv.append(f"--config.learners.num={fv.learners}")
  counts = list(config_lib.resolve(config).learners.device_counts)  # sized before validating (resolve never raises)
  config = cli.validated(config, sum(counts), learners=True)  # the run's RunSpec from here on
  hosts = fv["hosts-per-learner"].value
  shards = fv["syncer-shards"].value
  if shards > config.outer.num_fragments:
    raise cli.UsageError(f"--syncer-shards ({shards}) must be at most outer.num_fragments "
                         f"({config.outer.num_fragments}): a shard owns whole fragments")
  if hosts < 1 or any(n % hosts for n in counts):
    raise cli.UsageError(f"--hosts-per-learner ({hosts}) must be >= 1 and divide every learner's devices "
                         f"({counts if len(set(counts)) > 1 else counts[0]})")
  return config, config_argv, counts


def _run_children(launcher: Launcher, *, with_evaluator: bool) -> tuple:
  """Start the children in order, watch them until the learners are done (or one fails, or a signal), ask
  the syncer for its status, and stop them all in order. Returns (status, the failure, exit codes)."""
  status, failed = None, None
  try:
    launcher.start_syncers()
    if not launcher.signals:
      pids = ", ".join(str(c.pid) for c in launcher.syncers)
      print(f"local: syncer on {launcher.target} (pid {pids})", file=sys.stderr, flush=True)
      if with_evaluator:
        launcher.start_evaluator()
      launcher.start_learners()
      launcher.watch()
    if not launcher.signals:
      status = launcher.syncer_status()
  except RuntimeError as e:  # a child failed (ChildFailed), or the syncer never served
    failed = e
  finally:
    codes = launcher.stop_all()
  return status, failed, codes


def _finish(launcher: Launcher, status: dict | None, codes: dict, t0: float, *, evaluate: bool,
            export: bool) -> None:
  """The run's summary (the learners', the syncer's status, the evaluator's), the final eval and export of
  the global model, the plots; what it says on stderr."""
  config, workdir, run_id = launcher.config, launcher.workdir, launcher.run_id
  summary = merged_summary(workdir, config.learners.num, status, time.perf_counter() - t0, run_id,
                           config.outer.num_fragments)
  summary["exit_codes"] = codes
  evaluator_summary = workdir / "global" / "summary.json"
  if launcher.evaluator is not None and evaluator_summary.exists():
    summary["global_eval"] = json.loads(evaluator_summary.read_text())
  if evaluate:
    export_dir = workdir / "model" if export else None
    summary["final_eval_loss"] = evaluate_global(config, launcher.syncer_dirs(), run_id, export_dir)
    if export_dir is not None and summary["final_eval_loss"] is not None:
      summary["model"] = str(export_dir)
  # A rerun resumes the run: its summary covers every segment (an earlier one left summary.json).
  summary = metrics_lib.write_summary(workdir, summary, resumed_fields=SEGMENT_FIELDS)
  loss = summary.get("final_eval_loss")
  segments = f" over {len(summary['segments'])} segments" if "segments" in summary else ""
  print(f"local done: {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s{segments}, "
        f"versions {summary.get('versions')}, "
        + (f"global eval loss {loss:.4f}, " if loss is not None else "")
        + f"{summary['comm_bytes'] / 2**20:.2f} MiB per learner on the wire; summary in "
        + cli.shown(workdir / "summary.json")
        + (f", model in {cli.shown(summary['model'])}" if "model" in summary else ""),
        file=sys.stderr)
  print(plot_lib.outputs(workdir, "local"), file=sys.stderr)

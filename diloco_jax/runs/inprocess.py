"""Decoupled DiLoCo in one process: M learners, each on its own slice of this process's devices, running
concurrently (one thread each) against the syncer core through the in-process transport.

  python -m diloco_jax train --config configs/small_cpu.py --workdir runs/diloco

On a CPU-only machine the command gives itself the fake CPU devices it needs (every learner's, and learner
0's count more for the global model's evaluator; an explicit XLA_FLAGS wins). The global model is evaluated
every `train.eval_every` steps of progress on devices no learner uses, if there are any. The workdir has
the same layout as `local`'s (docs/observability.md, "What a run directory holds"); `--record-tape FILE`
records the syncer's steps for `python -m diloco_jax replay`.
"""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.evaluator import loop as eval_loop
from diloco_jax.learner import loop as loop_lib
from diloco_jax.outer import merge as outer_lib
from diloco_jax.runs import export as export_lib
from diloco_jax.runs import plots as plot_lib
from diloco_jax.syncer import build
from diloco_jax.syncer import checkpoint as syncer_checkpoint
from diloco_jax.syncer.monitor import SyncerMonitor
from diloco_jax.syncer.tape import Tape
from diloco_jax.syncer.ticker import Ticker
from diloco_jax.transports.inprocess import InProcessTransport

SEGMENT_FIELDS = ("wall_s", "bytes_sent", "bytes_received", "comm_bytes")  # each segment counts its own

RUN_ID = "in-process"


class InProcessRun:
  """A syncer core, its ticker, and learners on disjoint slices of this process's devices, talking to the
  core through `InProcessTransport`: the `train` command, benchmarks and tests build on it.

  Args:
    config: the run's RunSpec (`cli.validated`), or a validated config (resolved here).
    workdir: where learners keep metrics and checkpoints (`learner_<i>/`) and the syncer its checkpoints
      (`syncer/syncer_checkpoints/`, the decision records `syncer/rounds.jsonl`); None: nothing on disk.
    learner_ids: which learners to create (default: all `learners.num`); each gets its devices
      (the spec's `learners.device_counts`), carved in order from `devices` (default `jax.devices()`).
    tape: a `syncer.tape.Tape` the core records its steps on (`python -m diloco_jax replay`).

  `global_eval` evaluates the global model on `evaluator_devices`.
  """

  def __init__(self, config, workdir: str | pathlib.Path | None, *, learner_ids: Sequence[int] | None = None,
               devices: Sequence[jax.Device] | None = None, run_id: str = RUN_ID, tape=None):
    config = config_lib.resolve(config)  # the run's RunSpec passes as it is; a config (tests, tools) resolves here
    self.config = config
    self.workdir = None if workdir is None else pathlib.Path(workdir)
    ids = list(range(config.learners.num) if learner_ids is None else learner_ids)
    slices = mesh_lib.carve_slices(devices or jax.devices(), [config.learners.device_counts[i] for i in ids])
    self.core, self.fingerprint = build.build_core(config, run_id, tape=tape)
    self.global_eval = eval_loop.GlobalEval(config, evaluator_devices(config, [d for s in slices for d in s]))
    self._syncer_ckpt = None
    self.resumed = False
    if self.workdir is not None:
      self._syncer_ckpt = syncer_checkpoint.SyncerCheckpointer(self.workdir / "syncer" / "syncer_checkpoints",
                                                                keep=2)
      self.resumed = syncer_checkpoint.restore_core(self._syncer_ckpt, self.core) is not None
    self.ticker = Ticker(self.core)
    # The syncer's per-round decisions (who was merged, waited for, how long, with which weights).
    self.rounds_log = (None if self.workdir is None else
                       metrics_lib.DrainLog(self.core.drain_decisions, self.workdir / "syncer", "rounds"))
    self.learners = [
        loop_lib.Learner(config, i, devices_i, InProcessTransport(self.core), self.fingerprint,
                         None if self.workdir is None else str(self.workdir / f"learner_{i}"),
                         metrics_log=None if self.workdir is None else
                         metrics_lib.MetricsLog(self.workdir / f"learner_{i}", tags=metrics_lib.LEARNER_TAGS),
                         async_checkpoints=False)
        for i, devices_i in zip(ids, slices)
    ]
    self.plan = self.learners[0].plan

  def global_params(self):
    """The syncer's global model (host arrays)."""
    return self.global_eval.params(self.core.global_fragments())

  def evaluate_global(self) -> float:
    """Eval loss of the syncer's global model, on the evaluator's devices."""
    return self.global_eval.loss(self.global_params())

  def global_evaluator(self, metrics_log=None, poll_s: float = 0.5) -> eval_loop.GlobalEvaluator:
    """The evaluator of the global model's curve (not started), reading the core's Theta directly."""
    return eval_loop.GlobalEvaluator(self.global_eval, CoreSource(self.core),
                                     eval_loop.EvalSchedule.from_config(self.config), metrics_log, poll_s=poll_s)

  def close(self) -> None:
    """Learners leave, the ticker stops, and the syncer's state is checkpointed (with a workdir)."""
    for learner in self.learners:
      learner.close(leave=True)
      if learner.log is not None:
        learner.log.close()
    self.ticker.stop()
    if self.rounds_log is not None:
      self.rounds_log.close()
    if self._syncer_ckpt is not None:
      syncer_checkpoint.save_core(self._syncer_ckpt, self.core, rounds=self.core.rounds_closed())
      self._syncer_ckpt.close()
    self.core.close_tape()


def evaluator_devices(config, used: Sequence[jax.Device]) -> list[jax.Device]:
  """Up to learner 0's count of devices (`learners.device_counts[0]`: a mesh every eval batch is validated
  on) that no learner uses; if there are none, the host's CPU devices (on a CPU-only machine those are the
  learners' too: fake devices share the same cores anyway)."""
  k = config.learners.device_counts[0]
  spare = [d for d in jax.devices() if d not in set(used)]
  return spare[:k] or jax.devices("cpu")[:k]


class CoreSource:
  """The global model straight from a core in this process (`evaluator/loop.py`'s `Source`): Theta."""

  def __init__(self, core):
    self.core = core

  def progress(self) -> tuple[int, list[int]]:
    status = self.core.status()
    return int(status["counters"]["tokens_merged"]), list(status["versions"])

  def fetch(self) -> tuple[list[np.ndarray], list[int]]:
    return self.core.global_model()


def run(config, workdir: str, *, quiet: bool = False, export: bool = True, tape=None) -> dict:
  """Train M learners with the syncer core in this process; returns the summary (also summary.json). With
  `export`, the global model goes to `<workdir>/model` (`python -m diloco_jax eval/sample --model`)."""
  t0 = time.perf_counter()
  config = config_lib.resolve(config)  # the run's RunSpec passes as it is; a config (tests, tools) resolves here
  job = InProcessRun(config, workdir, tape=tape)
  config_lib.save_resolved(config, workdir, RUN_ID)
  global_log = metrics_lib.MetricsLog(job.workdir / "global", tags=metrics_lib.GLOBAL_EVAL_TAGS)
  syncer_log = metrics_lib.MetricsLog(job.workdir / "syncer", tags=metrics_lib.SYNCER_TAGS)
  monitor = SyncerMonitor(job.core, syncer_log)
  evaluator = job.global_evaluator(global_log)
  initial_eval = None if job.resumed else evaluator.evaluate()["eval_loss"]
  evaluator.start()
  if not quiet:
    _print_start(job)
  results, errors = _train_learners(job, evaluator, quiet=quiet)
  job.close()
  # The product of the run is the syncer's global model: its last eval is the run's final eval loss.
  final = evaluator.stop(final=not errors)
  monitor.stop()
  global_log.close()
  syncer_log.close()
  if errors:
    raise errors[0]
  summary = _summary(job, evaluator, results, final, initial_eval, t0)
  if export:
    summary["model"] = str(export_lib.export(
        pathlib.Path(workdir) / "model", config, job.global_params(), source="train", run_id=RUN_ID,
        steps=config.train.steps, tokens=summary["tokens"], tokens_merged=summary["tokens_merged"],
        final_eval_loss=summary["final_eval_loss"], versions=summary["versions"]))
  # Resumed: the wall time and the bytes are this segment's; the summary covers every segment.
  summary = metrics_lib.write_summary(workdir, summary, resumed_fields=SEGMENT_FIELDS if job.resumed else None)
  if not quiet:
    print(f"train done: global eval loss {summary['final_eval_loss']:.4f}"
          + (f" (from {initial_eval:.4f})" if initial_eval is not None else "")
          + f", {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s, {summary['outer_rounds']} outer rounds, "
          f"{summary['comm_bytes'] / 2**20:.2f} MiB per learner on the wire; summary in "
          f"{cli.shown(pathlib.Path(workdir) / 'summary.json')}"
          + (f", model in {cli.shown(summary['model'])}" if export else ""))
    print(plot_lib.outputs(workdir, "train"))
  return summary


def _print_start(job: InProcessRun) -> None:
  """The run's shape, on stdout: learners, devices, parameters, fragments and their schedule, codec, quorum."""
  config, plan = job.config, job.plan
  sizes = [plan.size(p) for p in range(plan.num_fragments)]
  devices = list(config.learners.device_counts)
  print(f"train: {config.learners.num} learners x {devices if len(set(devices)) > 1 else devices[0]} devices, "
        f"{job.learners[0].trainer.num_params:,} params, "
        f"{model_lib.flops_per_token(config.model, config.data.seq_len) / 1e6:.1f} MFLOPs/token; "
        f"{plan.num_fragments} fragments {sizes} every H={config.outer.sync_every} steps"
        + ("" if plan.sync_steps == () else f" on average ({config.outer.sync_schedule})") + ", "
        f"codec {config.outer.codec}, quorum K={config.outer.min_quorum}"
        + (", resumed" if job.resumed else ""))


def _train_learners(job: InProcessRun, evaluator, *, quiet: bool) -> tuple[list, list[BaseException]]:
  """Every learner trains on its own thread (`run_learner`) until done; an error in one stops the others.
  Returns (each learner's summary, the errors)."""
  learners, num = job.learners, job.config.learners.num
  total = num * job.config.train.steps
  bar = metrics_lib.progress(total, initial=sum(x.trainer.step for x in learners), desc="train") if not quiet else None
  bar_lock = threading.Lock()
  results: list[dict | None] = [None] * num
  errors: list[BaseException] = []

  def on_step():
    if bar is not None:
      with bar_lock:
        bar.update(1)
        if bar.n % 20 == 0:
          status = job.core.status()
          latest = evaluator.latest
          bar.set_postfix(versions=status["versions"], merged=status["counters"]["contributions_merged"],
                          **({"eval": f"{latest['eval_loss']:.3f}"} if latest else {}))

  def work(i):
    try:
      results[i] = loop_lib.run_learner(learners[i], on_step=on_step, should_stop=lambda: bool(errors))
    except BaseException as e:  # noqa: BLE001 - reported below, and stops the other learners
      errors.append(e)
      # Leave at once: the others may be waiting for this learner's contribution (K = M) while flushing.
      learners[i].comms.close(leave=True)

  threads = [threading.Thread(target=work, args=(i,), name=f"learner{i}") for i in range(num)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if bar is not None:
    bar.close()
  return results, errors


def _summary(job: InProcessRun, evaluator, results: list[dict], final: dict | None, initial_eval: float | None,
             t0: float) -> dict:
  """The run's summary: the global model's final eval, the learners' summaries and the syncer's counters."""
  final_eval = final["eval_loss"] if final is not None else job.evaluate_global()
  status = job.core.status()
  counters = status["counters"]
  wall = time.perf_counter() - t0
  tokens = sum(r["tokens"] for r in results)
  num = job.config.learners.num
  return {
      "mode": "train", "final_eval_loss": final_eval, "initial_eval_loss": initial_eval,
      "tokens": tokens, "steps": job.config.train.steps, "wall_s": wall, "tokens_per_s": tokens / wall,
      "params": job.learners[0].trainer.num_params, "learners": results,
      "outer_rounds": counters["rounds"], "contributions_merged": counters["contributions_merged"],
      "contributions_late": counters["contributions_late"],
      "contributions_rejected": counters["contributions_rejected"],
      "tokens_merged": outer_lib.tokens_merged(counters["tokens_merged"], job.plan.num_fragments),
      "bytes_sent": sum(r["bytes_sent"] for r in results),
      "bytes_received": sum(r["bytes_received"] for r in results),
      "comm_bytes": sum(r["bytes_sent"] + r["bytes_received"] for r in results) / num,  # per learner
      "blocked_s": {r["learner"]: r["blocked_s"] for r in results},
      "versions": status["versions"], "t_sync_s": status["t_sync_s"],
      "goodput_estimate": status["goodput_estimate"], "global_eval_failures": evaluator.failures,
  }


def train(argv) -> int:
  """`python -m diloco_jax train --config C --workdir D`; see the module docstring."""
  fv = cli.parse(argv, command_flags.train, doc=__doc__)
  c = fv.config
  # The learners' slices and the evaluator's.
  counts = config_lib.resolve(c).learners.device_counts  # sized before validating (resolve never raises)
  need = sum(counts) + counts[0]
  config = cli.validated(c, len(cli.devices(need, "train")), learners=True)
  cli.check_workdir(config, fv.workdir, RUN_ID)
  run(config, fv.workdir, export=fv.export, tape=Tape(fv["record-tape"].value) if fv["record-tape"].value else None)
  return 0

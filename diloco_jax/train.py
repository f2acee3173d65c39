"""Decoupled DiLoCo in one process: M learners, each on its own slice of this process's devices, running
concurrently (one thread each) against the syncer core through the in-process transport.

  python -m diloco_jax train --config configs/small_cpu.py --workdir runs/diloco

The same learners talk to a separate syncer process over gRPC with `python -m diloco_jax learner` (see
`local`). Summary: `<workdir>/summary.json`; per-learner metrics: `<workdir>/learner_<i>/metrics.jsonl`.
"""

from __future__ import annotations

import pathlib
import threading
import time

import jax
import numpy as np
from absl import flags

from diloco_jax import cli
from diloco_jax import fragments as fragments_lib
from diloco_jax import mesh as mesh_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import outer as outer_lib
from diloco_jax import transport as transport_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.syncer import checkpoint as syncer_checkpoint
from diloco_jax.syncer import server as syncer_server

RUN_ID = "in-process"


def global_params(core, plan, template):
  """The syncer's global model as a nested dict of host arrays shaped like `template`."""
  fragments = core.state_dict()["fragments"]
  leaves = {}
  for p in range(plan.num_fragments):
    leaves.update(fragments_lib.scatter(plan, p, np.asarray(fragments[p])))
  return fragments_lib.replace_leaves(template, leaves)


def run(config, workdir: str, *, quiet: bool = False) -> dict:
  """Train M learners with the syncer core in this process; returns the summary (also summary.json)."""
  workdir = pathlib.Path(workdir)
  t0 = time.perf_counter()
  num = config.learners.num
  slices = mesh_lib.carve_slices(jax.devices(), [config.learners.devices] * num)
  core, fingerprint = syncer_server.build_core(config, RUN_ID)
  syncer_ckpt = syncer_checkpoint.SyncerCheckpointer(workdir / "syncer", keep=2)
  resumed_syncer = syncer_checkpoint.restore_core(syncer_ckpt, core) is not None
  ticker = transport_lib.Ticker(core)
  learners = [
      loop_lib.Learner(config, i, slices[i], transport_lib.InProcessTransport(core), fingerprint,
                       str(workdir / f"learner_{i}"), metrics_log=metrics_lib.MetricsLog(workdir / f"learner_{i}"),
                       async_checkpoints=False)
      for i in range(num)
  ]
  plan = learners[0].plan
  params = learners[0].trainer.num_params
  initial_eval = None if resumed_syncer else learners[0].trainer.evaluate()
  if not quiet:
    sizes = [plan.size(p) for p in range(plan.num_fragments)]
    print(f"train: {num} learners x {config.learners.devices} devices, {params:,} params, "
          f"{model_lib.flops_per_token(config.model, config.data.seq_len) / 1e6:.1f} MFLOPs/token; "
          f"{plan.num_fragments} fragments {sizes} every H={config.outer.sync_every} steps, "
          f"codec {config.outer.codec}, quorum K={config.outer.min_quorum or num}"
          + (", resumed" if resumed_syncer else ""))
  total = num * config.train.steps
  bar = metrics_lib.progress(total, initial=sum(l.trainer.step for l in learners), desc="train") if not quiet else None
  bar_lock = threading.Lock()
  results: list[dict | None] = [None] * num
  errors: list[BaseException] = []

  log = metrics_lib.MetricsLog(workdir)  # the global model's eval loss, every train.eval_every steps
  if initial_eval is not None:
    log.write({"step": 0, "tokens": 0, "eval_loss": initial_eval})

  def evaluate_global():
    # Learner 0's thread, between its steps: the global model as the syncer holds it now, against the
    # tokens all learners have trained on so far.
    trainer0 = learners[0].trainer
    params = jax.device_put(global_params(core, plan, jax.tree.map(np.asarray, trainer0.state.params)),
                            trainer0.shardings.params)
    log.write({"step": trainer0.step, "tokens": sum(l.trainer.tokens for l in learners),
               "eval_loss": trainer0.evaluate(params)})

  def on_step(i):
    step = learners[i].trainer.step
    if i == 0 and step % config.train.eval_every == 0 and step < config.train.steps:
      evaluate_global()
    if bar is not None:
      with bar_lock:
        bar.update(1)
        if bar.n % 20 == 0:
          status = core.status()
          bar.set_postfix(versions=",".join(str(v) for v in status["versions"].values())
                          if isinstance(status["versions"], dict) else status["versions"],
                          merged=status["counters"]["contributions_merged"])

  def work(i):
    try:
      results[i] = loop_lib.run_learner(learners[i], on_step=lambda: on_step(i), should_stop=lambda: bool(errors))
    except BaseException as e:  # noqa: BLE001 - reported below, and stops the other learners
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,), name=f"learner{i}") for i in range(num)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if bar is not None:
    bar.close()
  for learner in learners:
    learner.close(leave=True)
  ticker.stop()
  syncer_checkpoint.save_core(syncer_ckpt, core, rounds=syncer_server.total_rounds(core))
  syncer_ckpt.close()
  if errors:
    raise errors[0]

  # The product of the run is the syncer's global model: evaluate it on learner 0's mesh.
  trainer0 = learners[0].trainer
  final = jax.device_put(global_params(core, plan, jax.tree.map(np.asarray, trainer0.state.params)),
                         trainer0.shardings.params)
  final_eval = trainer0.evaluate(final)
  log.write({"step": config.train.steps, "tokens": sum(r["tokens"] for r in results), "eval_loss": final_eval})
  log.close()
  status = core.status()
  counters = status["counters"]
  wall = time.perf_counter() - t0
  tokens = sum(r["tokens"] for r in results)
  summary = {
      "mode": "train", "final_eval_loss": final_eval, "initial_eval_loss": initial_eval,
      "tokens": tokens, "steps": config.train.steps, "wall_s": wall, "tokens_per_s": tokens / wall,
      "params": params, "learners": results,
      "outer_rounds": counters["rounds"], "contributions_merged": counters["contributions_merged"],
      "contributions_late": counters["contributions_late"],
      "contributions_rejected": counters["contributions_rejected"], "tokens_merged": outer_lib.tokens_merged(counters["tokens_merged"], plan.num_fragments),
      "bytes_sent": sum(r["bytes_sent"] for r in results),
      "bytes_received": sum(r["bytes_received"] for r in results),
      "comm_bytes": sum(r["bytes_sent"] + r["bytes_received"] for r in results) / num,  # per learner
      "blocked_s": {r["learner"]: r["blocked_s"] for r in results},
      "versions": status["versions"],
  }
  metrics_lib.write_summary(workdir, summary)
  if not quiet:
    print(f"train done: global eval loss {final_eval:.4f}"
          + (f" (from {initial_eval:.4f})" if initial_eval is not None else "")
          + f", {tokens:,} tokens in {wall:.1f}s, {counters['rounds']} outer rounds, "
          f"{summary['comm_bytes'] / 2**20:.2f} MiB per learner on the wire; summary in {workdir}/summary.json")
  return summary


def _flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "Output directory (metrics, checkpoints, summary.json).",
                      flag_values=fv, required=True)


def main(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__)
  config = cli.validated(fv.config, len(jax.devices()), learners=True)
  run(config, fv.workdir)
  return 0

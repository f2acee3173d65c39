"""Synchronous data-parallel training of the same model on the same data: the reference every Decoupled
DiLoCo comparison is measured against.

  python -m diloco_jax baseline --config configs/small_cpu.py --workdir runs/dp

The whole global batch is split over one mesh of all (or `mesh.num_devices`) devices. Communication is
reported as what a ring all-reduce of the fp32 gradients moves per worker: 2 (n-1)/n x gradient bytes per
step, with n the number of data-parallel workers (the mesh's data x fsdp ways).

It trains on `mesh.num_devices` devices, by default all; on a machine whose only backend is the CPU it
gives itself `learners.num * learners.devices` fake CPU devices, the Decoupled DiLoCo run's (an explicit
XLA_FLAGS=--xla_force_host_platform_device_count=N wins). Output in the workdir: `summary.json`,
`config.json` (fingerprint beside it), `metrics.jsonl` and TensorBoard event files under the same tags as
the learners' and the global model's (`train/loss`, `eval/loss`, `comm/bytes`), checkpoints, `plots/`.
"""

from __future__ import annotations

import pathlib
import time

import jax

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.runs import export as export_lib
from diloco_jax.runs import plots as plot_lib


def make_trainer(config, workdir: str | None) -> trainer_lib.MeshTrainer:
  """The baseline's trainer: one mesh of all (or `mesh.num_devices`) devices, the whole global batch, read
  in `data.baseline_order`."""
  config = config_lib.resolve(config)  # the run's RunSpec passes as it is; a config (tests) resolves here
  devices = jax.devices()[: config.mesh.num_devices or None]
  batches = data_lib.baseline_iterator(
      config.data, num_learners=config.learners.num, seed=config.seed,
      batches=list(config.learners.batches))
  return trainer_lib.MeshTrainer(config, devices, workdir, batch_size=config.data.global_batch,
                                 data_iterator=batches)


def run(config, workdir: str, *, quiet: bool = False, export: bool = True) -> dict:
  """Train the data-parallel baseline; returns the summary (also written to <workdir>/summary.json). With
  `export`, the final parameters go to `<workdir>/model`, as a Decoupled DiLoCo run's global model does."""
  t0 = time.perf_counter()
  trainer = make_trainer(config, workdir)
  resumed = trainer.restore()
  workers = trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"]
  params = trainer.num_params
  per_step_bytes = metrics_lib.ring_allreduce_bytes(params, workers)
  flops = model_lib.flops_per_token(config.model, config.data.seq_len)
  config_lib.save_resolved(config, workdir)
  log = metrics_lib.MetricsLog(workdir, tags=metrics_lib.BASELINE_TAGS)
  if not quiet:
    print(f"baseline: {params:,} params, {flops / 1e6:.1f} MFLOPs/token, mesh {dict(trainer.mesh.shape)}, "
          f"all-reduce {per_step_bytes / 2**20:.2f} MiB/worker/step"
          + (f", resumed at step {trainer.step}" if resumed else ""))
  total = config.train.steps
  bar = metrics_lib.progress(total, initial=trainer.step, desc="baseline") if not quiet else None
  eval_loss = initial_eval_loss = None
  if trainer.step == 0:
    eval_loss = initial_eval_loss = trainer.evaluate()
    log.write({"step": 0, "tokens": 0, "eval_loss": eval_loss})

  def on_record(record):
    if bar is not None:
      bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                      **({"eval": f"{record['eval_loss']:.3f}"} if "eval_loss" in record else {}))

  last_eval = trainer_lib.run_loop(
      trainer, log, steps=total, record_fields=lambda: {"comm_bytes": per_step_bytes * trainer.step},
      on_record=on_record, on_step=(lambda: bar.update(1)) if bar is not None else None)
  if bar is not None:
    bar.close()
  eval_loss = last_eval if last_eval is not None else (eval_loss or trainer.evaluate())
  trainer.save()
  trainer.close()
  wall = time.perf_counter() - t0
  summary = {
      "mode": "baseline", "final_eval_loss": eval_loss, "tokens": trainer.tokens, "steps": trainer.step,
      "wall_s": wall, "tokens_per_s": trainer.tokens / wall, "params": params, "workers": workers,
      "comm_bytes": per_step_bytes * trainer.step, "comm_bytes_per_step": per_step_bytes,
      "flops_per_token": flops, "initial_eval_loss": initial_eval_loss,
  }
  if export:
    summary["model"] = str(export_lib.export(
        pathlib.Path(workdir) / "model", config, trainer.state.params, source="baseline", steps=trainer.step,
        tokens=trainer.tokens, final_eval_loss=eval_loss))
  # Resumed: the wall time is this segment's; the steps, tokens and bytes are the run's so far.
  metrics_lib.write_summary(workdir, summary, resumed_fields=("wall_s",) if resumed else None)
  log.close()
  if not quiet:
    print(f"baseline done: eval loss {eval_loss:.4f}, {trainer.tokens:,} tokens in {wall:.1f}s "
          f"({summary['tokens_per_s']:,.0f} tokens/s); summary in {cli.shown(pathlib.Path(workdir) / 'summary.json')}"
          + (f", model in {cli.shown(summary['model'])}" if export else ""))
    print(plot_lib.outputs(workdir, "baseline"))
  return summary


def train_baseline(argv) -> int:
  fv = cli.parse(argv, command_flags.baseline, doc=__doc__)
  c = fv.config
  need = c.mesh.num_devices or c.learners.num * c.learners.devices
  config = cli.validated(c, len(cli.devices(need, "baseline")), learners=False)
  cli.check_workdir(config, fv.workdir)
  run(config, fv.workdir, export=fv.export)
  return 0

"""Synchronous data-parallel training of the same model on the same data: the reference every Decoupled
DiLoCo comparison is measured against.

  python -m diloco_jax baseline --config configs/small_cpu.py --workdir runs/dp

The whole global batch is split over one mesh of all (or `mesh.num_devices`) devices. Communication is
reported as what a ring all-reduce of the fp32 gradients moves per worker: 2 (n-1)/n x gradient bytes per
step, with n the number of data-parallel workers (the mesh's data x fsdp ways).
"""

from __future__ import annotations

import time

import jax
from absl import flags

from diloco_jax import cli
from diloco_jax import data as data_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import model as model_lib
from diloco_jax import trainer as trainer_lib


def ring_allreduce_bytes(num_params: int, workers: int, bytes_per_param: int = 4) -> float:
  """Bytes one worker sends and receives in a ring all-reduce of the gradient, per step."""
  return 2.0 * (workers - 1) / workers * num_params * bytes_per_param


def make_trainer(config, workdir: str | None) -> trainer_lib.MeshTrainer:
  """The baseline's trainer: one mesh of all (or `mesh.num_devices`) devices, the whole global batch, read
  in `data.baseline_order`."""
  devices = jax.devices()[: config.mesh.num_devices or None]
  batches = data_lib.baseline_iterator(config.data, num_learners=config.learners.num, seed=config.seed)
  return trainer_lib.MeshTrainer(config, devices, workdir, batch_size=config.data.global_batch,
                                 data_iterator=batches)


def run(config, workdir: str, *, quiet: bool = False) -> dict:
  """Train the data-parallel baseline; returns the summary (also written to <workdir>/summary.json)."""
  t0 = time.perf_counter()
  trainer = make_trainer(config, workdir)
  resumed = trainer.restore()
  workers = trainer.mesh.shape["data"] * trainer.mesh.shape["fsdp"]
  params = trainer.num_params
  per_step_bytes = ring_allreduce_bytes(params, workers)
  flops = model_lib.flops_per_token(config.model, config.data.seq_len)
  log = metrics_lib.MetricsLog(workdir)
  if not quiet:
    print(f"baseline: {params:,} params, {flops / 1e6:.1f} MFLOPs/token, mesh {dict(trainer.mesh.shape)}, "
          f"all-reduce {per_step_bytes / 2**20:.2f} MiB/worker/step" + (f", resumed at step {trainer.step}" if resumed else ""))
  total = config.train.steps
  bar = metrics_lib.progress(total, initial=trainer.step, desc="baseline") if not quiet else None
  rate = trainer_lib.RateMeter(trainer.tokens)
  eval_loss = initial_eval_loss = None
  if trainer.step == 0:
    eval_loss = initial_eval_loss = trainer.evaluate()
    log.write({"step": 0, "tokens": 0, "eval_loss": eval_loss})
  while trainer.step < total:
    trainer.train_step()
    s = trainer.step
    if s % config.train.log_every == 0 or s == total:
      m = trainer.fetch_metrics()
      tps = rate.read(trainer.tokens)
      record = {"step": s, "tokens": trainer.tokens, "tokens_per_s": tps,
                "comm_bytes": per_step_bytes * s, **m}
      if s % config.train.eval_every == 0 or s == total:
        eval_loss = trainer.evaluate()
        record["eval_loss"] = eval_loss
      log.write(record)
      if bar is not None:
        bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{tps:,.0f}",
                        **({"eval": f"{eval_loss:.3f}"} if eval_loss is not None else {}))
    if bar is not None:
      bar.update(1)
    if config.train.checkpoint_every and s % config.train.checkpoint_every == 0:
      trainer.save()
  if bar is not None:
    bar.close()
  if eval_loss is None:
    eval_loss = trainer.evaluate()
  trainer.save()
  trainer.close()
  wall = time.perf_counter() - t0
  summary = {
      "mode": "baseline", "final_eval_loss": eval_loss, "tokens": trainer.tokens, "steps": trainer.step,
      "wall_s": wall, "tokens_per_s": trainer.tokens / wall, "params": params, "workers": workers,
      "comm_bytes": per_step_bytes * trainer.step, "comm_bytes_per_step": per_step_bytes,
      "flops_per_token": flops, "initial_eval_loss": initial_eval_loss,
  }
  metrics_lib.write_summary(workdir, summary)
  log.close()
  if not quiet:
    print(f"baseline done: eval loss {eval_loss:.4f}, {trainer.tokens:,} tokens in {wall:.1f}s "
          f"({summary['tokens_per_s']:,.0f} tokens/s); summary in {workdir}/summary.json")
  return summary


def _flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "Output directory (metrics, checkpoints, summary.json).", flag_values=fv,
                      required=True)


def main(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__)
  config = cli.validated(fv.config, len(jax.devices()), learners=False)
  run(config, fv.workdir)
  return 0

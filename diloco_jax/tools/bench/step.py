"""`python -m diloco_jax bench step --config FILE [--config.x=y] [--steps N] [--devices N] [--json]`:
throughput of the jitted inner step against a measured matmul rate on the same devices.

  python -m diloco_jax bench step --config configs/small_cpu.py --steps 20

One `trainer.MeshTrainer` (the baseline's: `data.global_batch` sequences per step over one mesh of all
devices, or of the first `--devices`) is built; its inner step is compiled and warmed up, then `--steps`
steps are dispatched back to back on batches already on the devices and timed to `block_until_ready` of
the last state: the figure is the step's, not the host data pipeline's (`run`).

Printed: tokens/s, model FLOPs/s (`model.flops_per_token` x tokens/s: 6 x matmul parameters plus
attention, the usual MFU numerator) and, in the same run, the FLOP rate of a jitted matmul chain of the
model's own shapes on the same mesh (`matmul_reference`). Their ratio is an MFU-like fraction: how much of
what these devices demonstrably do on matmuls of this size the training step achieves. On fake CPU devices
it says more about the host's cores than about an accelerator.
"""

from __future__ import annotations

import json
import math
import sys
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax import cli
from diloco_jax.compute import inner
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.tools.bench import bench_flags

# Distinct device batches cycled through the timed steps: more than one, so no step sees its predecessor's
# exact input, few, so that they cost little memory.
_NUM_BATCHES = 2


def _log(message: str) -> None:
  print(f"bench step: {message}", file=sys.stderr, flush=True)


def _time_calls(fn, args_for, n: int, warmup: int):
  """Seconds for `n` back-to-back calls of `fn(*args_for(i))`, after `warmup` untimed calls (the first
  compiles); blocks only once at the end of each phase so dispatch overlaps execution, as in training."""
  out = None
  for i in range(max(warmup, 1)):
    out = fn(*args_for(i))
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for i in range(n):
    out = fn(*args_for(i))
  jax.block_until_ready(out)
  return time.perf_counter() - t0, out


def matmul_reference(model_cfg, mesh, tokens: int, target_flops: float, dtype=jnp.float32):
  """A jitted chain of the MLP's matmuls on `mesh`: returns (fn, args, flops_per_call).

  `x [tokens, d_model]` is split over the batch axes; `w_up [d_model, mlp_dim]` and
  `w_down [mlp_dim, d_model]` are sharded by the model's logical rules (embed -> fsdp, mlp -> tensor), so
  the collectives XLA inserts are the model's too. The chain is repeated inside the call (a fori_loop)
  until one call does about `target_flops`, so dispatch overhead weighs on it as on a training step.
  """
  d, f = model_cfg.d_model, model_cfg.mlp_dim
  flops_per_rep = 2.0 * 2.0 * tokens * d * f  # two matmuls, 2 FLOPs per multiply-add
  reps = max(1, round(target_flops / flops_per_rep))
  rules = dict(mesh_lib.LOGICAL_RULES)
  x_sharding = mesh_lib.batch_sharding(mesh)
  up_sharding = NamedSharding(mesh, P(rules["embed"], rules["mlp"]))
  down_sharding = NamedSharding(mesh, P(rules["mlp"], rules["embed"]))
  kx, ku, kd = jax.random.split(jax.random.key(0), 3)
  # Scaled so activations keep unit variance through the chain: no overflow, and no denormals (which are
  # slow on CPUs) however long the chain.
  x = jax.device_put(jax.random.normal(kx, (tokens, d), dtype), x_sharding)
  w_up = jax.device_put(jax.random.normal(ku, (d, f), dtype) * d ** -0.5, up_sharding)
  w_down = jax.device_put(jax.random.normal(kd, (f, d), dtype) * f ** -0.5, down_sharding)

  def chain(x, w_up, w_down):
    return jax.lax.fori_loop(0, reps, lambda _, y: (y @ w_up) @ w_down, x)

  fn = jax.jit(chain, in_shardings=(x_sharding, up_sharding, down_sharding), out_shardings=x_sharding)
  return fn, (x, w_up, w_down), flops_per_rep * reps


def run(config, devices, *, steps: int, warmup: int, matmul_dtype: str = "float32") -> dict:
  """Time the inner step and the reference matmul on a mesh over `devices`; returns the figures. The matmul
  chain has activations `[batch * seq_len, d_model]` and does about one step's FLOPs per call, timed the
  same way as the steps (warm-up, N calls, one block at the end: `_time_calls`)."""
  batch_size = config.data.global_batch
  _log(f"building the train state on {len(devices)} {devices[0].platform} devices ...")
  t0 = time.perf_counter()
  trainer = trainer_lib.MeshTrainer(config, devices, None, batch_size=batch_size)
  mesh = trainer.mesh
  host_batches = [next(trainer.data)["tokens"] for _ in range(_NUM_BATCHES)]
  batches = [inner.put_batch(b, mesh) for b in host_batches]
  tokens_per_step = data_lib.tokens_in_batch(host_batches[0])
  flops_per_token = model_lib.flops_per_token(config.model, config.data.seq_len)
  _log(f"{trainer.num_params:,} params, mesh {dict(mesh.shape)}, {tokens_per_step:,} tokens/step; "
       f"compiling the inner step ...")

  compile_s, step_s, loss = _time_steps(trainer, batches, steps, warmup)
  tokens_per_s = steps * tokens_per_step / step_s
  model_flops_per_s = tokens_per_s * flops_per_token
  _log(f"{step_s / steps * 1e3:.1f} ms/step, {tokens_per_s:,.0f} tokens/s; timing the reference matmul ...")

  step_flops = tokens_per_step * flops_per_token
  mm_fn, mm_args, mm_flops = matmul_reference(config.model, mesh, batch_size * config.data.seq_len,
                                              step_flops, jnp.dtype(matmul_dtype))
  mm_s, _ = _time_calls(mm_fn, lambda i: mm_args, steps, warmup)
  matmul_flops_per_s = steps * mm_flops / mm_s
  trainer.close()
  result = {
      "config_model": config.model.to_dict(),
      "platform": devices[0].platform,
      "device_kind": devices[0].device_kind,
      "num_devices": len(devices),
      "mesh": {k: int(v) for k, v in mesh.shape.items()},
      "params": trainer.num_params,
      "batch": batch_size,
      "seq_len": config.data.seq_len,
      "tokens_per_step": tokens_per_step,
      "steps": steps,
      "compile_s": compile_s,
      "step_ms": step_s / steps * 1e3,
      "tokens_per_s": tokens_per_s,
      "flops_per_token": flops_per_token,
      "model_flops_per_s": model_flops_per_s,
      "matmul_dtype": matmul_dtype,
      "matmul_shape": [batch_size * config.data.seq_len, config.model.d_model, config.model.mlp_dim],
      "matmul_flops_per_call": mm_flops,
      "matmul_flops_per_s": matmul_flops_per_s,
      "flops_fraction": model_flops_per_s / matmul_flops_per_s,
      "final_loss": loss,
      "wall_s": time.perf_counter() - t0,
  }
  return result


def _time_steps(trainer, batches: list, steps: int, warmup: int) -> tuple[float, float, float]:
  """Compiles the inner step (with its first call), then times `steps` calls after `warmup`: (compile and
  first step seconds, seconds of the timed steps, the last loss). The trainer keeps the final state."""
  state = trainer.state
  t_compile = time.perf_counter()
  state, metrics = trainer.step_fn(state, batches[0])
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - t_compile
  _log(f"compiled + first step in {compile_s:.1f}s; {warmup} warm-up and {steps} timed steps ...")

  # The state is donated at every call: thread it through a closure instead of re-passing the old one.
  holder = {"state": state}

  def one_step(batch):
    holder["state"], m = trainer.step_fn(holder["state"], batch)
    return m

  step_s, last_metrics = _time_calls(one_step, lambda i: (batches[i % _NUM_BATCHES],), steps, warmup)
  loss = float(jax.device_get(last_metrics["loss"]))
  if not math.isfinite(loss):
    raise trainer_lib.NonFiniteLoss(f"loss is {loss} during the benchmark; lower train.lr")
  trainer.state = holder["state"]
  return compile_s, step_s, loss


def _report(r: dict) -> str:
  return "\n".join([
      f"devices          {r['num_devices']} x {r['device_kind']} ({r['platform']}), mesh {r['mesh']}",
      f"model            {r['params']:,} params, {r['flops_per_token'] / 1e6:,.1f} MFLOPs/token "
      f"(train, 6N + attention)",
      f"step             {r['step_ms']:,.1f} ms, {r['tokens_per_step']:,} tokens "
      f"({r['batch']} x {r['seq_len']}), compile {r['compile_s']:.1f}s",
      f"tokens/s         {r['tokens_per_s']:,.0f}",
      f"model FLOP/s     {r['model_flops_per_s'] / 1e9:,.2f} GFLOP/s",
      f"matmul FLOP/s    {r['matmul_flops_per_s'] / 1e9:,.2f} GFLOP/s ({r['matmul_dtype']} "
      f"[{r['matmul_shape'][0]}x{r['matmul_shape'][1]}] @ [{r['matmul_shape'][1]}x{r['matmul_shape'][2]}] "
      f"and back, same mesh)",
      f"model / matmul   {r['flops_fraction']:.1%}",
  ])


def bench_step(argv) -> int:
  fv = cli.parse(argv, bench_flags.step, doc=__doc__)
  config = fv.config
  available = cli.devices(fv.devices or config.mesh.num_devices or config.learners.num * config.learners.devices,
                          "bench step")
  n = fv.devices or config.mesh.num_devices or len(available)
  if n > len(available):
    raise cli.UsageError(f"--devices asks for {n} devices but only {len(available)} exist")
  config.mesh.num_devices = n  # validate() then checks the mesh and the batch split on these n devices
  config = cli.validated(config, len(available), learners=False)
  result = run(config, available[:n], steps=fv.steps, warmup=fv.warmup, matmul_dtype=fv.matmul_dtype)
  if fv.json:
    print(json.dumps(result, indent=1, default=float))
  else:
    print(_report(result))
  return 0

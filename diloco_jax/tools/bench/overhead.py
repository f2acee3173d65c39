"""`python -m diloco_jax bench overhead --config configs/small_cpu.py [--chunks 30 --steps N]`

A learner's tokens/s with its outer loop active (snapshots, int4 encoding, pushes, merges by an
in-process syncer core, adoptions) against the bare inner step of the same model on the same device
slice, measured side by side: the two alternate in chunks of N steps (the bare side first and last), and
each learner chunk is compared with the mean of the bare chunks just before and after it, which cancels
the drift of a shared machine's speed. Reported: the median of those ratios (goal >= 0.97), their
spread, and the ratio of the two sides' median rates. The learner is the only one in its run (a quorum
of one), so every sync commits.

Also the outer loop's host CPU time per step, as a fraction of the learner's step time (`_chunks`), and
the host memory of the outer loop against its bounds (`_MemorySampler`). docs/benchmarks.md, "Outer-loop
overhead".
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import tracemalloc

import jax

from diloco_jax import cli
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.runs import inprocess
from diloco_jax.tools.bench import bench_flags


def _timed(step_fn, trainer, steps: int) -> float:
  """Tokens/s over `steps` calls of step_fn, waiting for the device at the end."""
  tokens0, t0 = trainer.tokens, time.perf_counter()
  for _ in range(steps):
    step_fn()
  jax.block_until_ready(trainer.state.params)
  return (trainer.tokens - tokens0) / (time.perf_counter() - t0)


class _MemorySampler:
  """Samples traced allocations, attributed to the learner's comms or the syncer core by call stack.

  The host memory of the outer loop: traced numpy allocations (tracemalloc), sampled during 2H learner
  steps and attributed by call stack to the learner's comms side and to the syncer core, against the
  bounds (max_in_flight + 1) x the largest fragment, and 4 x the model's fp32 bytes."""

  # The syncer core is called from the learner's comms thread (in-process transport): test it first.
  GROUPS = {"syncer_core": ("syncer/core.py",),
            "learner_outer_loop": ("learner/comms.py", "learner/loop.py")}

  def __init__(self, period_s: float = 0.05):
    self.peak = {g: 0 for g in self.GROUPS}
    self._stop = threading.Event()
    self._period = period_s
    self._thread = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    while not self._stop.wait(self._period):
      totals = {g: 0 for g in self.GROUPS}
      for trace in tracemalloc.take_snapshot().traces:
        files = [f.filename for f in trace.traceback]
        for group, suffixes in self.GROUPS.items():
          if any(name.endswith(suffixes) for name in files):
            totals[group] += trace.size
            break
      for g, v in totals.items():
        self.peak[g] = max(self.peak[g], v)

  def __enter__(self):
    tracemalloc.start(16)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    tracemalloc.stop()


def bench_overhead(argv) -> int:
  """`python -m diloco_jax bench overhead --config C`; see the module docstring."""
  fv = cli.parse(argv, bench_flags.overhead, doc=__doc__)
  config = fv.config
  cli.validated(config, len(cli.devices(config.learners.num * config.learners.devices, "bench overhead")),
                learners=True)
  config.outer.min_quorum = 1
  h = config.outer.sync_every
  steps = fv.steps or h * -(-8 // h)
  devices = jax.devices()[:config.learners.devices]
  batch = config.data.global_batch // config.learners.num
  print(f"bench overhead: {len(devices)} devices, batch {batch}, H={h}, P={config.outer.num_fragments}, "
        f"codec {config.outer.codec}/{config.outer.downlink_codec}, {fv.chunks} x {steps} steps a side",
        file=sys.stderr)

  bare = trainer_lib.MeshTrainer(config, devices, None, batch_size=batch, num_shards=config.learners.num)
  job = inprocess.InProcessRun(config, None, learner_ids=[0], devices=devices, run_id="bench-overhead")
  learner = job.learners[0]
  learner.join()
  # Warm up: compile the steps, the outer-gradient and adoption functions of every fragment.
  _timed(bare.train_step, bare, 3)
  _timed(learner.train_step, learner.trainer, h + 2)

  bare_rates, learner_rates, step_cpu, worker_cpu, step_s = _chunks(bare, learner, fv.chunks, steps)
  pair_ratios = [r / ((a + b) / 2) for r, a, b in zip(learner_rates, bare_rates, bare_rates[1:])]

  with _MemorySampler() as sampler:
    for _ in range(2 * h):
      learner.train_step()
    jax.block_until_ready(learner.trainer.state.params)
  learner.flush()
  job.close()

  plan = learner.plan
  largest = max(plan.size(p) for p in range(plan.num_fragments)) * 4
  model_bytes = sum(plan.size(p) for p in range(plan.num_fragments)) * 4
  ratio = statistics.median(pair_ratios)
  result = {
      "bare_tokens_per_s": statistics.median(bare_rates),
      "learner_tokens_per_s": statistics.median(learner_rates), "ratio": ratio,
      "pair_ratios": pair_ratios, "ratio_of_medians": statistics.median(learner_rates) / statistics.median(bare_rates),
      "step_s": step_s, "outer_cpu_per_step_s": step_cpu + worker_cpu,
      "outer_cpu_fraction": (step_cpu + worker_cpu) / step_s, "boundary_cpu_per_step_s": step_cpu,
      "worker_cpu_per_step_s": worker_cpu, "max_in_flight": learner.max_in_flight,
      "load_avg": os.getloadavg()[0],
      "syncs": learner.stats.syncs, "blocked_s": learner.stats.blocked_s,
      "learner_host_bytes_peak": sampler.peak["learner_outer_loop"],
      "learner_host_bytes_bound": (learner.max_in_flight + 1) * largest,
      "syncer_host_bytes_peak": sampler.peak["syncer_core"], "syncer_host_bytes_bound": 4 * model_bytes,
  }
  print(json.dumps(result, indent=2) if fv.json else _format_result(result))
  return 0


def _chunks(bare, learner, chunks: int, steps: int) -> tuple[list[float], list[float], float, float, float]:
  """`chunks` x `steps` steps with the outer loop, each bracketed by as many bare steps: (bare tokens/s,
  learner tokens/s, outer-loop CPU per step at step boundaries, in sync workers, wall time per step).

  The outer loop's host CPU: the work at step boundaries on the learner's thread (adoptions, snapshots:
  dispatches and host copies) and on its sync workers (encoding, pushing, fetching, decoding, and here the
  in-process syncer's merge too). On an accelerator host it overlaps the device's inner steps; on a
  CPU-only machine it competes with them."""
  bare_rates, learner_rates = [_timed(bare.train_step, bare, steps)], []
  cpu0 = learner.stats.outer_cpu_s, learner.comms.cpu_s
  learner_wall = 0.0
  for i in range(chunks):
    t0 = time.perf_counter()
    learner_rates.append(_timed(learner.train_step, learner.trainer, steps))
    learner_wall += time.perf_counter() - t0
    bare_rates.append(_timed(bare.train_step, bare, steps))
    print(f"  chunk {i + 1}/{chunks}: with outer loop {learner_rates[-1]:,.0f} tok/s, bare "
          f"{bare_rates[-1]:,.0f} tok/s", file=sys.stderr)
  step_cpu = (learner.stats.outer_cpu_s - cpu0[0]) / (chunks * steps)
  worker_cpu = (learner.comms.cpu_s - cpu0[1]) / (chunks * steps)
  return bare_rates, learner_rates, step_cpu, worker_cpu, learner_wall / (chunks * steps)


def _format_result(result: dict) -> str:
  """The figures of `bench_overhead` in three lines."""
  ratio, pair_ratios = result["ratio"], result["pair_ratios"]
  step_cpu, worker_cpu, step_s = result["boundary_cpu_per_step_s"], result["worker_cpu_per_step_s"], result["step_s"]
  return "\n".join([
      f"tokens/s: bare inner step {result['bare_tokens_per_s']:,.0f}, with the outer loop "
      f"{result['learner_tokens_per_s']:,.0f}: ratio {ratio:.3f} (median of {len(pair_ratios)} bracketed "
      f"chunks, {min(pair_ratios):.3f} to {max(pair_ratios):.3f}; ratio of medians "
      f"{result['ratio_of_medians']:.3f}; goal >= 0.97: {'met' if ratio >= 0.97 else 'NOT met'}); "
      f"{result['syncs']} syncs, blocked {result['blocked_s']:.2f}s, max_in_flight {result['max_in_flight']}",
      f"outer loop host CPU per step: {1e3 * (step_cpu + worker_cpu):.2f} ms = "
      f"{100 * result['outer_cpu_fraction']:.1f}% of the {1e3 * step_s:.0f} ms step (step boundaries "
      f"{1e3 * step_cpu:.2f} ms, sync workers {1e3 * worker_cpu:.2f} ms incl. the in-process merge)",
      f"host memory (traced, peak): learner outer loop {result['learner_host_bytes_peak'] / 2**20:.2f} MiB "
      f"(bound {result['learner_host_bytes_bound'] / 2**20:.2f}); syncer core "
      f"{result['syncer_host_bytes_peak'] / 2**20:.2f} MiB (bound {result['syncer_host_bytes_bound'] / 2**20:.2f})",
  ])

"""`python -m diloco_jax bench syncer [--params 16777216 --pushes 4 --codec int4 --downlink fp32] [--json]`

How fast the syncer absorbs outer gradients: M pushes of one fragment of N parameters make a round (a
quorum of M, no grace window), which the core checks, merges, steps (Nesterov) and publishes; then one
learner pulls the result (the downlink answer). The payloads are encoded once beforehand: encoding is the
learners' work.

Measured side by side in one process, each round timed in wall-clock and in this process's CPU time (all
threads): `unfused`, the arithmetic before the chunked merge path, a strict baseline (`Unfused`), and
`fused`, a real `SyncerCore` once per `--threads` (`Fused`). Reported: parameters absorbed per second (M x
N per round), by the wall clock and per core (over CPU seconds); the bound from the bytes a round must
touch at the rate of a plain copy measured in the same run (`bytes_touched`); and the fused path's gain
over the unfused one. Medians over `--rounds` rounds after a warm-up round. docs/benchmarks.md, "Syncer
merge path".
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
import time

import numpy as np

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.outer import chunked
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import merge as outer
from diloco_jax.protocol.messages import Push
from diloco_jax.syncer.core import SyncerCore
from diloco_jax.syncer.settings import SyncerSettings
from diloco_jax.tools.bench import bench_flags, outer_reference

LR, MOMENTUM = 0.7, 0.9
FINGERPRINT = "bench-syncer"


def copy_rate(size: int, repeats: int = 10) -> float:
  """Bytes per CPU second of the best of `repeats` copies of a float32[size] vector into a warm one
  (np.copyto; CPU time, like the rounds: a shared machine's waits for a core do not count)."""
  src = np.random.default_rng(0).standard_normal(size).astype(np.float32)
  dst = np.zeros_like(src)
  best = float("inf")
  for _ in range(repeats):
    t0 = time.thread_time()
    np.copyto(dst, src)
    best = min(best, time.thread_time() - t0)
  return src.nbytes / best


def bytes_touched(size: int, pushes: int, up: str, down: str, block: int) -> int:
  """The bytes one round must read and write, at the least: each payload read three times (for the CRC,
  the norm and the decode; fp32 and bf16 once more for finiteness), the global and the momentum read and
  written, and the downlink's reads and writes. At the rate of a plain copy (`copy_rate`: a copy of B bytes
  reads B and writes B, so bytes move at twice the copy rate) this bounds the parameters a core absorbs per
  second."""
  payload = codec_lib.encoded_size(size, up, block)
  reads_per_push = 3 * payload + (payload if up in ("fp32", "bf16") else 0)  # CRC, norm, decode, finiteness
  state = 4 * 4 * size  # global and momentum, each read and written
  if down == "fp32":
    downlink = 2 * 4 * size  # the answer's bytes: the global read, the payload written
  else:
    downlink = 3 * 4 * size + codec_lib.encoded_size(size, down, block)  # global read, reference read+written
  return pushes * reads_per_push + state + downlink


def _payloads(size: int, pushes: int, up: str, block: int) -> list[bytes]:
  rng = np.random.default_rng(1)
  return [codec_lib.encode(rng.standard_normal(size).astype(np.float32) * 1e-3, up, block)
          for _ in range(pushes)]


class Unfused:
  """The pre-chunked arithmetic of one fragment, as a baseline: per push CRC, a full decode and a
  finiteness check; at the close `outer.merge` over the decoded vectors, `outer_reference.outer_step`
  (optax, jitted on the CPU), and the downlink as separate encode / decode / add steps (fp32: the answer's
  bytes from the new global). Without the merge-safety checks (a norm per push, a finiteness check of the
  result), which the fused path pays for: a strict baseline."""

  def __init__(self, initial: np.ndarray, up: str, down: str, block: int):
    self.up, self.down, self.block = up, down, block
    self.tx = outer_reference.make_outer_optimizer(LR, MOMENTUM)
    self.theta = initial.copy()
    self.opt_state = outer_reference.init_outer_state(self.tx, self.theta)
    self.ref = initial.copy()

  def round(self, payloads: list[bytes], tokens: list[int]) -> bytes:
    deltas = []
    for payload in payloads:
      codec_lib.checksum(payload)
      delta = codec_lib.decode(payload, self.up, self.theta.size, self.block)
      if not np.isfinite(delta).all():
        raise ValueError("nonfinite")
      deltas.append(delta)
    raw = outer.raw_weights(tokens, [1] * len(tokens))
    merged = outer.merge(deltas, outer.merge_coefficients(raw, float(raw.sum()), len(tokens)))
    self.theta, self.opt_state = outer_reference.outer_step(self.tx, self.theta, self.opt_state, merged)
    if self.down == "fp32":
      return codec_lib.encode(self.theta, "fp32")
    payload = codec_lib.encode(self.theta - self.ref, self.down, self.block)
    self.ref = self.ref + codec_lib.decode(payload, self.down, self.theta.size, self.block)
    return payload


class Fused:
  """A real SyncerCore with a quorum of all `pushes` learners and no grace window: per push the core's
  checks (CRC-32, finiteness, the norm for the outlier check at the shipped `outer.max_norm_ratio`); at the
  close `outer.apply_round` (decode, weighted sum and Nesterov step in place, in cache-sized chunks,
  written only when proven finite) and, for a lossy downlink, `codec.encode_residual`; then one pull's
  answer (the full fp32 fragment, or the quantized change from the reference)."""

  def __init__(self, initial: np.ndarray, up: str, down: str, block: int, pushes: int, threads: int):
    # The shipped defaults (`base_config()` resolved), with what this bench has always measured: one fragment,
    # a quorum of all pushes and no grace window, plain full rounds, and no stall, claim or history bounds
    # (its pushers report no steps, and only the latest reference is kept).
    base = SyncerSettings.for_fragments(config_lib.resolve(config_lib.base_config()), (initial.size,), 0, FINGERPRINT)
    settings = dataclasses.replace(
        base, codec=up, downlink_codec=down, block=block, outer_lr=LR, outer_momentum=MOMENTUM,
        policy=dataclasses.replace(base.policy, min_quorum=pushes, max_grace_s=0.0), lease_s=3600.0,
        merge_threads=threads, num_learners=pushes, scale_partial_rounds=False, stall_s=math.inf, tokens_per_step=0,
        period_steps=0, max_push_steps=0, downlink_history=1)
    self.core = SyncerCore(settings, [initial])
    for i in range(pushes):
      self.core.join(i, FINGERPRINT)
    self.version = 0
    self.up = up
    self._checksums: dict[int, int] = {}

  def round(self, payloads: list[bytes], tokens: list[int]) -> bytes:
    for i, (payload, t) in enumerate(zip(payloads, tokens)):
      if id(payload) not in self._checksums:  # the learner's work: not timed after the warm-up round
        self._checksums[id(payload)] = codec_lib.checksum(payload)
      self.core.push(Push(learner_id=i, fingerprint=FINGERPRINT, fragment=0, base_version=self.version,
                          steps=1, tokens=t, codec=self.up, payload=payload, checksum=self._checksums[id(payload)]))
    published = self.core.pull(0, self.version + 1, have_version=self.version, have_epoch=self.core.epoch)
    assert published is not None and published.version == self.version + 1
    self.version = published.version
    return published.payload


def _time_rounds(path, payloads, tokens, rounds: int) -> dict:
  path.round(payloads, tokens)  # warm-up: compiles the optax step, touches every page
  walls, cpus = [], []
  for _ in range(rounds):
    w0, c0 = time.perf_counter(), time.process_time()
    path.round(payloads, tokens)
    walls.append(time.perf_counter() - w0)
    cpus.append(time.process_time() - c0)
  return {"wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus),
          "wall_s_range": [min(walls), max(walls)], "cpu_s_range": [min(cpus), max(cpus)]}


def run(size: int = 1 << 24, pushes: int = 4, up: str = "int4", down: str = "fp32", block: int = 64,
        rounds: int = 5, threads: tuple[int, ...] = (1,), log=lambda msg: None, unfused: bool = True) -> dict:
  """The benchmark; returns {"rows": [...], "copy_gb_s", "bound_params_per_s", ...}. Each row's parameters
  absorbed per second are M x N per round over the median round, by the wall clock and per core (over CPU
  seconds: a host with more cores runs that many rounds' worth of work in parallel). `unfused`: also the
  unfused path (the first row; the fused rows then carry their speed-up over it)."""
  initial = np.random.default_rng(0).standard_normal(size).astype(np.float32)
  payloads = _payloads(size, pushes, up, block)
  tokens = [1000 + 10 * i for i in range(pushes)]
  absorbed = pushes * size
  rate = copy_rate(size)
  touched = bytes_touched(size, pushes, up, down, block)
  bound = absorbed / (touched / (2 * rate))
  log(f"copy {rate / 1e9:.1f} GB/s; a round touches {touched / 1e6:.0f} MB: bound {bound / 1e6:,.0f}M params/s")
  paths = [("unfused", 1, lambda: Unfused(initial, up, down, block))] if unfused else []
  paths += [("fused", t, lambda t=t: Fused(initial, up, down, block, pushes, t)) for t in threads]
  rows = []
  for name, t, make in paths:
    path = make()
    timing = _time_rounds(path, payloads, tokens, rounds)
    row = {"path": name, "threads": t, **timing, "params_per_s": absorbed / timing["wall_s"],
           "params_per_cpu_s": absorbed / timing["cpu_s"]}
    rows.append(row)
    log(f"  {name} x{t}: {timing['wall_s'] * 1e3:.0f} ms wall, {timing['cpu_s'] * 1e3:.0f} ms CPU per round")
    del path
  # Both paths compute the same global: check it (float32 rounding apart) so the speed is not bought wrong.
  base = rows[0]
  for r in rows[1:] if unfused else []:
    r["speedup_per_core"] = r["params_per_cpu_s"] / base["params_per_cpu_s"]
    r["speedup_wall"] = r["params_per_s"] / base["params_per_s"]
  return {"params": size, "pushes": pushes, "codec": up, "downlink_codec": down, "block": block, "rounds": rounds,
          "copy_gb_s": rate / 1e9, "bytes_touched": touched, "bound_params_per_s": bound, "rows": rows,
          "load_avg": os.getloadavg()[0]}


def agreement(size: int = 1 << 16, pushes: int = 4, up: str = "int4", down: str = "fp32", block: int = 64,
              rounds: int = 3) -> float:
  """The largest |difference| between the unfused and fused globals after `rounds` rounds, relative to
  the largest |value| (float32 rounding: about 1e-7)."""
  initial = np.random.default_rng(0).standard_normal(size).astype(np.float32)
  payloads = _payloads(size, pushes, up, block)
  tokens = [1000 + 10 * i for i in range(pushes)]
  a, b = Unfused(initial, up, down, block), Fused(initial, up, down, block, pushes, 1)
  for _ in range(rounds):
    a.round(payloads, tokens)
    b.round(payloads, tokens)
  theta = b.core.global_fragments()[0]
  return float(np.abs(theta - a.theta).max() / np.abs(a.theta).max())


def format_table(result: dict) -> str:
  head = f"{'path':<10}{'threads':>8}{'wall ms':>9}{'CPU ms':>8}{'params/s':>12}{'per core':>12}{'x unfused':>10}"
  lines = [head, "-" * len(head)]
  for r in result["rows"]:
    lines.append(f"{r['path']:<10}{r['threads']:>8}{r['wall_s'] * 1e3:>9.0f}{r['cpu_s'] * 1e3:>8.0f}"
                 f"{r['params_per_s'] / 1e6:>11,.0f}M{r['params_per_cpu_s'] / 1e6:>11,.0f}M"
                 f"{r.get('speedup_per_core', 1.0):>9.2f}x")
  lines.append(f"{'bound':<10}{'':>8}{'':>9}{'':>8}{result['bound_params_per_s'] / 1e6:>11,.0f}M"
               f"   (copy {result['copy_gb_s']:.1f} GB/s; {result['bytes_touched'] / 1e6:,.0f} MB a round)")
  return "\n".join(lines)


def bench_syncer(argv) -> int:
  """`python -m diloco_jax bench syncer`; see the module docstring."""
  fv = cli.parse(argv, bench_flags.syncer, doc=__doc__, config=False)
  try:
    threads = tuple(dict.fromkeys(int(t) or chunked.default_threads() for t in fv.threads))
  except ValueError:
    raise cli.UsageError(f"--threads: integers expected, got {fv.threads}") from None
  if fv.params < 1 or fv.pushes < 1 or fv.rounds < 1 or min(threads) < 1:
    raise cli.UsageError("--params, --pushes, --rounds and --threads must be >= 1")
  log = lambda msg: print(msg, file=sys.stderr)
  log(f"bench syncer: {fv.pushes} pushes of {fv.params:,} params, {fv.codec} up, {fv.downlink} down, "
      f"{fv.rounds} rounds per path, load average {os.getloadavg()[0]:.1f}")
  err = agreement(pushes=fv.pushes, up=fv.codec, down=fv.downlink, block=fv.block)
  result = run(fv.params, fv.pushes, fv.codec, fv.downlink, fv.block, fv.rounds, threads, log)
  result["fused_vs_unfused_max_rel_diff"] = err
  if fv.json:
    print(json.dumps(result, indent=2))
  else:
    print(format_table(result))
    fused1 = next(r for r in result["rows"] if r["path"] == "fused")
    goal = 4 * 150e6
    print(f"fused, 1 thread: {fused1['params_per_cpu_s'] / 1e6:,.0f}M params/s per core "
          f"({fused1['speedup_per_core']:.2f}x the unfused path in this run; goal >= 600M = 4 x 150M: "
          f"{'met' if fused1['params_per_cpu_s'] >= goal else 'NOT met'}); fused and unfused globals agree "
          f"to {err:.1e} of the largest value")
  return 0

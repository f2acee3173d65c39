"""The failure model of one job (the whole data-parallel job, or one Decoupled DiLoCo learner): its chips
under Poisson slice failures, event by event, and the closed forms it is checked against.

A job's settings come from `goodput.SimConfig` (`cfg` below): the per-chip MTBI, the slice size, the step
time, the reshape, repair and rejoin times. Only numpy: this module must import fast and never touch jax.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

import numpy as np


@dataclasses.dataclass
class JobTrace:
  """What one job (the whole dp/elastic job, or one learner) did over the horizon."""

  chips: int
  useful_chip_s: float  # chip-seconds of work that was kept
  stall_starts: np.ndarray  # disjoint [start, end) intervals when the job computed nothing
  stall_ends: np.ndarray
  failures: int


def simulate_job(
    rng: np.random.Generator,
    chips: int,
    horizon_s: float,
    cfg,
    mode: str,
    ckpt_period_s: float,
    ckpt_cost_s: float,
    restart_s: float,
) -> JobTrace:
  """One job of `chips` chips under Poisson slice failures, event by event.

  mode "restart": a failure stops the job for `restart_s` (a spare slice replaces the failed one), and
  the work since the last checkpoint (every `ckpt_period_s` of compute, costing `ckpt_cost_s`) is lost.
  mode "elastic": a failure pauses the job for one reshape and removes the slice for `repair_s`; the
  in-flight step is lost; the repaired slice rejoins with another reshape at a step boundary.
  In both modes a failure (or a rejoin) that happens while the job is already stalled is absorbed by the
  stall in progress: the controller re-plans with the latest set of healthy slices before resuming.

  The recurrence (is this failure inside the stall of an earlier one?) is sequential, so this is a loop
  over events; failure times are drawn vectorized. Its cost is O(failures).
  """
  rate = chips / cfg.mtbi_chip_s
  n_fail = int(rng.poisson(rate * horizon_s))
  fail_times = np.sort(rng.uniform(0.0, horizon_s, n_fail)).tolist()
  if mode == "restart":
    useful, stall_starts, stall_ends = _restart_job(fail_times, chips, horizon_s, ckpt_period_s, ckpt_cost_s,
                                                    restart_s)
  elif mode == "elastic":
    useful, stall_starts, stall_ends = _elastic_job(fail_times, chips, horizon_s, cfg, ckpt_period_s,
                                                    ckpt_cost_s)
  else:
    raise ValueError(f"unknown job mode {mode!r}")
  ends = np.minimum(np.asarray(stall_ends), horizon_s)
  return JobTrace(chips, useful, np.asarray(stall_starts), ends, n_fail)


def _restart_job(fail_times: list[float], chips: int, horizon_s: float, ckpt_period_s: float,
                 ckpt_cost_s: float, restart_s: float) -> tuple[float, list[float], list[float]]:
  """(useful chip-seconds, stall starts, stall ends) of a job that restarts from its last checkpoint."""
  cycle = ckpt_period_s + ckpt_cost_s
  useful = 0.0
  stalled_until = 0.0  # the job computes from here on (until the next stall)
  stall_starts: list[float] = []
  stall_ends: list[float] = []
  for t in fail_times:
    if t < stalled_until:
      continue  # absorbed by the restart in progress
    run = t - stalled_until
    kept = math.floor(run / cycle) * ckpt_period_s  # complete checkpoint cycles survive
    useful += chips * kept
    stall_starts.append(t)
    stalled_until = t + restart_s
    stall_ends.append(stalled_until)
  if horizon_s > stalled_until:
    # The run in progress at the end of the horizon keeps all its compute (a final checkpoint).
    useful += chips * (horizon_s - stalled_until) * ckpt_period_s / cycle
  return useful, stall_starts, stall_ends


def _elastic_job(fail_times: list[float], chips: int, horizon_s: float, cfg, ckpt_period_s: float,
                 ckpt_cost_s: float) -> tuple[float, list[float], list[float]]:
  """(useful chip-seconds, stall starts, stall ends) of a job that reshapes around failed slices."""
  step = cfg.step_s
  s_chips = min(cfg.slice_chips, chips)
  E, D, W = cfg.reshape_s, cfg.repair_s, cfg.rejoin_wait_s
  n_fail = len(fail_times)
  useful = 0.0
  stalled_until = 0.0  # the job computes from here on (until the next stall)
  stall_starts: list[float] = []
  stall_ends: list[float] = []
  out = 0  # slices out (failed, or repaired and waiting to rejoin)
  ready: list[float] = []  # heap: times repaired slices may rejoin
  t_prev = 0.0
  i = 0
  while True:
    next_fail = fail_times[i] if i < n_fail else math.inf
    # A repaired slice that found no reshape to join within W forces a grow reshape of its own.
    next_forced = ready[0] + W if ready else math.inf
    t = min(next_fail, next_forced)
    if t >= horizon_s:
      break
    # Work done by the live chips since the last event (if not stalled).
    run_from = max(t_prev, stalled_until)
    live = max(0, chips - out * s_chips)
    if t > run_from:
      useful += live * (t - run_from)
    t_prev = t
    if t >= stalled_until:
      if next_fail <= next_forced:
        # The step in flight is lost on the live chips (steps restart at each resume).
        useful -= live * ((t - stalled_until) % step)
      # else: a planned grow waits for a step boundary; nothing is lost, but everyone pauses.
      stall_starts.append(t)
      stalled_until = t + E
      stall_ends.append(stalled_until)
    # This reshape (new or in progress) takes in every repaired slice that is ready by now.
    while ready and ready[0] <= t:
      heapq.heappop(ready)
      out -= 1
    if next_fail <= next_forced:
      i += 1
      out += 1
      heapq.heappush(ready, t + D)
  run_from = max(t_prev, stalled_until)
  if horizon_s > run_from:
    useful += max(0, chips - out * s_chips) * (horizon_s - run_from)
  # Snapshots for pushes (or checkpoints) block the device briefly on every cycle.
  useful *= ckpt_period_s / (ckpt_period_s + ckpt_cost_s)
  return useful, stall_starts, stall_ends


def stalled_time(trace: JobTrace) -> float:
  """Seconds the job computed nothing."""
  return float(np.sum(trace.stall_ends - trace.stall_starts)) if trace.stall_starts.size else 0.0


def all_stalled_time(traces: list[JobTrace], horizon_s: float) -> float:
  """Seconds during which every job in `traces` is stalled at once (vectorized sweep over edges)."""
  m = len(traces)
  edges = np.concatenate([t.stall_starts for t in traces] + [t.stall_ends for t in traces])
  if edges.size == 0:
    return 0.0
  deltas = np.concatenate([np.ones(t.stall_starts.size) for t in traces] +
                          [-np.ones(t.stall_ends.size) for t in traces])
  order = np.argsort(edges, kind="stable")
  edges, stalled = edges[order], np.cumsum(deltas[order])
  widths = np.diff(np.concatenate([edges, [horizon_s]]))
  return float(np.sum(widths[stalled >= m]))


# ---- closed forms (used by the tests and printed as a sanity check) ----

def analytic_dp_goodput(cfg) -> float:
  """Renewal-reward expectation for `dp`: runs ~ Exp(rate), each followed by a restart (failures during
  a restart are absorbed); the kept work of a run is its complete checkpoint cycles."""
  rate = cfg.chips / cfg.mtbi_chip_s
  period = cfg.ckpt_every_steps * cfg.step_s
  cycle = period + cfg.ckpt_cost_s
  # E[floor(X / c)] for X ~ Exp(rate) is 1 / (exp(rate c) - 1).
  kept = period / math.expm1(rate * cycle) if rate > 0 else math.inf
  if rate == 0:
    return period / cycle
  return kept / (1.0 / rate + cfg.restart_s)


def no_failure_goodput(cfg) -> float:
  """Goodput when nothing fails: one minus the modelled overheads (snapshots / checkpoints)."""
  if cfg.strategy == "dp":
    period = cfg.ckpt_every_steps * cfg.step_s
    return period / (period + cfg.ckpt_cost_s)
  if cfg.strategy == "elastic":
    return 1.0
  period = cfg.inner_steps / cfg.fragments * cfg.step_s
  return period / (period + cfg.snapshot_s)

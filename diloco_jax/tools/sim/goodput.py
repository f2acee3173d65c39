"""Discrete-event goodput simulation of N chips in slices under failures.

Three strategies share one failure model (`sim/failures.py`) and one "job" simulator:

* `dp`: synchronous data-parallel with checkpoint-restart: any chip failure stops the whole job.
* `elastic`: elastic data-parallel: a failure removes its slice and pauses the whole job for one reshape.
* `diloco`: Decoupled DiLoCo with M learners, each an elastic data-parallel job of N/M chips, so a failure
  pauses only its own learner. Learners push fragments to the syncer, whose rounds close by the project's
  own quorum and grace-window policy (`diloco_jax.syncer.rules.quorum`), and wait on the outer loop as the
  real learner does (`sim/rounds.py`).

Outputs: goodput (useful chip-time / provisioned chip-time) and uptime (fraction of wall time the global
model advances), each as a mean and a 95% confidence interval over seeded repeats. The model in full
(restart, reshape, repair and rejoin costs): docs/simulator.md, "1. Goodput model". Only numpy: this
module must import fast and never touch jax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from diloco_jax.syncer.rules import quorum as syncer_policy
from diloco_jax.tools.sim import failures, rounds

YEAR_S = 365.25 * 24 * 3600.0
STRATEGIES = ("dp", "elastic", "diloco")

# The published grid (Decoupled DiLoCo, goodput % by chips). Reference values, compared against, never used in
# the model.
TABLE_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
TABLE_ROWS = (("dp", 1), ("elastic", 1), ("diloco", 2), ("diloco", 4), ("diloco", 8), ("diloco", 16))
PUBLISHED = {
    ("dp", 1): (72, 57, 38, 27, 18),
    ("elastic", 1): (88, 80, 69, 58, 40),
    ("diloco", 2): (94, 88, 80, 70, 54),
    ("diloco", 4): (96, 93, 89, 82, 73),
    ("diloco", 8): (98, 96, 94, 88, 80),
    ("diloco", 16): (99, 98, 96, 93, 86),
}
PUBLISHED_MTBI_YEARS = 1.0  # the grid's per-chip mean time between interruptions

# The paper's heterogeneous-hardware experiment: 8 learners, half of them 18% slower (TPU v5p beside v6e),
# 10% step-time variance; goodput (%) per quorum setting. Reference values, compared against, never used.
QUORUM_SETTINGS = {
    "all": "K = M (wait for all)",
    "k1": "K = 1, no grace",
    "k1grace": "K = 1 + adaptive grace",
}
PUBLISHED_HETERO = {"all": 84, "k1": 100, "k1grace": 100}
PUBLISHED_HETERO_SETTING = "8 learners, half 18% slower, step cv 0.1"


@dataclasses.dataclass(frozen=True)
class SimConfig:
  """One simulated configuration. Defaults are the documented assumptions behind `--table`."""

  chips: int = 1_200_000
  strategy: str = "diloco"
  learners: int = 8  # M (diloco only)
  # Failure model: each chip fails as a Poisson process; a failure takes out its whole slice.
  mtbi_chip_s: float = YEAR_S
  slice_chips: int = 256  # failure and elasticity unit (one v5e/v6e pod, 64 hosts)
  # Recovery times.
  restart_s: float = 72.0  # warm full-job restart: hot spare swapped in, state from in-memory replicas
  reshape_s: float = 18.0  # elastic reshape: re-form collectives, reshard, reload compiled program
  repair_s: float = 600.0  # a failed slice is out this long before it can rejoin
  rejoin_wait_s: float = 120.0  # a repaired slice waits this long to rejoin at a failure's reshape
  # Steps and checkpoints.
  step_s: float = 2.0
  step_cv: float = 0.05  # coefficient of variation of one step's time
  ckpt_every_steps: int = 1  # dp: in-memory snapshot every step (the best case for dp)
  ckpt_cost_s: float = 0.02  # blocking device->host part of one snapshot
  # Decoupled DiLoCo.
  inner_steps: int = 100  # H
  fragments: int = 8  # P
  snapshot_s: float = 0.01  # blocking device->host copy of one fragment per push
  t_sync_s: float = 1.0  # syncer merge + publish time of one fragment
  min_quorum: int = 1  # K
  tau: int = 5
  grace_gamma: float = 0.5
  max_grace_s: float = 30.0
  learner_recovery: str = "elastic"  # or "restart": a learner restarts like a small dp job and rejoins
  rejoin_s: float = 10.0  # restart mode: pull the current global fragments on rejoin
  max_in_flight: int = 2  # the learner's outer.max_in_flight: fragments pushed but not yet adopted
  # Mixed hardware: ((speed, learners), ...) groups (their learners sum to `learners`), or speeds drawn
  # uniformly in [1 - speed_spread, 1]; a speed-v learner's steps take step_s / v on average.
  groups: tuple[tuple[float, int], ...] = ()
  speed_spread: float = 0.0
  # Simulation length: enough time for this many failures in the smallest job (statistical accuracy).
  failures_per_job: int = 300
  horizon_s: float = 0.0  # > 0 overrides failures_per_job (and is simulated in full)
  # The outer loop (pushes, rounds, blocking) is simulated event by event over a window at the start of
  # the horizon holding at most this many pushes; the failure model always runs the whole horizon.
  max_pushes: int = 10_000

  def validate(self) -> SimConfig:
    """Raise ValueError naming the offending flag."""
    checks = [
        (self.chips >= 1, f"--chips must be >= 1, got {self.chips}"),
        (self.strategy in STRATEGIES, f"--strategy must be one of {STRATEGIES}, got {self.strategy!r}"),
        (self.learners >= 1, f"--learners (M) must be >= 1, got {self.learners}"),
        (0 < self.mtbi_chip_s < math.inf, f"--mtbi-years must be > 0 and finite, got {self.mtbi_chip_s / YEAR_S}"),
        (self.slice_chips >= 1, f"--slice-chips must be >= 1, got {self.slice_chips}"),
        (self.restart_s >= 0, f"--restart-s must be >= 0, got {self.restart_s}"),
        (self.reshape_s >= 0, f"--reshape-s must be >= 0, got {self.reshape_s}"),
        (self.repair_s >= 0, f"--repair-s must be >= 0, got {self.repair_s}"),
        (self.rejoin_wait_s >= 0, f"--rejoin-wait-s must be >= 0, got {self.rejoin_wait_s}"),
        (self.step_s > 0, f"--step-s must be > 0, got {self.step_s}"),
        (0 <= self.step_cv < 1, f"--step-cv must be in [0, 1), got {self.step_cv}"),
        (self.ckpt_every_steps >= 1, f"--ckpt-every-steps must be >= 1, got {self.ckpt_every_steps}"),
        (self.ckpt_cost_s >= 0, f"--ckpt-cost-s must be >= 0, got {self.ckpt_cost_s}"),
        (self.inner_steps >= 1, f"--inner-steps (H) must be >= 1, got {self.inner_steps}"),
        (1 <= self.fragments <= self.inner_steps,
         f"--fragments (P) must be in [1, H={self.inner_steps}], got {self.fragments}"),
        (self.snapshot_s >= 0, f"--snapshot-s must be >= 0, got {self.snapshot_s}"),
        (self.t_sync_s >= 0, f"--t-sync-s must be >= 0, got {self.t_sync_s}"),
        (self.min_quorum >= 1, f"--min-quorum (K) must be >= 1, got {self.min_quorum}"),
        (self.tau >= 0, f"--tau (outer.tau) must be >= 0, got {self.tau}"),
        (0 <= self.grace_gamma < 1, f"--grace-gamma (outer.grace_gamma) must be in [0, 1), got {self.grace_gamma}"),
        (self.max_grace_s >= 0, f"--max-grace-s (outer.max_grace_s) must be >= 0, got {self.max_grace_s}"),
        (self.learner_recovery in ("elastic", "restart"),
         f"--learner-recovery must be 'elastic' or 'restart', got {self.learner_recovery!r}"),
        (self.rejoin_s >= 0, f"--rejoin-s must be >= 0, got {self.rejoin_s}"),
        (0 <= self.speed_spread < 1, f"--speed-spread must be in [0, 1), got {self.speed_spread}"),
        (self.max_in_flight >= 1, f"--max-in-flight must be >= 1, got {self.max_in_flight}"),
        (self.failures_per_job >= 1, f"--failures-per-job must be >= 1, got {self.failures_per_job}"),
        (self.horizon_s >= 0, f"--horizon-s must be >= 0, got {self.horizon_s}"),
        (self.max_pushes >= 1, f"--max-pushes must be >= 1, got {self.max_pushes}"),
    ]
    for ok, message in checks:
      if not ok:
        raise ValueError(message)
    if self.strategy == "diloco" and self.chips < self.learners:
      raise ValueError(f"--chips ({self.chips}) must be >= --learners ({self.learners})")
    if self.groups:
      for speed, count in self.groups:
        if not (0 < speed <= 100 and math.isfinite(speed)) or count < 1:
          raise ValueError(f"--groups: each group is SPEED:LEARNERS with SPEED in (0, 100] and LEARNERS >= 1, "
                           f"got {speed:g}:{count}")
      if sum(c for _, c in self.groups) != self.learners:
        raise ValueError(f"--groups hold {sum(c for _, c in self.groups)} learners but --learners is "
                         f"{self.learners}")
      if self.speed_spread:
        raise ValueError("--groups and --speed-spread are two ways to set learner speeds: give one")
    return self

  def quorum_policy(self) -> syncer_policy.QuorumPolicy:
    return syncer_policy.QuorumPolicy(
        min_quorum=self.min_quorum, tau=self.tau, gamma=self.grace_gamma, min_grace_s=0.0, max_grace_s=self.max_grace_s
    )

  @property
  def jobs(self) -> int:
    """Independent failure domains: the whole job for dp/elastic, one per learner for diloco."""
    return self.learners if self.strategy == "diloco" else 1

  def outer_schedule(self) -> rounds.Schedule:
    return rounds.Schedule(inner_steps=self.inner_steps, fragments=self.fragments, tau=self.tau,
                           max_in_flight=self.max_in_flight, step_s=self.step_s, step_cv=self.step_cv,
                           t_sync_s=self.t_sync_s, policy=self.quorum_policy())

  def learner_speeds(self, rng: np.random.Generator) -> np.ndarray:
    """One speed per learner: the groups in order, or uniform draws with `speed_spread`, or all 1."""
    if self.groups:
      return np.concatenate([np.full(count, float(speed)) for speed, count in self.groups])
    if self.speed_spread:
      return 1.0 - self.speed_spread * rng.uniform(0.0, 1.0, self.learners)
    return np.ones(self.learners)

  def sync_window(self, speeds: Sequence[float]) -> float:
    """Wall seconds of the outer-loop simulation: the horizon, capped at `max_pushes` expected pushes
    unless --horizon-s was given."""
    horizon = self.horizon()
    if self.horizon_s > 0:
      return horizon
    rate = sum(rounds.pushes_per_second(self.outer_schedule(), float(v)) for v in speeds)
    return min(horizon, self.max_pushes / rate)

  def horizon(self) -> float:
    if self.horizon_s > 0:
      return self.horizon_s
    # Enough renewal cycles (run, then recover) for `failures_per_job` recoveries of one job.
    rate = self.chips / self.jobs / self.mtbi_chip_s
    recovery = self.restart_s if self.strategy == "dp" else self.reshape_s
    return self.failures_per_job * (1.0 / rate + recovery)


@dataclasses.dataclass
class RunResult:
  goodput: float
  uptime: float
  failures: int
  horizon_s: float
  extra: dict


def simulate_once(cfg: SimConfig, seed: int) -> RunResult:
  """One repeat of one configuration."""
  rng = np.random.default_rng(seed)
  horizon = cfg.horizon()
  provisioned = cfg.chips * horizon
  if cfg.strategy in ("dp", "elastic"):
    mode = "restart" if cfg.strategy == "dp" else "elastic"
    period = cfg.ckpt_every_steps * cfg.step_s if mode == "restart" else 1.0
    cost = cfg.ckpt_cost_s if mode == "restart" else 0.0
    trace = failures.simulate_job(rng, cfg.chips, horizon, cfg, mode, period, cost, cfg.restart_s)
    uptime = 1.0 - failures.stalled_time(trace) / horizon
    return RunResult(trace.useful_chip_s / provisioned, uptime, trace.failures, horizon, {})

  # Decoupled DiLoCo: M learners, N/M chips each (the first N mod M learners get one more chip).
  m = cfg.learners
  sizes = [cfg.chips // m + (1 if j < cfg.chips % m else 0) for j in range(m)]
  push_period = cfg.inner_steps / cfg.fragments * cfg.step_s  # compute time between two pushes
  traces = []
  for size in sizes:
    if cfg.learner_recovery == "elastic":
      tr = failures.simulate_job(rng, size, horizon, cfg, "elastic", push_period, cfg.snapshot_s, 0.0)
    else:
      # The learner restarts and pulls the global model: its work since its last push is lost.
      tr = failures.simulate_job(rng, size, horizon, cfg, "restart", push_period, cfg.snapshot_s,
                        cfg.restart_s + cfg.rejoin_s)
    traces.append(tr)
  speeds = cfg.learner_speeds(rng)
  window = cfg.sync_window(speeds)
  learners = []
  for tr, speed in zip(traces, speeds):
    inside = tr.stall_starts < window
    learners.append(rounds.Learner(float(speed), tr.stall_starts[inside].tolist(),
                                   np.minimum(tr.stall_ends[inside], window).tolist()))
  outer = rounds.simulate(cfg.outer_schedule(), learners, window, rng)
  # A learner loses the share of its compute time it spent blocked on the outer loop (measured over the
  # window, where it sees the same failures and rounds as over the whole horizon).
  blocked = outer.blocked_fraction
  useful = float(sum(tr.useful_chip_s * (1.0 - b) for tr, b in zip(traces, blocked)))
  # The global model advances while at least one learner computes: its pushes close rounds (the effective
  # quorum never exceeds the live learners). It stops only while every learner is stalled at once.
  uptime = 1.0 - failures.all_stalled_time(traces, horizon) / horizon
  closed = outer.contributors.size
  extra = {
      "rounds": int(closed),
      "mean_contributors": float(outer.contributors.mean()) if closed else 0.0,
      "mean_round_latency_s": float(outer.latency_s.mean()) if closed else 0.0,
      "max_update_gap_s": outer.max_update_gap_s,
      "blocked_fraction": float(sum(tr.useful_chip_s * b for tr, b in zip(traces, blocked))) / provisioned,
      "learner_blocked_max": float(blocked.max()),
      "late_fraction": outer.late_pushes / outer.pushes if outer.pushes else 0.0,
      "pushes": outer.pushes,
      "deferred_pushes": outer.deferred_pushes,
      "sync_window_s": window,
      "learner_stalled_fraction": float(np.mean([failures.stalled_time(t) / horizon for t in traces])),
  }
  return RunResult(useful / provisioned, uptime, sum(t.failures for t in traces), horizon, extra)


@dataclasses.dataclass
class Estimate:
  """Mean and 95% confidence half-width over repeats."""

  goodput: float
  goodput_ci: float
  uptime: float
  uptime_ci: float
  repeats: int
  failures: float  # mean per repeat
  horizon_s: float
  extra: dict

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def _ci(values: np.ndarray) -> float:
  if values.size < 2:
    return 0.0
  return float(1.96 * values.std(ddof=1) / math.sqrt(values.size))


def simulate(cfg: SimConfig, repeats: int = 5, seed: int = 0) -> Estimate:
  """Mean goodput and uptime of `cfg` over `repeats` seeded runs (deterministic for a given seed)."""
  cfg.validate()
  if repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {repeats}")
  seeds = np.random.SeedSequence(seed).generate_state(repeats)
  runs = [simulate_once(cfg, int(s)) for s in seeds]
  g = np.array([r.goodput for r in runs])
  u = np.array([r.uptime for r in runs])
  keys = runs[0].extra.keys()
  extra = {k: float(np.mean([r.extra[k] for r in runs])) for k in keys}
  return Estimate(float(g.mean()), _ci(g), float(u.mean()), _ci(u), repeats,
                  float(np.mean([r.failures for r in runs])), runs[0].horizon_s, extra)


def published_goodput(strategy: str, m: int, chips: int, cfg: SimConfig) -> int | None:
  """The published goodput (%) of this cell, or None when nothing was published for it: the grid holds
  only its five chip counts and six rows, at a per-chip MTBI of one year."""
  if not math.isclose(cfg.mtbi_chip_s, PUBLISHED_MTBI_YEARS * YEAR_S, rel_tol=1e-9):
    return None
  row = PUBLISHED.get((strategy, 1 if strategy != "diloco" else m))
  if row is None or chips not in TABLE_CHIPS:
    return None
  return row[TABLE_CHIPS.index(chips)]


def table(
    base: SimConfig, repeats: int = 3, seed: int = 0,
    progress: Callable[[str], None] | None = None,
    chips: Sequence[int] = TABLE_CHIPS,
    rows: Sequence[tuple[str, int]] = TABLE_ROWS,
) -> list[dict]:
  """The published grid (or the given part of it), simulated under one set of assumptions (`base`),
  beside the published values where they apply (`published_goodput`)."""
  out = []
  for strategy, m in rows:
    for n in chips:
      cfg = dataclasses.replace(base, chips=n, strategy=strategy, learners=m)
      est = simulate(cfg, repeats=repeats, seed=seed)
      pub = published_goodput(strategy, m, n, base)
      out.append({
          "strategy": strategy, "learners": m, "chips": n,
          "goodput": est.goodput, "goodput_ci": est.goodput_ci,
          "uptime": est.uptime, "uptime_ci": est.uptime_ci,
          "published": pub,
          "diff_points": None if pub is None else 100 * est.goodput - pub,
          "failures_per_repeat": est.failures, "horizon_s": est.horizon_s, **est.extra,
      })
      if progress:
        progress(f"{row_label(strategy, m):>10} {n:>9,} chips: goodput {100 * est.goodput:5.1f}%")
  return out


QUORUM_OVERRIDES = {
    "all": lambda cfg: {"min_quorum": cfg.learners},
    "k1": lambda cfg: {"min_quorum": 1, "max_grace_s": 0.0},
    "k1grace": lambda cfg: {"min_quorum": 1},
}


def with_quorum_setting(cfg: SimConfig, setting: str) -> SimConfig:
  """`cfg` under one of the paper's three quorum settings (`QUORUM_SETTINGS`): K = M; K = 1 closing at the
  first push (no grace window); K = 1 with the adaptive grace window of `cfg` (gamma, max grace)."""
  if setting not in QUORUM_OVERRIDES:
    raise ValueError(f"--quorum-settings must be a comma list of {', '.join(QUORUM_SETTINGS)}, got {setting!r}")
  return dataclasses.replace(cfg, **QUORUM_OVERRIDES[setting](cfg))


def lockstep_goodput(cfg: SimConfig, rng: np.random.Generator | None = None) -> float:
  """Goodput if every learner ran at the slowest one's pace: the mean over learners of slowest speed /
  own speed (for `speed_spread`, the mean over draws of `rng`)."""
  if cfg.groups or not cfg.speed_spread:
    return rounds.lockstep_goodput(cfg.learner_speeds(np.random.default_rng(0)))
  rng = rng or np.random.default_rng(0)
  return float(np.mean([rounds.lockstep_goodput(cfg.learner_speeds(rng)) for _ in range(1000)]))


def published_hetero_mismatch(cfg: SimConfig) -> str | None:
  """Why `cfg` is not the paper's heterogeneous setting (None when it is): 8 learners in two groups of 4,
  the slow group 18% slower (speed ratio 0.82 to 1/1.18 = 0.85), step cv 0.1, failures negligible."""
  reasons = []
  if cfg.learners != 8:
    reasons.append(f"{cfg.learners} learners, not 8")
  counts = sorted(c for _, c in cfg.groups)
  speeds = sorted(v for v, _ in cfg.groups)
  if counts != [4, 4] or not 0.80 <= speeds[0] / speeds[-1] <= 0.86:
    reasons.append("not two groups of 4 with the slow one 18% slower (--groups 0.847:4,1:4)")
  if not math.isclose(cfg.step_cv, 0.1):
    reasons.append(f"step cv {cfg.step_cv:g}, not 0.1")
  learner_mtbi_s = cfg.mtbi_chip_s / max(1, cfg.chips // cfg.learners)
  if learner_mtbi_s < 1000 * cfg.inner_steps * cfg.step_s:
    reasons.append("failures not negligible (raise --mtbi-years)")
  return "; ".join(reasons) or None


def row_label(strategy: str, m: int) -> str:
  return {"dp": "DP", "elastic": "elastic DP"}.get(strategy, f"M={m}")


def label(row: dict) -> str:
  """A result row's name: its strategy (and M), and its quorum setting if it has one."""
  name = row_label(row["strategy"], row["learners"])
  return f"{name} {row['setting']}" if row.get("setting") else name

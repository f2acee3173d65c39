"""When a syncer round may close: the minimum quorum and the adaptive grace window.

Pure functions of numbers, shared by the syncer's round rules (`syncer/rules/rounds.py`) and the scale
simulator (`tools/sim/`), so that what the simulator predicts is what the syncer does.

The grace rule (the paper's "Eq. 3", made explicit; per learner in `round_grace_s`). Counting from the
round's opening (its first contribution), the merged fragment must be out before the first contributor
adopts it, tau of its inner steps after its push:

    budget   = tau * step_time                  # time until the earliest contributor adopts
    slack    = budget - t_quorum - t_sync       # t_quorum: open -> K-th contribution; t_sync: merge + send
    grace    = clip(gamma * slack, min_grace_s, max_grace_s)

A round also closes as soon as every live learner has contributed (`round_close_time`: the whole rule);
phase alignment: `phase_offset_s`. docs/algorithm.md, "Syncer", 2. Quorum and 3. Grace window.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class QuorumPolicy:
  """How a round closes (the rule: the module docstring and `round_close_time`). No defaults and no checks:
  the syncer's come from the run's resolved config (`SyncerSettings.from_spec`), the simulator's from its
  flags. gamma < 1 keeps a safety margin. With min_grace_s = max_grace_s = 0 the syncer closes at quorum
  (K = 1 and no grace is the "no grace window" ablation of the paper)."""

  min_quorum: int  # K (>= 1): contributions needed before a round may close
  tau: int  # overlap steps between a learner's snapshot and its adoption of the merged fragment
  gamma: float  # fraction of the slack spent waiting for stragglers (< 1)
  min_grace_s: float
  max_grace_s: float


def estimate_step_time(reported_step_times: Sequence[float]) -> float:
  """The step time the grace window plans for: the median of the live learners' reports (robust to one
  very slow or very fast learner). 0 when nobody has reported yet."""
  times = [t for t in reported_step_times if t > 0]
  return statistics.median(times) if times else 0.0


def grace_window_s(policy: QuorumPolicy, step_time_s: float, t_quorum_s: float, t_sync_s: float) -> float:
  """Seconds to keep a round open after its quorum was reached: the paper's Eq. 3 with one step time."""
  slack = policy.tau * step_time_s - t_quorum_s - t_sync_s
  return min(max(policy.gamma * slack, policy.min_grace_s), policy.max_grace_s)


def adoption_budget_s(tau: int, offsets_s: Sequence[float], step_times_s: Sequence[float]) -> float:
  """Seconds from a round's opening until its first contributor adopts the result: `min_c (a_c + tau *
  step_c)` over contributors arrived `offsets_s` after the opening with step times `step_times_s`."""
  if not offsets_s or len(offsets_s) != len(step_times_s):
    raise ValueError(f"need one step time per contributor, got {len(offsets_s)} and {len(step_times_s)}")
  return min(a + tau * t for a, t in zip(offsets_s, step_times_s))


def round_grace_s(policy: QuorumPolicy, offsets_s: Sequence[float], step_times_s: Sequence[float],
                  t_quorum_s: float, t_sync_s: float) -> float:
  """The grace window of a round whose quorum was reached `t_quorum_s` after its opening, per learner:
  Eq. 3 with tau * step_time replaced by `adoption_budget_s` of the contributors in at the quorum. With
  contributors of different speeds, each contributor c (arrived a_c after the opening, robust step time
  step_c) needs the result at a_c + tau * step_c, so the budget is the earliest of these (for the opener,
  a_c = 0: the one-step-time formula)."""
  slack = adoption_budget_s(policy.tau, offsets_s, step_times_s) - t_quorum_s - t_sync_s
  return min(max(policy.gamma * slack, policy.min_grace_s), policy.max_grace_s)


def effective_quorum(policy: QuorumPolicy, live_learners: int) -> int:
  """K, but never more than the learners alive: with fewer live learners than K the round would never
  close, and the global model would stop for everyone (the opposite of fault isolation)."""
  return max(1, min(policy.min_quorum, live_learners))


def round_close_time(
    policy: QuorumPolicy,
    arrivals: Sequence[float],
    live_learners: int,
    step_time_s: float | Sequence[float],
    t_sync_s: float,
) -> float | None:
  """When a round closes, given the times its contributions arrived (seconds, any origin; the round opens
  at the first arrival), one per distinct learner. None if the quorum is not reached by these arrivals.
  `step_time_s`: the contributors' step times, one per arrival (in the same order), or one for all.

  This is the whole policy in one function; the syncer core evaluates the same rule incrementally. A round
  also closes early as soon as every live learner has contributed: there is nobody left to wait for.
  """
  if not arrivals:
    return None
  steps = [step_time_s] * len(arrivals) if isinstance(step_time_s, (int, float)) else list(step_time_s)
  if len(steps) != len(arrivals):
    raise ValueError(f"need one step time per arrival, got {len(steps)} for {len(arrivals)} arrivals")
  order = sorted(range(len(arrivals)), key=lambda i: arrivals[i])
  ordered = [arrivals[i] for i in order]
  k = effective_quorum(policy, live_learners)
  if len(ordered) < k:
    return None
  opened, quorum_at = ordered[0], ordered[k - 1]
  grace = round_grace_s(policy, [a - opened for a in ordered[:k]], [steps[i] for i in order[:k]],
                        quorum_at - opened, t_sync_s)
  deadline = quorum_at + grace
  if len(ordered) >= live_learners:
    # Everyone alive is in: no need to wait out the grace window.
    return min(deadline, ordered[live_learners - 1])
  return deadline


PHASE_STALE_PERIODS = 1.5  # another learner's latest push older than this many periods is not counted


def phase_offset_s(now: float, previous_s: float | None, others_s: Sequence[float]) -> float:
  """Seconds a push arriving at `now` lies after the middle of the other learners' latest pushes of its
  fragment (their arrival times `others_s`), on the circle of one sync period: the time since this learner's
  own previous push of it (`previous_s`). The middle is the circular mean of the others' arrivals (each an
  angle, 2 pi per period); one older than `PHASE_STALE_PERIODS` periods (a stopped learner) is left out.
  In (-period / 2, period / 2]: > 0 the push came late, < 0 early. 0 without a period or others."""
  if previous_s is None or not now > previous_s:
    return 0.0
  period = now - previous_s
  angles = [2 * math.pi * (now - t) / period for t in others_s if 0 <= now - t <= PHASE_STALE_PERIODS * period]
  if not angles:
    return 0.0
  mean = math.atan2(statistics.fmean(math.sin(a) for a in angles), statistics.fmean(math.cos(a) for a in angles))
  return mean * period / (2 * math.pi)

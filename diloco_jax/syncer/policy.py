"""When a syncer round may close: the minimum quorum and the adaptive grace window.

Pure functions of numbers, shared by the live syncer core (`syncer/core.py`) and the scale simulator
(`sim/`), so that what the simulator predicts is what the syncer does.

The grace rule (the paper's "Eq. 3", made explicit). A learner that pushed fragment p at its snapshot
adopts the merged result tau inner steps later. Counting from the moment the round opened (its first
contribution), the merged fragment must be out before the first contributor needs it:

    budget   = tau * step_time                  # time until the earliest contributor adopts
    slack    = budget - t_quorum - t_sync       # t_quorum: open -> K-th contribution; t_sync: merge + send
    grace    = clip(gamma * slack, min_grace_s, max_grace_s)

gamma < 1 keeps a safety margin. With min_grace_s = max_grace_s = 0 the syncer closes at quorum (K=1 and no
grace is the "no grace window" ablation of the paper). A round also closes early as soon as every live
learner has contributed: there is nobody left to wait for.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class QuorumPolicy:
  """How a round closes. See the module docstring for the rule."""

  min_quorum: int = 1  # K: contributions needed before a round may close
  tau: int = 2  # overlap steps between a learner's snapshot and its adoption of the merged fragment
  gamma: float = 0.5  # fraction of the slack spent waiting for stragglers (< 1)
  min_grace_s: float = 0.0
  max_grace_s: float = 30.0

  def __post_init__(self):
    if self.min_quorum < 1:
      raise ValueError(f"outer.min_quorum must be >= 1, got {self.min_quorum}")
    if self.tau < 0:
      raise ValueError(f"outer.tau must be >= 0, got {self.tau}")
    if not 0.0 <= self.gamma < 1.0:
      raise ValueError(f"outer.grace_gamma must be in [0, 1), got {self.gamma}")
    if not 0.0 <= self.min_grace_s <= self.max_grace_s:
      raise ValueError(
          f"outer.min_grace_s ({self.min_grace_s}) must be in [0, outer.max_grace_s ({self.max_grace_s})]"
      )


def estimate_step_time(reported_step_times: Sequence[float]) -> float:
  """The step time the grace window plans for: the median of the live learners' reports (robust to one
  very slow or very fast learner). 0 when nobody has reported yet."""
  times = [t for t in reported_step_times if t > 0]
  return statistics.median(times) if times else 0.0


def grace_window_s(policy: QuorumPolicy, step_time_s: float, t_quorum_s: float, t_sync_s: float) -> float:
  """Seconds to keep a round open after its quorum was reached."""
  slack = policy.tau * step_time_s - t_quorum_s - t_sync_s
  return min(max(policy.gamma * slack, policy.min_grace_s), policy.max_grace_s)


def effective_quorum(policy: QuorumPolicy, live_learners: int) -> int:
  """K, but never more than the learners alive: with fewer live learners than K the round would never
  close, and the global model would stop for everyone (the opposite of fault isolation)."""
  return max(1, min(policy.min_quorum, live_learners))


def round_close_time(
    policy: QuorumPolicy,
    arrivals: Sequence[float],
    live_learners: int,
    step_time_s: float,
    t_sync_s: float,
) -> float | None:
  """When a round closes, given the times its contributions arrived (seconds, any origin; the round opens
  at the first arrival). None if the quorum is not reached by these arrivals.

  This is the whole policy in one function; the syncer core evaluates the same rule incrementally.
  """
  if not arrivals:
    return None
  ordered = sorted(arrivals)
  k = effective_quorum(policy, live_learners)
  if len(ordered) < k:
    return None
  opened, quorum_at = ordered[0], ordered[k - 1]
  deadline = quorum_at + grace_window_s(policy, step_time_s, quorum_at - opened, t_sync_s)
  if len(ordered) >= live_learners:
    # Everyone alive is in: no need to wait out the grace window.
    return min(deadline, ordered[live_learners - 1])
  return deadline

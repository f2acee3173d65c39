"""Phase alignment: a learner moves its syncs of a fragment toward the other learners' syncs of it.

Learners of equal speed drift apart in wall time (one is a few steps ahead of another, at random), and
under K = 1 a round then holds one push: the grace window (a step or so) cannot gather pushes that come a
period apart, so every round merges a quarter of the work, late. Each push's receipt says how many seconds
it came after the middle of the other learners' latest pushes of the fragment (`phase_s`, the syncer's
`rules/quorum.phase_offset_s`); the learner converts it into its own steps and, once the sync's result is
adopted, moves the fragment's next sync earlier (late) or later (early) by `outer.phase_gain` of it, at
most a quarter of H either way and never onto a step already passed. Nobody waits: a sync only moves, and a
learner that is faster stays faster (its syncs spread by up to 1.25 H). Periodic schedule only.
docs/algorithm.md, "Learner", 2.
"""

from __future__ import annotations

import math

from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.outer import schedule as schedule_lib


class PhaseShift:
  """Per fragment, how many steps its syncs are moved from the plan's (`shift[p]`: > 0 later)."""

  def __init__(self, plan: fragments_lib.FragmentPlan, gain: float):
    self.plan = plan
    self.gain = float(gain)
    self.enabled = self.gain > 0 and not plan.sync_steps  # the front-loaded schedule keeps its own steps
    self.limit = plan.sync_every // 4
    self.shift = [0] * plan.num_fragments
    self.moved_steps = 0  # |moves| summed: how much aligning this learner did

  def due(self, step: int) -> list[int]:
    """The fragments due at `step`: the plan's, each moved by its shift."""
    if not any(self.shift):
      return schedule_lib.due_fragments(self.plan, step)
    return [p for p in range(self.plan.num_fragments)
            if p in schedule_lib.due_fragments(self.plan, step - self.shift[p])]

  def advise(self, p: int, snapshot_step: int, step: int, phase_steps: float) -> int:
    """After adopting, at `step`, the result of fragment p's sync made at `snapshot_step`, whose push came
    `phase_steps` of this learner's steps after the others' (> 0 late): move p's next sync by -gain x that,
    rounded, within a quarter of H, and after `step`. Returns the move (steps, > 0 later)."""
    if not self.enabled or not math.isfinite(phase_steps):
      return 0
    next_due = snapshot_step + self.plan.sync_every
    if step >= next_due:  # adopted as the next sync fell due: that one goes as planned
      return 0
    move = max(-self.limit, min(self.limit, -round(self.gain * phase_steps)))
    move = max(move, step + 1 - next_due)
    self.shift[p] += move
    self.moved_steps += abs(move)
    return move

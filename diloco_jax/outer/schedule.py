"""When each fragment is due: the sync schedule, and how many fragments a learner keeps in flight.

A learner syncs fragment p every H = `sync_every` inner steps, at the steps s with `s % H == offsets[p]`;
offsets are spread evenly over H (`round(p * H / P)`, `fragments.make_plan`) so the network carries one
fragment at a time instead of the whole model at once (Streaming DiLoCo).

Schedules (`outer.sync_schedule`). `periodic`: the rule above. `front_loaded`: each fragment syncs as
many times over `train.steps` = T as under `periodic` (so the bytes on the wire are the same), but dense
early and sparse late: the periodic sync steps x are warped to T (x / T) ** `outer.schedule_power`
(power 2: the gaps grow linearly, from a few steps to about 2H), rounded, kept at least max(1, tau)
apart (a fragment is never due again before its last sync was adopted), and their gaps sorted
ascending, so gaps never shrink (`front_loaded_steps`). The plan then carries every fragment's sync steps.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # fragments imports this module: the plan's type is only named here
  from diloco_jax.outer import fragments

SCHEDULES = ("periodic", "front_loaded")


def gaps(steps: Sequence[int]) -> tuple[int, ...]:
  """The steps each sync covers: from step 0 to the first, then between consecutive ones."""
  return tuple(b - a for a, b in zip((0,) + tuple(steps), steps))


def periodic_steps(total_steps: int, sync_every: int, offset: int) -> tuple[int, ...]:
  """The steps in [1, total_steps] a fragment with this offset is due at under the periodic schedule."""
  return tuple(range(offset or sync_every, total_steps + 1, sync_every))


def front_loaded_steps(total_steps: int, sync_every: int, offset: int, power: float,
                       min_gap: int = 1) -> tuple[int, ...]:
  """A fragment's sync steps under the front-loaded schedule (module docstring): as many as
  `periodic_steps`, at round(T (x / T) ** power) for each periodic step x, at least `min_gap` apart, the
  gaps sorted ascending. Raises ValueError naming outer.schedule_power if they do not fit in T steps."""
  warped, last = [], 0
  for x in periodic_steps(total_steps, sync_every, offset):
    last = max(int(round(total_steps * (x / total_steps) ** power)), last + min_gap)
    warped.append(last)
  if warped and warped[-1] > total_steps:
    raise ValueError(f"outer.schedule_power ({power}) puts {len(warped)} syncs at least {min_gap} steps apart "
                     f"past train.steps ({total_steps})")
  return tuple(int(s) for s in np.cumsum(sorted(gaps(warped))))


def schedule_steps(schedule: str, total_steps: int, sync_every: int, offsets: Sequence[int], power: float = 2.0,
                   min_gap: int = 1) -> tuple[tuple[int, ...], ...]:
  """Every fragment's sync steps for a non-periodic `schedule`; () for `periodic` (`due_fragments` then
  needs no table: the schedule repeats every H steps, however long the run)."""
  if schedule not in SCHEDULES:
    raise ValueError(f"outer.sync_schedule must be one of {SCHEDULES}, got {schedule!r}")
  if schedule == "periodic":
    return ()
  return tuple(front_loaded_steps(total_steps, sync_every, o, power, min_gap) for o in offsets)



def min_spacing(schedule: str, sync_every: int, tau: int) -> int:
  """The fewest inner steps between two syncs of one fragment under `schedule`: H when periodic,
  max(1, tau) when front-loaded (its first syncs; `front_loaded_steps`' min_gap)."""
  return sync_every if schedule == "periodic" else max(1, tau)


def in_flight_limit(max_in_flight: int, num_fragments: int, sync_every: int, tau: int) -> int:
  """The fragments a learner may have pushed and not yet adopted: `max_in_flight`, or with 0 what the
  schedule keeps in flight, ceil(tau x P / H) + 1: a snapshot every H / P steps, each adopted tau steps
  later, plus one whose sync is still on its way (2 for P = 2, H = 20, tau = 2; tau + 1 for P = H). A
  smaller limit makes the learner wait at every snapshot. For a non-periodic schedule pass its
  `min_spacing` as `sync_every` (front-loaded, tau = 2: P + 1)."""
  if max_in_flight > 0:
    return max_in_flight
  return -(-tau * num_fragments // sync_every) + 1


def due_fragments(plan: fragments.FragmentPlan, step: int) -> list[int]:
  """Fragments due at inner step `step` (steps counted from 1; step 0 is the initial state, never due)."""
  if step <= 0:
    return []
  if plan.sync_steps:
    return [p for p, steps in enumerate(plan.sync_steps) if _contains(steps, step)]
  phase = step % plan.sync_every
  return [p for p, o in enumerate(plan.offsets) if o == phase]


def _contains(sorted_steps: tuple[int, ...], step: int) -> bool:
  i = bisect.bisect_left(sorted_steps, step)
  return i < len(sorted_steps) and sorted_steps[i] == step

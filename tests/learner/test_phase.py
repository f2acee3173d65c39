"""Phase alignment on the learner (`learner/phase.py`): a fragment's next sync moves toward the others'."""

import math

import numpy as np

from diloco_jax.learner import phase as phase_lib
from diloco_jax.outer import fragments as fragments_lib


def plan(sync_every=12, num_fragments=2, sync_steps=()):
  params = {"w": np.zeros((4, 6), np.float32), "b": np.zeros(8, np.float32)}
  p = fragments_lib.make_plan(params, num_fragments, sync_every, "strided")
  return fragments_lib.dataclasses.replace(p, sync_steps=sync_steps) if sync_steps else p


def due_steps(shift, p, upto=60):
  return [s for s in range(1, upto) if p in shift.due(s)]


def test_a_late_push_moves_the_next_sync_earlier_within_a_quarter_period():
  shift = phase_lib.PhaseShift(plan(), gain=0.5)
  assert due_steps(shift, 0) == [12, 24, 36, 48] and due_steps(shift, 1) == [6, 18, 30, 42, 54]
  # Fragment 0's sync at step 12, adopted at 14: its push came 4 steps after the others' -> 2 steps earlier.
  assert shift.advise(0, 12, 14, 4.0) == -2
  assert due_steps(shift, 0) == [10, 22, 34, 46, 58] and due_steps(shift, 1) == [6, 18, 30, 42, 54]
  # 40 steps early: a quarter of H (3 steps) later at most.
  assert shift.advise(0, 22, 24, -40.0) == 3
  assert due_steps(shift, 0)[:3] == [13, 25, 37]
  assert shift.advise(0, 25, 27, 100.0) == -3
  assert 34 in due_steps(shift, 0) and 37 not in due_steps(shift, 0)
  # Never onto a step already passed: adopted at step 44, the sync due at 46 moves to 45 at the earliest.
  assert shift.advise(0, 34, 44, 100.0) == -1
  assert shift.advise(0, 45, 56, 100.0) == 0
  assert due_steps(shift, 0, 70)[-3:] == [45, 57, 69]
  assert shift.moved_steps == 9


def test_no_move_without_a_phase_when_off_or_when_already_due():
  shift = phase_lib.PhaseShift(plan(), gain=0.5)
  assert shift.advise(0, 12, 24, 5.0) == 0  # adopted as the next sync fell due: it goes as planned
  assert shift.advise(0, 12, 14, 0.6) == 0 and shift.advise(0, 12, 14, math.nan) == 0
  off = phase_lib.PhaseShift(plan(), gain=0.0)
  assert off.advise(0, 12, 14, 8.0) == 0 and due_steps(off, 0) == [12, 24, 36, 48]
  front = phase_lib.PhaseShift(plan(sync_steps=((3, 9, 20), (5, 14, 30))), gain=0.5)
  assert front.advise(0, 3, 5, 8.0) == 0 and due_steps(front, 0) == [3, 9, 20]

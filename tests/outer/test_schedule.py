"""Sync schedules: each fragment due once per period, front-loaded gaps, the in-flight limit."""

import numpy as np
import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax.outer import fragments, schedule

fake_params = helpers.fake_params


@pytest.mark.parametrize("num_fragments,sync_every", [(1, 5), (2, 8), (3, 10), (4, 4), (4, 13)])
def test_due_each_fragment_once_per_period(num_fragments, sync_every):
  plan = fragments.make_plan(fake_params(), num_fragments, sync_every)
  assert plan.offsets == tuple(round(p * sync_every / num_fragments) for p in range(num_fragments))
  assert len(set(plan.offsets)) == num_fragments and all(0 <= o < sync_every for o in plan.offsets)
  assert schedule.due_fragments(plan, 0) == []
  for start in (1, 1 + sync_every, 7 * sync_every + 3):
    seen = []
    for step in range(start, start + sync_every):
      due = schedule.due_fragments(plan, step)
      seen += due
      for p in due:
        assert step % sync_every == plan.offsets[p]
    assert sorted(seen) == list(range(num_fragments))


def test_in_flight_limit_follows_the_schedule():
  assert schedule.in_flight_limit(0, 2, 20, 2) == 2  # the default schedule: what max_in_flight was
  assert schedule.in_flight_limit(0, 24, 24, 2) == 3  # P = H: a snapshot every step, adopted tau later
  assert schedule.in_flight_limit(0, 4, 4, 0) == 1  # synchronous
  assert schedule.in_flight_limit(5, 24, 24, 2) == 5  # a set value is kept


@pytest.mark.parametrize("steps,sync_every,num_fragments,power,tau", [
    (160, 20, 2, 2.0, 2), (480, 20, 2, 2.0, 2), (480, 20, 2, 3.0, 2), (200, 10, 2, 3.0, 0),
    (100_000, 100, 4, 2.0, 2), (61, 7, 3, 1.5, 1), (40, 20, 2, 2.0, 2), (200, 20, 20, 2.0, 2)])
def test_front_loaded_keeps_the_periodic_sync_count_with_growing_gaps(steps, sync_every, num_fragments, power,
                                                                      tau):
  offsets = fragments.make_plan(fake_params(), num_fragments, sync_every).offsets
  min_gap = schedule.min_spacing("front_loaded", sync_every, tau)
  table = schedule.schedule_steps("front_loaded", steps, sync_every, offsets, power, min_gap)
  assert table == schedule.schedule_steps("front_loaded", steps, sync_every, offsets, power, min_gap)  # pure
  for p, o in enumerate(offsets):
    periodic = schedule.periodic_steps(steps, sync_every, o)
    assert periodic == tuple(s for s in range(1, steps + 1) if s % sync_every == o)  # due_fragments' rule
    due = table[p]
    assert len(due) == len(periodic) >= 1  # the same syncs, so the same bytes; every fragment synced
    assert 1 <= due[0] and due[-1] <= steps and list(due) == sorted(set(due))
    gaps = np.diff((0,) + due)
    assert (np.diff(gaps) >= 0).all() and gaps.min() >= max(1, tau)  # never shrinking, never due in flight
    if len(due) >= 4:  # dense early, sparse late
      assert gaps[0] < sync_every < gaps[-1]
  if steps % sync_every == 0:
    assert table[0][-1] == steps  # fragment 0's last sync still lands on the last step


def test_front_loaded_power_one_is_periodic_and_too_much_front_loading_is_refused():
  for o in (0, 3, 7):
    assert schedule.front_loaded_steps(100, 10, o, 1.0) == schedule.periodic_steps(100, 10, o)
  assert schedule.schedule_steps("periodic", 100, 10, (0, 5)) == ()
  with pytest.raises(ValueError, match="outer.schedule_power"):
    schedule.front_loaded_steps(20, 2, 0, 4.0, min_gap=3)  # 10 syncs at least 3 apart need 30 steps
  with pytest.raises(ValueError, match="outer.sync_schedule"):
    schedule.schedule_steps("cosine", 100, 10, (0,))


def test_due_fragments_follow_the_configured_schedule():
  c = config_lib.base_config()
  c.train.steps, c.outer.sync_every, c.outer.num_fragments, c.outer.tau = 160, 20, 2, 2
  periodic = fragments.plan_for_config(fake_params(), c)
  assert periodic.sync_steps == () and periodic.longest_gap == 20
  c.outer.sync_schedule = "front_loaded"
  plan = fragments.plan_for_config(fake_params(), c)
  assert plan.paths == periodic.paths and plan.offsets == periodic.offsets
  seen = [[], []]
  for step in range(0, 200):
    for p in schedule.due_fragments(plan, step):
      seen[p].append(step)
  assert tuple(map(tuple, seen)) == plan.sync_steps
  assert [len(s) for s in seen] == [8, 8]  # as periodic: 160 / 20 syncs each
  assert seen[0][:3] == [2, 10, 22] and seen[0][-1] == 160
  assert plan.longest_gap == max(np.diff([0] + seen[0]).max(), np.diff([0] + seen[1]).max()) == 38
  # A fragment is never due again before its sync, adopted tau steps later, came back: P + 1 in flight.
  assert schedule.in_flight_limit(0, 2, schedule.min_spacing("front_loaded", 20, 2), 2) == 3
  assert schedule.min_spacing("periodic", 20, 2) == 20

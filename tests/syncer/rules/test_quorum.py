"""The quorum and grace rule (`syncer/rules/quorum.py`): the paper's Eq. 3 per learner, and the core closing
rounds exactly when the rule (shared with the simulator) says."""

import dataclasses
import functools
import math

import numpy as np
import pytest

import helpers
from diloco_jax.syncer.rules import quorum as policy
from diloco_jax.syncer.rules.quorum import round_close_time

make_core = helpers.joined_core
make_push = functools.partial(helpers.make_push, block=4)
FP = helpers.FP


@pytest.mark.parametrize("seed", range(12))
def test_core_closes_rounds_when_the_shared_policy_says(seed):
  """The simulator predicts round closes with `policy.round_close_time`; the core, driven by the same
  arrivals on a fake clock, must close at exactly those instants (or not at all when it says None)."""
  rng = np.random.default_rng(seed)
  live = int(rng.integers(1, 6))
  k = int(rng.integers(1, live + 1))
  step_time = float(rng.uniform(0.5, 3.0))
  policy = dict(tau=int(rng.integers(0, 4)), gamma=float(rng.uniform(0.0, 0.9)),
                max_grace_s=float(rng.uniform(0.0, 5.0)))
  arriving = sorted(rng.choice(live, size=int(rng.integers(1, live + 1)), replace=False).tolist(),
                    key=lambda _: rng.random())
  arrivals = np.cumsum(rng.exponential(1.0, len(arriving))).tolist()
  # The quorum rule alone: `round_close_time` knows no stalls, so no learner stops counting here.
  c, clock = make_core(num_learners=live, k=k, step_time=step_time, stall_s=math.inf, **policy)
  expected = round_close_time(helpers.quorum_policy(min_quorum=k, **policy), arrivals, live, step_time, t_sync_s=0.0)

  closed_at = None
  events = list(zip(arrivals, arriving))
  while closed_at is None:
    deadline = c.next_deadline()
    if deadline is not None and deadline >= clock.t + 50:
      deadline = None  # only the leases (100 s, renewed below): the quorum was never reached
    upcoming = [t for t, _ in events[:1]] + ([deadline] if deadline is not None else [])
    if not upcoming:
      break
    now = min(upcoming)
    clock.t = now
    for i in range(live):  # leases stay alive (lease 100 s, but keep it explicit)
      c.heartbeat(i, step_time)
    if events and events[0][0] == now:
      _, learner = events.pop(0)
      c.push(make_push(learner, np.ones(8)))
    c.tick()
    if c.status()["versions"] == [1]:
      closed_at = now
  if expected is None:
    assert closed_at is None
  else:
    assert closed_at == pytest.approx(expected, abs=1e-9), (closed_at, expected, arrivals, k, live, policy)


def test_grace_formula_single_step_time_is_eq3():
  p = helpers.quorum_policy(min_quorum=1, tau=5, gamma=0.5, max_grace_s=30.0)
  # gamma (tau * step - t_quorum - t_sync) = 0.5 (5 * 2 - 1 - 0.5)
  assert policy.grace_window_s(p, 2.0, 1.0, 0.5) == pytest.approx(4.25)
  # One contributor (the opener, offset 0): the per-learner form is the same number.
  assert policy.round_grace_s(p, [0.0], [2.0], 0.0, 0.5) == pytest.approx(0.5 * (10 - 0.5))
  # No slack left: the lower bound; a huge budget: the upper bound.
  assert policy.grace_window_s(p, 0.1, 5.0, 1.0) == 0.0
  assert policy.grace_window_s(dataclasses.replace(p, min_grace_s=0.2), 0.1, 5.0, 1.0) == 0.2
  assert policy.grace_window_s(p, 100.0, 0.0, 0.0) == 30.0
  # tau = 0 (synchronous adoption): nothing to spend.
  assert policy.round_grace_s(dataclasses.replace(p, tau=0), [0.0, 0.3], [2.0, 1.0], 0.3, 0.0) == 0.0


def test_grace_budget_is_the_first_contributor_to_need_the_result():
  p = helpers.quorum_policy(min_quorum=2, tau=4, gamma=0.5, max_grace_s=30.0)
  # The opener is slow (2 s/step, needs the result at 8 s); a fast learner (1 s/step) arrived 1 s later
  # and needs it at 1 + 4 = 5 s: the budget is 5 s, not the opener's 8 s.
  assert policy.adoption_budget_s(4, [0.0, 1.0], [2.0, 1.0]) == 5.0
  assert policy.round_grace_s(p, [0.0, 1.0], [2.0, 1.0], 1.0, 0.5) == pytest.approx(0.5 * (5.0 - 1.0 - 0.5))
  # The other way round the opener binds: 0 + 4 * 1 = 4 < 1 + 4 * 2.
  assert policy.adoption_budget_s(4, [0.0, 1.0], [1.0, 2.0]) == 4.0
  # round_close_time takes the step times per arrival, in any order of arrival.
  close = policy.round_close_time(p, [1.0, 0.0, 9.0], live_learners=4, step_time_s=[1.0, 2.0, 1.0],
                                  t_sync_s=0.5)
  assert close == pytest.approx(1.0 + 0.5 * (5.0 - 1.0 - 0.5))
  with pytest.raises(ValueError, match="step time"):
    policy.round_close_time(p, [0.0, 1.0], 4, [1.0], 0.0)


def test_core_uses_each_contributors_own_step_time():
  clock = helpers.FakeClock()
  c = helpers.make_core((8,), k=2, clock=clock, tau=4, gamma=0.5, max_grace_s=30.0, lease_s=100.0)
  for i, step in ((0, 2.0), (1, 1.0), (2, 1.0)):
    c.join(i, FP)
    c.heartbeat(i, step)
  clock.t = 10.0
  c.push(helpers.make_push(0, np.ones(8)))  # the slow opener
  clock.t = 11.0
  c.push(helpers.make_push(1, np.ones(8)))  # quorum: the fast learner binds
  assert c.next_deadline() == pytest.approx(11.0 + 0.5 * (5.0 - 1.0 - 0.0))
  # A learner that never reported a step time plans with the median of the live learners' reports.
  c2 = helpers.make_core((8,), k=1, clock=clock, tau=4, gamma=0.5, max_grace_s=30.0, lease_s=100.0)
  for i, step in ((0, 0.0), (1, 3.0), (2, 1.0), (3, 2.0)):
    c2.join(i, FP)
    c2.heartbeat(i, step)
  c2.push(helpers.make_push(0, np.ones(8)))
  assert c2.next_deadline() == pytest.approx(11.0 + 0.5 * 4 * 2.0)


def test_phase_offset_is_how_late_a_push_came_after_the_others_on_the_period_circle():
  # This learner pushed at 0 and now at 10: a period of 10 s.
  assert policy.phase_offset_s(10.0, 0.0, [9.0, 9.0]) == pytest.approx(1.0)  # the others 1 s before: late
  assert policy.phase_offset_s(10.0, 0.0, [1.0]) == pytest.approx(-1.0)  # 9 s before = 1 s after: early
  assert policy.phase_offset_s(10.0, 0.0, [8.0, 1.0]) == pytest.approx(0.5)  # the circular middle, 9.5 s
  # Another learner's push older than 1.5 periods (stopped) is left out; no period or nobody: 0.
  assert policy.phase_offset_s(10.0, 0.0, [9.0, -6.0]) == pytest.approx(1.0)
  assert policy.phase_offset_s(10.0, 0.0, [-6.0]) == 0.0
  assert policy.phase_offset_s(10.0, None, [9.0]) == 0.0
  assert policy.phase_offset_s(10.0, 10.0, [9.0]) == 0.0
  assert policy.phase_offset_s(10.0, 0.0, []) == 0.0


def test_receipts_say_how_late_each_push_came_after_the_others():
  """The core's receipts carry `phase_offset_s` of each push against the other learners' latest pushes of
  the same fragment (K = 1, no grace: every push its own round)."""
  c, clock = make_core(num_learners=2, k=1, max_grace_s=0.0)
  phases = []
  for t, learner in ((0.0, 0), (1.0, 1), (10.0, 0), (11.0, 1), (19.5, 0)):
    clock.t = t
    receipt = c.push(make_push(learner, np.zeros(8, np.float32), core=c, base_version=c.status()["versions"][0]))
    phases.append(receipt.phase_s)
  # No period yet for either learner's first push; then learner 0 is 1 s early (learner 1 pushes 1 s after
  # it), learner 1 1 s late, and learner 0, on a 9.5 s period, 8.5 s after learner 1: 1 s early.
  assert phases == pytest.approx([0.0, 0.0, -1.0, 1.0, -1.0])

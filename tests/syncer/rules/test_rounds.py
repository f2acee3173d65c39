"""Round rules (`syncer/rules/rounds.py`) through the core on a fake clock: quorum, grace and late
contributions, merge weights and the staleness discount, partial rounds, deadlocks, the decision record."""

import functools

import numpy as np
import pytest

import helpers
from diloco_jax import metrics as metrics_lib
from diloco_jax.protocol.messages import PushReceipt
from diloco_jax.syncer.rules.quorum import grace_window_s

make_core = helpers.joined_core
global_of = helpers.global_of
make_push = functools.partial(helpers.make_push, block=4)
FP = helpers.FP


def test_quorum_grace_straggler_late_and_everyone_in():
  # K=2 of 4 live learners; lr 1, momentum 0: new global = old global - merged delta (the plain weighted
  # mean of a round's contributors: not scaled to their share of the four learners' work).
  c, clock = make_core(num_learners=4, k=2, gamma=0.5, max_grace_s=30.0, scale_partial_rounds=False)
  deltas = {i: np.full(8, float(i + 1), np.float32) for i in range(4)}
  g0 = global_of(c)
  clock.t = 1.0
  r = c.push(make_push(0, deltas[0], tokens=100))
  assert r == PushReceipt(fragment=0, round=0, late=False, epoch=c.epoch, version=1)
  for t in (1.0, 1.2):  # one contribution: never commits, whatever the time (within the lease)
    clock.t = t
    assert c.tick() == []
  assert c.status()["versions"] == [0]
  clock.t = 1.5
  c.push(make_push(1, deltas[1], tokens=300))  # quorum: the grace window opens
  deadline = 1.5 + grace_window_s(c.settings.policy, 10.0, 0.5, 0.0)
  assert deadline == pytest.approx(1.5 + 0.5 * (2 * 10.0 - 0.5))
  assert c.next_deadline() == pytest.approx(deadline)
  assert c.status()["versions"] == [0]
  clock.t = 5.0
  c.push(make_push(2, deltas[2], tokens=600))  # a straggler inside the window
  clock.t = deadline - 1e-6
  assert c.tick() == []
  clock.t = deadline
  assert c.tick() == [0]
  w = np.array([100, 300, 600]) / 1000
  expected = g0 - (w[0] * deltas[0] + w[1] * deltas[1] + w[2] * deltas[2])
  np.testing.assert_allclose(global_of(c), expected, rtol=1e-6)
  assert c.status()["versions"] == [1]
  assert c.counters["contributions_merged"] == 3 and c.counters["tokens_merged"] == 1000

  # Learner 3 pushes after round 0's deadline: it goes into round 1, as a late contribution.
  c2, clock2 = make_core(num_learners=4, k=2, gamma=0.5, max_grace_s=30.0, scale_partial_rounds=False)
  clock2.t = 1.0
  c2.push(make_push(0, deltas[0], tokens=100))
  clock2.t = 1.5
  c2.push(make_push(1, deltas[1], tokens=300))
  clock2.t = 1.5 + 0.5 * (2 * 10.0 - 0.5) + 0.1  # past the deadline, and nobody ticked
  r = c2.push(make_push(3, deltas[3], tokens=200, base_version=0))
  assert r.round == 1 and r.late and r.version == 2  # merged by round 1, which publishes version 2
  assert c2.status()["versions"] == [1]
  w01 = np.array([100, 300]) / 400
  np.testing.assert_allclose(global_of(c2), g0 - (w01[0] * deltas[0] + w01[1] * deltas[1]), rtol=1e-6)
  # Everyone live contributes to round 1: it closes at once, no grace wait; learner 3's delta is in.
  g1 = global_of(c2)
  c2.push(make_push(0, deltas[0], tokens=100, base_version=1))
  c2.push(make_push(1, deltas[1], tokens=100, base_version=1))
  assert c2.status()["versions"] == [1]  # quorum reached, 2 live learners not in yet
  r = c2.push(make_push(2, deltas[2], tokens=100, base_version=1))
  assert r.round == 1 and not r.late
  assert c2.status()["versions"] == [2]
  w = np.array([200, 100, 100, 100]) / 500  # staleness_beta 0: no discount
  expected = g1 - (w[0] * deltas[3] + w[1] * deltas[0] + w[2] * deltas[1] + w[3] * deltas[2])
  np.testing.assert_allclose(global_of(c2), expected, rtol=1e-6)
  assert c2.counters["contributions_late"] == 1 and c2.counters["contributions_merged"] == 6


def test_staleness_discount_applied():
  # Deltas far above the fragment's norm: the outlier bound (test_merge_safety's subject) off.
  c, clock = make_core(num_learners=2, k=2, max_grace_s=0.0, staleness_beta=1.0, max_norm_ratio=0.0)
  d = np.ones(8, np.float32)
  c.push(make_push(0, d))
  c.push(make_push(1, d))
  assert c.status()["versions"] == [1]
  g1 = global_of(c)
  a, b = np.full(8, 2.0, np.float32), np.full(8, 8.0, np.float32)
  c.push(make_push(0, a, base_version=0, tokens=100))  # staleness 1 -> its share 1/2, halved
  c.push(make_push(1, b, base_version=1, tokens=100))
  w = np.array([0.5 / 2, 0.5])  # the discount is not renormalized away
  np.testing.assert_allclose(global_of(c), g1 - (w[0] * a + w[1] * b), rtol=1e-6)


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 4.0])
def test_lone_stale_push_keeps_its_discount(beta, partial):
  """K = 1, lr 1, momentum 0: a lone push with staleness 1 moves the global (1 + 1)^-beta as far as the
  same push when fresh (the discount used to be renormalized away within its one-push round)."""
  moved = {}
  for staleness in (0, 1):
    c, clock = make_core(num_learners=1, k=1, max_grace_s=0.0, staleness_beta=beta, scale_partial_rounds=partial)
    c.push(make_push(0, np.zeros(8)))  # version 1
    g = global_of(c)
    c.push(make_push(0, np.ones(8), base_version=1 - staleness))
    moved[staleness] = g - global_of(c)
  np.testing.assert_allclose(moved[0], np.ones(8), rtol=1e-6)
  np.testing.assert_allclose(moved[1], moved[0] * 2.0**-beta, rtol=1e-6)


def test_partial_rounds_move_the_model_by_their_share_of_the_work():
  """With scale_partial_rounds, a round moves the model by the share of one period of every live
  learner's work it holds: k/n for equal learners, by tokens for learners of different batch sizes; a
  learner's two pushes in one round weigh together what its largest one weighs (one period)."""
  c, clock = make_core(num_learners=4, k=1, max_grace_s=0.0, scale_partial_rounds=True)
  d = np.ones(8, np.float32)
  g = global_of(c)
  for i in range(4):  # four one-learner rounds of equal learners: each a quarter
    c.push(make_push(i, d, base_version=i))
  assert c.status()["versions"] == [4]
  np.testing.assert_allclose(g - global_of(c), 4 * 0.25 * d, rtol=1e-6)  # what one full round moves
  g = global_of(c)
  c.push(make_push(2, d, base_version=4))  # one of four equal learners: a quarter of a full round
  np.testing.assert_allclose(g - global_of(c), 0.25 * d, rtol=1e-6)
  # A learner with a 3x batch (300 tokens per period) among three of 100: its period is half the work.
  c2, _ = make_core(num_learners=4, k=1, max_grace_s=0.0, scale_partial_rounds=True)
  for i, tokens in enumerate((300, 100, 100, 100)):
    c2.push(make_push(i, d, tokens=tokens))
  g = global_of(c2)
  c2.push(make_push(0, d, tokens=300, base_version=4))
  np.testing.assert_allclose(g - global_of(c2), 0.5 * d, rtol=1e-6)
  g = global_of(c2)
  c2.push(make_push(1, d, tokens=100, base_version=4))
  np.testing.assert_allclose(g - global_of(c2), d / 6, rtol=1e-6)
  # Two pushes of one learner in one round (K = 2 of 2, learner 0 pushes twice before learner 1): one
  # period between them (each half its weight), not two (issue 21: copies of one period took the merge).
  c3, clock3 = make_core(num_learners=2, k=2, max_grace_s=0.0, scale_partial_rounds=True)
  c3.push(make_push(0, d, tokens=100))
  c3.push(make_push(0, 3 * d, tokens=100))
  g = global_of(c3)
  c3.push(make_push(1, 5 * d, tokens=100))
  assert c3.status()["versions"] == [1]
  np.testing.assert_allclose(g - global_of(c3), 0.5 * 0.5 * (d + 3 * d) + 0.5 * 5 * d, rtol=1e-6)


def test_k1_no_grace_commits_at_first_push_and_multiple_fragments_independent():
  c, clock = make_core(num_learners=3, sizes=(8, 5), k=1, max_grace_s=0.0)
  c.push(make_push(2, np.ones(5), fragment=1))
  assert c.status()["versions"] == [0, 1]
  assert c.next_deadline() is None


def test_rounds_that_wait_on_each_other_close_after_the_stall_time():
  """K = all, tau = 0, two fragments, learners out of phase: learner 0 waits on fragment 0's round, which
  waits on learner 1, who waits on fragment 1's round, which waits on learner 0. No push can ever come;
  after `stall_s` the older round closes with what it holds, and the rest goes on as usual. A round that
  waits on a learner still stepping is never closed that way."""
  c, clock = make_core(num_learners=2, sizes=(8, 8), k=2, stall_s=2.0, max_grace_s=0.0)
  clock.t = 1.0
  c.push(make_push(0, np.ones(8), fragment=0))
  c.heartbeat(0, 10.0, step=5, blocked=True)
  clock.t = 1.5
  c.push(make_push(1, np.ones(8), fragment=1))
  c.heartbeat(1, 10.0, step=5, blocked=True)
  assert c.tick() == []
  assert c.next_deadline() == pytest.approx(1.5 + 2.0)  # both stuck since the second push
  clock.t = 3.49
  assert c.tick() == [] and c.status()["versions"] == [0, 0]
  clock.t = 3.5
  assert c.tick() == [0]  # the older round, with learner 0's push alone
  assert c.status()["versions"] == [1, 0] and c.counters["deadlocks_broken"] == 1
  (record,) = c.drain_decisions()
  assert record["close"] == "deadlock" and record["contributors"] == [0]
  c.heartbeat(0, 10.0, step=5, blocked=False)
  c.push(make_push(0, np.ones(8), fragment=1))  # learner 0 goes on: fragment 1's round is all in
  assert c.status()["versions"] == [1, 1] and c.counters["deadlocks_broken"] == 1

  # The same round waiting on a learner that steps (not blocked) waits for it, whatever the time.
  c, clock = make_core(num_learners=2, sizes=(8, 8), k=2, stall_s=2.0, max_grace_s=0.0)
  c.push(make_push(0, np.ones(8), fragment=0))
  c.heartbeat(0, 10.0, step=5, blocked=True)
  for step, t in enumerate((1.0, 5.0, 9.0, 13.0)):
    clock.t = t
    c.heartbeat(1, 10.0, step=step, blocked=False)
    c.heartbeat(0, 10.0, step=5, blocked=True)
    assert c.tick() == []
  assert c.status()["versions"] == [0, 0] and c.counters["deadlocks_broken"] == 0


def test_decision_record_says_who_was_merged_waited_for_how_long_and_with_which_weights(tmp_path):
  clock = helpers.FakeClock()
  c = helpers.make_core((8,), k=2, clock=clock, tau=2, gamma=0.5, max_grace_s=30.0, lease_s=100.0,
                        scale_partial_rounds=True, staleness_beta=1.0)
  for i in range(4):
    c.join(i, FP)
    c.heartbeat(i, 10.0)
  log = metrics_lib.DrainLog(c.drain_decisions, tmp_path, "rounds", period_s=0.01)
  clock.t = 1.0
  c.push(helpers.make_push(0, np.ones(8), tokens=100))
  clock.t = 1.5
  c.push(helpers.make_push(1, np.ones(8), tokens=300))  # quorum at 0.5 s
  grace = 0.5 * (2 * 10.0 - 0.5 - 0.0)
  clock.t = 3.0
  c.push(helpers.make_push(2, np.ones(8), tokens=100))  # arrives inside the grace window
  clock.t = 1.5 + grace
  assert c.tick() == [0]  # learner 3 never came: closed by the deadline
  # Round 2: learner 3 alone pushes a stale push, then everyone else; it closes when all live are in.
  clock.t = 20.0
  c.push(helpers.make_push(3, np.ones(8), tokens=100, base_version=0))
  for i in range(3):
    c.push(helpers.make_push(i, np.ones(8), tokens=100, base_version=1))
  assert c.status()["versions"] == [2]
  helpers.wait_for(lambda: log.written == 2, "the drain thread to write both records", timeout=10, poll=0.01)
  log.close()
  first, second = metrics_lib.read_jsonl(tmp_path / "rounds.jsonl")
  assert (first["fragment"], first["version"], first["close"]) == (0, 1, "deadline")
  assert first["contributors"] == [0, 1, 2] and first["live"] == [0, 1, 2, 3]
  assert first["quorum_s"] == pytest.approx(0.5) and first["grace_s"] == pytest.approx(grace)
  assert first["step_times_s"] == [10.0, 10.0] and first["t_sync_s"] == 0.0
  assert first["waited_for"] == [2, 3] and first["arrived_in_grace"] == [2]
  assert first["open_s"] == pytest.approx(0.5 + grace)
  assert [x["learner"] for x in first["contributions"]] == [0, 1, 2]
  assert [x["arrived_s"] for x in first["contributions"]] == pytest.approx([0.0, 0.5, 2.0])
  # Coefficients: each push's tokens over one period of every live learner (learner 3 never pushed: it
  # counts as the mean of the others, 500 / 3), so this partial round moves by its share of the work.
  period = 100 + 300 + 100 + 500 / 3
  assert first["period_weight"] == pytest.approx(period) and first["answered_for"] == 4
  assert [x["coefficient"] for x in first["contributions"]] == pytest.approx([100 / period, 300 / period,
                                                                              100 / period])
  assert first["share"] == pytest.approx(500 / period) == first["moved"]
  assert second["close"] == "all_in" and second["contributors"] == [3, 0, 1, 2]
  stale = second["contributions"][0]
  assert (stale["learner"], stale["base_version"], stale["staleness"]) == (3, 0, 1)
  # Periods: learner 0 pushed 100, 1 pushed 100 now, 2 and 3: 100 -> 400; learner 3 discounted by 1/2.
  assert [x["coefficient"] for x in second["contributions"]] == pytest.approx([0.125, 0.25, 0.25, 0.25])
  assert second["share"] == pytest.approx(1.0) and second["moved"] == pytest.approx(0.875)
  assert second["waited_for"] == [1, 2] and second["arrived_in_grace"] == [1, 2]  # quorum: 3, then 0

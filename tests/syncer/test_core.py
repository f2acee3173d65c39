"""The syncer core, the shell around the rules (fake clock): a refused push changes nothing, pulls wait
and time out, the decision queue is bounded."""

import functools

import numpy as np
import pytest

import helpers
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import state as state_lib

FP = helpers.FP
make_push = functools.partial(helpers.make_push, block=4)


make_core = helpers.joined_core


_assert_states_equal = helpers.assert_states_equal


def _bad_pushes():
  good = np.ones(8, np.float32)
  nan, inf = good.copy(), good.copy()
  nan[3], inf[5] = np.nan, -np.inf
  p = make_push(0, good)
  return [
      ("unknown_learner", make_push(5, good)),  # a learner of the run that never joined
      ("learner_id", make_push(99, good)),  # not a learner of the run at all
      ("learner_id", make_push(-1, good)),
      ("learner_id", make_push(2**31 - 1, good)),
      ("fingerprint", make_push(0, good, fingerprint="other-run")),
      ("unknown_fragment", make_push(0, good, fragment=7)),
      ("unknown_fragment", make_push(0, good, fragment=-1)),
      ("codec", make_push(0, good, codec="bf16")),
      ("shape", make_push(0, np.ones(9, np.float32))),
      ("checksum", make_push(0, good, checksum=p.checksum ^ 1)),
      ("nonfinite", make_push(0, nan)),
      ("nonfinite", make_push(0, inf)),
      ("future_version", make_push(0, good, base_version=5)),
      ("metadata", make_push(0, good, tokens=-1)),
  ]


@pytest.mark.parametrize("reason,bad", _bad_pushes(), ids=[r for r, _ in _bad_pushes()])
def test_malformed_pushes_rejected_without_touching_state(reason, bad):
  c, clock = make_core(num_learners=3, k=2, sizes=(8, 4))
  c.push(make_push(1, np.full(8, 0.5, np.float32)))  # an open round that must stay as it is
  before, status_before = c.state_dict(), c.status()
  with pytest.raises(Rejected) as e:
    c.push(bad)
  assert e.value.reason == reason
  after, status_after = c.state_dict(), c.status()
  assert after["counters"]["rejected"][reason] == before["counters"]["rejected"][reason] + 1
  assert after["counters"]["contributions_rejected"] == before["counters"]["contributions_rejected"] + 1
  for s in (before, after, status_before, status_after):
    del s["counters"]
  _assert_states_equal(before, after)
  assert status_before == status_after  # open rounds, members, versions unchanged
  # The open round still holds only learner 1; learner 2's good push reaches the quorum and merges both.
  c.push(make_push(2, np.full(8, 1.5, np.float32)))
  clock.t = 100.0
  c.heartbeat(0, 10.0)
  c.tick()
  assert c.status()["versions"][0] == 1 and c.counters["contributions_merged"] == 2


def test_pull_waits_and_times_out():
  c, clock = make_core(num_learners=2, k=2)
  assert c.pull(0, 1, timeout_s=0.0) is None
  assert c.pull(0, 0).version == 0
  with pytest.raises(Rejected):
    c.pull(3, 0)


def test_decision_queue_is_bounded(monkeypatch):
  monkeypatch.setattr(state_lib, "MAX_DECISIONS", 3)  # a small bound, the same code path
  c = helpers.make_core((8,), k=1, clock=helpers.FakeClock())
  c.join(0, FP)
  for v in range(5):
    c.push(helpers.make_push(0, np.ones(8), base_version=v))
  records = c.drain_decisions()
  assert [r["version"] for r in records] == [3, 4, 5] and c.decisions_dropped == 2
  assert c.drain_decisions() == []

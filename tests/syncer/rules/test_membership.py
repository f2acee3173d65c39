"""Membership and liveness (`syncer/rules/membership.py`) through the core on a fake clock: joins of other
runs, leaves, lease expiry and revival, pruning of lapsed members."""

import functools

import numpy as np
import pytest

import helpers
from diloco_jax.protocol.reasons import Rejected

make_core = helpers.joined_core
make_push = functools.partial(helpers.make_push, block=4)
FP = helpers.FP


def test_rejected_join_and_left_learner():
  c, clock = make_core(num_learners=2, k=1)
  with pytest.raises(Rejected) as e:
    c.join(5, "another-run")
  assert e.value.reason == "fingerprint" and 5 not in c.live_learners()
  c.leave(1)
  assert c.live_learners() == [0]
  with pytest.raises(Rejected) as e:
    c.push(make_push(1, np.ones(8)))
  assert e.value.reason == "not_member"
  assert c.join(1, FP).versions == {0: 0}  # rejoin after a crash
  assert c.live_learners() == [0, 1]


def test_lease_expiry_and_heartbeat_revival():
  c, clock = make_core(num_learners=3, k=3, lease_s=10.0, max_grace_s=30.0)
  clock.t = 5.0
  c.heartbeat(0, 10.0)
  c.heartbeat(1, 10.0)
  clock.t = 12.0  # learner 2 has been silent for 12 s > lease_s
  assert c.live_learners() == [0, 1]
  with pytest.raises(Rejected) as e:
    c.push(make_push(2, np.ones(8)))
  assert e.value.reason == "not_member"
  c.push(make_push(0, np.ones(8)))
  assert c.status()["versions"] == [0]
  c.push(make_push(1, np.ones(8)))  # K=3 but only 2 live, both in: closes
  assert c.status()["versions"] == [1]
  assert c.counters["leases_expired"] == 1
  clock.t = 13.0
  c.heartbeat(2, 10.0)  # back: counts toward the quorum again
  assert c.live_learners() == [0, 1, 2]
  c.push(make_push(0, np.ones(8), base_version=1))
  c.push(make_push(1, np.ones(8), base_version=1))
  clock.t = 14.0
  assert c.tick() == [] and c.status()["versions"] == [1]
  c.push(make_push(2, np.ones(8), base_version=1))
  assert c.status()["versions"] == [2]


def test_lease_expiry_during_open_round_closes_it():
  # An expiry is itself a deadline: learner 2 dies, the round no longer waits for it.
  c, clock = make_core(num_learners=3, k=3, lease_s=10.0, max_grace_s=30.0)
  clock.t = 5.0
  c.heartbeat(0, 10.0)
  c.heartbeat(1, 10.0)
  c.push(make_push(0, np.ones(8)))
  c.push(make_push(1, np.ones(8)))
  assert c.next_deadline() == pytest.approx(10.0)  # learner 2's lease
  clock.t = 10.5
  assert c.tick() == [0]


def test_lapsed_members_are_pruned_and_rejoin():
  c, clock = helpers.bounded_core(num_learners=3, k=1, lease_s=10.0)
  clock.t = 5.0
  c.heartbeat(0, 1.0)
  clock.t = 12.0  # leases of 1 and 2 lapsed: still members, not live
  c.tick()
  assert c.status()["member_count"] == {"total": 3, "live": 1, "shown": 3}
  clock.t = 20.5  # a lease past the lapse: pruned (learner 0 heartbeats on)
  c.heartbeat(0, 1.0)
  c.tick()
  assert sorted(c.status()["members"]) == ["0"] and c.counters["members_pruned"] == 2
  with pytest.raises(Rejected) as e:
    c.heartbeat(1, 1.0)
  assert e.value.reason == "unknown_learner"  # a rejoin reason: the learner joins again
  c.join(1, FP)
  assert c.status()["live"] == [0, 1]

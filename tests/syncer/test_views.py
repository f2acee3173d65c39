"""Read-only views of the syncer state (`syncer/views.py`): what `status` reports, and its bound."""

import json
import time

import numpy as np
import pytest

import helpers
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import views
from diloco_jax.syncer.rules import rounds as rounds_rules

FP = helpers.FP
make_core = helpers.bounded_core


def test_status_stays_bounded_whatever_the_membership():
  n = 50_000
  c, _ = make_core(num_learners=n, k=n, sizes=(8,), max_norm_ratio=0.0)
  t0 = time.monotonic()
  for i in range(n):
    c.join(i, FP)
  status = c.status()
  size = len(json.dumps(status))
  assert size < 64 << 10, size  # far under gRPC's 4 MiB message limit
  assert status["member_count"] == {"total": n, "live": n, "shown": views.STATUS_MEMBERS}
  assert len(status["live"]) == rounds_rules.STATUS_IDS
  assert time.monotonic() - t0 < 60
  # Joins under ids outside the run do not even become members.
  small_core, _ = make_core(num_learners=4)
  for i in range(4, 4 + n):
    with pytest.raises(Rejected):
      small_core.join(i, FP)
  assert small_core.status()["member_count"]["total"] == 4


def test_status_reports_steps_pushes_rounds_and_goodput_on_a_fake_clock():
  clock = helpers.FakeClock()
  # stall_s 60: learner 2, silent, still counts for the whole test (the shipped bound would drop it after 1 s).
  core = helpers.make_core((8, 8), k=2, max_grace_s=1.0, gamma=0.5, tau=100, clock=clock, lease_s=60.0,
                           num_learners=3, stall_s=60.0)
  for i in range(3):  # learner 2 stays silent: the round waits for it until the grace deadline
    core.join(i, FP)
  core.heartbeat(0, 0.5, step=10)
  core.heartbeat(1, 0.25)  # no step reported
  clock.t = 2.0
  core.push(helpers.make_push(0, np.ones(8), core=core, fragment=0, steps=10))
  clock.t = 3.0
  core.push(helpers.make_push(1, np.ones(8), core=core, fragment=0, steps=20))  # quorum: grace 1 s from here
  status = core.status()
  assert status["open_rounds"]["0"]["contributors"] == [0, 1] and status["versions"] == [0, 0]
  clock.t = 4.0
  assert core.tick() == [0]  # closed at the deadline, one second after the quorum
  status = core.status()
  m0, m1 = status["members"]["0"], status["members"]["1"]
  assert (m0["step"], m1["step"]) == (10, None) and (m0["step_ago_s"], m1["step_ago_s"]) == (4.0, None)
  assert (m0["last_push_ago_s"], m1["last_push_ago_s"]) == (2.0, 1.0)
  assert (m0["steps_merged"], m1["steps_merged"]) == (5.0, 10.0)  # over P = 2 fragments
  assert status["since_start"] == {"rounds": 1, "contributors": 2, "grace_wait_s": 1.0}
  assert status["uptime_s"] == 4.0 and status["num_learners"] == 3
  # (10 steps x 0.5 s + 20 steps x 0.25 s) / 2 fragments, over 3 learners x 4 s.
  assert status["goodput_estimate"] == pytest.approx((10 * 0.5 + 20 * 0.25) / 2 / (3 * 4.0))
  json.dumps(status)  # all of it travels as JSON


def test_a_rejoin_keeps_what_the_status_knew():
  core = helpers.make_core((8,), k=1)
  core.join(0, FP)
  core.heartbeat(0, 0.1, step=7)
  core.push(helpers.make_push(0, np.ones(8), core=core, steps=7))
  core.leave(0)
  core.join(0, FP)
  m = core.status()["members"]["0"]
  assert m["step"] == 7 and m["steps_merged"] == 7.0 and m["last_push_ago_s"] is not None

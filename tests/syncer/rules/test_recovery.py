"""Syncer restarts and stopped learners, without processes: the core's journal, version floor and lifetime
history; progress-based quorums on a fake clock; a learner recovering from a restored (older) syncer.

The real processes killed with real signals are in test_processes.py.
"""

import json

import jax
import numpy as np
import pytest

import helpers
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.messages import EpochRecord
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.runs import inprocess
from diloco_jax.syncer import build, checkpoint
from diloco_jax.syncer.ticker import Ticker

FP = helpers.FP


def _core(num_learners=3, k=3, stall_s=0.5, lease_s=30.0, **kw):
  clock = helpers.FakeClock()
  c = helpers.make_core((8,), k=k, lr=1.0, momentum=0.0, block=4, initial="arange", clock=clock,
                        lease_s=lease_s, stall_s=stall_s, max_grace_s=kw.pop("max_grace_s", 30.0), **kw)
  for i in range(num_learners):
    c.join(i, FP)
  return c, clock


def _push(c, learner, base_version=0):
  return c.push(helpers.make_push(learner, np.ones(8), core=c, block=4, base_version=base_version,
                                  base_epoch=c.epoch))


# ---- progress-based quorums -------------------------------------------------------------------------


def test_a_stopped_learner_stops_gating_rounds_after_the_stall_bound_and_comes_back():
  # K = 3 = M: every learner that makes progress is waited for. Learners report steps of 0.1 s.
  c, clock = _core(k=3, stall_s=0.5)
  for i in range(3):
    c.heartbeat(i, 0.1, step=1)
  clock.t = 0.2
  c.heartbeat(0, 0.1, step=3)
  c.heartbeat(1, 0.1, step=3)  # learner 2 stops here: its last progress was at t = 0
  _push(c, 0)
  _push(c, 1)
  assert c.status()["versions"] == [0]
  # The round waits for learner 2 exactly until its last progress + stall_s + its step time.
  assert c.next_deadline() == pytest.approx(0.0 + 0.5 + 0.1)
  clock.t = 0.59
  assert c.tick() == [] and c.counted_learners() == [0, 1, 2]
  clock.t = 0.61
  assert c.tick() == [0] and c.counted_learners() == [0, 1]
  assert c.counters["learner_stalls"] == 1 and c.live_learners() == [0, 1, 2]  # its lease is intact
  assert not c.status()["members"]["2"]["progressing"]
  # It resumes: the next heartbeat that shows a new step makes it count again, and rounds wait for it.
  clock.t = 5.0
  for i in range(3):
    c.heartbeat(i, 0.1, step=10 + i)
  _push(c, 0, base_version=1)
  _push(c, 1, base_version=1)
  clock.t = 5.3
  c.heartbeat(2, 0.1, step=13)
  assert c.tick() == [] and c.status()["versions"] == [1]
  _push(c, 2, base_version=1)
  assert c.status()["versions"] == [2]


def test_a_slow_or_blocked_learner_that_makes_progress_is_waited_for():
  c, clock = _core(k=3, stall_s=0.5)
  _push(c, 0)
  _push(c, 1)
  for t in np.arange(0.3, 6.0, 0.3):  # learner 2: one slow step every 0.6 s; learner 1 blocked on the round
    clock.t = float(t)
    c.heartbeat(2, 0.6, step=int(t / 0.6))
    c.heartbeat(1, 0.1, step=5, blocked=True)
    c.heartbeat(0, 0.1, step=5, blocked=True)
    assert c.tick() == []
  assert c.status()["versions"] == [0] and c.counters["learner_stalls"] == 0
  _push(c, 2)
  assert c.status()["versions"] == [1]


def test_a_heartbeat_without_a_step_counter_keeps_the_lease_rule():
  c, clock = _core(k=3, stall_s=0.5, lease_s=10.0)
  _push(c, 0)
  _push(c, 1)
  for t in (1.0, 2.0, 3.0):
    clock.t = t
    c.heartbeat(0, 0.1, step=5, blocked=True)
    c.heartbeat(1, 0.1, step=5, blocked=True)
    c.heartbeat(2, 0.1)  # step -1: progress unknown, counts as progress
    assert c.tick() == []
  clock.t = 3.0 + 0.5 + 0.1 + 0.01
  c.heartbeat(0, 0.1, step=5, blocked=True)
  assert c.status()["versions"] == [1]  # silent past the bound: no longer waited for


# ---- lifetimes, the journal and the version floor ------------------------------------------------------


def test_history_helpers():
  a, b, c = 11, 22, 33
  # Lifetime a made rounds 0..; b restored a's checkpoint at 3 rounds and numbered from version 5 (a had
  # published up to 5); c restored b's at 6 rounds, numbered from 10.
  history = (EpochRecord(a, (0,), (0,)), EpochRecord(b, (3,), (2,)), EpochRecord(c, (6,), (4,)))
  assert protocol.current_version(history, a, 3, 0) == 3 + 4  # kept: renamed into c's numbering
  assert protocol.current_version(history, a, 4, 0) is None  # a's 4th round was lost with a
  assert protocol.current_version(history, b, 8, 0) == 6 + 4  # b's version 8 = 6 rounds
  assert protocol.current_version(history, b, 9, 0) is None
  assert protocol.current_version(history, c, 12, 0) == 12
  assert protocol.current_version(history, 99, 0, 0) is None
  assert protocol.merged_for_good(history, a, 2, 0) and not protocol.merged_for_good(history, a, 3, 0)
  assert protocol.merged_for_good(history, b, 5, 0) and not protocol.merged_for_good(history, b, 6, 0)
  assert protocol.merged_for_good(history, c, 100, 0) and not protocol.merged_for_good(history, 99, 0, 0)


def test_a_restored_core_never_goes_back_and_refuses_pushes_of_the_dead_lifetime(tmp_path):
  a, clock = _core(num_learners=1, k=1, max_grace_s=0.0)
  for v in range(2):
    _push(a, 0, base_version=v)
  checkpointed = a.state_dict()  # 2 rounds
  for v in range(2, 5):
    _push(a, 0, base_version=v)
  _push_open = a.push(helpers.make_push(0, np.ones(8), core=a, block=4, base_version=5, base_epoch=a.epoch))
  assert _push_open.round == 5 or a.status()["versions"] == [6]
  journal = checkpoint.Journal(tmp_path / "journal.json", timeline=tmp_path / "versions.jsonl")
  journal(a.journal_record(), True)
  record = journal.read()
  assert record["versions"] == a.status()["versions"] and record["epoch"] == a.epoch

  b = helpers.make_core((8,), k=1, lr=1.0, momentum=0.0, block=4, initial="arange", max_grace_s=0.0,
                        clock=clock)
  b.load_state_dict(checkpointed)
  assert b.status()["versions"] == [2]
  b.attach_journal(journal, record)
  top = record["versions"][0]
  assert b.status()["versions"] == [top] and b.status()["rounds"] == [2]  # never below what learners saw
  assert b.history() == (EpochRecord(a.epoch, (0,), (0,)), EpochRecord(b.epoch, (2,), (top - 2,)))
  # The model's counters are the checkpoint's; what the crash took is counted; event counters go on.
  assert b.counters["rounds"] == 2 and b.counters["restarts"] == 1
  assert b.counters["rounds_rolled_back"] == top - 2
  assert b.counters["bytes_in"] == a.counters["bytes_in"] and b.counters["joins"] == a.counters["joins"]
  b.join(0, FP)
  with pytest.raises(Rejected) as e:  # based on the dead lifetime's numbering: recover first
    b.push(helpers.make_push(0, np.ones(8), core=b, block=4, base_version=3, base_epoch=a.epoch))
  assert e.value.reason == "epoch" and b.counters["rejected"]["epoch"] == 1
  receipt = b.push(helpers.make_push(0, np.ones(8), core=b, block=4, base_version=top, base_epoch=b.epoch))
  assert receipt.epoch == b.epoch and receipt.round == 2 and b.status()["versions"] == [top + 1]
  assert b.pull(0, top + 1).epoch == b.epoch
  lines = [json.loads(x) for x in (tmp_path / "versions.jsonl").read_text().splitlines()]
  assert [x["versions"] for x in lines] == [[top], [top], [top + 1]]  # a's record, b attaching, b's commit
  journal.close()


def test_a_stopping_syncer_merges_its_open_rounds():
  c, clock = _core(num_learners=2, k=2, max_grace_s=30.0)
  _push(c, 0)
  assert c.status()["versions"] == [0] and c.status()["open_rounds"]
  assert c.close_open_rounds() == [0]
  assert c.status()["versions"] == [1] and not c.status()["open_rounds"]
  assert c.counters["contributions_merged"] == 1 and c.counters["rounds_closed_at_stop"] == 1


# ---- a learner recovering from a restored syncer, exactly ----------------------------------------------


def _identity_config(c):
  """One learner, outer lr 1 / momentum 0, fp32, K = 1 without grace: every merge sets the global fragment
  to the learner's parameters at its snapshot, so the learner follows plain training exactly and the
  global model catches up with it at every sync: any lost or doubled work would show."""
  c.learners.num, c.learners.devices = 1, 2
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 2, 4, 1
  c.outer.lr, c.outer.momentum = 1.0, 0.0
  c.outer.codec = c.outer.downlink_codec = "fp32"
  c.outer.min_quorum, c.outer.max_grace_s = 1, 0.0
  return c


@pytest.mark.parametrize("how", ["kill", "term"])
def test_a_learner_recovers_from_a_restart_without_losing_or_doubling_work(tiny_config, how):
  """kill: the restored syncer holds an older checkpoint (5 steps behind); term: it stopped cleanly."""
  c = _identity_config(tiny_config)
  devices = jax.devices()[:2]
  plain = trainer_lib.MeshTrainer(c, devices, None, batch_size=c.data.global_batch)
  job = inprocess.InProcessRun(c, None, devices=devices)
  learner, old = job.learners[0], job.core
  ticker = job.ticker
  versions_seen = []
  checkpointed = None
  try:
    learner.join()
    for step in range(1, 17):
      plain.train_step()
      learner.train_step()
      versions_seen.append(list(learner.base_version))
      if step == 4:
        checkpointed = old.state_dict()
      if step == 9:
        # The "crash": once the pushes made so far reached the old syncer (the journal of a real one is
        # written at every change, so it always holds the last version published; here the old core must
        # publish nothing after its record is taken).
        helpers.wait_for(lambda: old.counters["contributions_accepted"] == learner.stats.syncs, "pushes in", 60)
        if how == "term":
          old.close_open_rounds()
          checkpointed = old.state_dict()
        record = old.journal_record()
        ticker.stop()
        new, _ = build.build_core(c, inprocess.RUN_ID)
        new.load_state_dict(checkpointed)
        new.attach_journal(lambda record, durable: None, record)
        learner.comms.transport.core = new  # the same address, a restarted syncer
        ticker = Ticker(new)
    learner.flush()
    versions_seen.append(list(learner.base_version))
  finally:
    ticker.stop()
    job.ticker = ticker
    job.close()
  assert learner.stats.recoveries == 1
  assert all(b >= a for x, y in zip(versions_seen, versions_seen[1:]) for a, b in zip(x, y)), versions_seen
  # Nothing lost, nothing doubled: the learner trained exactly like plain training, and the restored
  # global model caught up with it; every token was merged exactly once per fragment.
  params = jax.tree.map(np.asarray, learner.trainer.state.params)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(jax.tree.map(np.asarray, plain.state.params))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  global_model = build.global_params(new, learner.plan, params)
  for x, y in zip(jax.tree.leaves(global_model), jax.tree.leaves(params)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
  assert new.counters["tokens_merged_by_fragment"] == [learner.trainer.tokens] * 2
  if how == "kill":
    assert learner.stats.steps_taken_back > 0 and learner.stats.rebased >= 1
    assert new.counters["rounds_rolled_back"] > 0
  else:
    # Nothing was lost; a push made before the learner noticed the restart is refused ("epoch"), or one
    # still queued in its comms when the epoch changed is never sent: either way its steps are pushed
    # again after the recovery, and those are at most the syncs in flight (one period per fragment).
    assert learner.stats.rebased == 0 and new.counters["rounds_rolled_back"] == 0
    assert learner.stats.steps_taken_back <= c.outer.num_fragments * c.outer.sync_every

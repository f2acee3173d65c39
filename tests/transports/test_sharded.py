"""The sharded syncer: shard cores, the sharded transport (in process), targets and combined status."""

import math
import threading

import numpy as np
import pytest

import helpers
from diloco_jax.outer import placement
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import checkpoint
from diloco_jax.transports.inprocess import InProcessTransport
from diloco_jax.transports.sharded import ShardedTransport, combine_status, parse_targets

SIZES = helpers.SHARDED_SIZES


def _cores(shards: int, **kw):
  # Its learners report no steps between pushes (0.1 s apart on the fake clock): no stall bound, so that
  # rounds close by the quorum alone, on one core as on the shards.
  kw.setdefault("stall_s", math.inf)
  clock = helpers.FakeClock()
  owned = placement.assign_shards(SIZES, shards) if shards > 1 else [None]
  cores = [helpers.make_core(SIZES, codec="int4", downlink="int4", k=2, max_grace_s=0.0, clock=clock,
                             owned=None if o is None else tuple(o), **kw) for o in owned]
  return cores, clock


def _drive(shards: int) -> tuple[list[np.ndarray], list[bytes]]:
  """Three rounds of pushes from two learners on every fragment, on one core or on `shards` shard cores
  (each push to its fragment's owner, membership calls to all); the globals and the last answers."""
  cores, clock = _cores(shards)
  owner = placement.shard_of(SIZES, shards)
  for core in cores:
    for i in (0, 1):
      core.join(i, helpers.FP)
  rng = np.random.default_rng(7)
  for r in range(3):
    for p, n in enumerate(SIZES):
      for i in (0, 1):
        clock.t += 0.1
        core = cores[owner[p]]
        core.push(helpers.make_push(i, 0.01 * rng.standard_normal(n), core=core, fragment=p, base_version=r,
                                    steps=10, tokens=100 + 10 * i))
      for core in cores:
        core.tick()
  globals_ = [cores[owner[p]].global_fragments()[p] for p in range(len(SIZES))]
  answers = [bytes(cores[owner[p]].pull(p, 3, have_version=2, have_epoch=0).payload) for p in range(len(SIZES))]
  for p in range(len(SIZES)):
    assert cores[owner[p]].status()["versions"][p] == 3
  return globals_, answers


def test_one_core_and_two_shard_cores_give_bitwise_identical_globals():
  one, one_answers = _drive(1)
  two, two_answers = _drive(2)
  for a, b in zip(one, two):
    assert a.dtype == b.dtype == np.float32 and a.tobytes() == b.tobytes()
  assert one_answers == two_answers
  assert not all(np.array_equal(a, b) for a, b in zip(one, _cores(1)[0][0].global_fragments()))  # it moved


def test_a_shard_core_holds_serves_and_checkpoints_only_its_fragments(tmp_path):
  cores, _ = _cores(2)
  shard0 = cores[0]  # owns fragments 2 and 3
  assert [g.size for g in shard0.global_fragments()] == [0, 0, 56, 16]
  assert shard0.join(0, helpers.FP).versions == {2: 0, 3: 0}
  assert shard0.status()["owned"] == [2, 3]
  with pytest.raises(Rejected, match="another syncer shard") as e:
    shard0.push(helpers.make_push(0, np.zeros(40), core=shard0, fragment=0))
  assert e.value.reason == "wrong_shard" and shard0.counters["rejected"]["wrong_shard"] == 1
  with pytest.raises(Rejected) as e:
    shard0.pull(1, 0)
  assert e.value.reason == "wrong_shard"
  # A shard's checkpoint (orbax, on disk) holds only its fragments, and only that shard restores it.
  cores[0].push(helpers.make_push(0, np.full(56, 0.01), core=shard0, fragment=2))  # the only member: merged
  ckpt = checkpoint.SyncerCheckpointer(tmp_path / "ckpt", async_save=False)
  checkpoint.save_core(ckpt, shard0, rounds=1)
  state, _ = ckpt.restore()
  ckpt.close()
  assert [None if f is None else np.asarray(f).size for f in state["fragments"]] == [None, None, 56, 16]
  with pytest.raises(ValueError, match="owning fragments"):
    cores[1].load_state_dict(state)
  unsharded, _ = _cores(1)
  with pytest.raises(ValueError, match="owning fragments"):
    unsharded[0].load_state_dict(state)
  fresh, _ = _cores(2)
  fresh[0].load_state_dict(state)
  assert fresh[0].status()["versions"] == [0, 0, 1, 0]
  assert fresh[0].global_fragments()[2].tobytes() == shard0.global_fragments()[2].tobytes()
  assert fresh[0].pull(2, 1).version == 1


def test_sharded_transport_routes_fragments_and_fans_out_membership():
  cores, _ = _cores(2, lease_s=30.0)
  owners = placement.shard_of(SIZES, 2)
  t = ShardedTransport([InProcessTransport(c) for c in cores], owners)
  assert t.join(0, helpers.FP).versions == {0: 0, 1: 0, 2: 0, 3: 0}
  assert all(c.live_learners() == [0] for c in cores)
  receipt = t.push(helpers.make_push(0, np.full(56, 0.01), core=cores[0], fragment=2))
  assert receipt.fragment == 2 and cores[0].status()["versions"][2] == 1  # the only live learner: merged
  assert t.pull(3, 0).fragment == 3
  t.heartbeat(0, 0.5, step=7)
  assert all(c.status()["members"]["0"]["step"] == 7 for c in cores)
  status = t.status()
  assert status["owned"] == [0, 1, 2, 3] and len(status["shards"]) == 2 and status["live"] == [0]
  assert status["counters"]["joins"] == 2  # one join per shard
  t.leave(0)
  assert all(c.live_learners() == [] for c in cores)
  # Addresses in the wrong order: the shards' join answers disagree with the map, refused by name.
  wrong = ShardedTransport([InProcessTransport(c) for c in reversed(cores)], owners)
  with pytest.raises(Rejected, match="shard order") as e:
    wrong.join(1, helpers.FP)
  assert e.value.reason == "wrong_shard"


def test_a_shard_that_forgot_the_learner_is_joined_again_by_the_heartbeat():
  cores, _ = _cores(2)
  t = ShardedTransport([InProcessTransport(c) for c in cores], placement.shard_of(SIZES, 2))
  t.join(0, helpers.FP)
  restarted, _ = _cores(2)  # shard 1 restarts: its new core knows no members
  t.shards[1] = InProcessTransport(restarted[1])
  t.heartbeat(0, 0.5)
  assert restarted[1].live_learners() == [0] and restarted[1].counters["joins"] == 1


def test_a_stuck_shard_does_not_hold_up_the_other_shards_heartbeats():
  cores, _ = _cores(2)
  t = ShardedTransport([InProcessTransport(c) for c in cores], placement.shard_of(SIZES, 2))
  t.join(0, helpers.FP)
  release = threading.Event()

  class Stuck(InProcessTransport):

    def heartbeat(self, *args, **kwargs):
      release.wait(30)  # a shard that is down: its client retries

  t.shards[1] = Stuck(cores[1])
  try:
    for step in (1, 2, 3):
      t.heartbeat(0, 0.5, step=step)  # returns although shard 1's first beat is still in flight
      assert cores[0].status()["members"]["0"]["step"] == step
  finally:
    release.set()
    t.close()


def test_one_shard_restart_is_one_epoch_change_whose_history_speaks_per_fragment(tmp_path):
  # Shard 0 owns fragments 2 and 3, shard 1 fragments 0 and 1 (see the placement test).
  cores, _ = _cores(2)
  owners = placement.shard_of(SIZES, 2)
  t = ShardedTransport([InProcessTransport(c) for c in cores], owners)
  joined = t.join(0, helpers.FP)
  e0 = joined.epoch
  assert e0 and t.heartbeat(0, 0.5) == e0 and [r.epoch for r in joined.history] == [e0]
  receipts = {}
  for version in (0, 1):  # two rounds of every fragment (learner 0 alone: each push merges at once)
    for p, n in enumerate(SIZES):
      receipts[p, version] = t.push(helpers.make_push(0, np.full(n, 0.01), core=cores[owners[p]], fragment=p,
                                                      base_version=version, base_epoch=e0))
      assert receipts[p, version].epoch == e0
  published = t.pull(1, 2, have_version=1, have_epoch=e0)
  assert published.epoch == e0 and published.kind == "delta"  # the shard's own epoch was sent back to it
  # Shard 1 is checkpointed after the first round of its fragments... then merges the second, and
  # restarts from that checkpoint with a new epoch.
  state = cores[1].state_dict()
  state["versions"], state["rounds"] = [1, 1, 0, 0], [1, 1, 0, 0]
  restarted, _ = _cores(2)
  restarted[1].load_state_dict(state)
  t.shards[1] = InProcessTransport(restarted[1])
  e1 = t.heartbeat(0, 0.5)  # the restarted shard forgot the learner: joined again, a new combined epoch
  assert e1 not in (0, e0) and restarted[1].live_learners() == [0]
  joined = t.join(0, helpers.FP)
  assert joined.epoch == e1 and [r.epoch for r in joined.history] == [e0, e1]
  history = joined.history
  # Shard 0 did not restart: its fragments' rounds of e0 are all held, its versions keep their numbers.
  for p in (2, 3):
    assert protocol.merged_for_good(history, e0, receipts[p, 1].round, p)
    assert protocol.current_version(history, e0, 2, p) == 2
  # Shard 1 restored round 1 of 2: the second round of e0 is lost, version 1 is still held.
  for p in (0, 1):
    assert protocol.merged_for_good(history, e0, receipts[p, 0].round, p)
    assert not protocol.merged_for_good(history, e0, receipts[p, 1].round, p)
    assert protocol.current_version(history, e0, 1, p) is not None
    assert protocol.current_version(history, e0, 2, p) is None
  # Epochs sent back are translated: a push based on e1 reaches shard 1 under its own new epoch.
  receipt = t.push(helpers.make_push(0, np.full(40, 0.01), core=restarted[1], fragment=0,
                                     base_version=joined.versions[0], base_epoch=e1))
  assert receipt.epoch == e1
  with pytest.raises(Rejected) as e:  # a push still based on the old epoch: refused, the learner recovers
    t.push(helpers.make_push(0, np.full(40, 0.01), core=restarted[1], fragment=0, base_version=1, base_epoch=e0))
  assert e.value.reason == "epoch"


def test_parse_targets_and_combine_status():
  assert parse_targets("h:1,h:2") == ["h:1", "h:2"]
  for bad in ("h:1,h", "h:1,h:1", ""):
    with pytest.raises(ValueError, match="--syncer"):
      parse_targets(bad)
  a = {"versions": [0, 5, 0], "owned": [1], "live": [0, 1], "counters": {"rounds": 5, "rejected": {"x": 1}},
       "open_rounds": {"1": {}}, "fingerprint": "f"}
  b = {"versions": [3, 0, 4], "owned": [0, 2], "live": [1], "counters": {"rounds": 7, "rejected": {"x": 2}},
       "open_rounds": {}, "fingerprint": "f"}
  combined = combine_status([a, b])
  assert combined["versions"] == [3, 5, 4] and combined["live"] == [1]
  assert combined["counters"] == {"rounds": 12, "rejected": {"x": 3}} and combined["open_rounds"] == {"1": {}}

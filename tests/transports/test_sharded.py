"""The sharded syncer: fragment placement, shard cores, the sharded transport (in process and over gRPC)."""

import math
import re
import signal
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

import helpers
from configs import tiny_cpu
from diloco_jax.runs import export
from diloco_jax.runs import local as launch_local
from diloco_jax.outer import placement
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import build
from diloco_jax.syncer import checkpoint
from diloco_jax.transports.inprocess import InProcessTransport
from diloco_jax.transports.sharded import ShardedTransport, combine_status, parse_targets

SIZES = (40, 24, 56, 16)


def test_placement_is_balanced_deterministic_and_total():
  assert placement.assign_shards(SIZES, 2) == [[2, 3], [0, 1]]  # 56 | 40, 24 | then 16 to the lighter
  assert placement.shard_of(SIZES, 2) == [1, 1, 0, 0]
  assert placement.shard_of(SIZES, 1) == [0, 0, 0, 0]
  assert sorted(p for s in placement.assign_shards(SIZES, 3) for p in s) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="shards must be in"):
    placement.assign_shards(SIZES, 5)


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


def _versions(run, shard: int) -> int:
  """The versions of the fragments shard `shard` owns, summed."""
  status = run.status(shard)
  return sum(status["versions"][p] for p in status["owned"])


def test_kill_9_of_one_shard_leaves_the_other_merging_and_it_recovers(tmp_path):
  run = helpers.ProcessRun(tmp_path, helpers.tiny_overrides(steps=60))
  base = launch_local.free_ports(2)
  try:
    shard0 = run.syncer(f"127.0.0.1:{base}", shard=0, shards=2)
    run.syncer(f"127.0.0.1:{base + 1}", shard=1, shards=2)
    assert [run.status(s)["owned"] for s in (0, 1)] == [[0], [1]]
    run.learner(0)
    run.learner(1)
    ckpt_dir = tmp_path / "syncer" / "shard_0" / "syncer_checkpoints"
    helpers.wait_for(lambda: _versions(run, 0) >= 3 and any(p.name.isdigit() for p in ckpt_dir.iterdir()),
                     "a few rounds and a checkpoint on shard 0")
    shard0.send_signal(signal.SIGKILL)
    shard0.wait()
    # Shard 1's fragment goes on merging while shard 0 is dead.
    at_kill = _versions(run, 1)
    helpers.wait_for(lambda: _versions(run, 1) > at_kill, "shard 1 to merge while shard 0 is dead")
    run.syncer(f"127.0.0.1:{base}", shard=0, shards=2)  # same workdir, same port
    match = re.search(r"resumed from checkpoint step \d+ \((\d+) rounds\)", run.log("syncer_0"))
    assert match, run.log("syncer_0")
    resumed = int(match.group(1))
    run.wait_ok("learner_0")
    run.wait_ok("learner_1")
    status = [run.status(s) for s in (0, 1)]
    status_command = subprocess.run(
        [sys.executable, "-m", "diloco_jax", "status", "--syncer", run.target, "--token-file", str(run.token_file)],
        cwd=helpers.REPO, capture_output=True, text=True, timeout=helpers.PROCESS_TIMEOUT_S)
  finally:
    run.kill_all()
  # The restarted shard merged again after its restore; the learners never restarted and finished.
  assert status[0]["versions"][0] > resumed >= 1
  for i in (0, 1):
    s = run.summary(i)
    assert s["steps"] == 60 and s["completed"] and not s["restored"]
  assert all(s["counters"]["joins"] >= 2 for s in status)
  # `status` shows every shard: each with its own fragment.
  assert status_command.returncode == 0, status_command.stderr
  out = status_command.stdout
  blocks = out.split("syncer shard ")[1:]
  assert [b.split()[0] for b in blocks] == ["0/2", "1/2"], out
  for shard, block in enumerate(blocks):
    lines = block.splitlines()
    table = lines[[i for i, line in enumerate(lines) if line.startswith("fragment")][0] + 1:]
    rows = [line.split() for line in table[:table.index("")]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(shard, status[shard]["versions"][shard])], out


def test_export_assembles_the_model_from_every_shards_checkpoint(tmp_path):
  config = tiny_cpu.get_config()
  config.learners.num = 2
  unsharded, _ = build.build_core(config, "r")
  shards = [build.build_core(config, "r", shard=i, shards=2)[0] for i in (0, 1)]
  assert [c.status()["owned"] for c in shards] == [[0], [1]]
  dirs = []
  for i, core in enumerate(shards):
    ckpt = checkpoint.SyncerCheckpointer(tmp_path / f"shard_{i}" / "syncer_checkpoints", async_save=False)
    checkpoint.save_core(ckpt, core)
    ckpt.close()
    dirs.append(tmp_path / f"shard_{i}")
  params, info = export.syncer_params(config, list(reversed(dirs)), "r")  # any order
  assert info["versions"] == [0, 0] and len(info["step"]) == 2
  template = jax.tree.map(np.asarray, params)
  expected = build.global_params(unsharded, build.fragment_plan(config, template), template)
  jax.tree.map(np.testing.assert_array_equal, params, expected)
  with pytest.raises(ValueError, match=r"holds fragments \[1\]"):
    export.syncer_params(config, dirs[:1], "r")

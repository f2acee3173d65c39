"""Syncer persistence: state dicts through orbax, save and restore into a new core."""

import json

import jax
import numpy as np

import helpers
from diloco_jax.syncer import checkpoint

REPO = helpers.REPO
FP = helpers.FP


def make_core(sizes=(500, 200)):
  # A clock that stands still: on a loaded machine a real one let the stall bound (0.5 s here) pass between
  # two pushes in one core and not in the other, and their `learner_stalls` counters differed.
  return helpers.make_core(sizes, codec="int8", downlink="bf16", initial="linspace", clock=helpers.FakeClock())


def push(core, fragment, base_version, scale):
  n = core.settings.sizes[fragment]
  core.push(helpers.make_push(0, np.full(n, scale, np.float32), core=core, fragment=fragment,
                              base_version=base_version, steps=5))


def assert_same_state(a, b):
  assert a["versions"] == b["versions"] and a["rounds"] == b["rounds"] and a["counters"] == b["counters"]
  for x, y in zip(a["fragments"], b["fragments"]):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(jax.tree.leaves(a["opt_states"]), jax.tree.leaves(b["opt_states"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_split_join_round_trip():
  state = {"a": [np.arange(3, dtype=np.int32), (np.float32(2.5), None)], "b": {0: "x", 1: np.ones((2, 2))},
           "c": {"n": 3, "f": 1.5, "flag": True}}
  arrays, skeleton = checkpoint.split_state(state)
  assert len(arrays) == 3
  back = checkpoint.join_state(arrays, json.loads(json.dumps(skeleton)))
  assert back["a"][1][0] == np.float32(2.5) and isinstance(back["a"][1][0], np.float32)
  assert isinstance(back["a"][1], tuple) and back["b"][0] == "x" and back["c"] == state["c"]
  np.testing.assert_array_equal(back["b"][1], state["b"][1])


def test_save_restore_into_a_new_core(tmp_path):
  core = make_core()
  core.join(0, FP)
  push(core, 0, 0, 0.01)
  push(core, 0, 1, 0.02)
  push(core, 1, 0, -0.01)
  assert core.status()["versions"] == [2, 1]
  ckpt = checkpoint.SyncerCheckpointer(tmp_path / "ck")
  assert checkpoint.save_core(ckpt, core, rounds=3) == 1
  ckpt.close()

  fresh = make_core()
  reopened = checkpoint.SyncerCheckpointer(tmp_path / "ck")
  info = checkpoint.restore_core(reopened, fresh)
  assert info == {"step": 1, "rounds": 3}
  assert_same_state(fresh.state_dict(), core.state_dict())
  assert fresh.pull(0, 2).payload == core.pull(0, 2).payload
  # The restored core carries on exactly like the original (momentum included).
  for c in (core, fresh):
    c.join(0, FP)
    push(c, 0, 2, 0.03)
  assert_same_state(fresh.state_dict(), core.state_dict())
  assert checkpoint.restore_core(checkpoint.SyncerCheckpointer(tmp_path / "empty"), make_core()) is None

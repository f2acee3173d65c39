"""The reference-tracking delta downlink: the syncer publishes the quantized change of what learners hold.

Core tests use a fake clock; the last test runs two real learners against an in-process syncer and checks
that each learner's device base is bitwise the syncer's reference of the version it adopted.
"""

import dataclasses
import threading

import jax
import numpy as np
import pytest

import helpers
from configs import tiny_cpu
from diloco_jax.learner import loop as loop_lib
from diloco_jax.outer import codec
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.runs import inprocess
from diloco_jax.syncer import checkpoint
from diloco_jax.syncer import downlink as downlink_lib

FP = helpers.FP
N = 300
BLOCK = 16


def make_core(downlink="int4", sizes=(N,), **settings):
  # One learner, K=1: every push closes its round at once (everyone live has contributed).
  c = helpers.make_core(sizes, downlink=downlink, block=BLOCK, clock=helpers.FakeClock(), **settings)
  c.join(0, FP)
  return c


def commit(c, rng, fragment=0):
  """One round: a random outer gradient from learner 0 against the current version."""
  version = c.status()["versions"][fragment]
  delta = (0.05 * rng.standard_normal(c.settings.sizes[fragment])).astype(np.float32)
  c.push(helpers.make_push(0, delta, core=c, fragment=fragment, base_version=version, steps=5))
  assert c.status()["versions"][fragment] == version + 1


def theta(c, p=0):
  return c.state_dict()["fragments"][p]


def test_deltas_track_the_reference_bitwise_with_bounded_error():
  c = make_core()
  rng = np.random.default_rng(1)
  version, held = c.reference(0)  # the learner starts from R_0 = Theta_0
  assert version == 0
  np.testing.assert_array_equal(held, theta(c))
  errors, bounds = [], []
  for v in range(1, 21):
    prev_ref = c.reference(0)[1]
    commit(c, rng)
    bytes_out = c.counters["bytes_out"]
    pub = c.pull(0, v, have_version=v - 1, have_epoch=c.epoch)
    assert (pub.kind, pub.version, pub.base_version, pub.codec, pub.epoch) == ("delta", v, v - 1, "int4", c.epoch)
    assert c.counters["bytes_out"] - bytes_out == len(pub.payload) == codec.encoded_size(N, "int4", BLOCK)
    held = held + codec.decode(pub.payload, "int4", N, BLOCK)  # the learner's float32 add
    version, ref = c.reference(0)
    assert version == v
    np.testing.assert_array_equal(held, ref)  # bitwise
    # Error feedback: R_v trails Theta_v by one quantization error of the residual delta only (plus the
    # float32 rounding of the subtraction and the add).
    th = theta(c)
    residual = th - prev_ref
    bound = (codec.error_bound(residual, "int4", BLOCK) + np.spacing(np.abs(ref)) + np.spacing(np.abs(residual)))
    err = np.abs(ref.astype(np.float64) - th)
    assert (err <= bound).all(), (v, float((err - bound).max()))
    errors.append(float(err.max()))
    bounds.append(float(bound.max()))
  # ... and does not grow: the last rounds are no worse than the first (a random walk would be ~2x).
  assert max(errors[-5:]) <= 1.5 * max(errors[:5]), errors
  assert max(errors) <= max(bounds)


def test_laggards_and_joiners_get_the_full_reference():
  c = make_core(downlink_history=1)  # only the latest reference kept: a learner behind it gets the full one
  rng = np.random.default_rng(2)
  for _ in range(3):
    commit(c, rng)
  ref = c.reference(0)[1]
  for have in (-1, 0, 1, 3):  # nothing, two and more behind, already current
    bytes_out = c.counters["bytes_out"]
    pub = c.pull(0, 0, have_version=have, have_epoch=c.epoch)
    assert (pub.kind, pub.version, pub.base_version, pub.codec, pub.epoch) == ("full", 3, -1, "fp32", c.epoch)
    np.testing.assert_array_equal(codec.decode(pub.payload, "fp32", N), ref)
    assert c.counters["bytes_out"] - bytes_out == 4 * N
  assert c.pull(0, 0).kind == "full"  # the default holds nothing
  assert c.pull(0, 0, have_version=2, have_epoch=c.epoch).kind == "delta"
  assert (c.counters["pulls_full"], c.counters["pulls_delta"]) == (5, 1)


def test_k1_learners_get_one_delta_from_the_version_they_hold():
  """K = 1, three learners taking turns: the global moves three times between two syncs of one learner.
  Each version is published as a delta from the version its contributor holds, so every learner gets one
  int4 delta per sync (not the full fragment, not a chain) and still holds the reference bitwise."""
  c = helpers.make_core((N,), downlink="int4", block=BLOCK, clock=helpers.FakeClock(), downlink_history=6)
  for i in range(3):
    c.join(i, FP)
  rng = np.random.default_rng(13)
  held = {i: (0, c.reference(0)[1]) for i in range(3)}  # each learner's (version, base vector)
  refs = {}
  waiting = None
  for turn in range(13):
    i = turn % 3
    if turn < 12:
      delta = (0.05 * rng.standard_normal(N)).astype(np.float32)
      receipt = c.push(helpers.make_push(i, delta, core=c, base_version=held[i][0]))
      assert receipt.late == (turn >= 1) and receipt.version == turn + 1
      refs[turn + 1] = c.reference(0)[1]
    if waiting is not None:
      # The previous learner pulls only now, after this push closed another round: it gets the newest
      # version from its own round on that was published as a delta from the version it holds.
      j, version = waiting
      base_version, base = held[j]
      pub = c.pull(0, version, have_version=base_version, have_epoch=c.epoch)
      assert (pub.kind, pub.base_version) == ("delta", base_version) and pub.version >= version
      assert len(pub.payload) == codec.encoded_size(N, "int4", BLOCK)
      held[j] = (pub.version, base + codec.decode(pub.payload, "int4", N, BLOCK))
      np.testing.assert_array_equal(held[j][1], refs[pub.version])  # bitwise the syncer's R of that version
    waiting = (i, receipt.version)
  assert c.counters["pulls_full"] == 0 and c.counters["pulls_delta"] == 12


def test_a_round_is_published_from_every_base_its_contributors_hold():
  """One round, one version (the recovery protocol numbers versions as rounds + an offset), one reference
  per base its pushes hold: the main one from the base most of them hold, and a contributor on another base
  gets an int4 delta from its own (before: the full fp32 fragment), which it tracks bitwise from then on; a
  pull under its id, whatever it claims, lands on the same reference; an unknown puller gets main ones."""
  c = helpers.make_core((N,), k=3, downlink="int4", block=BLOCK, clock=helpers.FakeClock(), downlink_history=4,
                        max_grace_s=30.0)
  for i in range(3):
    c.join(i, FP)
  rng = np.random.default_rng(14)
  step = lambda: (0.05 * rng.standard_normal(N)).astype(np.float32)
  held = {}
  for v in range(2):  # versions 1, 2: everyone in
    for i in range(3):
      c.push(helpers.make_push(i, step(), core=c, base_version=v))
    held[v + 1] = c.reference(0)[1]
  assert c.status()["versions"] == [2] and c.status()["rounds"] == [2]
  # Round 3: learners 0 and 1 hold version 2, learner 2 still holds version 1 (it missed version 2).
  receipts = [c.push(helpers.make_push(i, step(), core=c, base_version=base))
              for i, base in ((0, 2), (1, 2), (2, 1))]
  assert [r.version for r in receipts] == [3, 3, 3]
  assert receipts[2].late and not receipts[0].late
  assert c.status()["versions"] == [3] and c.status()["rounds"] == [3]
  pub = c.pull(0, 3, have_version=2, have_epoch=c.epoch)
  assert (pub.kind, pub.version, pub.base_version) == ("delta", 3, 2)
  np.testing.assert_array_equal(held[2] + codec.decode(pub.payload, "int4", N, BLOCK), c.reference(0)[1])
  theta = c.state_dict()["fragments"][0]
  assert (np.abs(c.reference(0)[1] - theta) <= codec.error_bound(theta - held[2], "int4", BLOCK) + 1e-6).all()
  downlink = c._machine.downlink
  assert c.pull(0, 3, have_version=1, have_epoch=c.epoch).kind == "full"  # unknown puller: main references only
  pub1 = c.pull(0, 3, have_version=1, have_epoch=c.epoch, learner_id=2)
  assert (pub1.kind, pub1.version, pub1.base_version) == ("delta", 3, 1)
  assert len(pub1.payload) == codec.encoded_size(N, "int4", BLOCK) < 4 * N / 5  # 228 bytes, not 1,200
  mine = held[1] + codec.decode(pub1.payload, "int4", N, BLOCK)
  np.testing.assert_array_equal(mine, downlink._refs[0][(3, 1)])
  assert (np.abs(mine - theta) <= codec.error_bound(theta - held[1], "int4", BLOCK) + 1e-6).all()
  assert downlink.held_key(0, 2, 3) == (3, 1) and downlink.held_key(0, 0, 3) == (3, 0)
  # Round 4 from both references of version 3: each learner gets one delta and holds R bitwise.
  main3 = c.reference(0)[1]
  for i in range(3):
    assert c.push(helpers.make_push(i, step(), core=c, base_version=3)).version == 4
  for i, base, ref in ((0, main3, c.reference(0)[1]), (2, mine, downlink._refs[0][(4, 1)])):
    pub = c.pull(0, 4, have_version=3, have_epoch=c.epoch, learner_id=i)
    assert (pub.kind, pub.version, pub.base_version) == ("delta", 4, 3)
    np.testing.assert_array_equal(base + codec.decode(pub.payload, "int4", N, BLOCK), ref)
  mine = downlink._refs[0][(4, 1)].copy()
  # Under learner 2's id: a full fetch, or a claim to hold the main reference, gives its own reference.
  np.testing.assert_array_equal(codec.decode(c.pull(0, 0, learner_id=2).payload, "fp32", N), mine)
  assert c.pull(0, 4, have_version=3, have_epoch=c.epoch, learner_id=2).base_version == 3
  np.testing.assert_array_equal(downlink._refs[0][(4, 1)], mine)


def test_references_older_than_the_history_get_the_full_fragment():
  c = helpers.make_core((N,), downlink="int4", block=BLOCK, clock=helpers.FakeClock(), downlink_history=2)
  c.join(0, FP)
  rng = np.random.default_rng(15)
  for _ in range(3):
    commit(c, rng)
  # Learner 0's push based on version 0: R_0 is no longer kept (history 2: versions 2 and 3).
  c.push(helpers.make_push(0, (0.05 * rng.standard_normal(N)).astype(np.float32), core=c, base_version=0))
  pub = c.pull(0, 4, have_version=0, have_epoch=c.epoch)
  assert (pub.kind, pub.version) == ("full", 4)
  with pytest.raises(ValueError, match="downlink_history"):
    helpers.make_core((N,), downlink="int4", downlink_history=0)


def test_no_delta_before_the_first_commit():
  c = make_core()
  pub = c.pull(0, 0, have_version=-1)
  assert pub.kind == "full" and pub.version == 0


def test_fp32_downlink_is_unchanged():
  c = make_core(downlink="fp32")
  rng = np.random.default_rng(3)
  commit(c, rng)
  pub = c.pull(0, 1, have_version=0)
  assert (pub.kind, pub.base_version, pub.codec) == ("full", -1, "fp32")
  assert pub.payload == codec.encode(theta(c), "fp32")
  np.testing.assert_array_equal(c.reference(0)[1], theta(c))
  assert c.state_dict()["references"] is None  # R is Theta: not stored twice


def _assert_same_downlink(a, b, version):
  np.testing.assert_array_equal(a.reference(0)[1], b.reference(0)[1])
  pa = a.pull(0, version, have_version=version - 1, have_epoch=a.epoch)
  pb = b.pull(0, version, have_version=version - 1, have_epoch=b.epoch)
  assert (pa.epoch, pb.epoch) == (a.epoch, b.epoch)
  assert dataclasses.replace(pa, epoch=0) == dataclasses.replace(pb, epoch=0) and pa.kind == "delta"
  assert a.pull(0, version).payload == b.pull(0, version).payload


@pytest.mark.parametrize("via_orbax", [False, True])
def test_state_dict_round_trip_keeps_references_and_delta(tmp_path, via_orbax):
  c = make_core()
  rng = np.random.default_rng(4)
  for _ in range(4):
    commit(c, rng)
  state = c.state_dict()
  if via_orbax:
    ckpt = checkpoint.SyncerCheckpointer(tmp_path / "ck", async_save=False)
    checkpoint.save_core(ckpt, c)
    state, _ = checkpoint.SyncerCheckpointer(tmp_path / "ck").restore()
    ckpt.close()
  fresh = make_core()
  fresh.load_state_dict(state)
  _assert_same_downlink(c, fresh, 4)
  # Both carry on identically: the same next delta bytes.
  commit(c, np.random.default_rng(5))
  commit(fresh, np.random.default_rng(5))
  _assert_same_downlink(c, fresh, 5)


def test_restore_from_an_fp32_downlink_checkpoint():
  # Learners of an fp32-downlink run hold Theta itself: it becomes the reference, and no delta exists yet.
  old = make_core(downlink="fp32")
  commit(old, np.random.default_rng(6))
  c = make_core()
  c.load_state_dict(old.state_dict())
  np.testing.assert_array_equal(c.reference(0)[1], theta(old))
  assert c.pull(0, 1, have_version=0).kind == "full"
  commit(c, np.random.default_rng(7))
  assert c.pull(0, 2, have_version=1, have_epoch=c.epoch).kind == "delta"


def test_epochs_are_random_nonzero_and_redrawn_on_restore():
  c = make_core()
  commit(c, np.random.default_rng(8))
  state = c.state_dict()
  assert "epoch" not in state  # a restored syncer is a new epoch, never the checkpointed one
  fresh = make_core()
  assert 0 < c.epoch < 2**63 and 0 < fresh.epoch < 2**63 and fresh.epoch != c.epoch
  before = fresh.epoch
  fresh.load_state_dict(state)
  assert fresh.epoch not in (0, before, c.epoch)
  assert fresh.pull(0, 1).epoch == fresh.epoch and fresh.status()["epoch"] == fresh.epoch
  c.load_state_dict(state)  # even restoring its own state
  assert c.pull(0, 1).epoch == c.epoch != fresh.epoch


def test_restored_older_syncer_serves_the_full_fragment_to_pre_crash_references():
  """A learner holds R_2 of epoch A; the syncer restarts from its version-1 checkpoint (epoch B) and reaches
  version 3 again with other references: asking for the delta from (2, A) gets the full R_3 of epoch B."""
  c = make_core()
  rng = np.random.default_rng(9)
  commit(c, rng)
  old_state = c.state_dict()  # version 1
  commit(c, rng)
  epoch_a = c.epoch
  pub = c.pull(0, 2, have_version=1, have_epoch=epoch_a)
  assert (pub.kind, pub.epoch) == ("delta", epoch_a)
  held_version, held = c.reference(0)  # the learner's base: R_2 of epoch A
  assert held_version == 2
  c.load_state_dict(old_state)  # killed; restored from the older checkpoint
  epoch_b = c.epoch
  assert epoch_b != epoch_a and c.status()["versions"] == [1]
  commit(c, np.random.default_rng(10))  # other contributions: another R_2
  assert not np.array_equal(c.reference(0)[1], held)
  commit(c, np.random.default_rng(11))  # caught up past what the learner holds
  version, ref = c.reference(0)
  assert version == 3
  pub = c.pull(0, 3, have_version=2, have_epoch=epoch_a)
  assert (pub.kind, pub.version, pub.base_version, pub.codec, pub.epoch) == ("full", 3, -1, "fp32", epoch_b)
  np.testing.assert_array_equal(codec.decode(pub.payload, "fp32", N), ref)
  # The bug this guards against: the delta on top of the pre-crash base is not the syncer's reference.
  delta = c.pull(0, 3, have_version=2, have_epoch=epoch_b)
  assert (delta.kind, delta.base_version, delta.epoch) == ("delta", 2, epoch_b)
  assert not np.array_equal(held + codec.decode(delta.payload, "int4", N, BLOCK), ref)
  assert c.pull(0, 3, have_version=2).kind == "full"  # an unknown epoch (0) is no epoch


def test_version_zero_reference_is_the_same_in_every_epoch():
  # R_0 is the seed's fragment whatever the epoch: a fresh learner (no epoch yet) gets the first delta, and
  # a restored syncer still at version 0 serves it to learners of the previous epoch.
  c = make_core()
  state = c.state_dict()
  c.load_state_dict(state)
  commit(c, np.random.default_rng(12))
  for have_epoch in (0, 12345, c.epoch):
    pub = c.pull(0, 1, have_version=0, have_epoch=have_epoch)
    assert (pub.kind, pub.base_version, pub.epoch) == ("delta", 0, c.epoch)
  np.testing.assert_array_equal(make_core().reference(0)[1] + codec.decode(pub.payload, "int4", N, BLOCK),
                                c.reference(0)[1])


@pytest.mark.parametrize("quorum, num_fragments", [(0, 2), (1, 5)])
def test_learners_hold_the_syncer_reference_bitwise(tmp_path, monkeypatch, quorum, num_fragments):
  """Two learners train with an int4 downlink (K = all, and K = 1 where deltas start from older versions);
  each one's device base is R of the version it adopted (P = 5 = H: leaves split into pieces, each piece's
  base rebuilt from the deltas bitwise)."""
  config = tiny_cpu.get_config()
  config.train.steps = 20
  config.outer.sync_every = 5
  config.outer.num_fragments = num_fragments
  config.outer.downlink_codec = "int4"
  config.outer.min_quorum = quorum
  config.learners.num = 2
  config.learners.devices = 1
  job = inprocess.InProcessRun(config, tmp_path, run_id="downlink-test")
  core = job.core
  # Every reference the syncer ever held, by (fragment, version).
  refs = {(p, 0, 0): core.reference(p)[1] for p in range(core.settings.num_fragments)}
  downlink = core._machine.downlink
  commit_downlink, served = downlink.commit, downlink._served
  tags = {}  # (fragment, learner, version) -> the tag of the reference served

  def recording(p, version, theta, held=(), learners=None):
    published = commit_downlink(p, version, theta, held, learners)
    for key, ref in downlink._refs[p].items():  # one reference per base the round's contributors held
      if key[0] == version:
        refs[(p, *key)] = ref.copy()
    return published

  def serving(p, learner, key, published):
    tags.setdefault((p, learner, key[0]), key[1])
    return served(p, learner, key, published)

  monkeypatch.setattr(downlink, "commit", recording)
  monkeypatch.setattr(downlink, "_served", serving)
  errors = []

  def work(learner):
    try:
      loop_lib.run_learner(learner, should_stop=lambda: bool(errors))
    except BaseException as e:  # noqa: BLE001 - surfaced below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(learner,)) for learner in job.learners]
  for t in threads:
    t.start()
  for t in threads:
    t.join(120)
  try:
    assert not errors, errors
    counters = core.status()["counters"]
    assert counters["rounds"] >= 4
    # Deltas past version 0 (at most one per learner and fragment is from R_0): the learners named the
    # syncer's epoch when they pulled.
    assert counters["pulls_delta"] > 2 * core.settings.num_fragments, counters
    for learner in job.learners:
      base = jax.tree.map(np.asarray, learner.base)
      for p in range(learner.plan.num_fragments):
        held = np.asarray(fragments_lib.gather(learner.plan, base, p), np.float32)
        v = learner.base_version[p]
        np.testing.assert_array_equal(held, refs[(p, v, tags.get((p, learner.learner_id, v), 0))])
      assert learner.base_epoch == [core.epoch] * learner.plan.num_fragments  # set by every adoption
      assert learner.stats.adopted > 0
  finally:
    job.close()


def test_parents_are_the_references_held_most_held_first():
  """The pure rule: one reference per base held (among those kept), the most held first (ties: the newest),
  each learner's base named by the reference it was served; with history 1 only the first."""
  zero = np.zeros(N, np.float32)
  d = downlink_lib.Downlink((N,), "int4", BLOCK, [zero], epoch=7, history=4)
  rng = np.random.default_rng(3)
  theta = lambda: (0.1 * rng.standard_normal(N)).astype(np.float32)
  assert d.parents(0) == [(0, 0)]
  assert d.commit(0, 1, theta(), held=[0], learners=[0]) == 1
  assert d.parents(0, [1, 1, 0], [0, 1, 2]) == [(1, 0), (0, 0)]
  assert d.parents(0, [0, 1], [0, 1]) == [(1, 0), (0, 0)]  # a tie: the newest first
  assert d.parents(0, [5, 9], [0, 1]) == [(1, 0)]  # none kept: the latest
  assert d.commit(0, 2, theta(), held=[1, 1, 0], learners=[0, 1, 2]) == 1  # one version, two references
  assert sorted(k for k in d._refs[0] if k[0] == 2) == [(2, 0), (2, 1)]
  assert d.answer(0, 2, 0, 7, learner=2).base_version == 0 and d.held_key(0, 2, 2) == (2, 1)
  assert d.parents(0, [2, 2], [0, 2]) == [(2, 0), (2, 1)]  # a tie of versions: the main reference first
  one = downlink_lib.Downlink((N,), "int4", BLOCK, [zero], epoch=7, history=1)
  one.commit(0, 1, theta(), held=[0], learners=[0])
  assert one.parents(0, [1, 0], [0, 1]) == [(1, 0)]

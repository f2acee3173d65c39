"""Admission of a push (`syncer/rules/admission.py`) on a fake clock: no claim, norm, duplicate or stranger
changes the global model, and what each hostile push gets back."""

import collections

import numpy as np
import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax.outer import fragments
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import settings as settings_lib
from diloco_jax.syncer.rules import admission

FP = helpers.FP
H, TPB, STEPS = helpers.PERIOD_STEPS, helpers.TOKENS_PER_STEP, helpers.TRAIN_STEPS
make_core, push, frozen, small = helpers.bounded_core, helpers.push_period, helpers.frozen, helpers.small_delta


def test_settings_from_config_bound_the_claims():
  c = config_lib.base_config()
  c.learners.num, c.data.global_batch, c.data.seq_len = 4, 16, 64
  plan = type("Plan", (), {"num_fragments": 1, "size": lambda self, p: 8, "longest_gap": c.outer.sync_every})()
  s = settings_lib.SyncerSettings.from_spec(config_lib.resolve(c), plan, "fp")
  assert (s.num_learners, s.tokens_per_step, s.period_steps, s.max_push_steps) == (4, 4 * 64, c.outer.sync_every,
                                                                                   c.train.steps)
  assert s.max_norm_ratio == c.outer.max_norm_ratio == 10.0
  # A front-loaded schedule: a merge weight counts up to its longest gap, not H.
  c.outer.sync_schedule, c.train.steps = "front_loaded", 160
  plan = fragments.plan_for_config({"w": np.zeros(8, np.float32)}, c)
  s = settings_lib.SyncerSettings.from_spec(config_lib.resolve(c), plan, "fp")
  assert s.period_steps == plan.longest_gap == 38 > c.outer.sync_every


@pytest.mark.parametrize("steps,tokens,why", [
    (H, 10**18, "tokens claimed"),  # the push: tokens=1e18 took the whole merge weight
    (H, H * TPB + 1, "tokens claimed"),
    (0, 1, "tokens claimed"),
    (STEPS + 1, (STEPS + 1) * TPB, "train.steps"),
    (2**62, 2**62 * TPB, "train.steps"),
])
def test_impossible_claims_are_refused_and_change_nothing(steps, tokens, why):
  c, _ = make_core(k=2)
  push(c, 1, small())  # an open round that must stay as it is
  before = frozen(c)
  with pytest.raises(Rejected, match=why) as e:
    push(c, 0, small(seed=1), steps=steps, tokens=tokens)
  assert e.value.reason == "overclaim"
  assert frozen(c) == before
  assert c.counters["rejected"]["overclaim"] == 1 and c.counters["contributions_rejected"] == 1


@pytest.mark.parametrize("rule", ["tokens", "tokens_sq_per_step"])
def test_no_claim_weighs_more_than_an_honest_period(rule):
  # Learner 0 claims the most the schedule allows (all of train.steps); learner 1 an honest period. Both
  # weigh one period: the merge is their plain mean.
  # Two of four learners' pushes make the round: the plain weighted mean, not scaled to their share.
  c, _ = make_core(k=2, merge_rule=rule, scale_partial_rounds=False)
  g0 = c.global_fragments()[0]
  a, b = small(seed=1), small(seed=2)
  push(c, 0, a, steps=STEPS, tokens=STEPS * TPB)
  push(c, 1, b)
  assert c.status()["versions"] == [1]
  np.testing.assert_allclose(c.global_fragments()[0], g0 - (0.5 * a + 0.5 * b), rtol=1e-5, atol=1e-7)
  assert c.counters["tokens_merged"] == (STEPS + H) * TPB  # the tokens are still counted as claimed
  # A shorter honest push (a flush) still weighs less.
  c, _ = make_core(k=2, merge_rule=rule, scale_partial_rounds=False)
  g0 = c.global_fragments()[0]
  push(c, 0, a, steps=5)
  push(c, 1, b)
  w = np.array([5, 10.0]) if rule == "tokens" else np.array([25 / 5, 100 / 10])
  w /= w.sum()
  np.testing.assert_allclose(c.global_fragments()[0], g0 - (w[0] * a + w[1] * b), rtol=1e-5, atol=1e-7)


def test_outliers_are_refused_against_the_fragment_history():
  c, _ = make_core(k=4)
  g_norm = float(np.linalg.norm(c.global_fragments()[0]))
  unit = np.ones(64, np.float32) / 8  # norm 1
  # Warm-up: the reference is the global fragment's own norm.
  before = frozen(c)
  with pytest.raises(Rejected, match="global fragment's own norm") as e:
    push(c, 0, unit * 11 * g_norm)
  assert e.value.reason == "outlier" and frozen(c) == before
  # The example: a finite 3e38 per element (its norm overflows float32): refused, state unchanged.
  with pytest.raises(Rejected) as e:
    push(c, 0, np.full(64, 3e38, np.float32))
  assert e.value.reason == "outlier" and frozen(c) == before
  # Four accepted pushes of norm ~1: now the median is the reference.
  for i, scale in enumerate((1.0, 1.2, 0.9, 1.1)):
    push(c, i, unit * scale)
  assert c.status()["versions"] == [1]
  before = frozen(c)
  with pytest.raises(Rejected, match=r"median of 4 live learners") as e:
    push(c, 0, unit * 10.6, base_version=1)  # > 10 x median(1.0, 1.2, 0.9, 1.1) = 10.5
  assert e.value.reason == "outlier" and frozen(c) == before
  push(c, 0, unit * 10.4, base_version=1)  # within the bound
  assert c.counters["rejected"]["outlier"] == 3 and c.counters["contributions_rejected"] == 3


def test_work_of_several_periods_pushed_again_is_bounded_per_period():
  # After a syncer restart a learner pushes again the work the restored syncer lacks: an outer gradient
  # over several periods, as large as their sum. It is no outlier; the same norm over one period is.
  c, _ = make_core(k=4)
  unit = np.ones(64, np.float32) / 8  # norm 1
  for i, scale in enumerate((1.0, 1.2, 0.9, 1.1)):
    push(c, i, unit * scale)
  before = frozen(c)
  with pytest.raises(Rejected, match="over 10 steps") as e:
    push(c, 0, unit * 40.0, base_version=1)  # 40 > 10 x 1 period x 1.05
  assert e.value.reason == "outlier" and frozen(c) == before
  push(c, 0, unit * 40.0, base_version=1, steps=5 * H)  # 40 <= 10 x 5 periods x 1.05
  with pytest.raises(Rejected, match="5 period") as e:
    push(c, 1, unit * 60.0, base_version=1, steps=5 * H)  # 60 > 52.5: the bound still holds per period
  assert e.value.reason == "outlier"


def test_front_loaded_pushes_are_bounded_per_period_of_the_pushes_behind_the_reference():
  # A front-loaded schedule's syncs cover 2 steps early and up to its longest gap late (here H = 10 is
  # that longest gap): a push over many more steps than the ones behind the median may be as many times
  # larger, no outlier; the same norm over as few steps as theirs is one.
  c, _ = make_core(k=4)
  unit = np.ones(64, np.float32) / 8  # norm 1
  for i in range(4):
    push(c, i, unit * 0.1, steps=2)  # early syncs: 2 steps each, norm 0.1
  before = frozen(c)
  with pytest.raises(Rejected, match="over 2 steps") as e:
    push(c, 0, unit * 1.2, base_version=1, steps=2)  # 1.2 > 10 x 1 period x 0.1
  assert e.value.reason == "outlier" and frozen(c) == before
  push(c, 0, unit * 1.2, base_version=1, steps=H)  # 1.2 <= 10 x 5 periods of 2 steps x 0.1
  with pytest.raises(Rejected, match="5 period") as e:
    push(c, 1, unit * 5.5, base_version=1, steps=H)  # 5.5 > 5: still bounded per period
  assert e.value.reason == "outlier"


def test_a_stale_push_is_compared_with_the_norms_of_its_base_version():
  # A learner stopped for a while pushes the period it took early in training, when outer gradients were
  # larger than the ones the others push now: no outlier against the norms of its own time. The same norm
  # on a recent base is one.
  c, _ = make_core(k=4)
  unit = np.ones(64, np.float32) / 8  # norm 1
  for i in range(4):
    push(c, i, unit * 1.0)  # version 1 published with the median 1.0 as its reference
  for v in range(1, 6):
    for i in range(4):
      push(c, i, unit * 0.05, base_version=v)
  assert c.status()["versions"] == [6]
  before = frozen(c)
  with pytest.raises(Rejected, match="median of 4 live learners") as e:
    push(c, 0, unit * 5.0, base_version=6)  # 5 > 10 x median 0.05
  assert e.value.reason == "outlier" and frozen(c) == before
  push(c, 3, unit * 5.0, base_version=1)  # 5 <= 10 x 1.0, the reference when version 1 was published
  with pytest.raises(Rejected, match="its base version 1") as e:
    push(c, 2, unit * 11.0, base_version=1)  # still bounded by that reference
  assert e.value.reason == "outlier"


def test_shrinking_early_pushes_and_flushes_are_never_outliers():
  # Norms as a run shows them (tiny_cpu, measured): short warm-up pushes, a first full period about 3x
  # larger, then shrinking, ending with half-period flushes.
  c, _ = make_core(k=4, sizes=(64,))
  unit = np.ones(64, np.float32) / 8
  norms = [0.8] * 4 + [2.5] * 4 + [1.2] * 4 + [0.8] * 4 + [0.5] * 4 + [0.3] * 4 + [0.09] * 4
  for v in range(len(norms) // 4):
    for i in range(4):
      push(c, i, unit * norms[4 * v + i], base_version=v)
  assert c.status()["versions"] == [len(norms) // 4]
  assert c.counters["contributions_rejected"] == 0


def test_zero_pushes_do_not_set_the_scale():
  # A first step at lr 0 moves nothing: those pushes must not make every later one an outlier.
  c, _ = make_core(k=4)
  for i in range(4):
    push(c, i, np.zeros(64))
  for i in range(4):
    push(c, i, small(seed=i), base_version=1)
  assert c.status()["versions"] == [2] and c.counters["contributions_rejected"] == 0


def test_a_duplicate_push_gets_the_original_receipt_and_merges_once():
  c, _ = make_core(k=2, scale_partial_rounds=False)  # two of four learners: the plain mean, checked below
  g0 = c.global_fragments()[0]
  a = small(seed=1)
  first = c.push(helpers.make_push(0, a, core=c, steps=H, tokens=H * TPB, incarnation=77, sequence=1))
  before = frozen(c)
  again = c.push(helpers.make_push(0, a, core=c, steps=H, tokens=H * TPB, incarnation=77, sequence=1))
  assert again == first and frozen(c) == before
  assert c.counters["pushes_duplicate"] == 1
  # The same key on another payload: refused.
  with pytest.raises(Rejected) as e:
    c.push(helpers.make_push(0, small(seed=9), core=c, steps=H, tokens=H * TPB, incarnation=77, sequence=1))
  assert e.value.reason == "key_conflict" and frozen(c) == before
  # Another sequence number of the same process is a new push; another learner's same key too.
  b = small(seed=2)
  c.push(helpers.make_push(1, b, core=c, steps=H, tokens=H * TPB, incarnation=77, sequence=1))
  assert c.status()["versions"] == [1] and c.counters["contributions_merged"] == 2
  np.testing.assert_allclose(c.global_fragments()[0], g0 - 0.5 * (a + b), rtol=1e-5, atol=1e-7)
  # A retry after the round closed: still the original receipt, not merged again.
  assert c.push(helpers.make_push(0, a, core=c, steps=H, tokens=H * TPB, incarnation=77,
                                  sequence=1)) == first
  assert c.status()["versions"] == [1] and c.counters["contributions_merged"] == 2


def test_a_replayed_push_is_never_merged_again_and_key_memory_is_bounded():
  # The replay: a keyed push sent again after 16 newer pushes of its learner was merged again (a
  # 16-key window). Now every key a learner may still retry is remembered, and an older key of the same
  # process is refused; memory stays bounded (KEYS_PER_LEARNER keys, INCARNATIONS_PER_LEARNER floors).
  c, _ = make_core(k=1)
  first = helpers.make_push(0, small(seed=0), core=c, steps=H, tokens=H * TPB, incarnation=5, sequence=0)
  c.push(first)
  for seq in range(1, admission.KEYS_PER_LEARNER + 8):
    c.push(helpers.make_push(0, small(seed=seq), core=c, steps=H, tokens=H * TPB, incarnation=5, sequence=seq,
                             base_version=c.status()["versions"][0]))
  state = c._machine.state
  assert len(state.keys[0]) == admission.KEYS_PER_LEARNER and state.key_floors[0] == {5: 7}
  before = frozen(c)
  with pytest.raises(Rejected, match="older than the 256 keys remembered") as e:
    c.push(first)
  assert e.value.reason == "key_conflict" and frozen(c) == before
  # A checkpoint keeps the floor: the replay stays refused after a restart.
  restored, _ = make_core(k=1)
  restored.load_state_dict(c.state_dict())
  with pytest.raises(Rejected, match="older than"):
    restored.push(first)
  # Floors of at most INCARNATIONS_PER_LEARNER processes per learner.
  keys, floors = collections.OrderedDict(), {}
  for incarnation in range(1, 3 * admission.INCARNATIONS_PER_LEARNER):
    for seq in range(admission.KEYS_PER_LEARNER // 64):
      admission.remember_key(keys, floors, (incarnation, seq), None)
  assert len(keys) == admission.KEYS_PER_LEARNER and len(floors) == admission.INCARNATIONS_PER_LEARNER


def test_checkpoints_keep_the_keys_of_settled_contributions_only():
  c, _ = make_core(k=2)
  merged = helpers.make_push(0, small(seed=1), core=c, steps=H, tokens=H * TPB, incarnation=3, sequence=1)
  c.push(merged)
  c.push(helpers.make_push(1, small(seed=2), core=c, steps=H, tokens=H * TPB, incarnation=4, sequence=1))
  pending = helpers.make_push(0, small(seed=3), core=c, steps=H, tokens=H * TPB, incarnation=3, sequence=2,
                              base_version=1)
  c.push(pending)  # in the open round: a checkpoint does not hold it
  state = c.state_dict()
  restored, _ = make_core(k=2)
  restored.load_state_dict(state)
  # The retry of a merged push is a duplicate for the restored syncer too; that of the dropped one merges.
  assert restored.push(merged).round == 0
  assert restored.counters["pushes_duplicate"] == c.counters["pushes_duplicate"] + 1
  restored.push(pending)
  assert restored.status()["open_rounds"]["0"]["contributions"] == 1


@pytest.mark.parametrize("bad_id", [-1, 4, 2**31 - 1, -2**31])
def test_learner_ids_outside_the_run_are_refused_everywhere(bad_id):
  c, _ = make_core(num_learners=4, k=2)
  push(c, 0, small())
  before = frozen(c)
  calls = [lambda: c.join(bad_id, FP), lambda: c.heartbeat(bad_id, 1.0), lambda: c.leave(bad_id),
           lambda: push(c, bad_id, small(seed=1)), lambda: c.check_learner_id(bad_id)]
  for call in calls:
    with pytest.raises(Rejected, match=r"\[0, learners.num=4\)") as e:
      call()
    assert e.value.reason == "learner_id"
  assert frozen(c) == before and c.counters["rejected"]["learner_id"] == len(calls)


def test_copies_of_one_period_never_weigh_more_than_one_period():
  # The attack: 10 copies of one period (fresh keys, or none) took 91% of the merge weight, and 532
  # copies into one K = M round a 266x step and 1.36M tokens. Now a learner has at most PUSHES_PER_ROUND
  # pushes in a round, together weighing one period, and tokens_merged counts its largest claim once.
  c, _ = make_core(k=4, scale_partial_rounds=False)
  g0 = c.global_fragments()[0]
  a = small(seed=1)
  for seq in range(admission.PUSHES_PER_ROUND):
    push(c, 0, a, incarnation=9, sequence=seq + 1)
  before = frozen(c)
  for seq in range(admission.PUSHES_PER_ROUND, 10):
    with pytest.raises(Rejected, match="at most 2") as e:
      push(c, 0, a, incarnation=9 if seq % 2 else 0, sequence=seq + 1)
    assert e.value.reason == "round_share"
  assert frozen(c) == before and c.counters["rejected"]["round_share"] == 10 - admission.PUSHES_PER_ROUND
  others = [small(seed=i + 2) for i in range(3)]
  for i, d in enumerate(others, start=1):
    push(c, i, d)
  assert c.status()["versions"] == [1]
  # Learner 0's copies weigh one period between them: the plain mean of four learners' periods.
  np.testing.assert_allclose(c.global_fragments()[0], g0 - (a + sum(others)) / 4, rtol=1e-5, atol=1e-7)
  assert c.counters["tokens_merged"] == 4 * H * TPB


def test_base_version_0_keeps_no_looser_bound_after_warm_up():
  # The bypass: a push refused on the current base was accepted on base 0, whose seed reference
  # (about 60x the median) held for the whole run.
  c, _ = make_core(k=4)
  unit = np.ones(64, np.float32) / 8  # norm 1
  g_norm = float(np.linalg.norm(c.global_fragments()[0]))
  for v in range(3):
    for i in range(4):
      push(c, i, unit * 0.01 * g_norm, base_version=v)
  before = frozen(c)
  for base in (0, 1, 3):
    with pytest.raises(Rejected) as e:
      push(c, 0, unit * 0.5 * g_norm, base_version=base)  # 50x the others' norms, far under the seed's bound
    assert e.value.reason == "outlier"
  assert frozen(c) == before


def test_the_outlier_reference_cannot_be_ratcheted_by_one_learner():
  # The ratchet: pushing alone (K = 1), one learner drove max|theta| from 1 to 1.4e34 in 3 s, each
  # push just under the bound raising the median behind the next bound. Now the reference is the median of
  # the live learners' own histories: the attacker's best (pushes just under the bound, in one direction)
  # moves the global by at most the bound per round, never more, and the reference stays the honest one.
  c, _ = make_core(k=1, scale_partial_rounds=False)
  unit = np.ones(64, np.float32) / 8
  for i in range(4):
    for _ in range(3):
      push(c, i, small(seed=i), base_version=c.status()["versions"][0])
  st = c._machine.state
  honest = max(float(np.median(st.members[i].norms[0])) for i in (1, 2, 3))  # the others' own medians
  g0 = float(np.linalg.norm(c.global_fragments()[0]))
  for _ in range(100):
    reference = admission.outlier_reference(c.settings, st.fragments[0], helpers.make_push(0, unit, core=c),
                                            st.members, 0.0)[0]
    push(c, 0, unit * 9.99 * reference, base_version=c.status()["versions"][0])
  after = admission.norm_reference(st.fragments[0], 64, st.members, 0, 0.0)[0]
  assert after <= honest  # within the honest learners' own scales, whatever the attacker pushed
  growth = float(np.linalg.norm(c.global_fragments()[0])) - g0
  assert growth <= 100 * 10 * honest  # at most the bound per round: linear, not a ratchet


def test_a_learner_refused_again_and_again_is_reported():
  c, _ = make_core(k=1)
  for i in range(4):
    push(c, i, small(seed=i))
  for n in range(admission.REPEATED_REFUSALS):
    with pytest.raises(Rejected):
      push(c, 2, np.full(64, 1e3, np.float32), base_version=c.status()["versions"][0])
    assert c.status()["refused_repeatedly"] == ([2] if n + 1 >= admission.REPEATED_REFUSALS else [])
  assert c.status()["members"]["2"]["refused_in_row"] == admission.REPEATED_REFUSALS
  c.drain_decisions()
  push(c, 0, small(seed=7), base_version=c.status()["versions"][0])
  assert c.drain_decisions()[-1]["refused_repeatedly"] == [2]
  push(c, 2, small(seed=8), base_version=c.status()["versions"][0])  # an accepted push ends the run
  assert c.status()["refused_repeatedly"] == [] and c.status()["members"]["2"]["refused_total"] == 3


def test_honest_norm_growth_is_followed_as_before():
  # The per-learner histories share out the 16 latest pushes of a run: 4 learners whose norms grow 2.5x a
  # round (a learning-rate warm-up) are never refused, as with one fragment-wide history; 3x is (as before).
  unit = np.ones(64, np.float32) / 8
  for growth, refused in ((2.5, 0), (3.0, 40)):
    c, _ = make_core(k=4)
    norm = 0.001
    for _ in range(14):
      for i in range(4):
        try:
          push(c, i, unit * norm, base_version=c.status()["versions"][0])
        except Rejected:
          pass
      norm *= growth
    assert c.counters["rejected"]["outlier"] == refused

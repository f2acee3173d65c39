"""The learner's recovery rules (learner/recovery.py), pure: the plan after a syncer restart chooses each
action from a constructed situation, travels as JSON (to the other processes of a multi-host learner) and
back unchanged; the catch-up rule judges version jumps."""

import json

import numpy as np

from diloco_jax.learner import recovery
from diloco_jax.learner.comms import SyncResult
from diloco_jax.learner.recovery import Action, FragmentRecovery, MergedReceipt, RecoveryPlan, SettledSync
from diloco_jax.protocol import messages as protocol_messages
from diloco_jax.protocol.messages import EpochRecord, Kind, PushReceipt, Versions

A, B = 11, 22  # lifetime A made rounds 0..; B restored A's checkpoint at 3 rounds, numbered from version 5
N = 5
VERSIONS = Versions({p: 5 for p in range(N)}, epoch=B,
                    history=(EpochRecord(A, (0,) * N, (0,) * N), EpochRecord(B, (3,) * N, (2,) * N)))


def _abandoned(p: int, receipt: PushReceipt | None) -> SyncResult:
  return SyncResult(p, -1, None, late=False, epoch=A, receipt=receipt, abandoned=True)


def _plan(syncs=(), base_versions=(0,) * N, base_epochs=(A,) * N, merged=((),) * N) -> RecoveryPlan:
  return recovery.plan_recovery(VERSIONS, list(syncs), list(base_versions), list(base_epochs), list(merged))


def test_a_push_the_current_syncer_merged_is_adopted_as_its_result():
  result = SyncResult(0, 6, np.zeros(3, np.float32), late=True, kind=Kind.DELTA, base_version=5, epoch=B,
                      receipt=PushReceipt(0, 3, True, 6, B))
  plan = _plan([SettledSync(0, 4, 400, result)], base_versions=(5,) * N, base_epochs=(B,) * N)
  assert plan.fragments[0] == FragmentRecovery(0, Action.RESULT, 0, 6, B, 0, 0, Kind.DELTA, 5, True)
  assert 0 not in plan.to_fetch()


def test_a_push_the_restored_model_holds_is_adopted_from_the_restored_model():
  plan = _plan([SettledSync(1, 4, 400, _abandoned(1, PushReceipt(1, 2, False, 3, A)))])  # round 2 < 3 kept
  assert plan.fragments[1] == FragmentRecovery(1, Action.ADOPT, 0)  # its version and epoch: fetched
  assert plan.to_fetch() == [1]  # the others keep their bases (A's version 0, B's version 2)
  fetched = plan.with_fetched({1: (5, B)})
  assert fetched.fragments[1] == FragmentRecovery(1, Action.ADOPT, 0, 5, B)
  assert fetched.fragments[0] == plan.fragments[0]  # the others unchanged


def test_a_lost_push_on_a_kept_base_keeps_the_base_renamed_and_pushes_its_work_again():
  # Round 3 of lifetime A was lost (B restored 3 rounds); the base, A's version 3, is B's version 3 + 2.
  lost = SettledSync(2, 4, 400, _abandoned(2, PushReceipt(2, 3, False, 4, A)))
  plan = _plan([lost], base_versions=(3,) * N)
  assert plan.fragments[2] == FragmentRecovery(2, Action.KEEP, 0, 5, B, 4, 400)
  # No sync in flight: nothing to push again, the base kept all the same.
  assert plan.fragments[3] == FragmentRecovery(3, Action.KEEP, -1, 5, B, 0, 0)
  # A push refused before any receipt: its work is pushed again too.
  plan = _plan([SettledSync(2, 4, 400, _abandoned(2, None))], base_versions=(3,) * N)
  assert plan.fragments[2] == FragmentRecovery(2, Action.KEEP, 0, 5, B, 4, 400)


def test_the_seed_is_kept_in_every_lifetime():
  plan = _plan(base_versions=(0,) * N, base_epochs=(0,) * N)  # no base from any syncer yet: the seed's
  assert [f.action for f in plan.fragments] == [Action.KEEP] * N
  assert [f.version for f in plan.fragments] == [2] * N  # version 0, in B's numbering


def test_a_lost_base_rebases_and_takes_back_the_lost_merges_it_had_adopted():
  # The base, A's version 4, held round 3, which the restart lost; of the merges adopted, round 1 is kept
  # and round 3 lost: its work comes back with the sync's.
  merged = [()] * N
  merged[3] = (MergedReceipt(A, 1, 10, 100), MergedReceipt(A, 3, 7, 70))
  plan = _plan([SettledSync(3, 4, 400, _abandoned(3, None))], base_versions=(4,) * N, merged=merged)
  assert plan.fragments[3] == FragmentRecovery(3, Action.REBASE, 0, None, B, 4 + 7, 400 + 70)
  assert plan.fragments[4] == FragmentRecovery(4, Action.REBASE, -1, None, B, 0, 0)
  assert plan.to_fetch() == [0, 1, 2, 3, 4]  # every base was A's version 4


def test_the_plan_round_trips_through_json_with_every_action():
  syncs = [SettledSync(2, 4, 400, _abandoned(2, PushReceipt(2, 3, False, 4, A))),
           SettledSync(0, 1, 10, SyncResult(0, 6, None, late=True, kind=Kind.DELTA, base_version=5, epoch=B)),
           SettledSync(1, 2, 20, _abandoned(1, PushReceipt(1, 2, False, 3, A)))]
  merged = [()] * N
  merged[3] = (MergedReceipt(A, 3, 7, 70),)
  plan = _plan(syncs, base_versions=(5, 5, 3, 4, 0), base_epochs=(B, B, A, A, 0), merged=merged)
  assert [f.action for f in plan.fragments] == [Action.RESULT, Action.ADOPT, Action.KEEP, Action.REBASE,
                                                Action.KEEP]
  assert [f.sync_index for f in plan.fragments] == [1, 2, 0, -1, -1]  # its index among the syncs in flight
  plan = plan.with_fetched({1: (5, B), 3: (5, B)})
  text = json.dumps(plan.to_json())
  back = RecoveryPlan.from_json(json.loads(text))
  assert back == plan
  assert isinstance(back.fragments[0].action, Action) and isinstance(back.fragments[0].kind, Kind)


def test_the_catch_up_rule():
  # Before JUMP_WARMUP jumps, the usual jump is the number of learners.
  assert not recovery.is_absence(5 * 4, [], num_learners=4)
  assert recovery.is_absence(5 * 4 + 1, [1, 1], num_learners=4)
  # Then the median of the recent jumps; a jump of at most one usual round is 1 at least.
  assert recovery.is_absence(11, [1, 2, 2, 9], num_learners=4) and not recovery.is_absence(10, [1, 2, 2, 9], 4)
  assert recovery.is_absence(6, [0, 0, 0], num_learners=4) and not recovery.is_absence(5, [0, 0, 0], 4)


def test_an_absence_jump_is_not_a_usual_one():
  watch = recovery.AbsenceWatch(num_learners=2)
  for jump in (2, 2, 2):
    watch.note(jump)
  assert not watch.absent and list(watch.jumps) == [2, 2, 2]
  watch.note(11)
  assert watch.absent and list(watch.jumps) == [2, 2, 2]


def test_a_rebase_push_claims_a_period_for_every_lost_round_it_carries():
  # The base, A's version 9 (round 9), lost rounds 3..8 (B restored 3): 6 rounds, of which the learner's own
  # merge was one (7 steps). The claim covers a period (10 steps) per lost round, beyond its own steps: the
  # syncer bounds the push's norm by the periods it claims, and the lost rounds hold the others' work too.
  merged = [()] * N
  merged[3] = (MergedReceipt(A, 1, 10, 100), MergedReceipt(A, 5, 7, 70))
  claims = recovery.Claims(period_steps=10, max_steps=1000)
  plan = recovery.plan_recovery(VERSIONS, [SettledSync(3, 4, 400, _abandoned(3, None))], [9] * N, [A] * N,
                                merged, claims)
  assert plan.fragments[3] == FragmentRecovery(3, Action.REBASE, 0, None, B, 4 + 6 * 10, 400 + 70)
  assert plan.fragments[4].steps == 6 * 10  # no sync in flight: the lost rounds alone
  # Never over what a push may claim, and never under its own work (its tokens need the steps).
  capped = recovery.plan_recovery(VERSIONS, [SettledSync(3, 4, 400, _abandoned(3, None))], [9] * N, [A] * N,
                                  merged, recovery.Claims(period_steps=10, max_steps=20))
  assert capped.fragments[3].steps == 20 and capped.fragments[0].steps == 20
  tight = recovery.plan_recovery(VERSIONS, [SettledSync(3, 4, 400, _abandoned(3, None))], [9] * N, [A] * N,
                                 merged, recovery.Claims(period_steps=10, max_steps=5))
  assert tight.fragments[3].steps == 4 + 7
  # A base from a lifetime the history does not know: no lost rounds to count, its own lost steps only.
  unknown = recovery.plan_recovery(VERSIONS, [], [9] * N, [99] * N, merged, claims)
  assert unknown.fragments[3].steps == 7 and unknown.fragments[4].steps == 0


def test_lost_rounds_of_a_base():
  history = VERSIONS.history  # A kept 3 rounds; B numbers from version 5 (offset 2)
  assert protocol_messages.lost_rounds(history, A, 9, 0) == 6
  assert protocol_messages.lost_rounds(history, A, 3, 0) == 0 and protocol_messages.lost_rounds(history, A, 2, 0) == 0
  assert protocol_messages.lost_rounds(history, B, 40, 0) == 0  # the current lifetime loses nothing
  assert protocol_messages.lost_rounds(history, 99, 4, 0) is None

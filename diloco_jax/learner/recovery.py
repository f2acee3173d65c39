"""A learner's recovery rules, pure and typed: after a syncer restart, `plan_recovery` settles each fragment
against the restored model into a `RecoveryPlan` (which every process of a multi-host learner applies alike,
sent as JSON); after an absence, `is_absence` is the catch-up rule. The learner's loop (`learner/loop.py`)
applies both. docs/operations.md, "The recovery protocol (learner side)"; docs/algorithm.md, "Learner".
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import statistics
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.messages import Kind, Versions

if TYPE_CHECKING:
  from diloco_jax.learner.comms import SyncResult

RECEIPT_LOG = 64  # accepted pushes remembered per fragment (their work is pushed again if a crash lost it)
CATCH_UP_PERIODS = 5  # a version jump this many times the usual one means the learner was away (`is_absence`)
JUMP_HISTORY = 16  # recent version jumps of adopted fragments; their median is the usual jump
JUMP_WARMUP = 3  # jumps needed before their median is trusted (before: learners.num)


class Action(enum.StrEnum):
  """What a recovery does with one fragment."""

  RESULT = "result"  # the current syncer merged its push itself: adopt that result as usual
  ADOPT = "adopt"  # the restored model holds its push: adopt the restored global fragment
  KEEP = "keep"  # push its work again; its base is still in the restored model (renamed)
  REBASE = "rebase"  # push its work again, and the lost merges it adopted, onto the restored global fragment


@dataclasses.dataclass(frozen=True)
class MergedReceipt:
  """An accepted push whose merged fragment the learner adopted (a later restart may lose that merge)."""

  epoch: int
  round: int
  steps: int
  tokens: int


@dataclasses.dataclass(frozen=True)
class SettledSync:
  """A sync that was in flight when the syncer restarted, settled: the work its push carried and its end."""

  fragment: int
  steps: int
  tokens: int
  result: SyncResult


@dataclasses.dataclass(frozen=True)
class FragmentRecovery:
  """The recovery of one fragment. `version` and `epoch` name the reference its base becomes (None for
  ADOPT and REBASE until the restored global fragment is fetched, `RecoveryPlan.with_fetched`); `steps` and
  `tokens` are the work to push again; `kind`, `base_version` and `late` describe a RESULT's merged fragment."""

  fragment: int
  action: Action
  sync_index: int = -1  # its sync in flight, an index into the recovery's syncs; -1: none
  version: int | None = None
  epoch: int | None = None
  steps: int = 0
  tokens: int = 0
  kind: Kind = Kind.FULL
  base_version: int = -1
  late: bool = False


@dataclasses.dataclass(frozen=True)
class RecoveryPlan:
  """A recovery against the syncer lifetime `epoch`: one `FragmentRecovery` per fragment, in order."""

  epoch: int
  fragments: tuple[FragmentRecovery, ...]

  def to_fetch(self) -> list[int]:
    """The fragments whose restored global fragment the recovery adopts or rebases onto, in order."""
    return [f.fragment for f in self.fragments if f.action in (Action.ADOPT, Action.REBASE)]

  def with_fetched(self, named: Mapping[int, tuple[int, int]]) -> RecoveryPlan:
    """This plan with the (version, epoch) of each fetched fragment in `named`."""
    return dataclasses.replace(self, fragments=tuple(
        dataclasses.replace(f, version=named[f.fragment][0], epoch=named[f.fragment][1])
        if f.fragment in named else f for f in self.fragments))

  def to_json(self) -> dict:
    """A JSON-able form (what process 0 of a multi-host learner publishes); `from_json` reads it back."""
    return {"epoch": self.epoch, "fragments": [
        {**dataclasses.asdict(f), "action": f.action.value, "kind": f.kind.value} for f in self.fragments]}

  @classmethod
  def from_json(cls, data: Mapping) -> RecoveryPlan:
    return cls(int(data["epoch"]), tuple(
        FragmentRecovery(**{**f, "action": Action(f["action"]), "kind": Kind(f["kind"])}) for f in data["fragments"]))


@dataclasses.dataclass(frozen=True)
class Claims:
  """What a learner may claim for a push: `period_steps`, the steps of one sync period (the schedule's
  longest gap), and `max_steps`, the most steps one push may claim (train.steps; 0: no limit)."""

  period_steps: int = 0
  max_steps: int = 0


def plan_recovery(versions: Versions, syncs: Sequence[SettledSync], base_versions: Sequence[int],
                  base_epochs: Sequence[int], merged: Sequence[Sequence[MergedReceipt]],
                  claims: Claims = Claims()) -> RecoveryPlan:
  """The recovery against `versions` (the join's answer from the restored syncer), for a learner whose
  syncs in flight ended as `syncs`, whose bases are (`base_versions`, `base_epochs`) per fragment, and whose
  adopted merges per fragment are `merged`. ADOPT and REBASE fragments are left to fetch (`to_fetch`)."""
  by_fragment = {sync.fragment: (i, sync) for i, sync in enumerate(syncs)}
  return RecoveryPlan(versions.epoch, tuple(
      _plan_fragment(p, versions, *by_fragment.get(p, (-1, None)), base_versions[p], base_epochs[p], merged[p],
                     claims)
      for p in range(len(base_versions))))


def _plan_fragment(p: int, versions: Versions, index: int, sync: SettledSync | None, base_version: int,
                   base_epoch: int, merged: Sequence[MergedReceipt], claims: Claims) -> FragmentRecovery:
  epoch, history = versions.epoch, versions.history
  if sync is not None:
    result = sync.result
    if not result.abandoned and result.epoch == epoch:  # merged by the current syncer itself
      return FragmentRecovery(p, Action.RESULT, index, result.version, result.epoch, kind=Kind(result.kind),
                              base_version=result.base_version, late=bool(result.late))
    receipt = result.receipt
    if receipt is not None and protocol.merged_for_good(history, receipt.epoch, receipt.round, p):
      return FragmentRecovery(p, Action.ADOPT, index)
  # Its push (if any) is not in the restored model: push that work again.
  steps, tokens = (sync.steps, sync.tokens) if sync is not None else (0, 0)
  renamed = protocol.current_version(history, base_epoch, base_version, p)
  if renamed is None and base_epoch == 0 and base_version == 0 and history:
    renamed = history[-1].version_offsets[p]  # the seed: the same in every lifetime
  if renamed is not None:
    return FragmentRecovery(p, Action.KEEP, index, renamed, epoch, steps, tokens)
  # Adopted merges the crash lost are in theta but not in the restored global: rebasing makes the next
  # outer gradient carry them, so their steps and tokens count again.
  lost_own = 0
  for m in merged:
    if not protocol.merged_for_good(history, m.epoch, m.round, p):
      lost_own, tokens = lost_own + m.steps, tokens + m.tokens
  lost = protocol.lost_rounds(history, base_epoch, base_version, p)
  return FragmentRecovery(p, Action.REBASE, index, None, epoch, _rebase_steps(steps, lost_own, lost, claims), tokens)


def _rebase_steps(steps: int, lost_own: int, lost_rounds: int | None, claims: Claims) -> int:
  """The steps a rebase push claims: those of its sync in flight, and for the lost merges it carries its
  own steps in them or one period per lost round when that is more. The lost rounds hold the other
  learners' work as well (under K = 1 about one round in M is its own), and the syncer bounds a push's norm
  by the periods its steps cover: a claim of its own steps alone got rebase pushes refused as outliers.
  Within `max_steps`; tokens stay its own (a merge weight counts at most one period whatever the claim)."""
  claim = steps + max(lost_own, (lost_rounds or 0) * claims.period_steps)
  return max(min(claim, claims.max_steps), steps + lost_own) if claims.max_steps else claim


def is_absence(jump: int, usual_jumps: Sequence[int], num_learners: int) -> bool:
  """Whether a fragment's version jump since its base (the rounds the syncer closed meanwhile) says the
  learner was away (stopped, swapped out, starved of its host) while the others trained.

  Such a learner finds the global model moved on without it: every fragment it did not sync meanwhile is
  many rounds behind the ones it adopts as their syncs come back, and outer gradients from that mix of
  fresh and stale fragments are large, wrong, and refused as outliers. The sign: a jump of more than
  `CATCH_UP_PERIODS` times the usual one (the median of `usual_jumps`, the recent jumps; before
  `JUMP_WARMUP` of them, the number of learners: K = 1 closes about one round per learner and period).
  Versions, unlike wall time, are not fooled by asynchronous dispatch, evals, compilations or a busy host
  that slows everyone alike, and a slow learner's jumps are its usual ones; every process of a multi-host
  learner adopts the same versions, so each reaches the same verdict by itself. The learner then catches up
  (`Learner.after_step`): it settles its syncs in flight, syncs every fragment it holds work for, and adopts
  them all at once.
  """
  usual = statistics.median(usual_jumps) if len(usual_jumps) >= JUMP_WARMUP else num_learners
  return jump > CATCH_UP_PERIODS * max(1.0, usual)


class AbsenceWatch:
  """The recent version jumps of a learner's adopted fragments, and whether one said it was away."""

  def __init__(self, num_learners: int):
    self.num_learners = num_learners
    self.jumps: collections.deque[int] = collections.deque(maxlen=JUMP_HISTORY)
    self.absent = False  # an absence seen and not yet caught up with

  def note(self, jump: int) -> None:
    """A fragment's jump since its base, before its adoption (`is_absence`)."""
    if is_absence(jump, self.jumps, self.num_learners):
      self.absent = True
    else:
      self.jumps.append(jump)  # an absence's jump is not a usual one

"""Admission of a push: who sent it, whether it is a retry, whether it may enter a round. Pure.

Nothing a single learner sends may dominate a merge or poison the global (docs/operations.md, "What a
learner can do"):
* Claims: steps at most `max_push_steps`, tokens at most steps x `tokens_per_step`: "overclaim". A merge
  weight counts at most one period (`weight_inputs`); a learner's pushes in one round at most
  `PUSHES_PER_ROUND` ("round_share"), their weights summed under its largest (`rules/rounds.py`).
* Outliers: a norm over `max_norm_ratio` x the periods its steps cover x the fragment's reference
  (`outlier_problem`, `norm_reference`): a median over the live learners' own histories (one learner
  cannot raise it), never above the anchor, the global's own norm.
* Finiteness and integrity: checksum, and finiteness from the payload's scales (`payload_check`).
* Idempotency: a key accepted before gets its receipt again; the same key on another payload, or a key
  older than the ones remembered of its learner's process, is refused (`retry_of`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import Push
from diloco_jax.protocol.reasons import Reason, shorten
from diloco_jax.syncer.rules import membership
from diloco_jax.syncer.state import NORM_HISTORY, FragmentState, KeyRecord, Member

NORM_WARMUP = 4  # accepted norms needed before their median is the outlier reference
NORM_FLOOR = 1e-3  # the median reference never falls below this times the global fragment's norm
WARMUP_RMS = 0.1  # before NORM_WARMUP accepted norms, the reference is at least this RMS per element
# Idempotency keys remembered per learner: far more than the pushes it can have in flight, so any key it
# may still retry (within its retry deadline) is remembered; an older key of the same process is refused.
KEYS_PER_LEARNER = 256
INCARNATIONS_PER_LEARNER = 64  # processes of one learner whose forgotten keys are refused (the newest)
PUSHES_PER_ROUND = 2  # a learner's pushes into one round of a fragment (an honest one makes one)
REPEATED_REFUSALS = 3  # refusals in a row after which a learner is reported (status, decision records)
MERGE_SAFETY = (Reason.OVERCLAIM, Reason.OUTLIER, Reason.ROUND_SHARE, Reason.KEY_CONFLICT)


@dataclasses.dataclass(frozen=True)
class Refusal:
  """Why a request is refused: one of `protocol.REASONS` and a message."""

  reason: str
  message: str


@dataclasses.dataclass(frozen=True)
class PayloadCheck:
  """What the expensive, state-free checks of a payload found: a refusal, or its parsed form and norm."""

  refusal: Refusal | None
  encoded: codec_lib.Encoded | None = None
  norm: float = 0.0


def sender_problem(settings, push: Push) -> Refusal | None:
  """A learner of this run, of this run's fingerprint (checked before anything else, retries included)."""
  problem = membership.id_problem(push.learner_id, settings.num_learners)
  if problem:
    return Refusal(Reason.LEARNER_ID, problem)
  if push.fingerprint != settings.fingerprint:
    return Refusal(Reason.FINGERPRINT, f"push fingerprint {shorten(push.fingerprint)} != run {settings.fingerprint!r}")
  return None


def retry_of(keys: Mapping[int, collections.OrderedDict], push: Push,
             floors: Mapping[int, Mapping[int, int]] | None = None) -> KeyRecord | Refusal | None:
  """The record of this push's idempotency key if it was accepted before (a retry), a refusal if the key
  came with another payload or is no newer than a key its process had forgotten (`floors`: learner ->
  incarnation -> the highest sequence dropped), else None."""
  if not push.incarnation:
    return None
  record = keys.get(push.learner_id, {}).get((push.incarnation, push.sequence))
  if record is None:
    floor = (floors or {}).get(push.learner_id, {}).get(push.incarnation)
    if floor is not None and push.sequence <= floor:
      return Refusal(Reason.KEY_CONFLICT, f"learner {push.learner_id} push key ({push.incarnation}, "
                     f"{push.sequence}) is older than the {KEYS_PER_LEARNER} keys remembered of its process: "
                     "a replay, never merged again")
    return None
  if record.checksum == push.checksum:
    return record
  return Refusal(Reason.KEY_CONFLICT, f"learner {push.learner_id} reused push key ({push.incarnation}, "
                 f"{push.sequence}) for a different payload")


def remember_key(keys: collections.OrderedDict, floors: dict[int, int], key: tuple[int, int],
                 record: KeyRecord) -> None:
  """Remember an accepted push's key; beyond `KEYS_PER_LEARNER`, the oldest is dropped and its sequence
  raises its process's floor (`retry_of`)."""
  keys[key] = record
  while len(keys) > KEYS_PER_LEARNER:
    (incarnation, sequence), _ = keys.popitem(last=False)
    floors[incarnation] = max(floors.pop(incarnation, sequence), sequence)  # re-inserted: the newest
    while len(floors) > INCARNATIONS_PER_LEARNER:
      del floors[next(iter(floors))]


def refused_repeatedly(members: Mapping[int, Member]) -> list[int]:
  """The learners whose latest REPEATED_REFUSALS pushes (or more) were all refused for merge safety
  (`MERGE_SAFETY`): a buggy learner, or a stolen token. Status and decision records list them."""
  return sorted(i for i, m in members.items() if m.refused_in_row >= REPEATED_REFUSALS)


def round_share_problem(rnd, push: Push) -> Refusal | None:
  """A learner's further push into a round that already holds `PUSHES_PER_ROUND` of its pushes."""
  if rnd is None:
    return None
  mine = sum(1 for c in rnd.contributions if c.learner_id == push.learner_id)
  if mine < PUSHES_PER_ROUND:
    return None
  return Refusal(Reason.ROUND_SHARE, f"learner {push.learner_id} already has {mine} pushes in fragment "
                 f"{push.fragment}'s open round (at most {PUSHES_PER_ROUND}): wait for the version it publishes")


def push_problem(settings, members: Mapping[int, Member], fragments: Sequence[FragmentState], epoch: int,
                 push: Push, now: float) -> Refusal | None:
  """Membership, fragment, epoch, codec, shape, metadata, version and claims, in that order (cheap)."""
  s = settings
  member = members.get(push.learner_id)
  if member is None:
    return Refusal(Reason.UNKNOWN_LEARNER, f"learner {push.learner_id} is not a member of this syncer (never "
                   "joined, or pruned after its lease lapsed)")
  if not membership.live(member, now):
    why = "left" if member.left else "lease expired (heartbeat to renew)"
    return Refusal(Reason.NOT_MEMBER, f"learner {push.learner_id} is not a live member: {why}")
  if not 0 <= push.fragment < s.num_fragments:
    return Refusal(Reason.UNKNOWN_FRAGMENT, f"fragment {push.fragment} not in [0, {s.num_fragments})")
  if not s.owns(push.fragment):
    return Refusal(Reason.WRONG_SHARD, f"fragment {push.fragment} belongs to another syncer shard; this one "
                   f"serves fragments {list(s.owned)}")
  if push.base_epoch not in (0, epoch):
    return Refusal(Reason.EPOCH, f"base_version {push.base_version} is numbered by syncer epoch {push.base_epoch}, "
                   f"this syncer's epoch is {epoch}: it restarted; join again and recover (docs/operations.md)")
  if push.codec != s.codec:
    return Refusal(Reason.CODEC, f"push codec {shorten(push.codec)}, this run uses {s.codec!r}")
  want = codec_lib.encoded_size(s.sizes[push.fragment], s.codec, s.block)
  if len(push.payload) != want:
    return Refusal(Reason.SHAPE, f"fragment {push.fragment} ({s.sizes[push.fragment]} elements) needs a {want}-byte "
                   f"{s.codec} payload, got {len(push.payload)} bytes")
  if push.steps < 0 or push.tokens < 0 or push.base_version < 0:
    return Refusal(Reason.METADATA, f"steps ({push.steps}), tokens ({push.tokens}) and base_version "
                   f"({push.base_version}) must be >= 0")
  version = fragments[push.fragment].version
  if push.base_version > version:
    return Refusal(Reason.FUTURE_VERSION, f"base_version {push.base_version} is ahead of fragment {push.fragment}'s "
                   f"version {version}")
  if s.max_push_steps and push.steps > s.max_push_steps:
    return Refusal(Reason.OVERCLAIM, f"{push.steps} steps claimed; no learner of this run takes more than "
                   f"train.steps={s.max_push_steps}")
  if s.tokens_per_step and push.tokens > push.steps * s.tokens_per_step:
    return Refusal(Reason.OVERCLAIM, f"{push.tokens} tokens claimed over {push.steps} steps; a learner takes at "
                   f"most {s.tokens_per_step} tokens per step")
  return None


def payload_check(settings, push: Push) -> PayloadCheck:
  """Checksum, finiteness and norm: the expensive part, a function of the payload alone (the core runs it
  outside its lock). The payload is not decoded: finiteness from its scales, the norm from its codes and
  scales (`codec.finite`, `codec.norm`)."""
  s = settings
  crc = codec_lib.checksum(push.payload)
  if crc != push.checksum:
    return PayloadCheck(Refusal(Reason.CHECKSUM, f"payload CRC-32 {crc:#010x} != declared {push.checksum:#010x}"))
  encoded = codec_lib.parse(push.payload, s.codec, s.sizes[push.fragment], s.block)
  if not codec_lib.finite(encoded, threads=s.merge_threads):
    return PayloadCheck(Refusal(Reason.NONFINITE, f"the decoded outer gradient for fragment {push.fragment} holds "
                                "NaN or Inf"))
  return PayloadCheck(None, encoded, codec_lib.norm(encoded, threads=s.merge_threads))


def period_cap(settings) -> int:
  """The steps of one schedule period (H, or a non-periodic schedule's longest gap); 0: no cap."""
  return settings.period_steps


def weight_inputs(settings, push: Push) -> tuple[int, int]:
  """(steps, tokens) as the merge weight counts them: at most one schedule period's."""
  steps, tokens = push.steps, push.tokens
  cap = period_cap(settings)
  if cap:
    steps = min(steps, cap)
    if settings.tokens_per_step:
      tokens = min(tokens, cap * settings.tokens_per_step)
  return steps, tokens


def anchor_reference(fragment: FragmentState, size: int) -> float:
  """The warm-up reference, the global fragment's own norm (an RMS of WARMUP_RMS per element at least, so
  that a fragment of zeros has a usable scale): no reference is ever larger."""
  return max(fragment.global_norm, WARMUP_RMS * math.sqrt(size))


def warmed_up(fragment: FragmentState) -> bool:
  return len(fragment.norms) >= NORM_WARMUP


def learner_medians(members: Mapping[int, Member] | None, p: int, now: float | None) -> list[float]:
  """Each live member's median of its own recent accepted norms of fragment p, ascending."""
  out = []
  for m in (members or {}).values():
    history = m.norms.get(p)
    if history and (now is None or membership.live(m, now)):
      out.append(float(np.median(history)))
  return sorted(out)


def norm_reference(fragment: FragmentState, size: int, members: Mapping[int, Member] | None = None,
                   p: int = 0, now: float | None = None) -> tuple[float, str]:
  """The norm a fragment's outer gradients are compared with, and what it is: during warm-up the anchor
  (`anchor_reference`); then the median over the live learners' own medians (the lower of two: one learner,
  whose own history is one entry, cannot raise it; the fragment's median when none is live), floored at
  NORM_FLOOR x the global's norm, never above the anchor."""
  anchor = anchor_reference(fragment, size)
  if not warmed_up(fragment):
    return anchor, "the global fragment's own norm (too few accepted pushes yet)"
  medians = learner_medians(members, p, now)
  if medians:
    # With two learners the lower: one learner alone never raises the reference above another's.
    reference = medians[0] if len(medians) == 2 else float(np.median(medians))
    what = f"the median of {len(medians)} live learners' own recent norms"
  else:
    reference, what = float(np.median(fragment.norms)), f"the median of its last {len(fragment.norms)} accepted norms"
  reference = max(reference, NORM_FLOOR * fragment.global_norm)
  if reference > anchor:
    return anchor, "the global fragment's own norm"
  return reference, what


def learner_window(settings) -> int:
  """Accepted norms kept per learner and fragment: the fragment's NORM_HISTORY shared out among the run's
  learners (at least 2), so the reference follows a run's norms as closely as one fragment-wide history
  of the latest NORM_HISTORY pushes would."""
  return max(2, NORM_HISTORY // max(int(settings.num_learners), 1))


def _period_steps(fragment: FragmentState, settings) -> float:
  """The steps of one period for the outlier bound: the period cap, or fewer when the median push behind
  the reference covered fewer (a front-loaded schedule's early syncs are a few steps apart)."""
  if len(fragment.norm_steps) >= NORM_WARMUP:
    return max(1.0, min(float(period_cap(settings)), float(np.median(fragment.norm_steps))))
  return float(period_cap(settings))


def outlier_reference(settings, fragment: FragmentState, push: Push, members: Mapping[int, Member] | None = None,
                      now: float | None = None) -> tuple[float, str]:
  """The reference a push is compared with: today's (`norm_reference`), or for a push on a base version
  remembered from after warm-up, the larger reference of that version's time (a stale push is compared with
  the norms of its own time). Never above the anchor: no base version keeps a looser bound."""
  p, size = push.fragment, settings.sizes[push.fragment]
  reference, what = norm_reference(fragment, size, members, p, now)
  at_base = min(fragment.version_reference.get(push.base_version, 0.0), anchor_reference(fragment, size))
  if at_base > reference:
    return at_base, f"the reference when its base version {push.base_version} was published"
  return reference, what


def outlier_problem(settings, fragment: FragmentState, push: Push, norm: float,
                    members: Mapping[int, Member] | None = None, now: float | None = None) -> Refusal | None:
  """A push whose norm is far above the fragment's reference (module docstring); None when the bound is off.
  A push of n periods (work pushed again after a syncer restart, or after a cut-off) may be up to n periods'
  change, but never over `max_norm_ratio` x the anchor (the global's own norm)."""
  s = settings
  if not s.max_norm_ratio > 0:
    return None
  p, size = push.fragment, s.sizes[push.fragment]
  reference, what = outlier_reference(s, fragment, push, members, now)
  periods = max(1.0, push.steps / _period_steps(fragment, s)) if period_cap(s) else 1.0
  bound = min(periods * reference, anchor_reference(fragment, size))
  if periods * reference > bound:
    periods, reference, what = 1.0, bound, "the global fragment's own norm"
  if norm <= s.max_norm_ratio * bound:
    return None
  return Refusal(Reason.OUTLIER, f"outer gradient norm {norm:.4g} of fragment {p} over {push.steps} steps exceeds "
                 f"outer.max_norm_ratio={s.max_norm_ratio:g} x {periods:g} period(s) x {reference:.4g}, {what}")

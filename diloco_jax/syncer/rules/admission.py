"""Admission of a push: who sent it, whether it is a retry, whether it may enter a round. Pure.

Nothing a single push claims or sends may dominate a merge or poison the global (docs/algorithm.md):
* Claims: steps at most `max_push_steps` (train.steps), tokens at most steps x `tokens_per_step` (the
  largest learner's batch): "overclaim". The merge weight counts at most one schedule period
  (`weight_inputs`).
* Outliers: a push whose norm exceeds `max_norm_ratio` x the periods its steps cover x the fragment's
  reference norm is refused (`outlier_problem`). The reference is the median of the last accepted norms
  (floored at `NORM_FLOOR` x the global's norm) or, during warm-up, the global fragment's own norm; a push
  on an older base may use the larger reference of its base's time.
* Finiteness and integrity: checksum, and finiteness from the payload's scales (`payload_check`).
* Idempotency: a key accepted before gets its receipt again; the same key on another payload is refused.
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
from diloco_jax.syncer.state import FragmentState, KeyRecord, Member

NORM_WARMUP = 4  # accepted norms needed before their median is the outlier reference
NORM_FLOOR = 1e-3  # the median reference never falls below this times the global fragment's norm
WARMUP_RMS = 0.1  # before NORM_WARMUP accepted norms, the reference is at least this RMS per element
KEYS_PER_LEARNER = 16  # idempotency keys remembered per learner


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


def retry_of(keys: Mapping[int, collections.OrderedDict], push: Push) -> KeyRecord | Refusal | None:
  """The record of this push's idempotency key if it was accepted before (a retry), a refusal if the key
  came with another payload, else None."""
  if not push.incarnation:
    return None
  record = keys.get(push.learner_id, {}).get((push.incarnation, push.sequence))
  if record is None or record.checksum == push.checksum:
    return record
  return Refusal(Reason.KEY_CONFLICT, f"learner {push.learner_id} reused push key ({push.incarnation}, "
                 f"{push.sequence}) for a different payload")


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


def norm_reference(fragment: FragmentState, size: int) -> tuple[float, str]:
  """The norm a fragment's outer gradients are compared with, and what it is."""
  if len(fragment.norms) >= NORM_WARMUP:
    return (max(float(np.median(fragment.norms)), NORM_FLOOR * fragment.global_norm),
            f"the median of its last {len(fragment.norms)} accepted norms")
  # A fragment that is all zeros still gets a usable scale: an RMS of WARMUP_RMS per element.
  return (max(fragment.global_norm, WARMUP_RMS * math.sqrt(size)),
          "the global fragment's own norm (too few accepted pushes yet)")


def _period_steps(fragment: FragmentState, settings) -> float:
  """The steps of one period for the outlier bound: the period cap, or fewer when the median push behind
  the reference covered fewer (a front-loaded schedule's early syncs are a few steps apart)."""
  if len(fragment.norm_steps) >= NORM_WARMUP:
    return max(1.0, min(float(period_cap(settings)), float(np.median(fragment.norm_steps))))
  return float(period_cap(settings))


def outlier_problem(settings, fragment: FragmentState, push: Push, norm: float) -> Refusal | None:
  """A push whose norm is far above the fragment's reference (module docstring); None when the bound is off."""
  s = settings
  if not s.max_norm_ratio > 0:
    return None
  p, size = push.fragment, s.sizes[push.fragment]
  reference, what = norm_reference(fragment, size)
  # The seed (version 0) had the warm-up reference; a version no longer remembered, today's.
  at_base = fragment.version_reference.get(push.base_version, 0.0)
  if push.base_version == 0 and 0 in fragment.version_round:
    at_base = max(fragment.seed_norm, WARMUP_RMS * math.sqrt(size))
  if at_base > reference:
    reference, what = at_base, f"the reference when its base version {push.base_version} was published"
  # A push of n periods (work pushed again after a syncer restart, or after a cut-off) may be up to n
  # periods' change; its steps are bounded by the claim check.
  periods = max(1.0, push.steps / _period_steps(fragment, s)) if period_cap(s) else 1.0
  if norm <= s.max_norm_ratio * periods * reference:
    return None
  return Refusal(Reason.OUTLIER, f"outer gradient norm {norm:.4g} of fragment {p} over {push.steps} steps exceeds "
                 f"outer.max_norm_ratio={s.max_norm_ratio:g} x {periods:g} period(s) x {reference:.4g}, {what}")

"""The messages that cross the line between a learner and the syncer (both sides import them, and nothing of
each other):

* `Push` (a learner's outer gradient for one fragment) and its `PushReceipt`;
* `Published` (a global fragment as served, of `Kind` full or delta);
* `Versions` (what a join answers: versions, epoch and the epoch history a learner recovers with after a
  syncer restart, see docs/operations.md "Recovery"), its `EpochRecord`s and the history's arithmetic
  (`kept_rounds`, `current_version`, `merged_for_good`);
* `PullCall` and `HeartbeatCall`: a Pull and a Heartbeat as the service receives them;
* `OBSERVER_ID`, the id of a caller that pulls without ever joining.

Refusals are in `reasons.py`, chunking in `chunking.py`, the interfaces in `interfaces.py`, the protobuf
form in `convert.py`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping

# The id an observer (the global-model evaluator, `status`) uses on its calls: it pulls and asks for the
# status without ever joining, so it is no member and never counts toward a quorum.
OBSERVER_ID = -1


class Kind(enum.StrEnum):
  """What a `Published` payload decodes to: the fragment itself, or a change from a reference."""

  FULL = "full"
  DELTA = "delta"


@dataclasses.dataclass(frozen=True)
class Push:
  """A learner's outer gradient for one fragment. `payload` encodes delta = base - local with `codec`."""

  learner_id: int
  fingerprint: str
  fragment: int
  base_version: int  # the version of the global fragment the learner's base is
  steps: int  # inner steps since that fragment's last sync
  tokens: int  # tokens over those steps
  codec: str
  payload: bytes
  checksum: int  # codec.checksum(payload)
  # The idempotency key (learner_id, incarnation, sequence): incarnation is random per learner process
  # start, sequence counts that process's pushes. A retry carries the same key, and the syncer answers a
  # key it already accepted with the original receipt instead of merging the push again. 0: no key.
  incarnation: int = 0
  sequence: int = 0
  # The epoch of the syncer whose numbering base_version is in (0: unspecified, taken as the current one).
  # A syncer refuses a push based on another epoch ("epoch"): after a restart the learner recovers first.
  base_epoch: int = 0


@dataclasses.dataclass(frozen=True)
class PushReceipt:
  fragment: int
  round: int  # the round of the fragment this contribution went into (an index into its history)
  late: bool  # base_version < the fragment's version when the push arrived
  version: int = -1  # the version whose publication merges this contribution; -1: unknown
  epoch: int = 0  # the epoch of the syncer that accepted it (0: unknown)
  # Seconds this push arrived after the middle of the other learners' latest pushes of its fragment,
  # wrapped into half a sync period (> 0: late, < 0: early; 0: unknown). The learner moves its next sync of
  # the fragment toward the others' by a share of it (`learner/phase.py`, `syncer/rules/quorum.py`).
  phase_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class EpochRecord:
  """One syncer lifetime in the history of the global model (see docs/operations.md, "Recovery").

  `start_rounds[p]`: how many rounds of fragment p the model held when this lifetime began (the restored
  checkpoint's; 0 for the first); `version_offsets[p]`: the published version minus the rounds held,
  constant within a lifetime (a restored syncer numbers its versions from at least the highest version
  ever published, so versions seen by learners never go backwards).
  """

  epoch: int
  start_rounds: tuple[int, ...]
  version_offsets: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Versions:
  """What `join` answers: `versions` {fragment: version} (of the fragments the serving syncer owns), the
  serving syncer's `epoch` (0: unknown) and `history` (its lifetimes, oldest first, the current one last)."""

  versions: Mapping[int, int]
  epoch: int = 0
  history: tuple[EpochRecord, ...] = ()

  def __post_init__(self):
    object.__setattr__(self, "versions", dict(self.versions))  # a copy: the sender's dict may change
    object.__setattr__(self, "history", tuple(self.history))


@dataclasses.dataclass(frozen=True)
class Published:
  """A global fragment as served to learners: decode with `codec.decode(payload, codec, size, block)`.

  `Kind.FULL`: the decoded vector is the fragment at `version`. `Kind.DELTA`: it is the change from the
  reference of `base_version` (< version) of the same syncer `epoch`, to be added to the base the learner
  holds (one float32 add). See `syncer/downlink.py`.
  """

  fragment: int
  version: int
  codec: str
  payload: bytes
  checksum: int
  kind: Kind = Kind.FULL
  base_version: int = -1  # for a delta: the version whose reference it applies to; -1 for a full fragment
  epoch: int = 0  # the serving syncer's epoch (random per syncer lifetime); 0: unknown


def kept_rounds(history: tuple[EpochRecord, ...], epoch: int, fragment: int) -> float | None:
  """How many rounds of `fragment` from the lifetime `epoch` are still in the current global model: up to
  the rounds the next lifetime of `history` started from (a syncer restored from a checkpoint keeps the
  rounds up to it and loses the later ones); unlimited for the current (last) lifetime; None when `epoch`
  is not in `history` (its rounds were all lost, or the history is too short to tell)."""
  for k, record in enumerate(history):
    if record.epoch == epoch:
      return history[k + 1].start_rounds[fragment] if k + 1 < len(history) else math.inf
  return None


def current_version(history: tuple[EpochRecord, ...], epoch: int, version: int, fragment: int) -> int | None:
  """The version, in the current lifetime's numbering (the last of `history`), of the global fragment that
  was `version` in lifetime `epoch`; None when that fragment is not in the current model's history (it was
  lost with a crash, or comes from an unknown lifetime)."""
  if not history:
    return None
  for record in history:
    if record.epoch == epoch:
      rounds = version - record.version_offsets[fragment]
      kept = kept_rounds(history, epoch, fragment)
      if rounds < 0 or kept is None or rounds > kept:
        return None
      return rounds + history[-1].version_offsets[fragment]
  return None


def lost_rounds(history: tuple[EpochRecord, ...], epoch: int, version: int, fragment: int) -> int | None:
  """How many rounds the global fragment that was `version` in lifetime `epoch` held beyond what the
  current model kept of that lifetime (0 when it was kept whole); None when `epoch` is not in `history`."""
  for record in history:
    if record.epoch == epoch:
      kept = kept_rounds(history, epoch, fragment)
      return max(0, int(version - record.version_offsets[fragment] - kept)) if kept != math.inf else 0
  return None


def merged_for_good(history: tuple[EpochRecord, ...], epoch: int, round_: int, fragment: int) -> bool:
  """Whether the contribution that lifetime `epoch` put into round `round_` of `fragment` is (or, for the
  current lifetime, will be) in the current global model: its round closed before the lifetime that
  followed `epoch` was restored, or `epoch` is the current lifetime."""
  kept = kept_rounds(history, epoch, fragment)
  return kept is not None and round_ < kept


@dataclasses.dataclass(frozen=True)
class PullCall:
  """A Pull as the service receives it (see `Transport.pull`); `have_version` -1 and `have_epoch` 0: the
  caller says nothing of what it holds (it gets the full fragment)."""

  learner_id: int
  fingerprint: str
  fragment: int
  min_version: int
  timeout_s: float
  have_version: int = -1
  have_epoch: int = 0


@dataclasses.dataclass(frozen=True)
class HeartbeatCall:
  """A Heartbeat as the service receives it (see `Transport.heartbeat`)."""

  learner_id: int
  fingerprint: str
  step_time_s: float
  step: int | None = None
  blocked: bool = False

"""The syncer's state, typed: one record per member, per open round and its contributions, per fragment.

`SyncerState` is everything a `SyncerCore` decides from; `syncer/rules/` read it (and `now`) and return
decisions, and the core applies them. Arrays (each fragment's global vector and Nesterov momentum) are
held here and changed in place only by a round's close (`syncer/close.py`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from diloco_jax.outer import chunked
from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import EpochRecord, PushReceipt
from diloco_jax.protocol.reasons import REASONS

NORM_HISTORY = 16  # accepted outer-gradient norms kept per fragment, and per learner and fragment
MAX_DECISIONS = 10_000  # decision records kept until the shell drains them (the oldest are dropped beyond)
# Counters that describe the global model: restored with it from a checkpoint. Every other counter is a
# running total of events, kept across restarts by the journal.
MODEL_COUNTERS = ("rounds", "contributions_merged", "contributions_late", "tokens_merged",
                  "tokens_merged_by_fragment")


@dataclasses.dataclass(slots=True)
class Member:
  """A learner the syncer knows: its lease and what its heartbeats and pushes said."""

  lease_until: float
  progress_at: float  # when the learner last showed progress (joined, stepped, blocked, pushed)
  step_time_s: float = 0.0
  step: int | None = -1  # its inner-step counter in its latest heartbeat (-1: never sent; None: not sent)
  blocked: bool = False  # its latest heartbeat said it waits on the syncer
  left: bool = False
  expiry_counted: bool = False  # counters["leases_expired"] already counts this lapse
  stall_counted: bool = False  # counters["learner_stalls"] already counts this stall
  step_at: float | None = None  # clock time of the latest heartbeat with a step counter
  last_push: float | None = None  # clock time of its last accepted push
  # Inner steps of its contributions merged since this syncer started, summed over fragments (each
  # fragment's contributions count the same steps: `status` divides by P).
  steps_merged: int = 0
  # Per fragment, the merge rule's raw weight of its latest push (capped claims): one period of its work.
  period_weights: dict[int, float] = dataclasses.field(default_factory=dict)
  # Per fragment, its own recent accepted norms (clipped): its entry in the outlier reference.
  norms: dict[int, collections.deque] = dataclasses.field(default_factory=dict)
  refused_in_row: int = 0  # its pushes refused for merge safety since its last accepted one
  refused_total: int = 0  # its pushes refused for merge safety, in all


@dataclasses.dataclass(slots=True)
class Contribution:
  """One accepted push, held as it arrived (checked, not decoded) until its round closes."""

  learner_id: int
  base_version: int
  steps: int  # as claimed (within the bounds)
  tokens: int
  encoded: codec_lib.Encoded
  norm: float  # its L2 norm, from the payload (`codec.norm`)
  arrived: float
  weight_steps: int  # what the merge weight counts: capped at one schedule period
  weight_tokens: int
  key: tuple[int, int] | None = None  # its idempotency key (incarnation, sequence)


@dataclasses.dataclass(slots=True)
class KeyRecord:
  """An idempotency key accepted before: the payload's checksum and the receipt a retry gets again."""

  checksum: int
  receipt: PushReceipt
  settled: bool = False  # its round closed (merged or refused): checkpoints keep the key


@dataclasses.dataclass(slots=True)
class Round:
  """A fragment's open round. The quorum fields are set once, when the quorum is reached."""

  opened: float
  contributions: list[Contribution] = dataclasses.field(default_factory=list)
  deadline: float | None = None
  quorum_at: float | None = None  # when the quorum was reached (the grace window runs from here)
  grace_s: float = 0.0
  step_times_s: tuple[float, ...] = ()  # of the contributors in at the quorum, in order of arrival
  t_sync_s: float = 0.0
  waited_for: tuple[int, ...] = ()  # counted learners not yet in at the quorum
  stuck_since: float | None = None  # since when it waits only on learners blocked on other stuck rounds

  def contributors(self) -> list[int]:
    """Distinct contributing learners, in order of first arrival."""
    return list(dict.fromkeys(c.learner_id for c in self.contributions))

  def first_arrivals(self) -> dict[int, float]:
    """Each contributor's first arrival time."""
    first: dict[int, float] = {}
    for c in self.contributions:
      first.setdefault(c.learner_id, c.arrived)
    return first


@dataclasses.dataclass(slots=True)
class FragmentState:
  """One fragment at the syncer: its global vector and momentum, versions, open round and norm history.

  `version_round` and `version_reference` remember, for recent versions, the rounds closed when each was
  published (staleness counts rounds) and the outlier reference then (a stale push is compared with the
  norms of its own time)."""

  global_vec: np.ndarray
  momentum: np.ndarray
  global_norm: float
  momentum_norm: float = 0.0
  seed_norm: float = 0.0  # the global's norm when this lifetime began: the warm-up outlier reference
  version: int = 0
  rounds: int = 0  # rounds closed (= rounds the model holds); the index of the next round
  cycle_open: bool = False  # delayed Nesterov: partial rounds folded into the momentum, not yet applied
  pending_share: float = 0.0  # their share of a full round
  version_round: dict[int, int] = dataclasses.field(default_factory=lambda: {0: 0})
  version_reference: dict[int, float] = dataclasses.field(default_factory=dict)
  open: Round | None = None
  t_sync: float = 0.0  # EMA of this fragment's close time (merge + outer step + downlink encode)
  norms: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=NORM_HISTORY))
  norm_steps: collections.deque = dataclasses.field(
      default_factory=lambda: collections.deque(maxlen=NORM_HISTORY))  # the steps of each norm
  refused_at: int = -1  # the version a refused round left in place
  arrivals: dict[int, float] = dataclasses.field(default_factory=dict)  # learner -> its latest push's arrival


@dataclasses.dataclass(slots=True)
class SinceStart:
  """Since this core started (not checkpointed; `status` reports them)."""

  rounds: int = 0
  contributors: int = 0  # distinct contributors of those rounds, summed
  grace_wait_s: float = 0.0  # their waits from quorum to close, summed


@dataclasses.dataclass(slots=True)
class SyncerState:
  """Everything the syncer core decides from."""

  fragments: list[FragmentState]
  history: list[EpochRecord]  # the lifetimes of the global model, the current one last
  started: float
  members: dict[int, Member] = dataclasses.field(default_factory=dict)
  keys: dict[int, collections.OrderedDict] = dataclasses.field(default_factory=dict)  # learner -> key -> record
  # learner -> incarnation -> the highest sequence whose key was dropped (older keys are refused)
  key_floors: dict[int, dict[int, int]] = dataclasses.field(default_factory=dict)
  counters: dict[str, Any] = dataclasses.field(default_factory=dict)
  since_start: SinceStart = dataclasses.field(default_factory=SinceStart)
  decisions: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=MAX_DECISIONS))
  decisions_dropped: int = 0

  @property
  def epoch(self) -> int:
    return self.history[-1].epoch

  @property
  def versions(self) -> list[int]:
    return [f.version for f in self.fragments]

  @property
  def rounds(self) -> list[int]:
    return [f.rounds for f in self.fragments]


def fragment_state(global_vec: np.ndarray, threads: int, momentum: np.ndarray | None = None) -> FragmentState:
  """A fragment's state around its global vector (and momentum: zeros unless given), norms taken."""
  momentum = np.zeros_like(global_vec) if momentum is None else momentum
  norm = chunked.norm(global_vec, threads)
  return FragmentState(global_vec, momentum, norm, chunked.norm(momentum, threads), seed_norm=norm)


def new_state(fragments: Sequence[np.ndarray], epoch: int, started: float, threads: int) -> SyncerState:
  """A fresh syncer state from the initial global fragments (float32 vectors)."""
  n = len(fragments)
  return SyncerState([fragment_state(f, threads) for f in fragments],
                     [EpochRecord(epoch, (0,) * n, (0,) * n)], started, counters=new_counters(n))


def new_counters(num_fragments: int) -> dict[str, Any]:
  """Every counter at zero (`status` shows them; the journal keeps the event counters across crashes)."""
  return {
      "rounds": 0,
      "contributions_merged": 0,
      "contributions_late": 0,
      "contributions_rejected": 0,
      "rejected": {r: 0 for r in REASONS},
      "tokens_merged": 0,
      "tokens_merged_by_fragment": [0] * num_fragments,
      "contributions_accepted": 0,
      "bytes_in": 0,
      "bytes_out": 0,
      "pulls_full": 0,
      "pulls_delta": 0,
      "joins": 0,
      "leaves": 0,
      "leases_expired": 0,
      "learner_stalls": 0,
      "deadlocks_broken": 0,  # rounds closed short of their quorum because they waited on each other
      "members_pruned": 0,
      "pushes_duplicate": 0,
      "rounds_refused": 0,  # rounds that would have published a non-finite value
      "contributions_dropped": 0,  # the contributions of those rounds
      "tick_errors": 0,  # exceptions the ticker survived
      # Restarts (`attach_journal`): lifetimes, and what the crashes took from the global model (merged
      # rounds and contributions after the restored checkpoint; contributions of open rounds). The learners
      # push that work again (docs/operations.md, "Recovery").
      "restarts": 0,
      "rounds_rolled_back": 0,
      "contributions_rolled_back": 0,
      "tokens_rolled_back": 0,
      "contributions_lost_open": 0,
      "rounds_closed_at_stop": 0,
  }


def merge_counters(num_fragments: int, *sources: dict) -> dict[str, Any]:
  """Fresh counters updated by each source in turn (missing keys keep their defaults)."""
  out = new_counters(num_fragments)
  for source in sources:
    for k, v in source.items():
      if k == "rejected":
        out[k].update({r: int(n) for r, n in v.items()})
      elif k == "tokens_merged_by_fragment":
        if len(v) == num_fragments:
          out[k] = [int(n) for n in v]
      else:
        out[k] = v
  return out


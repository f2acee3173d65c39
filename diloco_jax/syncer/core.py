"""The syncer's state machine: membership, per-fragment rounds, merges and outer steps. No transport.

One `SyncerCore` serves all learners of a run; it implements `protocol.SyncerAPI`. Transports
(`transports/inprocess.py`, the gRPC service `syncer/service.py`) call `join`, `heartbeat`, `push`, `pull`,
and `syncer/ticker.py` calls `tick` at `next_deadline()` (`push`, `heartbeat` and a blocking `pull` tick
too). The clock is injectable, so the
whole policy can be tested with a fake clock and no sleeps.

Membership. A learner joins with the run's fingerprint (another fingerprint is refused) and holds a lease
of `lease_s` seconds, renewed by every join and heartbeat. A learner whose lease ran out, or that left, is
not live: it does not count toward the quorum's denominator, and its pushes are refused ("not_member")
until it heartbeats (expired lease) or joins again (left). Its pushes already received still merge.
Negative ids are observers' (`protocol.OBSERVER_ID`: the global model's evaluator, `status`): they pull
and read the status without joining, and a join with one is refused, so an observer is never a member.

Progress. Heartbeats carry the learner's inner-step counter and whether it is blocked on the syncer. A live
learner counts toward quorums only while it makes progress: its counter changed, it said it was blocked,
or it pushed, within the last `stall_s` seconds plus one of its own step times. A learner that stops
(SIGSTOP, kill -9, cut off, hung) therefore stops gating rounds within that bound, long before its lease
lapses, and counts again with its next heartbeat that shows progress. A heartbeat without a counter
(step -1) counts as progress (clients that do not send one keep the lease-only rule).

Rounds, per fragment p. A round opens with its first contribution. With L counted learners, it may close
once `effective_quorum(policy, L)` distinct learners contributed (the time the K-th arrived is `t_quorum`
after the opening); it then stays open for `round_grace_s(policy, offsets, step_times, t_quorum, t_sync)`
seconds (`syncer/policy.py`, the paper's Eq. 3 per learner): offsets and step times are those of the
contributors in at the quorum, each learner's step time the robust estimate it reports with its
heartbeats (the median of its recent steps; a learner that never reported gets the median of the counted
learners' reports), and t_sync a running average (EMA) of this fragment's merge + outer step + encode
time, measured on the same clock. It closes early as soon as every counted learner has contributed. Once
the quorum is reached, the deadline is fixed. Closing: every push j gets the coefficient
`c_j = w_j / W * (1 + s_j)^-beta` (`outer.merge_coefficients`: w_j the merge rule's raw weight of its capped
claims, below; staleness s_j the rounds closed since the push's base version; W the raw weight of one
period of every learner the round answers for: with `scale_partial_rounds` every counted learner and every
contributor, each counted once with the weight of its latest push of this fragment, else only the
contributors), the merged outer gradient `sum_j c_j v_j` (optionally RDA), and the Nesterov outer step
with the round's share of a full round (`outer.make_outer_optimizer`: the momentum moves once per full
share, delayed Nesterov); the new global fragment is published for the downlink as one version (below:
a delta from the base version most of the round's pushes hold), and waiting pulls are woken. So a round
holding part of the counted learners' work moves the model by that share of a full round (k/n for equal
learners; by tokens when their batches differ), a learner that pushed two periods into one round has both summed,
and a lone stale push keeps its discount. Contributions are held as they arrived (their payloads, checked
at push time: checksum, finiteness and norm, none of which decodes a quantized payload), and the close
decodes, weighs, sums and steps them in one chunked pass over the fragment (`outer.apply_round`, on
`merge_threads` threads), updating the global and its momentum in place (the momentum vector also holds
the pending sum of a cycle of partial rounds: no extra fragment-sized state). A contribution that
arrives after its round's deadline goes into the next round (never lost); one based on an older version
("late") is merged with its staleness discount. The receipt of a push names the version that will merge
it (`PushReceipt.version`): the learner waits for that one, not for any newer version than its base.

Decisions. Closing a round builds a record of what was decided (`decision_record`: who contributed, with
which base, staleness, tokens and coefficient; who the grace window waited for and who arrived in it; the
quorum time, the grace window and its inputs, how long the round stayed open, why it closed). The core
keeps the latest records in a bounded queue; `drain_decisions()` hands them to the shell that writes
them (`rounds.jsonl`: `syncer/app.py`, `inprocess.py`).

Downlink: `syncer/downlink.py` (reference-tracking deltas from the version the round's contributors
hold, epochs). The core draws a new epoch when it is created and on every `load_state_dict`.

Lifetimes and versions. The core keeps the history of the lifetimes (epochs) its global model went through
(`protocol.EpochRecord`: the rounds each began from and its version offset), checkpointed with the state,
and answers it with every join, so that a learner can tell, after a restart, which of its pushes and which
of its bases the restored model still holds (docs/operations.md, "Recovery"). A push based on another
epoch's numbering is refused ("epoch"): the learner recovers first. A restored core numbers its versions
from at least the highest version it ever published (`attach_journal`), so versions never go backwards.

Journal. With `attach_journal`, every change of versions or counters is handed, under the lock and in
order, to a journal (`syncer/checkpoint.py`): versions before any learner can see them, and the counters
that must survive a kill -9 (bytes, joins, rejections, ...). Counters that describe the global model
(rounds, contributions and tokens merged) come from the checkpoint: the merges a crash lost are counted
again when the learners push that work again.

Shards. A core may own only some fragments (`SyncerSettings.owned`, from `placement.assign_shards`: one
shard of a sharded syncer, docs/architecture.md). It holds arrays, rounds, checkpoints and epochs only for
those; the others hold no arrays (zero-length placeholders keep the per-fragment lists indexed by
fragment), and a push or pull of one is refused ("wrong_shard"). `join` answers the versions of the owned
fragments only. Membership is the same as unsharded: each shard keeps its own leases from the heartbeats
that reach it.

Identity. Learner ids lie in [0, num_learners): any call naming another id is refused ("learner_id").
Members whose lease lapsed (or that left) more than `lease_s` ago are pruned, and `status` shows at most
`STATUS_MEMBERS` members in detail (with counts of all), so membership and the status reply stay bounded.

Rejections. `push` validates everything before touching state; on any problem it raises `Rejected` with
one of `REASONS`, increments `counters["rejected"][reason]` and `counters["contributions_rejected"]`, and
changes nothing else.

Merge safety (nothing a single push claims or sends can dominate a merge or poison the global):
* Claims. A push's steps may not exceed `max_push_steps` (the run's `train.steps`: no learner runs more,
  whatever restarts or late rounds happened) and its tokens may not exceed steps x `tokens_per_step` (the
  largest learner's batch tokens of one inner step): "overclaim". The merge weight then counts at most one
  schedule period: tokens and steps enter `outer.raw_weights` capped at `sync_every` steps (H, or a
  non-periodic schedule's longest gap, `FragmentPlan.longest_gap`) (and their
  tokens), which every regular, flush, late or restarted learner's push stays within, so no claim weighs
  more than an honest learner's full period.
* Outliers. A push whose outer-gradient norm exceeds `max_norm_ratio` times the fragment's reference
  norm, times the periods its steps cover (`max(1, steps / period)`, the period `sync_every` or, once the
  median is the reference, the median steps of the pushes behind it if fewer: work pushed again after a
  restart spans several periods), is refused ("outlier"): the reference (for a push on an older base,
  the larger of this and the reference when its base version was published) is the median of the last `NORM_HISTORY` accepted norms of
  that fragment (floored at `NORM_FLOOR` x the global fragment's norm), or, before `NORM_WARMUP` were
  accepted (a new run, a restart), the global fragment's own norm (an outer gradient is one period's
  change of the fragment; at least an RMS of `WARMUP_RMS` per element, for a fragment of zeros). Legitimate pushes shrink over training; the measured worst ratio to the
  median in a tiny_cpu run is about 3 (the first full period after the lr warm-up's short ones).
* Finiteness. A round whose merged update, new global fragment or outer-optimizer state would hold a
  non-finite value is refused whole: nothing changes (version, global, momentum: the in-place step writes
  only a result that the norms of its inputs prove finite, or that a read-only pass found finite, see
  `outer.apply_round`), its contributions are dropped (`counters["rounds_refused"]`,
  `counters["contributions_dropped"]`, an error log line), and pulls waiting for the next version get the
  current one at once (as after a rejected push), so no learner waits on a version that its dropped push
  was to make.
* Idempotency. A push with a key (`Push.incarnation` != 0) that this core already accepted gets its
  original receipt and is not merged again (`counters["pushes_duplicate"]`); the same key on another
  payload is refused ("key_conflict"). The last `KEYS_PER_LEARNER` keys of each learner are kept; the
  keys of settled contributions (their round closed) go into checkpoints, so a retry that reaches a
  restarted syncer is merged again only if the checkpoint does not hold its effect.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import math
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from diloco_jax.outer import chunked
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import merge as outer
from diloco_jax.protocol.messages import REASONS, EpochRecord, Published, Push, PushReceipt, Rejected, Versions, shorten
from diloco_jax.syncer.downlink import Downlink, new_epoch
from diloco_jax.syncer.settings import SyncerSettings
from diloco_jax.syncer.rules.quorum import QuorumPolicy, effective_quorum, estimate_step_time, round_grace_s

log = logging.getLogger(__name__)

_T_SYNC_EMA = 0.2  # weight of the newest t_sync measurement
MAX_HISTORY = 64  # lifetimes kept in the history (older ones: their learners rebase, see operations.md)
# Counters that describe the global model: restored with it from a checkpoint. Every other counter is a
# running total of events, kept across restarts by the journal.
MODEL_COUNTERS = ("rounds", "contributions_merged", "contributions_late", "tokens_merged",
                  "tokens_merged_by_fragment")
NORM_HISTORY = 16  # accepted outer-gradient norms kept per fragment (the outlier reference is their median)
NORM_WARMUP = 4  # accepted norms needed before the median is the reference
NORM_FLOOR = 1e-3  # the median reference never falls below this times the global fragment's norm
WARMUP_RMS = 0.1  # before NORM_WARMUP accepted norms, the reference is at least this RMS per element
KEYS_PER_LEARNER = 16  # idempotency keys remembered per learner
STATUS_MEMBERS = 64  # members shown in detail by `status` (all are counted)
STATUS_IDS = 1024  # ids listed by `status` (live learners, round contributors); all are counted
_MAX_DECISIONS = 10_000  # decision records kept for `drain_decisions` (the oldest are dropped beyond)
_VERSIONS_REMEMBERED = 4096  # per fragment, the round each recent version was published in (staleness)


@dataclasses.dataclass
class _Member:
  lease_until: float
  progress_at: float  # when the learner last showed progress (joined, stepped, blocked, pushed)
  step_time_s: float = 0.0
  step: int = -1  # the learner's inner-step counter in its latest heartbeat (-1: never sent)
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

  def live(self, now: float) -> bool:
    return not self.left and now <= self.lease_until

  def progressing(self, now: float, stall_s: float) -> bool:
    return now - self.progress_at <= stall_s + self.step_time_s

  def counted(self, now: float, stall_s: float) -> bool:
    return self.live(now) and self.progressing(now, stall_s)


@dataclasses.dataclass
class _Contribution:
  learner_id: int
  base_version: int
  steps: int  # as claimed (within the bounds)
  tokens: int
  # The outer gradient as it arrived (checked, not decoded: a round decodes its contributions chunk by
  # chunk when it closes, see `outer.apply_round`), and its L2 norm (taken at push time from the payload,
  # `codec.norm`: the outlier check, RDA and the round's finiteness bound use it).
  encoded: codec_lib.Encoded
  norm: float
  arrived: float
  weight_steps: int  # what the merge weight counts: capped at one schedule period
  weight_tokens: int
  key: tuple[int, int] | None = None  # (incarnation, sequence)


@dataclasses.dataclass
class _KeyRecord:
  checksum: int
  receipt: PushReceipt
  settled: bool = False  # its round closed (merged or refused): checkpoints keep the key


@dataclasses.dataclass
class _Round:
  opened: float
  contributions: list[_Contribution] = dataclasses.field(default_factory=list)
  deadline: float | None = None  # fixed once the quorum is reached
  quorum_at: float | None = None  # when the quorum was reached (the grace window runs from here)
  # Set at the quorum, for the decision record: the grace window and its inputs, who it waits for.
  grace_s: float = 0.0
  step_times_s: tuple[float, ...] = ()  # of the contributors in at the quorum, in order of arrival
  t_sync_s: float = 0.0
  waited_for: tuple[int, ...] = ()  # live learners not yet in at the quorum
  stuck_since: float | None = None  # since when it waits only on learners blocked on other stuck rounds

  def contributors(self) -> list[int]:
    """Distinct contributing learners, in order of first arrival."""
    return list(dict.fromkeys(c.learner_id for c in self.contributions))


def _new_counters(num_fragments: int) -> dict[str, Any]:
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
      # Restarts (attach_journal): lifetimes, and what the crashes took from the global model (merged
      # rounds and contributions after the restored checkpoint; contributions of open rounds). The learners
      # push that work again (docs/operations.md, "Recovery").
      "restarts": 0,
      "rounds_rolled_back": 0,
      "contributions_rolled_back": 0,
      "tokens_rolled_back": 0,
      "contributions_lost_open": 0,
      "rounds_closed_at_stop": 0,
  }


def decision_record(fragment: int, version: int, rnd: _Round, closed: float, why: str, live: Sequence[int],
                    staleness: Sequence[int], coefficients: Sequence[float], period_weight: float,
                    answered: int, t_sync_s: float, share: float) -> dict:
  """What a round decided, as plain JSON values (times in seconds from the round's opening).

  `contributions`: one entry per push in arrival order (learner, base version, staleness, steps, tokens,
  arrival, coefficient). `quorum_s`, `grace_s`, `step_times_s`, `t_sync_s`: the grace window and its inputs
  (`syncer/policy.py`), `waited_for`: the live learners not yet in at the quorum, `arrived_in_grace`: those
  of them that made it, `open_s`: how long the round stayed open, `close`: "all_in" (every live learner
  contributed), "deadline", or "deadlock" (`_deadlocked_locked`). `period_weight`, `answered_for`: W and the learners it sums over, `share`:
  the share of a full round of work the round held (1 for everyone's period; before the discount),
  `moved`: the sum of the coefficients (the share with the staleness discount).
  """
  first = {}
  for c in rnd.contributions:
    first.setdefault(c.learner_id, c.arrived)
  quorum_at = rnd.quorum_at if rnd.quorum_at is not None else rnd.opened
  return {
      "fragment": fragment, "version": version, "close": why,
      "contributors": list(first)[:STATUS_IDS], "live": list(live)[:STATUS_IDS],
      "contributions": [
          {"learner": c.learner_id, "base_version": c.base_version, "staleness": int(s), "steps": c.steps,
           "tokens": c.tokens, "arrived_s": c.arrived - rnd.opened, "coefficient": float(w)}
          for c, s, w in zip(rnd.contributions, staleness, coefficients)],
      "quorum_s": quorum_at - rnd.opened, "grace_s": rnd.grace_s, "step_times_s": list(rnd.step_times_s),
      "t_sync_s": rnd.t_sync_s, "waited_for": list(rnd.waited_for)[:STATUS_IDS],
      "arrived_in_grace": [i for i in rnd.waited_for if i in first][:STATUS_IDS],
      "open_s": closed - rnd.opened, "merge_s": t_sync_s,
      "period_weight": float(period_weight), "answered_for": answered, "share": share,
      "moved": float(np.sum(coefficients)),
  }


def _merge_counters(num_fragments: int, *sources: dict) -> dict[str, Any]:
  """Fresh counters updated by each source in turn (missing keys keep their defaults)."""
  out = _new_counters(num_fragments)
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


class SyncerCore:
  """The transport-free syncer; thread-safe. See the module docstring for the rules."""

  def __init__(
      self,
      settings: SyncerSettings,
      initial_fragments: Sequence[np.ndarray],
      clock: Callable[[], float] = time.monotonic,
  ):
    if len(initial_fragments) != settings.num_fragments:
      raise ValueError(f"got {len(initial_fragments)} initial fragments for outer.num_fragments="
                       f"{settings.num_fragments}")
    self.settings = settings
    self.clock = clock
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    self._globals: list[np.ndarray] = []
    for p, frag in enumerate(initial_fragments):
      # Another shard's fragment: a zero-length placeholder (whatever was passed for it).
      frag = np.array(frag if settings.owns(p) else (), np.float32).reshape(-1)
      if frag.size != settings.held_sizes[p]:
        raise ValueError(f"initial fragment {p} has {frag.size} elements, expected {settings.held_sizes[p]}")
      self._globals.append(frag)
    n = settings.num_fragments
    # Per fragment: the Nesterov momentum (float32, like the global; both updated in place by a close).
    self._momenta = [np.zeros_like(g) for g in self._globals]
    # Delayed Nesterov (`outer.delayed_nesterov_step_`): whether a cycle of partial rounds is open (their
    # gradients folded into the momentum vector), and their share of a full round.
    self._cycle_open = [False] * n
    self._pending_shares = [0.0] * n
    self._versions = [0] * n
    self._rounds = [0] * n  # index of each fragment's next round to close (= rounds the model holds)
    # Rounds closed when each recent version was published: staleness counts rounds.
    self._version_round: list[dict[int, int]] = [{0: 0} for _ in range(n)]
    # The outlier reference when each recent version was published: a stale push (a learner stopped or
    # slow since its base) is compared with the norms of its own time, not only with today's smaller ones.
    self._version_reference: list[dict[int, float]] = [{} for _ in range(n)]
    self._open: list[_Round | None] = [None] * n
    self._t_sync = [0.0] * n
    self._members: dict[int, _Member] = {}
    self._norms = [collections.deque(maxlen=NORM_HISTORY) for _ in range(n)]
    self._norm_steps = [collections.deque(maxlen=NORM_HISTORY) for _ in range(n)]  # the steps of each norm
    # L2 norms of each global fragment and momentum (`chunked.norm`): the outlier check's scale, and what
    # lets a round prove its result finite before writing in place (`outer.apply_round`).
    self._global_norms = [chunked.norm(g, settings.merge_threads) for g in self._globals]
    self._global_norms_at_start = list(self._global_norms)  # the seed's warm-up outlier reference
    self._momentum_norms = [0.0] * n
    self._refused_at = [-1] * n  # the version a refused round left in place
    self._keys: dict[int, collections.OrderedDict[tuple[int, int], _KeyRecord]] = {}
    self.counters = _new_counters(n)
    # Since this core started (not checkpointed; `status` reports them): rounds closed, their distinct
    # contributors and their grace waits (quorum to close), summed.
    self._started = clock()
    self._since_start = {"rounds": 0, "contributors": 0, "grace_wait_s": 0.0}
    self._downlink = Downlink(settings.held_sizes, settings.downlink_codec, settings.block, self._globals,
                              epoch=new_epoch(), threads=settings.merge_threads, history=settings.downlink_history)
    self._decisions: collections.deque[dict] = collections.deque(maxlen=_MAX_DECISIONS)
    self.decisions_dropped = 0
    self._history = [EpochRecord(self._downlink.epoch, (0,) * n, (0,) * n)]
    self._journal: Callable[[dict, bool], None] | None = None

  @property
  def epoch(self) -> int:
    """This syncer lifetime's epoch (`syncer/downlink.py`); redrawn by `load_state_dict`."""
    return self._downlink.epoch

  def history(self) -> tuple[EpochRecord, ...]:
    """The lifetimes of this global model, oldest first, the current one last."""
    with self._lock:
      return tuple(self._history)

  def max_payload_bytes(self) -> int:
    """The largest valid push payload: the largest fragment in the run's uplink codec."""
    s = self.settings
    return max(codec_lib.encoded_size(n, s.codec, s.block) for n in s.held_sizes)

  # ---- journal ----

  def journal_record(self) -> dict:
    """What the journal holds: versions, rounds, epoch and counters, as JSON values."""
    with self._lock:
      return self._journal_record_locked()

  def _journal_record_locked(self) -> dict:
    return {"fingerprint": self.settings.fingerprint, "epoch": self.epoch, "versions": list(self._versions),
            "rounds": list(self._rounds), "counters": copy.deepcopy(self.counters),
            "open_contributions": sum(len(r.contributions) for r in self._open if r is not None)}

  def _changed(self, versions: bool = False) -> None:
    # Called with the lock held after every change worth keeping across a crash; `versions`: the versions
    # moved (the journal makes them durable before any learner can see them).
    if self._journal is not None:
      self._journal(self._journal_record_locked(), versions)

  def attach_journal(self, journal: Callable[[dict, bool], None], record: dict | None = None) -> None:
    """Start journaling to `journal(record, versions_changed)` (called under the lock), after applying the
    previous lifetime's last `record` (from `journal`'s file): versions are raised to at least its versions
    (they never go backwards, even when the checkpoint is older), event counters continue from it, and what
    the crash lost (rounds merged after the checkpoint, open-round contributions) is counted. Call once,
    after `load_state_dict` and before serving."""
    with self._lock:
      if record is not None:
        if record.get("fingerprint") != self.settings.fingerprint:
          raise ValueError(f"journal fingerprint {record.get('fingerprint')!r} != run {self.settings.fingerprint!r}")
        self._apply_journal_locked(record)
      self._journal = journal
      self._changed(versions=True)

  def _apply_journal_locked(self, record: dict) -> None:
    n = self.settings.num_fragments
    versions = [int(v) for v in record["versions"]]
    if len(versions) != n or len(record["rounds"]) != n:
      raise ValueError(f"journal holds {len(versions)} fragments, this run has {n}")
    floor = [max(v, f) for v, f in zip(self._versions, versions)]
    if floor != self._versions:
      # Renumber this lifetime from the highest version published: nothing was served in it yet.
      self._versions = floor
      offsets = tuple(v - r for v, r in zip(floor, self._rounds))
      self._history[-1] = dataclasses.replace(self._history[-1], version_offsets=offsets)
      self._downlink = Downlink.renumbered(self._downlink, floor)
      self._version_round = [{v: r} for v, r in zip(floor, self._rounds)]
      self._version_reference = [{} for _ in self._rounds]
    saved = _merge_counters(n, record.get("counters", {}))
    model = {k: copy.deepcopy(self.counters[k]) for k in MODEL_COUNTERS}
    events = {}
    for k, v in saved.items():
      if k in MODEL_COUNTERS:
        continue
      if k == "rejected":
        events[k] = {r: max(int(a), int(self.counters["rejected"].get(r, 0))) for r, a in v.items()}
      else:
        events[k] = max(v, self.counters.get(k, 0))
    self.counters = _merge_counters(n, events, model)
    c = self.counters
    c["restarts"] += 1
    c["rounds_rolled_back"] += max(0, sum(int(r) for r in record["rounds"]) - sum(self._rounds))
    c["contributions_rolled_back"] += max(0, saved["contributions_merged"] - model["contributions_merged"])
    c["tokens_rolled_back"] += max(0, saved["tokens_merged"] - model["tokens_merged"])
    c["contributions_lost_open"] += int(record.get("open_contributions", 0))
  def count(self, name: str, n: int = 1) -> None:
    """Add to one of `counters` (e.g. "tick_errors", counted by the ticker)."""
    with self._lock:
      self.counters[name] = self.counters.get(name, 0) + n
      self._changed()

  # ---- identity ----

  def _refuse(self, reason: str, message: str) -> Rejected:
    # Called with the lock held: counts the refusal by reason (journaled: it survives a kill -9).
    self.counters["rejected"][reason] += 1
    self._changed()
    return Rejected(reason, message)

  def _id_problem(self, learner_id) -> str | None:
    """Why `learner_id` is not one of this run's learners, or None if it is."""
    if isinstance(learner_id, int) and 0 <= learner_id < self.settings.num_learners:
      return None
    return (f"learner id {shorten(learner_id)} is not one of this run's learners "
            f"[0, learners.num={self.settings.num_learners})")

  def _check_id_locked(self, learner_id) -> None:
    problem = self._id_problem(learner_id)
    if problem:
      raise self._refuse("learner_id", problem)

  def check_learner_id(self, learner_id: int) -> None:
    """Raise Rejected("learner_id") unless 0 <= learner_id < learners.num."""
    with self._lock:
      self._check_id_locked(learner_id)

  # ---- membership ----

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Admit (or re-admit, after a crash or a lapsed lease) a learner; returns {fragment: version} with
    this core's epoch and history."""
    with self._lock:
      self._check_id_locked(learner_id)
      if fingerprint != self.settings.fingerprint:
        raise self._refuse("fingerprint", f"learner {learner_id} has run fingerprint {shorten(fingerprint)}, "
                           f"this syncer serves {self.settings.fingerprint!r} (different run or config)")
      now = self.clock()
      old = self._members.get(learner_id)
      self._members[learner_id] = _Member(lease_until=now + self.settings.lease_s, progress_at=now,
                                          step_time_s=old.step_time_s if old else 0.0,
                                          step=old.step if old else None,
                                          step_at=old.step_at if old else None,
                                          last_push=old.last_push if old else None,
                                          steps_merged=old.steps_merged if old else 0,
                                          period_weights=old.period_weights if old else {})
      self.counters["joins"] += 1
      self._changed()
      return Versions(((p, v) for p, v in enumerate(self._versions) if self.settings.owns(p)), epoch=self.epoch,
                      history=tuple(self._history))

  def leave(self, learner_id: int) -> None:
    """The learner stops counting toward quorums at once; its pushes already in still merge."""
    with self._lock:
      self._check_id_locked(learner_id)
      member = self._members.get(learner_id)
      if member is not None and not member.left:
        member.left = True
        self.counters["leaves"] += 1
        self._changed()
      self._tick_locked()

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the learner's lease (reviving a lapsed one); `step_time_s` > 0 feeds the step-time estimate;
    `step` (its inner-step counter; None: not sent; shown by `status`) and `blocked` say whether it makes
    progress (module docstring, "Progress"). Returns this core's epoch."""
    with self._lock:
      self._check_id_locked(learner_id)
      member = self._members.get(learner_id)
      if member is None:
        raise Rejected("unknown_learner", f"learner {learner_id} is not a member of this syncer (never "
                       "joined, or pruned after its lease lapsed): join again")
      if member.left:
        raise Rejected("not_member", f"learner {learner_id} left; join again")
      now = self.clock()
      member.lease_until = now + self.settings.lease_s
      member.expiry_counted = False
      if step_time_s > 0:
        member.step_time_s = float(step_time_s)
      if step is None or step != member.step or blocked:
        member.progress_at = now
        member.stall_counted = False
      if step is not None:
        member.step, member.step_at = int(step), now
      member.blocked = bool(blocked)
      self._tick_locked()
      return self.epoch

  def live_learners(self) -> list[int]:
    with self._lock:
      return self._live(self.clock())

  def counted_learners(self) -> list[int]:
    """The live learners that make progress: those rounds wait for."""
    with self._lock:
      return self._counted(self.clock())

  def _live(self, now: float) -> list[int]:
    return sorted(i for i, m in self._members.items() if m.live(now))

  def _counted(self, now: float) -> list[int]:
    return sorted(i for i, m in self._members.items() if m.counted(now, self.settings.stall_s))

  # ---- pushes ----

  def _reject(self, reason: str, message: str) -> Rejected:
    # Called with the lock held; the counters are the only state a rejection changes.
    self.counters["contributions_rejected"] += 1
    return self._refuse(reason, message)

  def _check_sender_locked(self, push: Push) -> None:
    """Who sent it: a learner of this run (checked before anything else, duplicates included)."""
    problem = self._id_problem(push.learner_id)
    if problem:
      raise self._reject("learner_id", problem)
    if push.fingerprint != self.settings.fingerprint:
      raise self._reject("fingerprint", f"push fingerprint {shorten(push.fingerprint)} != run "
                         f"{self.settings.fingerprint!r}")

  def _seen_locked(self, push: Push) -> PushReceipt | None:
    """The original receipt if this push's idempotency key was accepted before, else None."""
    if not push.incarnation:
      return None
    record = self._keys.get(push.learner_id, {}).get((push.incarnation, push.sequence))
    if record is None:
      return None
    if record.checksum != push.checksum:
      raise self._reject("key_conflict", f"learner {push.learner_id} reused push key "
                         f"({push.incarnation}, {push.sequence}) for a different payload")
    self.counters["pushes_duplicate"] += 1
    return record.receipt

  def _validate_locked(self, push: Push) -> None:
    s = self.settings
    member = self._members.get(push.learner_id)
    if member is None:
      raise self._reject("unknown_learner", f"learner {push.learner_id} is not a member of this syncer "
                         "(never joined, or pruned after its lease lapsed)")
    if not member.live(self.clock()):
      why = "left" if member.left else "lease expired (heartbeat to renew)"
      raise self._reject("not_member", f"learner {push.learner_id} is not a live member: {why}")
    if not 0 <= push.fragment < s.num_fragments:
      raise self._reject("unknown_fragment", f"fragment {push.fragment} not in [0, {s.num_fragments})")
    if not s.owns(push.fragment):
      raise self._reject("wrong_shard", f"fragment {push.fragment} belongs to another syncer shard; this "
                         f"one serves fragments {list(s.owned)}")
    if push.base_epoch not in (0, self.epoch):
      raise self._reject("epoch", f"base_version {push.base_version} is numbered by syncer epoch "
                         f"{push.base_epoch}, this syncer's epoch is {self.epoch}: it restarted; join again and "
                         "recover (docs/operations.md)")
    if push.codec != s.codec:
      raise self._reject("codec", f"push codec {shorten(push.codec)}, this run uses {s.codec!r}")
    want = codec_lib.encoded_size(s.sizes[push.fragment], s.codec, s.block)
    if len(push.payload) != want:
      raise self._reject("shape", f"fragment {push.fragment} ({s.sizes[push.fragment]} elements) needs a "
                         f"{want}-byte {s.codec} payload, got {len(push.payload)} bytes")
    if push.steps < 0 or push.tokens < 0 or push.base_version < 0:
      raise self._reject("metadata", f"steps ({push.steps}), tokens ({push.tokens}) and base_version "
                         f"({push.base_version}) must be >= 0")
    if push.base_version > self._versions[push.fragment]:
      raise self._reject("future_version", f"base_version {push.base_version} is ahead of fragment "
                         f"{push.fragment}'s version {self._versions[push.fragment]}")
    if s.max_push_steps and push.steps > s.max_push_steps:
      raise self._reject("overclaim", f"{push.steps} steps claimed; no learner of this run takes more than "
                         f"train.steps={s.max_push_steps}")
    if s.tokens_per_step and push.tokens > push.steps * s.tokens_per_step:
      raise self._reject("overclaim", f"{push.tokens} tokens claimed over {push.steps} steps; a learner "
                         f"takes at most {s.tokens_per_step} tokens per step")

  def _weight_inputs(self, push: Push) -> tuple[int, int]:
    """(steps, tokens) as the merge weight counts them: at most one schedule period's."""
    s = self.settings
    steps, tokens = push.steps, push.tokens
    if s.period_steps:
      steps = min(steps, s.period_steps)
      if s.tokens_per_step:
        tokens = min(tokens, s.period_steps * s.tokens_per_step)
    return steps, tokens

  def _period_steps_locked(self, p: int) -> float:
    """The steps of one period for the outlier bound: `sync_every`, or fewer when the median push behind
    the reference covered fewer (a front-loaded schedule's early syncs are a few steps apart)."""
    steps = self._norm_steps[p]
    if len(steps) >= NORM_WARMUP:
      return max(1.0, min(float(self.settings.period_steps), float(np.median(steps))))
    return float(self.settings.period_steps)

  def _norm_reference_locked(self, p: int) -> tuple[float, str]:
    """The norm fragment p's outer gradients are compared with, and what it is."""
    history = self._norms[p]
    if len(history) >= NORM_WARMUP:
      return (max(float(np.median(history)), NORM_FLOOR * self._global_norms[p]),
              f"the median of its last {len(history)} accepted norms")
    # A fragment that is all zeros still gets a usable scale: an RMS of WARMUP_RMS per element.
    return (max(self._global_norms[p], WARMUP_RMS * math.sqrt(self.settings.sizes[p])),
            "the global fragment's own norm (too few accepted pushes yet)")

  def push(self, push: Push) -> PushReceipt:
    """Accept one contribution into its fragment's open round (or raise Rejected), then tick."""
    s = self.settings
    with self._lock:
      self._check_sender_locked(push)
      receipt = self._seen_locked(push)
      if receipt is not None:
        return receipt
      self._validate_locked(push)
    # Checksum, finiteness and norm outside the lock: they are the expensive part and need no state. The
    # payload is not decoded (the round's close does that, chunk by chunk): finiteness from its scales,
    # the norm from its codes and scales (`codec.finite`, `codec.norm`).
    problem = None
    if codec_lib.checksum(push.payload) != push.checksum:
      problem = ("checksum", f"payload CRC-32 {codec_lib.checksum(push.payload):#010x} != declared "
                 f"{push.checksum:#010x}")
    else:
      encoded = codec_lib.parse(push.payload, s.codec, s.sizes[push.fragment], s.block)
      if not codec_lib.finite(encoded, threads=s.merge_threads):
        problem = ("nonfinite", f"the decoded outer gradient for fragment {push.fragment} holds NaN or Inf")
      else:
        norm = codec_lib.norm(encoded, threads=s.merge_threads)
    with self._lock:
      if problem is not None:
        raise self._reject(*problem)
      receipt = self._seen_locked(push)  # the same key may have been accepted meanwhile (a retry)
      if receipt is not None:
        return receipt
      # The state may have changed while we checked (a restore): validate again, cheaply.
      self._validate_locked(push)
      p = push.fragment
      if s.max_norm_ratio > 0:
        reference, what = self._norm_reference_locked(p)
        # The seed (version 0) had the warm-up reference; a version no longer remembered, today's.
        at_base = self._version_reference[p].get(push.base_version, 0.0)
        if push.base_version == 0 and push.base_version in self._version_round[p]:
          at_base = max(self._global_norms_at_start[p], WARMUP_RMS * math.sqrt(s.sizes[p]))
        if at_base > reference:
          reference, what = at_base, f"the reference when its base version {push.base_version} was published"
        # A push of n periods (work a learner pushes again after a syncer restart, or after it was cut
        # off) may be up to n periods' change; its steps are bounded by the claim check above.
        periods = max(1.0, push.steps / self._period_steps_locked(p)) if s.period_steps else 1.0
        if not norm <= s.max_norm_ratio * periods * reference:
          raise self._reject("outlier", f"outer gradient norm {norm:.4g} of fragment {p} over {push.steps} "
                             f"steps exceeds outer.max_norm_ratio={s.max_norm_ratio:g} x {periods:g} "
                             f"period(s) x {reference:.4g}, {what}")
      # Close whatever is due first: a push after a round's deadline belongs to the next round.
      self._tick_locked()
      now = self.clock()
      late = self._staleness_locked(p, push.base_version) > 0
      if self._open[p] is None:
        self._open[p] = _Round(opened=now)
      key = (push.incarnation, push.sequence) if push.incarnation else None
      weight_steps, weight_tokens = self._weight_inputs(push)
      self._open[p].contributions.append(_Contribution(push.learner_id, push.base_version, push.steps,
                                                       push.tokens, encoded, norm, now, weight_steps,
                                                       weight_tokens, key))
      if norm > 0:  # a push that moved nothing (e.g. a first step at lr 0) says nothing of the scale
        self._norms[p].append(norm)
        self._norm_steps[p].append(push.steps)
      member = self._members[push.learner_id]
      member.progress_at, member.stall_counted = now, False  # it stepped to get here
      member.last_push = now
      self.counters["bytes_in"] += len(push.payload)
      self.counters["contributions_late"] += int(late)
      member.period_weights[p] = float(outer.raw_weights([weight_tokens], [weight_steps], s.merge_rule)[0])
      self.counters["contributions_accepted"] += 1
      # The open round publishes the next version: that one merges this push.
      receipt = PushReceipt(fragment=p, round=self._rounds[p], late=late, epoch=self.epoch,
                            version=self._versions[p] + 1)
      if key is not None:
        keys = self._keys.setdefault(push.learner_id, collections.OrderedDict())
        keys[key] = _KeyRecord(push.checksum, receipt)
        while len(keys) > KEYS_PER_LEARNER:
          keys.popitem(last=False)
      self._changed()
      self._tick_locked()
      return receipt

  # ---- rounds ----

  def tick(self) -> list[int]:
    """Note lapsed leases and stalls, and close every round whose time has come; returns the fragments
    committed."""
    with self._lock:
      return self._tick_locked()

  def _step_time(self, now: float) -> float:
    return estimate_step_time([self._members[i].step_time_s for i in self._counted(now)])

  def _learner_step_time(self, learner_id: int, fallback: float) -> float:
    member = self._members.get(learner_id)
    return member.step_time_s if member is not None and member.step_time_s > 0 else fallback

  def _prune_locked(self, now: float) -> None:
    """Forget members whose lease lapsed (or that left) more than a lease ago: they join again."""
    stale = [i for i, m in self._members.items() if not m.live(now) and now > m.lease_until + self.settings.lease_s]
    for i in stale:
      del self._members[i]
    self.counters["members_pruned"] += len(stale)

  def _tick_locked(self) -> list[int]:
    now = self.clock()
    noted = False
    for m in self._members.values():
      if not m.left and not m.live(now) and not m.expiry_counted:
        m.expiry_counted = noted = True
        self.counters["leases_expired"] += 1
      if m.live(now) and not m.progressing(now, self.settings.stall_s) and not m.stall_counted:
        m.stall_counted = noted = True
        self.counters["learner_stalls"] += 1
    self._prune_locked(now)
    if noted:
      self._changed()
    counted = set(self._counted(now))
    committed, refused = [], False
    deadlocked = self._deadlocked_locked(counted, now)
    if deadlocked is not None:
      self.counters["deadlocks_broken"] += 1
      log.warning("fragment %d: round waits on learners %s, each blocked on another fragment's round that "
                  "waits on it; closing it with learners %s", deadlocked,
                  sorted(counted - set(self._open[deadlocked].contributors()))[:STATUS_IDS],
                  self._open[deadlocked].contributors()[:STATUS_IDS])
      if self._close_locked(deadlocked, "deadlock"):
        committed.append(deadlocked)
      else:
        refused = True
    for p, rnd in enumerate(self._open):
      if rnd is None:
        continue
      contributors = rnd.contributors()
      if rnd.deadline is None:
        k = effective_quorum(self.settings.policy, len(counted))
        if len(contributors) >= k:
          self._reach_quorum_locked(p, rnd, contributors[:k], counted, now)
      if rnd.deadline is None:
        continue
      if now >= rnd.deadline or counted <= set(contributors):
        if self._close_locked(p, "all_in" if counted <= set(contributors) else "deadline"):
          committed.append(p)
        else:
          refused = True
    if committed or refused:
      self._cond.notify_all()
    return committed

  def _deadlocked_locked(self, counted: set[int], now: float) -> int | None:
    """The fragment of the oldest round to close as a deadlock, if one has lasted `stall_s`.

    A round short of its quorum waits on the counted learners not in it. When each of those is blocked on
    the syncer (its heartbeats say so) and every open round holding its work is itself such a round, no
    push can ever complete any of them: with tau = 0 (or a full in-flight limit) and K above 1, learners
    out of phase (one joined late, or came back) each wait for a round of one fragment that waits for the
    others' push of another. The stuck set is the largest set of rounds closed under that rule. A round
    must stay stuck for `stall_s` (heartbeats come at least every third of it, so no learner's flag is
    stale by then) before it closes with what it holds, as a partial round; its contributors go on and
    push the fragments the others wait for."""
    open_rounds = {p: rnd for p, rnd in enumerate(self._open) if rnd is not None}
    contributors = {p: set(rnd.contributors()) for p, rnd in open_rounds.items()}
    holding: dict[int, set[int]] = collections.defaultdict(set)  # learner -> the open rounds with its work
    for p, ids in contributors.items():
      for i in ids:
        holding[i].add(p)
    missing = {p: counted - contributors[p] for p, rnd in open_rounds.items() if rnd.deadline is None}
    stuck = {p for p, waits in missing.items() if waits}

    def waits_on_stuck(i: int) -> bool:
      member = self._members.get(i)
      return member is not None and member.blocked and bool(holding[i]) and holding[i] <= stuck

    while True:
      free = {p for p in stuck if not all(waits_on_stuck(i) for i in missing[p])}
      if not free:
        break
      stuck -= free
    for p, rnd in open_rounds.items():
      if p not in stuck:
        rnd.stuck_since = None
      elif rnd.stuck_since is None:
        rnd.stuck_since = now
    due = [p for p in stuck if now - open_rounds[p].stuck_since >= self.settings.stall_s]
    return min(due, key=lambda p: open_rounds[p].opened) if due else None

  def _reach_quorum_locked(self, p: int, rnd: _Round, quorum: list[int], live: set[int], now: float) -> None:
    """Fix the round's deadline: the quorum time plus the per-learner grace window (`round_grace_s`)."""
    first = {}
    for c in rnd.contributions:
      first.setdefault(c.learner_id, c.arrived)
    fallback = self._step_time(now)
    rnd.quorum_at = first[quorum[-1]]
    rnd.step_times_s = tuple(self._learner_step_time(i, fallback) for i in quorum)
    rnd.t_sync_s = self._t_sync[p]
    rnd.grace_s = round_grace_s(self.settings.policy, [first[i] - rnd.opened for i in quorum], rnd.step_times_s,
                                rnd.quorum_at - rnd.opened, rnd.t_sync_s)
    rnd.deadline = rnd.quorum_at + rnd.grace_s
    rnd.waited_for = tuple(sorted(live - set(rnd.contributors())))

  def _staleness_locked(self, p: int, base_version: int) -> int:
    """Rounds of fragment p closed since `base_version` was published (the version difference, an upper
    bound, for a version older than the ones remembered)."""
    published_at = self._version_round[p].get(base_version)
    if published_at is None:
      return max(self._versions[p] - base_version, 0)
    return self._rounds[p] - published_at

  def _coefficients_locked(self, p: int, rnd: _Round, live: list[int]) -> tuple[np.ndarray, float, int]:
    """(raw weights, W, learners answered for) of a round's pushes, for `outer.merge_coefficients`: W sums
    one period weight per contributor and, with `scale_partial_rounds`, per live learner (its latest push
    of this fragment's; a learner that never pushed it counts as the mean of the others)."""
    s = self.settings
    cs = rnd.contributions
    raw = outer.raw_weights([c.weight_tokens for c in cs], [c.weight_steps for c in cs], s.merge_rule)
    answered = set(rnd.contributors()) | (set(live) if s.scale_partial_rounds else set())
    weights = {i: self._members[i].period_weights.get(p, 0.0) if i in self._members else 0.0 for i in answered}
    known = [w for w in weights.values() if w > 0]
    typical = statistics.fmean(known) if known else 0.0
    period = sum(w if w > 0 else typical for w in weights.values())
    return raw, period, len(answered)

  def _close_locked(self, p: int, why: str) -> bool:
    """Merge and publish fragment p's open round; False if it was refused (a non-finite result)."""
    s = self.settings
    rnd = self._open[p]
    self._open[p] = None
    started = self.clock()
    cs = rnd.contributions
    for c in cs:
      if c.key is not None and c.key in self._keys.get(c.learner_id, {}):
        self._keys[c.learner_id][c.key].settled = True
    live = self._counted(started)
    raw, period, answered = self._coefficients_locked(p, rnd, live)
    staleness = [self._staleness_locked(p, c.base_version) for c in cs]
    coefficients = outer.merge_coefficients(raw, period, answered, staleness, s.staleness_beta)
    # The share of a full round's work this round holds (undiscounted): the outer momentum moves once
    # per full share (delayed Nesterov, `outer.make_outer_optimizer`).
    share = float(np.sum(outer.merge_coefficients(raw, period, answered)))
    full, pending_share = outer.share_after(self._pending_shares[p], share)
    # The fused pass normalizes its weights; the scale restores the coefficients' sum (0 for a round whose
    # pushes all claim no tokens: it moves nothing).
    moved = float(np.sum(coefficients))
    weights = coefficients if moved > 0 else np.ones_like(coefficients)
    # In place, all or nothing: a round that would leave a non-finite value writes nothing.
    result = outer.apply_round(self._globals[p], self._momenta[p], [c.encoded for c in cs], weights,
                               codec_name=s.codec, block=s.block, lr=s.outer_lr, mu=s.outer_momentum, rda=s.rda,
                               norms=[c.norm for c in cs], scale=moved, threads=s.merge_threads,
                               state_norms=(self._global_norms[p], self._momentum_norms[p]),
                               opened=self._cycle_open[p], full=full)
    if not result.applied:
      # Nothing is published: the version, the global and the optimizer state stay; the contributions are
      # dropped.
      self._refused_at[p] = self._versions[p]
      self.counters["rounds_refused"] += 1
      self.counters["contributions_dropped"] += len(cs)
      log.error("fragment %d: round %d refused, its %s would hold non-finite values; dropped %d "
                "contributions from learners %s; version stays %d", p, self._rounds[p],
                " and ".join(result.nonfinite), len(cs), rnd.contributors()[:STATUS_IDS], self._versions[p])
      self._changed()
      return False
    self._global_norms[p], self._momentum_norms[p] = result.global_norm, result.momentum_norm
    self._pending_shares[p], self._cycle_open[p] = pending_share, not full
    first = self._versions[p] + 1
    published = self._downlink.commit(p, first, self._globals[p], held=[c.base_version for c in cs])
    self._rounds[p] += 1
    self._versions[p] += published
    seen, references = self._version_round[p], self._version_reference[p]
    reference = self._norm_reference_locked(p)[0]
    for v in range(first, first + published):
      seen[v] = self._rounds[p]
      references[v] = reference
    while len(seen) > _VERSIONS_REMEMBERED:
      del seen[next(iter(seen))]  # the oldest: versions are inserted in increasing order
    while len(references) > _VERSIONS_REMEMBERED:
      del references[next(iter(references))]
    took = self.clock() - started
    self._t_sync[p] = took if self._t_sync[p] == 0.0 else (1 - _T_SYNC_EMA) * self._t_sync[p] + _T_SYNC_EMA * took
    tokens = int(sum(c.tokens for c in cs))
    self.counters["rounds"] += 1
    self.counters["contributions_merged"] += len(cs)
    self.counters["tokens_merged"] += tokens
    self.counters["tokens_merged_by_fragment"][p] += tokens
    self._since_start["rounds"] += 1
    self._since_start["contributors"] += len(rnd.contributors())
    if rnd.quorum_at is not None:  # a round closed at a stop may not have reached its quorum
      self._since_start["grace_wait_s"] += max(started - rnd.quorum_at, 0.0)
    for c in cs:
      if c.learner_id in self._members:
        self._members[c.learner_id].steps_merged += c.steps
    if len(self._decisions) == self._decisions.maxlen:
      self.decisions_dropped += 1
    self._decisions.append(decision_record(p, first, rnd, started, why, live, staleness, coefficients, period,
                                           answered, took, share))
    self._changed(versions=True)  # durable before a learner can see the new version
    return True

  def close_open_rounds(self) -> list[int]:
    """Close every open round now, whatever its quorum (a syncer stopping: its contributions are merged
    rather than dropped); returns the fragments committed (a round refused as non-finite is not)."""
    with self._lock:
      due = [p for p, rnd in enumerate(self._open) if rnd is not None]
      committed = [p for p in due if self._close_locked(p, "stop")]
      self.counters["rounds_closed_at_stop"] += len(committed)
      if due:
        self._changed()
        self._cond.notify_all()
      return committed

  def drain_decisions(self) -> list[dict]:
    """The decision records of the rounds closed since the last call (oldest first), removed from the
    core's bounded queue (at most the latest 10,000 are kept; `decisions_dropped` counts the others)."""
    with self._lock:
      out = list(self._decisions)
      self._decisions.clear()
      return out

  def global_fragments(self) -> list[np.ndarray]:
    """Copies of the global fragments Theta (what the run trains)."""
    with self._lock:
      return [g.copy() for g in self._globals]

  def rounds_closed(self) -> int:
    """Rounds closed so far over all fragments, in the history of the current model."""
    with self._lock:
      return sum(self._rounds)

  def reference(self, fragment: int) -> tuple[int, np.ndarray]:
    """(version, a copy of R_version): exactly what a learner that adopted that version holds."""
    with self._lock:
      return self._versions[fragment], self._downlink.reference(fragment)

  def next_deadline(self) -> float | None:
    """When `tick` should next run (clock time), or None if no round is open. Before a round's quorum,
    that is the next lease expiry or stall (either can lower the effective quorum or complete 'everyone
    counted')."""
    with self._lock:
      return self._next_deadline_locked()

  def _next_deadline_locked(self) -> float | None:
    now = self.clock()
    times = [r.deadline for r in self._open if r is not None and r.deadline is not None]
    if math.isfinite(self.settings.stall_s):  # a deadlock breaks stall_s after it formed
      times += [r.stuck_since + self.settings.stall_s for r in self._open
                if r is not None and r.stuck_since is not None]
    if any(r is not None and r.deadline is None for r in self._open):
      stall_s = self.settings.stall_s
      for m in self._members.values():
        if m.live(now):
          times.append(m.lease_until)
          if m.progressing(now, stall_s) and math.isfinite(stall_s):
            times.append(m.progress_at + stall_s + m.step_time_s)
    return min(times) if times else None

  # ---- pulls ----

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The global fragment once its version >= min_version, waiting up to `timeout_s` real seconds
    (ticking at round deadlines meanwhile); None on timeout.

    `have_version`, `have_epoch`: the version whose reference the caller holds (-1: none usable) and the
    epoch of the syncer it got it from (`Published.epoch`; 0: unknown). If the epoch is this core's (or
    the version is 0, the same in every epoch) and a version >= min_version was published as a delta from
    that reference, the answer is the newest such delta (kind "delta"), else the full current fragment
    (`syncer/downlink.py`).
    """
    if not 0 <= fragment < self.settings.num_fragments:
      raise Rejected("unknown_fragment", f"fragment {fragment} not in [0, {self.settings.num_fragments})")
    if not self.settings.owns(fragment):
      raise Rejected("wrong_shard", f"fragment {fragment} belongs to another syncer shard; this one serves "
                     f"fragments {list(self.settings.owned)}")
    give_up = time.monotonic() + max(timeout_s, 0.0)
    with self._lock:
      while True:
        self._tick_locked()
        version = self._versions[fragment]
        # After a refused round, a wait for the version it was to make ends with the current one.
        if version >= min_version or (self._refused_at[fragment] == version and min_version == version + 1):
          published = self._downlink.answer(fragment, min(min_version, version), have_version, have_epoch)
          self.counters["pulls_delta" if published.kind == "delta" else "pulls_full"] += 1
          self.counters["bytes_out"] += len(published.payload)
          self._changed()
          return published
        remaining = give_up - time.monotonic()
        if remaining <= 0:
          return None
        deadline = self._next_deadline_locked()
        if deadline is not None:
          remaining = min(remaining, max(deadline - self.clock(), 0.001))
        self._cond.wait(remaining)

  # ---- introspection and checkpoints ----

  def status(self) -> dict:
    """Members, versions, open rounds and counters, as plain JSON-able values. Bounded whatever the
    membership: at most `STATUS_MEMBERS` members in detail (live ones first) and `STATUS_IDS` ids per
    list, with counts of all.

    `since_start`: rounds closed since this core started, with their distinct contributors and grace waits
    (quorum to close) summed. `goodput_estimate`: the syncer's view of goodput since it started, sum over
    members of (steps merged / P) x step time, over (learners provisioned x uptime): compute whose tokens
    reached the global model, as a fraction of the time the run held its learners (start-up and compile
    time, blocked waits, dead time and work not merged count as lost).
    """
    with self._lock:
      now = self.clock()
      stall_s = self.settings.stall_s
      uptime = now - self._started
      provisioned = max(self.settings.num_learners, len(self._members)) * uptime
      useful = sum(m.steps_merged * m.step_time_s for m in self._members.values()) / self.settings.num_owned
      live = self._live(now)
      shown = live[:STATUS_MEMBERS]
      if len(shown) < STATUS_MEMBERS:
        shown += sorted(i for i in self._members if i not in set(live))[:STATUS_MEMBERS - len(shown)]
      return {
          "fingerprint": self.settings.fingerprint,
          "epoch": self.epoch,
          "uptime_s": uptime,
          "since_start": dict(self._since_start),
          "num_learners": self.settings.num_learners,
          "goodput_estimate": useful / provisioned if provisioned > 0 else 0.0,
          "live": live[:STATUS_IDS],
          "counted": self._counted(now)[:STATUS_IDS],
          "member_count": {"total": len(self._members), "live": len(live), "shown": len(shown)},
          "members": {str(i): {"live": m.live(now), "left": m.left, "step_time_s": m.step_time_s,
                               "lease_left_s": max(m.lease_until - now, 0.0), "step": m.step,
                               "step_ago_s": None if m.step_at is None else now - m.step_at,
                               "blocked": m.blocked, "progressing": m.progressing(now, stall_s),
                               "last_push_ago_s": None if m.last_push is None else now - m.last_push,
                               "steps_merged": m.steps_merged / self.settings.num_owned}
                      for i, m in ((i, self._members[i]) for i in sorted(shown))},
          "versions": list(self._versions),
          "owned": [p for p in range(self.settings.num_fragments) if self.settings.owns(p)],
          "rounds": list(self._rounds),
          "open_rounds": {str(p): {"contributors": r.contributors()[:STATUS_IDS],
                                   "contributor_count": len(r.contributors()),
                                   "contributions": len(r.contributions),
                                   "deadline_in_s": None if r.deadline is None else r.deadline - now}
                          for p, r in enumerate(self._open) if r is not None},
          "step_time_s": self._step_time(now),
          "t_sync_s": list(self._t_sync),
          "history": [dataclasses.asdict(h) for h in self._history[-8:]],
          "counters": copy.deepcopy(self.counters),
      }

  def state_dict(self) -> dict:
    """What a syncer checkpoint holds: global fragments, their Nesterov momenta, versions, round
    numbers, the lifetime history (this lifetime included), counters (copies), the idempotency keys of
    settled pushes, and with a delta downlink the references R and the latest deltas (so a restored syncer
    serves learners the same bytes; under a new epoch, see `load_state_dict`). Not included: membership
    (learners rejoin after a restart) and the contributions of open rounds, which a restore drops (a
    stopping syncer closes them first, `close_open_rounds`); their learners push that work again
    (docs/operations.md, "Recovery")."""
    with self._lock:
      held = self.settings.owns  # another shard's fragment is None (orbax saves no zero-size array)
      return {
          "fragments": [g.copy() if held(p) else None for p, g in enumerate(self._globals)],
          "opt_states": [m.copy() if held(p) else None for p, m in enumerate(self._momenta)],
          # Delayed Nesterov: an open cycle of partial rounds (folded into the momentum) and its share.
          "cycle_open": list(self._cycle_open),
          "pending_shares": list(self._pending_shares),
          "versions": list(self._versions),
          "rounds": list(self._rounds),
          "t_sync": list(self._t_sync),
          "counters": copy.deepcopy(self.counters),
          "fingerprint": self.settings.fingerprint,
          "owned": None if self.settings.owned is None else list(self.settings.owned),
          "history": [[h.epoch, list(h.start_rounds), list(h.version_offsets)] for h in self._history],
          # Idempotency keys of settled contributions, whose effect this state holds: [learner,
          # incarnation, sequence, checksum, fragment, round, late, epoch that accepted it, version].
          "push_keys": [[i, *key, r.checksum, r.receipt.fragment, r.receipt.round, r.receipt.late,
                         r.receipt.epoch, r.receipt.version]
                        for i, keys in sorted(self._keys.items()) for key, r in keys.items() if r.settled],
          **self._held_only(self._downlink.state_dict()),
      }

  def _held_only(self, downlink_state: dict) -> dict:
    # The downlink's references of other shards' fragments (zero-length) as None, like the fragments.
    refs = downlink_state["references"]
    if refs is not None:
      refs = [r if self.settings.owns(p) else None for p, r in enumerate(refs)]
    return {**downlink_state, "references": refs}

  def load_state_dict(self, state: dict) -> None:
    """Restore from `state_dict()`; drops any open rounds (see `state_dict`). Members are kept.

    Draws a new `epoch` and appends it to the history: the checkpoint may be older than what learners
    hold, and its versions will be reached again with other references (module docstring, "Epochs").
    """
    s = self.settings
    n = s.num_fragments
    if state["fingerprint"] != s.fingerprint:
      raise ValueError(f"checkpoint fingerprint {state['fingerprint']!r} != run {s.fingerprint!r}")
    owned = state.get("owned")
    if (None if owned is None else tuple(int(p) for p in owned)) != s.owned:
      raise ValueError(f"checkpoint of a syncer owning fragments {'all' if owned is None else list(owned)}, this "
                       f"one owns {'all' if s.owned is None else list(s.owned)} (another shard's workdir, or "
                       f"another shard count)")
    empty = np.zeros(0, np.float32)  # what a shard's checkpoint holds (None) for another shard's fragment
    held = lambda xs: None if xs is None else [empty if x is None else x for x in xs]
    state = {**state, "fragments": held(state["fragments"]), "opt_states": held(state["opt_states"]),
             "references": held(state.get("references"))}
    fragments = [np.array(f, np.float32).reshape(-1) for f in state["fragments"]]
    if [f.size for f in fragments] != list(s.held_sizes):
      raise ValueError(f"checkpoint fragment sizes {[f.size for f in fragments]} != {list(s.held_sizes)}")
    momenta = [outer.momentum_from_state(st, f.size) for f, st in zip(fragments, state["opt_states"])]
    global_norms = [chunked.norm(f, s.merge_threads) for f in fragments]
    momentum_norms = [chunked.norm(m, s.merge_threads) for m in momenta]
    # Older checkpoints: no cycle of partial rounds open.
    cycle_open = [bool(x) for x in state.get("cycle_open", [False] * s.num_fragments)]
    pending_shares = [float(x) for x in state.get("pending_shares", [0.0] * s.num_fragments)]
    if len(cycle_open) != s.num_fragments or len(pending_shares) != s.num_fragments:
      raise ValueError(f"checkpoint cycle state has {len(cycle_open)} / {len(pending_shares)} entries for "
                       f"{s.num_fragments} fragments")
    versions = [int(v) for v in state["versions"]]
    rounds = [int(r) for r in state["rounds"]]
    epoch = new_epoch()
    downlink = Downlink.restore(state, s.held_sizes, s.downlink_codec, s.block, fragments, versions, epoch,
                                threads=s.merge_threads, history=s.downlink_history)
    history = [EpochRecord(int(e), tuple(int(x) for x in starts), tuple(int(x) for x in offsets))
               for e, starts, offsets in state.get("history") or ()]
    history = history[-(MAX_HISTORY - 1):] + [
        EpochRecord(epoch, tuple(rounds), tuple(v - r for v, r in zip(versions, rounds)))]
    with self._lock:
      self._globals = fragments
      self._momenta = momenta
      self._cycle_open, self._pending_shares = cycle_open, pending_shares
      self._versions = versions
      self._downlink = downlink
      self._history = history
      self._rounds = rounds
      self._version_round = [{v: r} for v, r in zip(self._versions, self._rounds)]
      self._version_reference = [{} for _ in self._rounds]
      self._t_sync = [float(t) for t in state["t_sync"]]
      self.counters = _merge_counters(n, state["counters"])
      self._open = [None] * n
      self._global_norms, self._momentum_norms = global_norms, momentum_norms
      self._global_norms_at_start = list(global_norms)
      self._norms = [collections.deque(maxlen=NORM_HISTORY) for _ in range(n)]
      self._norm_steps = [collections.deque(maxlen=NORM_HISTORY) for _ in range(n)]
      self._refused_at = [-1] * n
      self._keys = {}
      for row in state.get("push_keys", []):
        i, incarnation, sequence, checksum, fragment, rnd, late = row[:7]
        receipt = PushReceipt(fragment=int(fragment), round=int(rnd), late=bool(late),
                              epoch=int(row[7]) if len(row) > 7 else 0, version=int(row[8]) if len(row) > 8 else -1)
        self._keys.setdefault(int(i), collections.OrderedDict())[(int(incarnation), int(sequence))] = (
            _KeyRecord(int(checksum), receipt, settled=True))
      self._cond.notify_all()

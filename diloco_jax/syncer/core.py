"""The syncer's state machine: membership, per-fragment rounds, merges and outer steps. No transport.

One `SyncerCore` serves all learners of a run; it implements `protocol.SyncerAPI`. Transports
(`transports/inprocess.py`, the gRPC service `syncer/service.py`) call `join`, `heartbeat`, `push`, `pull`,
and `syncer/ticker.py` calls `tick` at `next_deadline()` (`push`, `heartbeat` and a blocking `pull` tick
too). The clock is injectable, so the
whole policy can be tested with a fake clock and no sleeps.

Membership. A learner joins with the run's fingerprint (another fingerprint is refused) and holds a lease
of `lease_s` seconds, renewed by every join and heartbeat. A learner whose lease ran out, or that left, is
not live: its pushes are refused ("not_member") until it heartbeats (expired lease) or joins again (left).
Its pushes already received still merge.

Progress. Heartbeats carry the learner's inner-step counter and whether it is blocked on the syncer. A live
learner counts toward quorums only while it makes progress: its counter changed, it said it was blocked,
or it pushed, within the last `stall_s` seconds plus one of its own step times. A learner that stops
(SIGSTOP, kill -9, cut off, hung) therefore stops gating rounds within that bound, long before its lease
lapses, and counts again with its next heartbeat that shows progress. A heartbeat without a counter
(step -1) counts as progress (clients that do not send one keep the lease-only rule).

Rounds, per fragment p. A round opens with its first contribution. With L counted learners, it may close once
`effective_quorum(policy, L)` distinct learners contributed (the time the K-th arrived is `t_quorum`
after the opening); it then stays open for `grace_window_s(policy, step_time, t_quorum, t_sync)` seconds,
where step_time is `estimate_step_time` of the live learners' reported step times and t_sync a running
average (EMA) of this fragment's merge + outer step + encode time, measured on the same clock. It closes
early as soon as every counted learner has contributed. Once the quorum is reached, the deadline is fixed.
Closing: merge weights (`outer.merge_weights`, staleness s = version - base_version, discount
(1 + s)^-beta), merge (`outer.merge`, optionally RDA), with `scale_partial_rounds` the merged outer
gradient scaled by `outer.participation` (k of n counted learners -> k/n), Nesterov outer step, version += 1, the new global
fragment published for the downlink (below), and waiting pulls are woken. A contribution that arrives
after its round's deadline goes into the next round (never lost); one based on an older version ("late")
is merged with its staleness discount. A learner pushing the same fragment twice into one round has both
contributions merged (quorum counts it once).

Downlink: `syncer/downlink.py` (reference-tracking deltas, epochs). The core draws a new epoch when it is
created and on every `load_state_dict`.

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

Rejections. `push` validates everything before touching state; on any problem it raises `Rejected` with
one of `REASONS`, increments `counters["rejected"][reason]` and `counters["contributions_rejected"]`, and
changes nothing else.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from diloco_jax import codec as codec_lib
from diloco_jax import config as config_lib
from diloco_jax import outer
from diloco_jax.protocol import REASONS, EpochRecord, Published, Push, PushReceipt, Rejected, Versions
from diloco_jax.syncer.downlink import Downlink, new_epoch
from diloco_jax.syncer.policy import QuorumPolicy, effective_quorum, estimate_step_time, grace_window_s

_T_SYNC_EMA = 0.2  # weight of the newest t_sync measurement
MAX_HISTORY = 64  # lifetimes kept in the history (older ones: their learners rebase, see operations.md)
# Counters that describe the global model: restored with it from a checkpoint. Every other counter is a
# running total of events, kept across restarts by the journal.
MODEL_COUNTERS = ("rounds", "contributions_merged", "contributions_late", "tokens_merged",
                  "tokens_merged_by_fragment")


@dataclasses.dataclass(frozen=True)
class SyncerSettings:
  """Everything the core needs, fixed for a run."""

  num_fragments: int
  sizes: tuple[int, ...]  # elements per fragment
  codec: str = "fp32"  # uplink (pushes)
  downlink_codec: str = "fp32"  # published global fragments
  block: int = 64
  merge_rule: str = "tokens"
  rda: bool = False
  staleness_beta: float = 0.0
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  policy: QuorumPolicy = QuorumPolicy()
  lease_s: float = 30.0
  fingerprint: str = ""
  scale_partial_rounds: bool = False
  # A learner without progress for this long (plus one of its steps) stops counting toward quorums.
  stall_s: float = math.inf

  def __post_init__(self):
    if self.num_fragments < 1 or len(self.sizes) != self.num_fragments:
      raise ValueError(f"outer.num_fragments ({self.num_fragments}) must be >= 1 and match the "
                       f"{len(self.sizes)} fragment sizes")
    if any(s < 1 for s in self.sizes):
      raise ValueError(f"fragment sizes must be >= 1, got {self.sizes}")
    for field, name in (("outer.codec", self.codec), ("outer.downlink_codec", self.downlink_codec)):
      if name not in codec_lib.CODECS:
        raise ValueError(f"{field} must be one of {codec_lib.CODECS}, got {name!r}")
    if self.block < 1:
      raise ValueError(f"outer.codec_block must be >= 1, got {self.block}")
    if self.merge_rule not in outer.MERGE_RULES:
      raise ValueError(f"outer.merge must be one of {outer.MERGE_RULES}, got {self.merge_rule!r}")
    if self.staleness_beta < 0:
      raise ValueError(f"outer.staleness_beta must be >= 0, got {self.staleness_beta}")
    if self.lease_s <= 0:
      raise ValueError(f"outer.lease_s must be > 0, got {self.lease_s}")
    if not self.stall_s > 0:
      raise ValueError(f"outer.stall_s must be > 0, got {self.stall_s}")

  @classmethod
  def from_config(cls, config, plan, fingerprint: str) -> "SyncerSettings":
    """Settings from `config.outer` and a `fragments.FragmentPlan`."""
    o = config.outer
    return cls(
        num_fragments=plan.num_fragments,
        sizes=tuple(plan.size(p) for p in range(plan.num_fragments)),
        codec=o.codec,
        downlink_codec=o.downlink_codec,
        block=o.codec_block,
        merge_rule=o.merge,
        rda=bool(o.rda),
        staleness_beta=float(o.staleness_beta),
        outer_lr=float(o.lr),
        outer_momentum=float(o.momentum),
        policy=QuorumPolicy(min_quorum=o.min_quorum or config.learners.num, tau=o.tau, gamma=o.grace_gamma,
                            min_grace_s=o.min_grace_s, max_grace_s=o.max_grace_s),
        lease_s=float(o.lease_s),
        fingerprint=fingerprint,
        scale_partial_rounds=bool(o.scale_partial_rounds),
        stall_s=config_lib.stall_bound_s(config),
    )


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
  steps: int
  tokens: int
  delta: np.ndarray
  arrived: float


@dataclasses.dataclass
class _Round:
  opened: float
  contributions: list[_Contribution] = dataclasses.field(default_factory=list)
  deadline: float | None = None  # fixed once the quorum is reached

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
      # Restarts (attach_journal): lifetimes, and what the crashes took from the global model (merged
      # rounds and contributions after the restored checkpoint; contributions of open rounds). The learners
      # push that work again (docs/operations.md, "Recovery").
      "restarts": 0,
      "rounds_rolled_back": 0,
      "contributions_rolled_back": 0,
      "tokens_rolled_back": 0,
      "contributions_dropped": 0,
      "rounds_closed_at_stop": 0,
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
    self._tx = outer.make_outer_optimizer(settings.outer_lr, settings.outer_momentum)
    self._globals: list[np.ndarray] = []
    for p, frag in enumerate(initial_fragments):
      frag = np.array(frag, np.float32).reshape(-1)
      if frag.size != settings.sizes[p]:
        raise ValueError(f"initial fragment {p} has {frag.size} elements, expected {settings.sizes[p]}")
      self._globals.append(frag)
    self._opt_states = [outer.init_outer_state(self._tx, g) for g in self._globals]
    n = settings.num_fragments
    self._versions = [0] * n
    self._rounds = [0] * n  # index of each fragment's next round to close (= rounds the model holds)
    self._open: list[_Round | None] = [None] * n
    self._t_sync = [0.0] * n
    self._members: dict[int, _Member] = {}
    self.counters = _new_counters(n)
    self._downlink = Downlink(settings.sizes, settings.downlink_codec, settings.block, self._globals,
                              epoch=new_epoch())
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
    return max(codec_lib.encoded_size(n, s.codec, s.block) for n in s.sizes)

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
    c["contributions_dropped"] += int(record.get("open_contributions", 0))

  # ---- membership ----

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Admit (or re-admit, after a crash or a lapsed lease) a learner; returns {fragment: version} with
    this core's epoch and history."""
    with self._lock:
      if fingerprint != self.settings.fingerprint:
        raise Rejected("fingerprint", f"learner {learner_id} has run fingerprint {fingerprint!r}, this "
                       f"syncer serves {self.settings.fingerprint!r} (different run or config)")
      now = self.clock()
      old = self._members.get(learner_id)
      self._members[learner_id] = _Member(lease_until=now + self.settings.lease_s, progress_at=now,
                                          step_time_s=old.step_time_s if old else 0.0)
      self.counters["joins"] += 1
      self._changed()
      return Versions(enumerate(self._versions), epoch=self.epoch, history=tuple(self._history))

  def leave(self, learner_id: int) -> None:
    """The learner stops counting toward quorums at once; its pushes already in still merge."""
    with self._lock:
      member = self._members.get(learner_id)
      if member is not None and not member.left:
        member.left = True
        self.counters["leaves"] += 1
        self._changed()
      self._tick_locked()

  def heartbeat(self, learner_id: int, step_time_s: float, step: int = -1, blocked: bool = False) -> int:
    """Renew the learner's lease (reviving a lapsed one); `step_time_s` > 0 feeds the step-time estimate;
    `step` (its inner-step counter; -1: not sent) and `blocked` say whether it makes progress (module
    docstring, "Progress"). Returns this core's epoch."""
    with self._lock:
      member = self._members.get(learner_id)
      if member is None:
        raise Rejected("unknown_learner", f"learner {learner_id} never joined this syncer")
      if member.left:
        raise Rejected("not_member", f"learner {learner_id} left; join again")
      now = self.clock()
      member.lease_until = now + self.settings.lease_s
      member.expiry_counted = False
      if step_time_s > 0:
        member.step_time_s = float(step_time_s)
      if step < 0 or step != member.step or blocked:
        member.progress_at = now
        member.stall_counted = False
      member.step, member.blocked = int(step), bool(blocked)
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
    self.counters["rejected"][reason] += 1
    self.counters["contributions_rejected"] += 1
    self._changed()
    return Rejected(reason, message)

  def _validate_locked(self, push: Push) -> None:
    s = self.settings
    member = self._members.get(push.learner_id)
    if member is None:
      raise self._reject("unknown_learner", f"learner {push.learner_id} never joined this syncer")
    if push.fingerprint != s.fingerprint:
      raise self._reject("fingerprint", f"push fingerprint {push.fingerprint!r} != run {s.fingerprint!r}")
    if not member.live(self.clock()):
      why = "left" if member.left else "lease expired (heartbeat to renew)"
      raise self._reject("not_member", f"learner {push.learner_id} is not a live member: {why}")
    if not 0 <= push.fragment < s.num_fragments:
      raise self._reject("unknown_fragment", f"fragment {push.fragment} not in [0, {s.num_fragments})")
    if push.base_epoch not in (0, self.epoch):
      raise self._reject("epoch", f"base_version {push.base_version} is numbered by syncer epoch "
                         f"{push.base_epoch}, this syncer's epoch is {self.epoch}: it restarted; join again and "
                         "recover (docs/operations.md)")
    if push.codec != s.codec:
      raise self._reject("codec", f"push codec {push.codec!r}, this run uses {s.codec!r}")
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

  def push(self, push: Push) -> PushReceipt:
    """Accept one contribution into its fragment's open round (or raise Rejected), then tick."""
    s = self.settings
    with self._lock:
      self._validate_locked(push)
    # Checksum and decode outside the lock: they are the expensive part and need no state.
    problem = None
    if codec_lib.checksum(push.payload) != push.checksum:
      problem = ("checksum", f"payload CRC-32 {codec_lib.checksum(push.payload):#010x} != declared "
                 f"{push.checksum:#010x}")
    else:
      delta = codec_lib.decode(push.payload, s.codec, s.sizes[push.fragment], s.block)
      if not np.isfinite(delta).all():
        problem = ("nonfinite", f"the decoded outer gradient for fragment {push.fragment} holds NaN or Inf")
    with self._lock:
      if problem is not None:
        raise self._reject(*problem)
      # The state may have changed while we decoded (a restore): validate again, cheaply.
      self._validate_locked(push)
      # Close whatever is due first: a push after a round's deadline belongs to the next round.
      self._tick_locked()
      now = self.clock()
      p = push.fragment
      late = push.base_version < self._versions[p]
      if self._open[p] is None:
        self._open[p] = _Round(opened=now)
      self._open[p].contributions.append(_Contribution(push.learner_id, push.base_version, push.steps,
                                                       push.tokens, delta, now))
      member = self._members[push.learner_id]
      member.progress_at, member.stall_counted = now, False  # it stepped to get here
      self.counters["bytes_in"] += len(push.payload)
      self.counters["contributions_late"] += int(late)
      self.counters["contributions_accepted"] += 1
      receipt = PushReceipt(fragment=p, round=self._rounds[p], late=late, epoch=self.epoch)
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
    if noted:
      self._changed()
    counted = set(self._counted(now))
    committed = []
    for p, rnd in enumerate(self._open):
      if rnd is None:
        continue
      contributors = rnd.contributors()
      if rnd.deadline is None:
        k = effective_quorum(self.settings.policy, len(counted))
        if len(contributors) >= k:
          quorum_at = next(c.arrived for c in rnd.contributions if c.learner_id == contributors[k - 1])
          grace = grace_window_s(self.settings.policy, self._step_time(now), quorum_at - rnd.opened,
                                 self._t_sync[p])
          rnd.deadline = quorum_at + grace
      if rnd.deadline is None:
        continue
      if now >= rnd.deadline or counted <= set(contributors):
        self._close_locked(p)
        committed.append(p)
    if committed:
      self._cond.notify_all()
    return committed

  def _close_locked(self, p: int) -> None:
    s = self.settings
    rnd = self._open[p]
    self._open[p] = None
    started = self.clock()
    cs = rnd.contributions
    weights = outer.merge_weights([c.tokens for c in cs], [c.steps for c in cs], s.merge_rule,
                                  staleness=[self._versions[p] - c.base_version for c in cs],
                                  beta=s.staleness_beta)
    merged = outer.merge([c.delta for c in cs], weights, rda=s.rda)
    if s.scale_partial_rounds:
      merged = merged * outer.participation(len(rnd.contributors()), len(self._counted(started)))
    self._globals[p], self._opt_states[p] = outer.outer_step(self._tx, self._globals[p], self._opt_states[p],
                                                             merged)
    self._versions[p] += 1
    self._rounds[p] += 1
    self._downlink.commit(p, self._versions[p], self._globals[p])
    took = self.clock() - started
    first = self._t_sync[p] == 0.0
    self._t_sync[p] = took if first else (1 - _T_SYNC_EMA) * self._t_sync[p] + _T_SYNC_EMA * took
    tokens = int(sum(c.tokens for c in cs))
    self.counters["rounds"] += 1
    self.counters["contributions_merged"] += len(cs)
    self.counters["tokens_merged"] += tokens
    self.counters["tokens_merged_by_fragment"][p] += tokens
    self._changed(versions=True)  # durable before a learner can see the new version

  def close_open_rounds(self) -> list[int]:
    """Close every open round now, whatever its quorum (a syncer stopping: its contributions are merged
    rather than dropped); returns the fragments committed."""
    with self._lock:
      committed = [p for p, rnd in enumerate(self._open) if rnd is not None]
      for p in committed:
        self._close_locked(p)
      self.counters["rounds_closed_at_stop"] += len(committed)
      if committed:
        self._changed()
        self._cond.notify_all()
      return committed

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
    epoch of the syncer it got it from (`Published.epoch`; 0: unknown). If the version is the one just
    before the current version and the epoch is this core's (or the version is 0, the same in every
    epoch), the answer is the delta (kind "delta"), else the full fragment.
    """
    if not 0 <= fragment < self.settings.num_fragments:
      raise Rejected("unknown_fragment", f"fragment {fragment} not in [0, {self.settings.num_fragments})")
    give_up = time.monotonic() + max(timeout_s, 0.0)
    with self._lock:
      while True:
        self._tick_locked()
        if self._versions[fragment] >= min_version:
          published = self._downlink.answer(fragment, have_version, have_epoch)
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
    """Members, versions, open rounds and counters, as plain JSON-able values."""
    with self._lock:
      now = self.clock()
      stall_s = self.settings.stall_s
      return {
          "fingerprint": self.settings.fingerprint,
          "epoch": self.epoch,
          "live": self._live(now),
          "counted": self._counted(now),
          "members": {str(i): {"live": m.live(now), "left": m.left, "step_time_s": m.step_time_s,
                               "lease_left_s": max(m.lease_until - now, 0.0), "step": m.step,
                               "blocked": m.blocked, "progressing": m.progressing(now, stall_s)}
                      for i, m in sorted(self._members.items())},
          "versions": list(self._versions),
          "rounds": list(self._rounds),
          "open_rounds": {str(p): {"contributors": r.contributors(), "contributions": len(r.contributions),
                                   "deadline_in_s": None if r.deadline is None else r.deadline - now}
                          for p, r in enumerate(self._open) if r is not None},
          "step_time_s": self._step_time(now),
          "t_sync_s": list(self._t_sync),
          "history": [dataclasses.asdict(h) for h in self._history[-8:]],
          "counters": copy.deepcopy(self.counters),
      }

  def state_dict(self) -> dict:
    """What a syncer checkpoint holds: global fragments, outer optimizer states (numpy), versions, round
    numbers, the lifetime history (this lifetime included) and counters (copies), and with a delta downlink
    the references R and the latest deltas (so a restored syncer serves learners the same bytes; under a
    new epoch, see `load_state_dict`). Not included: membership (learners rejoin after a restart) and the
    contributions of open rounds, which a restore drops (a stopping syncer closes them first,
    `close_open_rounds`); their learners push that work again (docs/operations.md, "Recovery")."""
    with self._lock:
      return {
          "fragments": [g.copy() for g in self._globals],
          "opt_states": [outer.state_to_numpy(st) for st in self._opt_states],
          "versions": list(self._versions),
          "rounds": list(self._rounds),
          "t_sync": list(self._t_sync),
          "counters": copy.deepcopy(self.counters),
          "fingerprint": self.settings.fingerprint,
          "history": [[h.epoch, list(h.start_rounds), list(h.version_offsets)] for h in self._history],
          **self._downlink.state_dict(),
      }

  def load_state_dict(self, state: dict) -> None:
    """Restore from `state_dict()`; drops any open rounds (see `state_dict`). Members are kept.

    Draws a new `epoch` and appends it to the history: the checkpoint may be older than what learners
    hold, and its versions will be reached again with other references (module docstring, "Epochs").
    """
    s = self.settings
    n = s.num_fragments
    if state["fingerprint"] != s.fingerprint:
      raise ValueError(f"checkpoint fingerprint {state['fingerprint']!r} != run {s.fingerprint!r}")
    fragments = [np.array(f, np.float32).reshape(-1) for f in state["fragments"]]
    if [f.size for f in fragments] != list(s.sizes):
      raise ValueError(f"checkpoint fragment sizes {[f.size for f in fragments]} != {list(s.sizes)}")
    opt_states = [outer.state_from_numpy(self._tx, f, st) for f, st in zip(fragments, state["opt_states"])]
    versions = [int(v) for v in state["versions"]]
    rounds = [int(r) for r in state["rounds"]]
    epoch = new_epoch()
    downlink = Downlink.restore(state, s.sizes, s.downlink_codec, s.block, fragments, versions, epoch)
    history = [EpochRecord(int(e), tuple(int(x) for x in starts), tuple(int(x) for x in offsets))
               for e, starts, offsets in state.get("history") or ()]
    history = history[-(MAX_HISTORY - 1):] + [
        EpochRecord(epoch, tuple(rounds), tuple(v - r for v, r in zip(versions, rounds)))]
    with self._lock:
      self._globals = fragments
      self._opt_states = opt_states
      self._versions = versions
      self._downlink = downlink
      self._history = history
      self._rounds = rounds
      self._t_sync = [float(t) for t in state["t_sync"]]
      self.counters = _merge_counters(n, state["counters"])
      self._open = [None] * n
      self._cond.notify_all()

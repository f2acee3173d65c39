"""The syncer's transitions: each method is one step of the state machine, applying what the rules decide.

A step reads the typed state (`syncer/state.py`), asks the rules (`syncer/rules/`) what to do, and applies
it: a member joins or is renewed, a push is refused or enters a round, a tick notes lapses and closes rounds
(`close.py`), a poll answers a pull. It reads time only through `now` and reports changes worth keeping
across a crash through `changed` (the core's journal). Not thread-safe: `syncer/core.py` runs one step at a
time under its lock, and records each on its tape; replaying the same steps with the same clock readings
gives bitwise the same state.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable

from diloco_jax.outer import merge as outer
from diloco_jax.protocol.messages import Kind, Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import Reason, Rejected, shorten
from diloco_jax.syncer import close, snapshot
from diloco_jax.syncer.downlink import Downlink
from diloco_jax.syncer.rules import admission, membership, recovery, rounds
from diloco_jax.syncer.rules.quorum import phase_offset_s
from diloco_jax.syncer.state import Contribution, KeyRecord, Round, SyncerState

log = logging.getLogger(__name__)


class Machine:
  """The state, the downlink, and the steps that change them (module docstring)."""

  def __init__(self, settings, state: SyncerState, downlink: Downlink, now: Callable[[], float],
               changed: Callable[[bool], None], wake: Callable[[], None]):
    self.settings, self.state, self.downlink = settings, state, downlink
    self._now, self._changed, self._wake = now, changed, wake
    self.closes: list[tuple[int, dict | None]] = []  # the rounds closed (decision record, None: refused)

  def _refuse(self, refusal: admission.Refusal, push: Push | None = None) -> Rejected:
    # No journal write: a refusal changes only counters, which the next change journals (a flood of
    # refusals must cost no disk write under the lock; a crash forgets at most the latest refusals' counts).
    self.state.counters["rejected"][refusal.reason] += 1
    self.state.counters["contributions_rejected"] += int(push is not None)
    if push is not None and refusal.reason in admission.MERGE_SAFETY:
      member = self.state.members.get(push.learner_id)
      if member is not None:
        member.refused_in_row += 1
        member.refused_total += 1
        if member.refused_in_row == admission.REPEATED_REFUSALS:
          log.warning("learner %d: %d pushes in a row refused for merge safety, the latest as %s: %s",
                      push.learner_id, member.refused_in_row, refusal.reason, refusal.message)
    return Rejected(refusal.reason, refusal.message)

  def check_id(self, learner_id) -> None:
    problem = membership.id_problem(learner_id, self.settings.num_learners)
    if problem:
      raise self._refuse(admission.Refusal(Reason.LEARNER_ID, problem))

  # ---- membership ----

  def join(self, learner_id, fingerprint) -> Versions:
    s, st = self.settings, self.state
    self.check_id(learner_id)
    if fingerprint != s.fingerprint:
      raise self._refuse(admission.Refusal(Reason.FINGERPRINT, f"learner {learner_id} has run fingerprint "
                                           f"{shorten(fingerprint)}, this syncer serves {s.fingerprint!r} "
                                           "(different run or config)"))
    st.members[learner_id] = membership.joined(st.members.get(learner_id), self._now(), s.lease_s)
    st.counters["joins"] += 1
    self._changed(False)
    return Versions(((p, f.version) for p, f in enumerate(st.fragments) if s.owns(p)), epoch=st.epoch,
                    history=tuple(st.history))

  def leave(self, learner_id) -> None:
    self.check_id(learner_id)
    member = self.state.members.get(learner_id)
    if member is not None and not member.left:
      member.left = True
      self.state.counters["leaves"] += 1
      self._changed(False)
    self.tick()

  def heartbeat(self, learner_id, step_time_s, step, blocked) -> int:
    st = self.state
    self.check_id(learner_id)
    problem = membership.heartbeat_problem(st.members.get(learner_id), learner_id)
    if problem:
      raise Rejected(*problem)
    st.members[learner_id] = membership.renewed(st.members[learner_id], self._now(), self.settings.lease_s,
                                                step_time_s, step, blocked)
    self.tick()
    return st.epoch

  # ---- pushes ----

  def _retry(self, push: Push) -> PushReceipt | None:
    found = admission.retry_of(self.state.keys, push, self.state.key_floors)
    if isinstance(found, admission.Refusal):
      raise self._refuse(found, push)
    if found is not None:
      self.state.counters["pushes_duplicate"] += 1
      return found.receipt
    return None

  def _check_push(self, push: Push) -> None:
    st = self.state
    refusal = admission.push_problem(self.settings, st.members, st.fragments, st.epoch, push, self._now())
    if refusal:
      raise self._refuse(refusal, push)

  def push_check(self, push: Push) -> PushReceipt | None:
    """The cheap checks: sender, retry (its receipt again), membership, shape and claims."""
    refusal = admission.sender_problem(self.settings, push)
    if refusal:
      raise self._refuse(refusal, push)
    receipt = self._retry(push)
    if receipt is None:
      self._check_push(push)
    return receipt

  def push_admit(self, push: Push, check: admission.PayloadCheck | None = None) -> PushReceipt:
    """Admit a push whose payload was checked (`check`; computed here if not given) into its open round."""
    s, st = self.settings, self.state
    check = admission.payload_check(s, push) if check is None else check
    if check.refusal:
      raise self._refuse(check.refusal, push)
    receipt = self._retry(push)  # the same key may have been accepted meanwhile (a retry)
    if receipt is not None:
      return receipt
    self._check_push(push)  # the state may have changed while the payload was checked
    p, fragment = push.fragment, st.fragments[push.fragment]
    now = self._now()
    refusal = admission.outlier_problem(s, fragment, push, check.norm, st.members, now)
    if refusal:
      raise self._refuse(refusal, push)
    self.tick()  # a push after a round's deadline belongs to the next round
    refusal = admission.round_share_problem(fragment.open, push)
    if refusal:
      raise self._refuse(refusal, push)
    now = self._now()
    late = rounds.staleness(fragment, push.base_version) > 0
    if fragment.open is None:
      fragment.open = Round(opened=now)
    key = (push.incarnation, push.sequence) if push.incarnation else None
    weight_steps, weight_tokens = admission.weight_inputs(s, push)
    fragment.open.contributions.append(Contribution(push.learner_id, push.base_version, push.steps, push.tokens,
                                                    check.encoded, check.norm, now, weight_steps, weight_tokens,
                                                    key))
    member = st.members[push.learner_id]
    if check.norm > 0:  # a push that moved nothing (e.g. a first step at lr 0) says nothing of the scale
      fragment.norms.append(check.norm)
      fragment.norm_steps.append(push.steps)
      member.norms.setdefault(p, collections.deque(maxlen=admission.learner_window(s))).append(check.norm)
    member.progress_at, member.stall_counted, member.last_push = now, False, now  # it stepped to get here
    member.refused_in_row = 0
    member.period_weights[p] = float(outer.raw_weights([weight_tokens], [weight_steps], s.merge_rule)[0])
    st.counters["bytes_in"] += len(push.payload)
    st.counters["contributions_late"] += int(late)
    st.counters["contributions_accepted"] += 1
    phase = phase_offset_s(now, fragment.arrivals.get(push.learner_id),
                           [t for i, t in fragment.arrivals.items() if i != push.learner_id])
    fragment.arrivals[push.learner_id] = now
    # The open round publishes the next version: that one merges this push.
    receipt = PushReceipt(fragment=p, round=fragment.rounds, late=late, epoch=st.epoch, version=fragment.version + 1,
                          phase_s=phase)
    if key is not None:
      admission.remember_key(st.keys.setdefault(push.learner_id, collections.OrderedDict()),
                             st.key_floors.setdefault(push.learner_id, {}), key, KeyRecord(push.checksum, receipt))
    self._changed(False)
    self.tick()
    return receipt

  # ---- rounds ----

  def _note_lapses(self, now: float) -> None:
    s, st = self.settings, self.state
    lapses = membership.lapses(st.members, now, s.stall_s, s.lease_s)
    for ids, flag, counter in ((lapses.expired, "expiry_counted", "leases_expired"),
                               (lapses.stalled, "stall_counted", "learner_stalls")):
      for i in ids:
        setattr(st.members[i], flag, True)
      st.counters[counter] += len(ids)
    for i in lapses.pruned:
      del st.members[i]
    st.counters["members_pruned"] += len(lapses.pruned)
    if lapses.expired or lapses.stalled:
      self._changed(False)

  def tick(self) -> list[int]:
    """Note lapses, then close what is due: a deadlocked round first, then every round whose quorum and grace
    window say so. Returns the fragments committed."""
    s, st = self.settings, self.state
    now = self._now()
    self._note_lapses(now)
    counted = set(membership.counted_ids(st.members, now, s.stall_s))
    open_rounds = {p: f.open for p, f in enumerate(st.fragments) if f.open is not None}
    stuck = rounds.stuck_rounds(open_rounds, counted, st.members)
    for p, rnd in open_rounds.items():
      rnd.stuck_since = (now if rnd.stuck_since is None else rnd.stuck_since) if p in stuck else None
    closed = []
    deadlocked = rounds.deadlock_due(open_rounds, s.stall_s, now)
    if deadlocked is not None:
      st.counters["deadlocks_broken"] += 1
      log.warning("fragment %d: round waits on learners %s, each blocked on another fragment's round that "
                  "waits on it; closing it with learners %s", deadlocked,
                  sorted(counted - set(open_rounds[deadlocked].contributors()))[:rounds.STATUS_IDS],
                  open_rounds[deadlocked].contributors()[:rounds.STATUS_IDS])
      closed.append((deadlocked, self._close(deadlocked, "deadlock")))
    for p, fragment in enumerate(st.fragments):
      rnd = fragment.open
      if rnd is None:
        continue
      if rnd.deadline is None:
        quorum = rounds.quorum_reached(rnd, counted, s.policy, st.members, fragment.t_sync, now, s.stall_s)
        if quorum is not None:
          for field in dataclasses.fields(quorum):
            setattr(rnd, field.name, getattr(quorum, field.name))
      why = rounds.close_reason(rnd, counted, now)
      if why is not None:
        closed.append((p, self._close(p, why)))
    if closed:
      self._wake()
    return [p for p, ok in closed if ok]

  def _close(self, p: int, why: str) -> bool:
    record = close.close_round(self.state, p, why, self.settings, self.downlink, self._now)
    self._changed(record is not None)  # versions durable before a learner can see them
    self.closes.append((p, record))
    return record is not None

  def close_all(self) -> list[int]:
    """Close every open round now, whatever its quorum (a stopping syncer merges what it holds)."""
    due = [p for p, f in enumerate(self.state.fragments) if f.open is not None]
    committed = [p for p in due if self._close(p, "stop")]
    self.state.counters["rounds_closed_at_stop"] += len(committed)
    if due:
      self._changed(False)
      self._wake()
    return committed

  # ---- pulls ----

  def poll(self, p, min_version, have_version, have_epoch, learner=None) -> tuple[Published | None, float | None]:
    """One look of a waiting pull (of `learner`, None: unknown): (the answer, None) once the version is
    there, else (None, the next tick)."""
    st = self.state
    self.tick()
    fragment = st.fragments[p]
    # After a refused round, a wait for the version it was to make ends with the current one.
    if fragment.version >= min_version or (fragment.refused_at == fragment.version
                                           and min_version == fragment.version + 1):
      published = self.downlink.answer(p, min(min_version, fragment.version), have_version, have_epoch,
                                       learner if learner is not None and learner >= 0 else None)  # not observers
      st.counters["pulls_delta" if published.kind == Kind.DELTA else "pulls_full"] += 1
      st.counters["bytes_out"] += len(published.payload)
      self._changed(False)
      return published, None
    return None, rounds.next_deadline(st.fragments, st.members, self._now(), self.settings.stall_s)

  # ---- counters, journal, checkpoints ----

  def count(self, name, n) -> None:
    self.state.counters[name] = self.state.counters.get(name, 0) + n
    self._changed(False)

  def apply_journal(self, record: dict) -> None:
    """The previous lifetime's journal: versions raised to its own, counters continued (`rules/recovery.py`)."""
    st = self.state
    floor = recovery.version_floor(st.versions, record)
    if floor is not None:  # renumber this lifetime from the highest version published: nothing was served yet
      for fragment, version in zip(st.fragments, floor):
        fragment.version, fragment.version_round, fragment.version_reference = version, {version: fragment.rounds}, {}
      st.history = recovery.renumbered(st.history, floor, st.rounds)
      self.downlink = Downlink.renumbered(self.downlink, floor)
    st.counters = recovery.counters_after_restart(st.counters, record, st.rounds)

  def restore(self, saved: dict, epoch: int) -> None:
    """A checkpoint's state under a new epoch; members, start time and decision records are kept."""
    old = self.state
    self.state, self.downlink = snapshot.restore(saved, self.settings, epoch, old.started)
    self.state.members, self.state.since_start = old.members, old.since_start
    self.state.decisions, self.state.decisions_dropped = old.decisions, old.decisions_dropped
    self._wake()

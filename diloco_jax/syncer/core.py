"""The syncer core: the shell around the syncer's state machine. No transport.

Transports (`transports/inprocess.py`, `syncer/server/`) call `join`, `heartbeat`, `push`, `pull`, `leave`;
`syncer/ticker.py` calls `tick` at `next_deadline()`. The core owns the lock, the clock, the journal and the
tape; the steps themselves are `syncer/machine.py`'s, which applies what the rules decide (membership,
admission, rounds, quorum and grace, recovery: `syncer/rules/`) to the typed state (`syncer/state.py`).
Every change of state is one step under the lock (`_step`): a join, a heartbeat, a leave, the two halves
of a push (its cheap checks, then its admission; the payload is checked between them, outside the lock),
a tick, one look of a waiting pull, a count, a restore, the journal's attachment. With a tape
(`syncer/tape.py`) each step is recorded with its arguments and the clock readings it took, and `apply`
replays one: the same steps give bitwise the same state (`python -m diloco_jax replay`). The journal gets
every change of versions and counters under the lock, versions before any learner can see them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import Reason, Rejected
from diloco_jax.syncer import snapshot, views
from diloco_jax.syncer import tape as tape_lib
from diloco_jax.syncer.downlink import Downlink, new_epoch
from diloco_jax.syncer.machine import Machine
from diloco_jax.syncer.rules import admission, membership, rounds
from diloco_jax.syncer.settings import SyncerSettings
from diloco_jax.syncer.state import new_state

log = logging.getLogger(__name__)


class SyncerCore:
  """The transport-free syncer; thread-safe. See the module docstring."""

  def __init__(self, settings: SyncerSettings, initial_fragments: Sequence[np.ndarray],
               clock: Callable[[], float] = time.monotonic, *, epoch: int | None = None, tape=None):
    if len(initial_fragments) != settings.num_fragments:
      raise ValueError(f"got {len(initial_fragments)} initial fragments for outer.num_fragments="
                       f"{settings.num_fragments}")
    self.settings, self.clock = settings, clock
    self._lock = threading.Lock()
    self._cond = threading.Condition(self._lock)
    held = []
    for p, frag in enumerate(initial_fragments):
      # Another shard's fragment: a zero-length placeholder (whatever was passed for it).
      frag = np.array(frag if settings.owns(p) else (), np.float32).reshape(-1)
      if frag.size != settings.held_sizes[p]:
        raise ValueError(f"initial fragment {p} has {frag.size} elements, expected {settings.held_sizes[p]}")
      held.append(frag)
    epoch = epoch or new_epoch()
    state = new_state(held, epoch, clock(), settings.merge_threads)
    downlink = Downlink(settings.held_sizes, settings.downlink_codec, settings.block, held, epoch=epoch,
                        threads=settings.merge_threads, history=settings.downlink_history)
    self._machine = Machine(settings, state, downlink, self._now, self._changed, self._cond.notify_all)
    self._journal: Callable[[dict, bool], None] | None = None
    self._tape, self._reads = tape, None
    if tape is not None:
      tape.begin(settings, held, epoch, state.started)

  # ---- steps ----

  def _now(self) -> float:
    t = self.clock()
    if self._reads is not None:
      self._reads.append(t)
    return t

  def _step(self, kind: str, **args) -> Any:
    """Run one step of the state machine (the lock held), recorded on the tape if there is one."""
    fn = getattr(self._machine, kind)
    if self._tape is None:
      return fn(**args)
    self._reads, self._machine.closes = [], []
    try:
      result = fn(**args)
    except Exception as e:
      self._tape.event(kind, args, self._reads, self._outcome(e))
      raise
    finally:
      reads, self._reads = self._reads, None
    self._tape.event(kind, args, reads, self._outcome(result))
    return result

  def _run(self, kind: str, **args) -> Any:
    with self._lock:
      return self._step(kind, **args)

  def _outcome(self, result) -> dict:
    """What a step decided, as the tape records it: its result and the rounds it closed, each with its
    decision record and the CRC-32 of the new global fragment."""
    fragments = self._machine.state.fragments
    return {"result": tape_lib.summary(result), "closes": [
        [p, record, codec_lib.checksum(fragments[p].global_vec.view(np.uint8))]
        for p, record in self._machine.closes]}

  def apply(self, kind: str, args: dict) -> dict:
    """Replay one recorded step (`tools/replay.py`); returns its outcome as a recording core records it."""
    with self._lock:
      self._reads, self._machine.closes = None, []
      try:
        return self._outcome(getattr(self._machine, kind)(**args))
      except Exception as e:  # noqa: BLE001 - a recorded step that raised must raise the same in replay
        return self._outcome(e)

  def _changed(self, versions: bool) -> None:
    # Under the lock after every change worth keeping across a crash; `versions`: the versions moved (the
    # journal makes them durable before any learner can see them).
    if self._journal is not None:
      self._journal(views.journal_record(self._machine.state, self.settings), versions)

  # ---- the syncer API (`protocol.SyncerAPI`) ----

  def check_learner_id(self, learner_id: int) -> None:
    """Raise Rejected(Reason.LEARNER_ID) unless 0 <= learner_id < learners.num."""
    self._run("check_id", learner_id=learner_id)

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Admit (or re-admit) a learner; returns {fragment: version} of the fragments this core serves, with
    its epoch and history."""
    return self._run("join", learner_id=learner_id, fingerprint=fingerprint)

  def leave(self, learner_id: int) -> None:
    """The learner stops counting toward quorums at once; its pushes already in still merge."""
    self._run("leave", learner_id=learner_id)

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None, blocked: bool = False) -> int:
    """Renew the learner's lease; `step_time_s` > 0 feeds its step time; `step` (its inner-step counter;
    None: not sent) and `blocked` say whether it makes progress. Returns this core's epoch."""
    return self._run("heartbeat", learner_id=learner_id, step_time_s=step_time_s, step=step, blocked=blocked)

  def push(self, push: Push) -> PushReceipt:
    """Accept one contribution into its fragment's open round (or raise Rejected), then tick."""
    receipt = self._run("push_check", push=push)
    if receipt is not None:
      return receipt
    check = admission.payload_check(self.settings, push)  # the expensive part, outside the lock
    with self._lock:
      return self._step("push_admit", push=push, check=check)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0, learner_id: int | None = None) -> Published | None:
    """The global fragment once its version >= min_version, waiting up to `timeout_s` real seconds; None on
    timeout. The answer is a delta from the reference the caller holds (`have_version` of `have_epoch`,
    which of its references: the one served to `learner_id` before) when one was published, else the full
    fragment (`syncer/downlink.py`)."""
    s = self.settings
    if not 0 <= fragment < s.num_fragments:
      raise Rejected(Reason.UNKNOWN_FRAGMENT, f"fragment {fragment} not in [0, {s.num_fragments})")
    if not s.owns(fragment):
      raise Rejected(Reason.WRONG_SHARD, f"fragment {fragment} belongs to another syncer shard; this one serves "
                     f"fragments {list(s.owned)}")
    give_up = time.monotonic() + max(timeout_s, 0.0)
    with self._lock:
      while True:
        published, deadline = self._step("poll", p=fragment, min_version=min_version, have_version=have_version,
                                         have_epoch=have_epoch, learner=learner_id)
        if published is not None:
          return published
        remaining = give_up - time.monotonic()
        if remaining <= 0:
          return None
        if deadline is not None:
          remaining = min(remaining, max(deadline - self.clock(), 0.001))
        self._cond.wait(remaining)

  def tick(self) -> list[int]:
    """Note lapsed leases and stalls, and close every round whose time has come; returns the fragments
    committed."""
    return self._run("tick")

  def close_open_rounds(self) -> list[int]:
    """Close every open round now, whatever its quorum (a syncer stopping: its contributions are merged
    rather than dropped); returns the fragments committed (a round refused as non-finite is not)."""
    return self._run("close_all")

  def count(self, name: str, n: int = 1) -> None:
    """Add to one of the counters (e.g. "tick_errors", counted by the ticker)."""
    self._run("count", name=name, n=n)

  # ---- journal, checkpoints, tape ----

  def attach_journal(self, journal: Callable[[dict, bool], None], record: dict | None = None) -> None:
    """Start journaling to `journal(record, versions_changed)` (called under the lock), after applying the
    previous lifetime's last `record`: versions raised to at least its versions, event counters continued
    (`rules/recovery.py`). Call once, after `load_state_dict` and before serving."""
    with self._lock:
      if record is not None:
        if record.get("fingerprint") != self.settings.fingerprint:
          raise ValueError(f"journal fingerprint {record.get('fingerprint')!r} != run {self.settings.fingerprint!r}")
        self._step("apply_journal", record=record)
      self._journal = journal
      self._changed(versions=True)

  def state_dict(self) -> dict:
    """What a syncer checkpoint holds (`syncer/snapshot.py`), a consistent copy."""
    with self._lock:
      return snapshot.state_dict(self._machine.state, self._machine.downlink, self.settings)

  def load_state_dict(self, saved: dict, epoch: int | None = None) -> None:
    """Restore from `state_dict()` under a new epoch (drawn unless given); drops open rounds, keeps members.
    The checkpoint may be older than what learners hold: its versions will be reached again with other
    references, hence the new epoch."""
    self._run("restore", saved=saved, epoch=epoch or new_epoch())

  def digest(self) -> list:
    """Per fragment: version, rounds, CRC-32 of the global vector and of the momentum (`tape.digest`)."""
    with self._lock:
      return tape_lib.digest(self._machine.state)

  def close_tape(self) -> None:
    """End the tape with the digest of the global model (replay checks it bit for bit)."""
    with self._lock:
      if self._tape is not None:
        self._tape.end(self._machine.state)
        self._tape.close()
        self._tape = None

  # ---- reads ----

  @property
  def epoch(self) -> int:
    """This syncer lifetime's epoch (`syncer/downlink.py`); redrawn by `load_state_dict`."""
    return self._machine.state.epoch

  @property
  def counters(self) -> dict[str, Any]:
    return self._machine.state.counters

  @property
  def decisions_dropped(self) -> int:
    return self._machine.state.decisions_dropped

  def history(self) -> tuple:
    """The lifetimes of this global model, oldest first, the current one last."""
    with self._lock:
      return tuple(self._machine.state.history)

  def max_payload_bytes(self) -> int:
    """The largest valid push payload: the largest fragment in the run's uplink codec."""
    s = self.settings
    return max(codec_lib.encoded_size(n, s.codec, s.block) for n in s.held_sizes)

  def journal_record(self) -> dict:
    with self._lock:
      return views.journal_record(self._machine.state, self.settings)

  def status(self) -> dict:
    """Members, versions, open rounds and counters (`syncer/views.py`)."""
    with self._lock:
      return views.status(self._machine.state, self.settings, self.clock())

  def live_learners(self) -> list[int]:
    with self._lock:
      return membership.live_ids(self._machine.state.members, self.clock())

  def counted_learners(self) -> list[int]:
    """The live learners that make progress: those rounds wait for."""
    with self._lock:
      return membership.counted_ids(self._machine.state.members, self.clock(), self.settings.stall_s)

  def next_deadline(self) -> float | None:
    """When `tick` should next run (clock time), or None if no round is open."""
    with self._lock:
      st = self._machine.state
      return rounds.next_deadline(st.fragments, st.members, self.clock(), self.settings.stall_s)

  def drain_decisions(self) -> list[dict]:
    """The decision records of the rounds closed since the last call (oldest first)."""
    with self._lock:
      out = list(self._machine.state.decisions)
      self._machine.state.decisions.clear()
      return out

  def global_fragments(self) -> list[np.ndarray]:
    """Copies of the global fragments Theta (what the run trains)."""
    return self.global_model()[0]

  def global_model(self) -> tuple[list[np.ndarray], list[int]]:
    """Copies of the global fragments and their versions, read together (a merge can land between calls)."""
    with self._lock:
      return [f.global_vec.copy() for f in self._machine.state.fragments], list(self._machine.state.versions)

  def rounds_closed(self) -> int:
    """Rounds closed so far over all fragments, in the history of the current model."""
    with self._lock:
      return sum(self._machine.state.rounds)

  def reference(self, fragment: int) -> tuple[int, np.ndarray]:
    """(version, a copy of R_version): exactly what a learner that adopted that version holds."""
    with self._lock:
      return self._machine.state.fragments[fragment].version, self._machine.downlink.reference(fragment)

"""A learner's outer-loop worker: everything that touches the network, off the inner loop's thread.

`Comms.sync(...)` takes a fragment's outer gradient (its pieces on the devices, host copies under way) and
returns a Future that, on background threads, brings it to the host, encodes it, pushes it with an
idempotency key (a random `incarnation` per process start and a `sequence` per push: a retried push is
merged once) and waits for the global fragment that merges it, fetched as a delta from the reference the
learner holds when the syncer has one (`syncer/downlink.py`). A heartbeat thread renews the lease with the
learner's step time, step counter and whether it is blocked on the syncer. Every answer names the syncer's
epoch: when another shows up, the syncer restarted, a sync in flight stops waiting and returns
`abandoned`, and `epoch_changed()` tells the learner to recover (docs/operations.md, "Recovery").
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import math
import secrets
import statistics
import threading
import time

import numpy as np

from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import feedback as feedback_lib
from diloco_jax.protocol.interfaces import Transport
from diloco_jax.protocol.messages import Kind, Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import REJOIN_REASONS, Reason, Rejected

log = logging.getLogger(__name__)

# The step time reported to the syncer: the median of the means of the last _STEP_GROUPS groups of
# `step_group` consecutive steps (`Comms.report_step_time`).
_STEP_GROUPS = 8


@dataclasses.dataclass(frozen=True)
class SyncResult:
  fragment: int
  version: int
  # kind "full": the global fragment at `version` (float32, flat). kind "delta": the change from the
  # reference of `base_version` (the learner's base) to that of `version`.
  global_vec: np.ndarray
  late: bool  # the push was merged into a later round than the one it was made for
  kind: Kind = Kind.FULL
  base_version: int = -1  # for a delta: the version of the base it applies to
  epoch: int = 0  # the serving syncer's epoch: with `version`, names the reference the base becomes
  receipt: PushReceipt | None = None  # the syncer's receipt of the push (None: not accepted)
  # The receipt's `phase_s` in this learner's steps (> 0: its push came after the others'; 0: unknown).
  phase_steps: float = 0.0
  # The syncer restarted (another epoch) before the merged fragment came back: no `global_vec`; the
  # learner recovers (`learner/loop.py`).
  abandoned: bool = False


def to_host(delta) -> np.ndarray:
  """A fragment's outer gradient as its flat float32 host vector: a host vector as it is, or the pieces of
  the fragment (device arrays of this process, sharded like the parameters: each device's shards come to
  the host, no device holds the whole vector) concatenated in plan order."""
  if isinstance(delta, np.ndarray):
    return np.asarray(delta, np.float32)
  out, start = np.empty(sum(x.size for x in delta), np.float32), 0
  for x in delta:  # one piece's host copy at a time besides the vector
    out[start:start + x.size] = np.asarray(x).reshape(-1)
    start += x.size
  return out


class Comms:
  """Background network worker of one learner (one per learner; thread-safe)."""

  def __init__(self, transport: Transport, learner_id: int, fingerprint: str, *, codec: str, downlink_codec: str,
               block: int, sizes: tuple[int, ...], max_in_flight: int, heartbeat_s: float,
               pull_timeout_s: float = 0.5, step_group: int = 8, error_feedback: bool = False):
    self.transport = transport
    self._step_group = max(1, int(step_group))
    self.learner_id = learner_id
    self.fingerprint = fingerprint
    self.codec, self.downlink_codec, self.block, self.sizes = codec, downlink_codec, block, sizes
    self.pull_timeout_s = pull_timeout_s
    self.feedback = feedback_lib.ErrorFeedback(codec, block) if error_feedback else None
    # Reported by the inner loop, read by the heartbeat thread.
    self._group_means: collections.deque[float] = collections.deque(maxlen=_STEP_GROUPS)
    self._group_s, self._group_steps = 0.0, 0  # the current group's seconds and steps
    self._step: int | None = None  # the inner loop's step counter, sent with heartbeats (None: unknown)
    self._stepped = False  # a step was reported with its count (the first one compiled: not timed)
    self._blocked = False  # the inner loop waits on the syncer
    self._epoch = 0  # the syncer epoch the learner's bases are named in (0: none yet)
    self._seen_epoch = 0  # the latest epoch any answer named
    self.rejected: list[str] = []
    self.incarnation = 1 + secrets.randbelow(2**63 - 1)  # idempotency keys: (learner, incarnation, sequence)
    self._sequence = itertools.count(1)
    self._lock = threading.Lock()
    self._payload_sent = self._payload_received = self._pushes = 0
    self._cpu_s = 0.0  # CPU time of the sync workers (encode, push, fetch, decode; an in-process core's merge)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight,
                                                       thread_name_prefix=f"learner{learner_id}-comms")
    self._stop = threading.Event()
    self._leaving = threading.Event()  # left the quorum: heartbeats stop and never rejoin
    self.joined = threading.Event()  # the syncer answered a join: until then there is nothing to flush
    self._heartbeat_s = heartbeat_s
    self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                       name=f"learner{learner_id}-heartbeat")

  def report_step_time(self, seconds: float, step: int | None = None) -> None:
    """The inner loop's latest step time (the host wall time from the end of its previous step, waits on
    the syncer excluded) and, if given, its step counter (sent with heartbeats: the syncer's evidence that
    this learner makes progress, shown by its status). The step time feeds the syncer's grace window and
    goodput estimate.

    With asynchronous dispatch single step times are bimodal: most steps only enqueue work and return in
    milliseconds, and now and then the loop waits for the device to catch up with all of them (a metrics
    fetch every `train.log_every` steps, a snapshot's host copy). Their median is the dispatch time, a
    hundredth of the real step on small_cpu (it made the grace window close before another learner's
    push could arrive). So the estimate is the median of the means of the last `_STEP_GROUPS` groups of
    `step_group` consecutive steps (the learner passes at least `train.log_every`, so that each group
    holds a catching-up): a group's mean is the learner's real pace, and the median across groups
    ignores a stall. The first step a process reports with its count is left out: it compiled."""
    with self._lock:
      warmup = step is not None and not self._stepped
      if step is not None:
        self._step, self._stepped = int(step), True
      if not warmup:
        self._group_s += float(seconds)
        self._group_steps += 1
        if self._group_steps == self._step_group:
          self._group_means.append(self._group_s / self._step_group)
          self._group_s, self._group_steps = 0.0, 0

  def report_step(self, step: int) -> None:
    """The step counter before any step ran (a resumed learner's checkpoint step): a learner that joined
    and is still compiling is not taken for one that makes progress."""
    with self._lock:
      self._step = step

  def set_blocked(self, blocked: bool) -> None:
    """The inner loop starts (True) or stops (False) waiting on the syncer: not a stopped learner."""
    with self._lock:
      self._blocked = blocked

  # ---- epochs ----

  @property
  def epoch(self) -> int:
    """The syncer epoch the learner's bases are named in (set by the learner at join and recovery)."""
    with self._lock:
      return self._epoch

  def set_epoch(self, epoch: int) -> None:
    with self._lock:
      self._epoch = self._seen_epoch = epoch

  def _see(self, epoch: int) -> None:
    if epoch:
      with self._lock:
        self._seen_epoch = epoch

  def epoch_changed(self) -> bool:
    """An answer named another syncer epoch than the learner's: the syncer restarted; recover."""
    with self._lock:
      return bool(self._epoch and self._seen_epoch and self._seen_epoch != self._epoch)

  @property
  def step_time_s(self) -> float:
    """The median of the recent groups' mean step times; before a whole group, the mean of the steps so
    far (0 before the first; `report_step_time`)."""
    with self._lock:
      if self._group_means:
        return statistics.median(self._group_means)
      return self._group_s / self._group_steps if self._group_steps else 0.0

  @property
  def cpu_s(self) -> float:
    """CPU seconds the sync workers spent so far (their own threads' time)."""
    with self._lock:
      return self._cpu_s

  def traffic(self) -> dict[str, int]:
    """Bytes on the wire both ways (the transport's count: payload and framing, retries included), and the
    fragment payload bytes of accepted pushes and of pulls (what the syncer counts as bytes_in / out)."""
    with self._lock:
      return {"bytes_sent": self.transport.bytes_sent, "bytes_received": self.transport.bytes_received,
              "payload_bytes_sent": self._payload_sent, "payload_bytes_received": self._payload_received,
              "pushes": self._pushes}

  def join(self) -> Versions:
    """Joins the run; returns the current version of every fragment, with the syncer's epoch and history
    (empty from a transport that sends none). Starts the heartbeat."""
    versions = self.transport.join(self.learner_id, self.fingerprint)
    self.joined.set()
    self._see(versions.epoch)
    if not self._heartbeat.is_alive():
      self._heartbeat.start()
    return versions

  def fetch(self, fragment: int, min_version: int, have_version: int = -1,
            have_epoch: int = 0) -> tuple[Published, np.ndarray]:
    """Blocks until the global fragment at `min_version` or later arrives; returns (its header, vector).

    `have_version`, `have_epoch`: the version of the base the learner holds for this fragment (-1: none
    usable) and the epoch of the syncer it came from. The answer is then either the full fragment or, when
    `published.kind == "delta"`, the change to add to that base (`published.base_version == have_version`
    and, past version 0, `published.epoch == have_epoch`, checked here).
    """
    while not self._stop.is_set():
      published = self.transport.pull(fragment, min_version, self.pull_timeout_s, have_version=have_version,
                                      have_epoch=have_epoch)
      if published is None:
        continue
      return self._checked(published, fragment, have_version, have_epoch)
    raise RuntimeError("comms stopped")

  def _checked(self, published: Published, fragment: int, have_version: int,
               have_epoch: int) -> tuple[Published, np.ndarray]:
    """Validates an answer against what the learner holds; returns it with its decoded vector."""
    if published.kind == Kind.DELTA and (have_version < 0 or published.base_version != have_version):
      raise codec_lib.CodecError(f"fragment {fragment} v{published.version}: a delta from version "
                                 f"{published.base_version}, but this learner holds {have_version}")
    if published.kind == Kind.DELTA and have_version > 0 and published.epoch != have_epoch:
      # R_0 is the same in every epoch; a later version's reference only within one syncer lifetime.
      raise codec_lib.CodecError(f"fragment {fragment} v{published.version}: a delta from syncer epoch "
                                 f"{published.epoch}, but this learner's base is from epoch {have_epoch}")
    if published.kind not in (Kind.FULL, Kind.DELTA):
      raise codec_lib.CodecError(f"fragment {fragment}: unknown kind {published.kind!r}")
    self._see(published.epoch)
    with self._lock:
      self._payload_received += len(published.payload)
    return published, self._decode(published)

  def _phase_steps(self, receipt: PushReceipt | None) -> float:
    """The receipt's phase in this learner's steps (0 without a step time or a finite phase)."""
    step_s = self.step_time_s
    phase = float(receipt.phase_s) if receipt is not None else 0.0
    return phase / step_s if step_s > 0 and math.isfinite(phase) else 0.0

  def _result(self, fragment: int, min_version: int, have_version: int, have_epoch: int, sync_epoch: int,
              receipt: PushReceipt | None) -> SyncResult:
    """The merged fragment of a sync made in `sync_epoch`, or `abandoned` once another epoch shows up."""
    while True:
      with self._lock:
        restarted = self._epoch != sync_epoch or self._seen_epoch not in (0, sync_epoch)
      if restarted and sync_epoch:
        return SyncResult(fragment, -1, None, late=False, receipt=receipt, abandoned=True)
      published = self.transport.pull(fragment, min_version, self.pull_timeout_s, have_version=have_version,
                                      have_epoch=have_epoch)
      if self._stop.is_set():
        raise RuntimeError("comms stopped")
      if published is None:
        continue
      if sync_epoch and published.epoch not in (0, sync_epoch):
        self._see(published.epoch)
        continue  # the loop's first check returns abandoned
      published, vec = self._checked(published, fragment, have_version, have_epoch)
      return SyncResult(fragment, published.version, vec, late=bool(receipt and receipt.late),
                        kind=published.kind, base_version=published.base_version, epoch=published.epoch,
                        receipt=receipt, phase_steps=self._phase_steps(receipt))

  def sync(self, fragment: int, delta, base_version: int, steps: int, tokens: int,
           base_epoch: int = 0) -> concurrent.futures.Future:
    """Starts pushing `delta` (the fragment's pieces on the devices, or its host vector: `to_host`) for
    `fragment` and fetching the merged result.

    `base_version`, `base_epoch`: the version and syncer epoch of the learner's base for the fragment.
    The future's `SyncResult` is `abandoned` if the syncer restarts meanwhile (module docstring).
    """
    return self._pool.submit(self._sync, fragment, delta, base_version, base_epoch, steps, tokens, self.epoch)

  def _sync(self, fragment, delta, base_version, base_epoch, steps, tokens, sync_epoch) -> SyncResult:
    cpu0 = time.thread_time()
    try:
      return self._sync_timed(fragment, delta, base_version, base_epoch, steps, tokens, sync_epoch)
    finally:
      with self._lock:
        self._cpu_s += time.thread_time() - cpu0

  def _sync_timed(self, fragment, delta, base_version, base_epoch, steps, tokens, sync_epoch) -> SyncResult:
    vec = to_host(delta)  # waits for the device->host copy, on this thread only
    del delta
    payload = (self.feedback.encode(fragment, vec) if self.feedback is not None
               else codec_lib.encode(vec, self.codec, self.block))
    with self._lock:
      sequence = next(self._sequence)
    push = Push(learner_id=self.learner_id, fingerprint=self.fingerprint, fragment=fragment,
                base_version=base_version, steps=steps, tokens=tokens, codec=self.codec, payload=payload,
                checksum=codec_lib.checksum(payload), incarnation=self.incarnation, sequence=sequence,
                base_epoch=base_epoch)
    del vec
    try:
      receipt = self._push(push, sync_epoch)
    except Rejected as e:
      if e.reason == Reason.EPOCH:  # the syncer restarted before this push: recover, then push again
        return SyncResult(fragment, -1, None, late=False, abandoned=True)
      # A refused push is lost work, but the learner must go on: fetch the current global and adopt it.
      self.rejected.append(e.reason)
      log.warning("learner %d: push of fragment %d refused: %s", self.learner_id, fragment, e)
      return self._result(fragment, 0, base_version, base_epoch, sync_epoch, None)
    if receipt is None:  # rejoined a restarted syncer: the push waits for the recovery
      return SyncResult(fragment, -1, None, late=False, abandoned=True)
    # Wait for the version that merges this push (the receipt names it), not just any version after the
    # base: a late push's base is already behind, and adopting a version without this learner's own work
    # would set it back by a period. The learner's base for this fragment is the reference of base_version
    # until this result is adopted (one sync per fragment in flight), so a delta from it applies if the
    # syncer's epoch is still that base's (a syncer restored meanwhile answers with the full fragment).
    merged = max(base_version + 1, receipt.version)
    return self._result(fragment, merged, base_version, base_epoch, sync_epoch, receipt)

  def _push(self, push: Push, sync_epoch: int) -> PushReceipt | None:
    """The receipt, or None when the syncer forgot this learner because it restarted (another epoch)."""
    try:
      receipt = self.transport.push(push)
    except Rejected as e:
      if e.reason not in REJOIN_REASONS or self._leaving.is_set():
        raise
      epoch = self.transport.join(self.learner_id, self.fingerprint).epoch
      self._see(epoch)
      if sync_epoch and epoch not in (0, sync_epoch):
        return None
      receipt = self.transport.push(push)
    if receipt.epoch != sync_epoch:  # a duplicate's receipt names the sync's own (maybe older) lifetime
      self._see(receipt.epoch)
    with self._lock:  # only an accepted push reaches the syncer's count
      self._payload_sent += len(push.payload)
      self._pushes += 1
    return receipt

  def _decode(self, published: Published) -> np.ndarray:
    if codec_lib.checksum(published.payload) != published.checksum:
      raise codec_lib.CodecError(f"fragment {published.fragment} v{published.version}: bad checksum")
    return codec_lib.decode(published.payload, published.codec, self.sizes[published.fragment], self.block)

  def _heartbeat_loop(self) -> None:
    while not self._stop.wait(self._heartbeat_s) and not self._leaving.is_set():
      step_time = self.step_time_s
      with self._lock:
        step, blocked = self._step, self._blocked
      try:
        self._see(self.transport.heartbeat(self.learner_id, step_time, step=step, blocked=blocked))
      except Rejected as e:
        if e.reason in REJOIN_REASONS and not self._leaving.is_set():
          try:
            self._see(self.transport.join(self.learner_id, self.fingerprint).epoch)
          except Exception as join_error:  # noqa: BLE001 - keep heartbeating; the next beat retries
            log.warning("learner %d: rejoin failed: %s", self.learner_id, join_error)
      except Exception as e:  # noqa: BLE001 - the syncer may be down; training goes on
        log.warning("learner %d: heartbeat failed: %s", self.learner_id, e)

  def abandon(self) -> None:
    """Stop waiting for syncs in flight: their fetch loops end with an error (the caller closes the
    transport to end calls on the wire too). For a shutdown whose grace ran out."""
    self._stop.set()

  def close(self, leave: bool = True) -> None:
    # Stop first: a sync still in flight (the learner failed) gives up within one pull instead of
    # holding the shutdown.
    self._stop.set()
    self._pool.shutdown(wait=True, cancel_futures=True)
    if leave:
      try:
        self.leave()
      except Exception as e:  # noqa: BLE001
        log.warning("learner %d: leave failed: %s", self.learner_id, e)

  def leave(self) -> None:
    """Leave the quorum for good: heartbeats stop first, so none rejoins this learner afterwards (a
    heartbeat refused as "left" would otherwise join it again)."""
    self._leaving.set()
    self.transport.leave(self.learner_id)

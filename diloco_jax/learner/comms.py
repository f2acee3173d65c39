"""A learner's outer-loop worker: everything that touches the network, off the inner loop's thread.

`Comms.sync(...)` takes a fragment's outer gradient (a device array whose host copy is already under way)
and returns a Future that, on background threads, brings it to the host, encodes it, pushes it, and waits
for the global fragment that merges it. A heartbeat thread renews the learner's lease with its step time.

Fetches say which version's reference the learner holds (`have_version`, its base version for that
fragment, and `have_epoch`, the epoch of the syncer that served it), so the syncer can answer with the
quantized change from it (kind "delta", to be added to the base on the device) instead of the full fragment
(see `syncer/core.py`, "Downlink" and "Epochs").

Every push carries an idempotency key: this worker's random `incarnation` (drawn once per learner process
start) and a per-push `sequence`, so a push the transport retries after a lost reply is merged once.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import secrets
import statistics
import threading
import time

import numpy as np

from diloco_jax import codec as codec_lib
from diloco_jax.protocol import REJOIN_REASONS, Published, Push, Rejected, Transport

log = logging.getLogger(__name__)

_STEP_TIME_WINDOW = 32  # recent inner steps whose median is the step time reported to the syncer


@dataclasses.dataclass(frozen=True)
class SyncResult:
  fragment: int
  version: int
  # kind "full": the global fragment at `version` (float32, flat). kind "delta": the change from the
  # reference of `base_version` (the learner's base) to that of `version`.
  global_vec: np.ndarray
  late: bool  # the push was merged into a later round than the one it was made for
  kind: str = "full"
  base_version: int = -1  # for a delta: the version of the base it applies to
  epoch: int = 0  # the serving syncer's epoch: with `version`, names the reference the base becomes


class Comms:
  """Background network worker of one learner (one per learner; thread-safe)."""

  def __init__(self, transport: Transport, learner_id: int, fingerprint: str, *, codec: str, downlink_codec: str,
               block: int, sizes: tuple[int, ...], max_in_flight: int, heartbeat_s: float,
               pull_timeout_s: float = 5.0):
    self.transport = transport
    self.learner_id = learner_id
    self.fingerprint = fingerprint
    self.codec, self.downlink_codec, self.block, self.sizes = codec, downlink_codec, block, sizes
    self.pull_timeout_s = pull_timeout_s
    # Reported by the inner loop, read by the heartbeat thread.
    self._step_times: collections.deque[float] = collections.deque(maxlen=_STEP_TIME_WINDOW)
    self._step: int | None = None  # likewise: the inner step, shown by the syncer's status
    self.rejected: list[str] = []
    self.incarnation = 1 + secrets.randbelow(2**63 - 1)  # idempotency keys: (learner, incarnation, sequence)
    self._sequence = itertools.count(1)
    self._lock = threading.Lock()
    self._payload_sent = self._payload_received = self._pushes = 0
    self._cpu_s = 0.0  # CPU time of the sync workers (encode, push, fetch, decode; an in-process core's merge)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_in_flight,
                                                       thread_name_prefix=f"learner{learner_id}-comms")
    self._stop = threading.Event()
    self._heartbeat_s = heartbeat_s
    self._heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                       name=f"learner{learner_id}-heartbeat")

  def report_step_time(self, seconds: float, step: int | None = None) -> None:
    """The inner loop's latest step time and, if given, its step count (the next heartbeat reports it).
    The median of the recent step times feeds the syncer's grace window and goodput estimate: robust to
    the noise of single steps (a step that waited for the host), unlike a mean. The first step a process
    reports with its count is left out: it compiled."""
    with self._lock:
      warmup = step is not None and self._step is None
      if step is not None:
        self._step = int(step)
      if not warmup:
        self._step_times.append(float(seconds))

  @property
  def step_time_s(self) -> float:
    """The median of the last 32 reported step times (0 before the first)."""
    with self._lock:
      return statistics.median(self._step_times) if self._step_times else 0.0

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

  def join(self) -> dict[int, int]:
    """Joins the run; returns the current version of every fragment. Starts the heartbeat."""
    versions = self.transport.join(self.learner_id, self.fingerprint)
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
      if published.kind == "delta" and (have_version < 0 or published.base_version != have_version):
        raise codec_lib.CodecError(f"fragment {fragment} v{published.version}: a delta from version "
                                   f"{published.base_version}, but this learner holds {have_version}")
      if published.kind == "delta" and have_version > 0 and published.epoch != have_epoch:
        # R_0 is the same in every epoch; a later version's reference only within one syncer lifetime.
        raise codec_lib.CodecError(f"fragment {fragment} v{published.version}: a delta from syncer epoch "
                                   f"{published.epoch}, but this learner's base is from epoch {have_epoch}")
      if published.kind not in ("full", "delta"):
        raise codec_lib.CodecError(f"fragment {fragment}: unknown kind {published.kind!r}")
      with self._lock:
        self._payload_received += len(published.payload)
      return published, self._decode(published)
    raise RuntimeError("comms stopped")

  def _result(self, fragment: int, min_version: int, have_version: int, have_epoch: int,
              late: bool) -> SyncResult:
    published, vec = self.fetch(fragment, min_version, have_version, have_epoch)
    return SyncResult(fragment, published.version, vec, late=late, kind=published.kind,
                      base_version=published.base_version, epoch=published.epoch)

  def sync(self, fragment: int, delta, base_version: int, steps: int, tokens: int,
           base_epoch: int = 0) -> concurrent.futures.Future:
    """Starts pushing `delta` (a device array) for `fragment` and fetching the merged result.

    `base_version`, `base_epoch`: the version and syncer epoch of the learner's base for the fragment.
    """
    return self._pool.submit(self._sync, fragment, delta, base_version, base_epoch, steps, tokens)

  def _sync(self, fragment, delta, base_version, base_epoch, steps, tokens) -> SyncResult:
    cpu0 = time.thread_time()
    try:
      return self._sync_timed(fragment, delta, base_version, base_epoch, steps, tokens)
    finally:
      with self._lock:
        self._cpu_s += time.thread_time() - cpu0

  def _sync_timed(self, fragment, delta, base_version, base_epoch, steps, tokens) -> SyncResult:
    vec = np.asarray(delta, dtype=np.float32)  # waits for the device->host copy, on this thread only
    del delta
    payload = codec_lib.encode(vec, self.codec, self.block)
    with self._lock:
      sequence = next(self._sequence)
    push = Push(learner_id=self.learner_id, fingerprint=self.fingerprint, fragment=fragment,
                base_version=base_version, steps=steps, tokens=tokens, codec=self.codec, payload=payload,
                checksum=codec_lib.checksum(payload), incarnation=self.incarnation, sequence=sequence)
    del vec
    try:
      receipt = self._push(push)
    except Rejected as e:
      # A refused push is lost work, but the learner must go on: fetch the current global and adopt it.
      self.rejected.append(e.reason)
      log.warning("learner %d: push of fragment %d refused: %s", self.learner_id, fragment, e)
      return self._result(fragment, 0, base_version, base_epoch, late=False)
    # Wait for the version that merges this push (the receipt names it), not just any version after the
    # base: a late push's base is already behind, and adopting a version without this learner's own work
    # would set it back by a period. The learner's base for this fragment is the reference of base_version
    # until this result is adopted (one sync per fragment in flight), so a delta from it applies if the
    # syncer's epoch is still that base's (a syncer restored meanwhile answers with the full fragment).
    merged = max(base_version + 1, receipt.version)
    return self._result(fragment, merged, base_version, base_epoch, late=receipt.late)

  def _push(self, push: Push):
    try:
      receipt = self.transport.push(push)
    except Rejected as e:
      if e.reason not in REJOIN_REASONS:
        raise
      self.transport.join(self.learner_id, self.fingerprint)
      receipt = self.transport.push(push)
    with self._lock:  # only an accepted push reaches the syncer's count
      self._payload_sent += len(push.payload)
      self._pushes += 1
    return receipt

  def _decode(self, published: Published) -> np.ndarray:
    if codec_lib.checksum(published.payload) != published.checksum:
      raise codec_lib.CodecError(f"fragment {published.fragment} v{published.version}: bad checksum")
    return codec_lib.decode(published.payload, published.codec, self.sizes[published.fragment], self.block)

  def _heartbeat_loop(self) -> None:
    while not self._stop.wait(self._heartbeat_s):
      try:
        with self._lock:
          step = self._step
        self.transport.heartbeat(self.learner_id, self.step_time_s, step=step)
      except Rejected as e:
        if e.reason in REJOIN_REASONS:
          try:
            self.transport.join(self.learner_id, self.fingerprint)
          except Exception as join_error:  # noqa: BLE001 - keep heartbeating; the next beat retries
            log.warning("learner %d: rejoin failed: %s", self.learner_id, join_error)
      except Exception as e:  # noqa: BLE001 - the syncer may be down; training goes on
        log.warning("learner %d: heartbeat failed: %s", self.learner_id, e)

  def abandon(self) -> None:
    """Stop waiting for syncs in flight: their fetch loops end with an error (the caller closes the
    transport to end calls on the wire too). For a shutdown whose grace ran out."""
    self._stop.set()

  def close(self, leave: bool = True) -> None:
    """Stop the workers and the heartbeat, then leave the quorum (`leave`). A sync still waiting for its
    merged fragment is abandoned (its future fails): after a clean flush there is none."""
    self._stop.set()  # first: a worker long-polling for a version that never comes must not hold us
    self._pool.shutdown(wait=True)
    if leave:
      try:
        self.transport.leave(self.learner_id)
      except Exception as e:  # noqa: BLE001
        log.warning("learner %d: leave failed: %s", self.learner_id, e)

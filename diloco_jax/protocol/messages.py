"""What crosses the line between a learner and the syncer.

Both sides import this module and nothing of each other:

* the messages: `Push` (a learner's outer gradient for one fragment), `PushReceipt`, `Published` (a global
  fragment as served, full or delta), `Versions` (what a join answers: versions, epoch and the epoch
  history a learner recovers with after a syncer restart, see docs/operations.md "Recovery");
* refusals: `Rejected` with one of `REASONS`;
* chunking: payloads travel as offset-tagged chunks (`chunks`), reassembled by `Reassembler` on the
  receiving end (the gRPC service for pushes, the gRPC client for pulls);
* `Transport`: what a learner's comms worker calls (join, push, pull, heartbeat, leave, status), served in
  one process by `transports.inprocess` and over the network by `transports.grpc`;
* `SyncerAPI`: what a transport calls on the syncer side (implemented by `syncer.core.SyncerCore`);
* the run token: `read_token`, shared by the syncer and learner processes;
* `shorten`: how any string that came off the wire is quoted in a message or a log line (bounded).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import pathlib
import sys
import threading
from typing import Iterator, Protocol, runtime_checkable

log = logging.getLogger(__name__)

# Why the syncer refuses a push (or another request). Each has a counter in the syncer's status.
#   learner_id: the id is outside [0, learners.num)      overclaim: steps or tokens the schedule cannot give
#   outlier: the outer gradient's norm is far above the fragment's recent ones
#   key_conflict: an idempotency key seen before, on a different payload
#   epoch: base_version is numbered by another syncer lifetime (it restarted): the learner recovers first
#   wrong_shard: the fragment belongs to another shard of a sharded syncer
REASONS = ("unknown_learner", "fingerprint", "not_member", "unknown_fragment", "codec", "shape",
           "checksum", "metadata", "nonfinite", "future_version", "learner_id", "overclaim", "outlier",
           "key_conflict", "epoch", "wrong_shard")
# Rejections that mean "the syncer forgot this learner" (it restarted, or the lease lapsed): join again.
REJOIN_REASONS = ("not_member", "unknown_learner")

TOKEN_ENV = "DILOCO_TOKEN"
# The id an observer (the global-model evaluator, `status`) uses on its calls: it pulls and asks for the
# status without ever joining, so it is no member and never counts toward a quorum.
OBSERVER_ID = -1
REASON_METADATA_KEY = "diloco-reason"  # gRPC trailing metadata: the machine-readable reason of a refusal
ECHO_CHARS = 64  # at most this much of a wire string is quoted back in a message or a log line


def shorten(value, limit: int = ECHO_CHARS) -> str:
  """`repr(value)` cut to about `limit` characters, saying how long it was: how a string from the wire
  (a fingerprint, a codec name...) is quoted in a reply or a log line, so a hostile 1 MiB field is never
  echoed whole."""
  text = repr(value)
  if len(text) <= limit:
    return text
  size = f" ({len(value)} chars)" if isinstance(value, (str, bytes)) else ""
  return f"{text[:limit]}...{size}"


class Rejected(Exception):
  """A request the syncer refuses. `reason` is one of `REASONS` and the message says why."""

  def __init__(self, reason: str, message: str):
    super().__init__(f"{reason}: {message}")
    self.reason = reason
    self.message = message


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


class Versions(dict):
  """What `join` answers: {fragment: version}, plus the serving syncer's `epoch` and `history` (its
  lifetimes, oldest first, the current one last; a tuple of `EpochRecord`)."""

  def __init__(self, versions, epoch: int = 0, history: tuple[EpochRecord, ...] = ()):
    super().__init__(versions)
    self.epoch = epoch
    self.history = tuple(history)


@dataclasses.dataclass(frozen=True)
class Published:
  """A global fragment as served to learners: decode with `codec.decode(payload, codec, size, block)`.

  kind "full": the decoded vector is the fragment at `version`. kind "delta": it is the change from the
  reference of `base_version` (< version) of the same syncer `epoch`, to be added to the base the learner
  holds (one float32 add). See `syncer/downlink.py`.
  """

  fragment: int
  version: int
  codec: str
  payload: bytes
  checksum: int
  kind: str = "full"  # "full" | "delta"
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


def merged_for_good(history: tuple[EpochRecord, ...], epoch: int, round_: int, fragment: int) -> bool:
  """Whether the contribution that lifetime `epoch` put into round `round_` of `fragment` is (or, for the
  current lifetime, will be) in the current global model: its round closed before the lifetime that
  followed `epoch` was restored, or `epoch` is the current lifetime."""
  kept = kept_rounds(history, epoch, fragment)
  return kept is not None and round_ < kept


# ---- chunking --------------------------------------------------------------------------------------------


class ProtocolError(ValueError):
  """A stream that breaks the chunking rules. `reason`: "sequence", "oversize" or "truncated"."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def chunks(payload: bytes, chunk_bytes: int) -> Iterator[tuple[int, bytes]]:
  """(offset, data) pieces of `payload`, in order, each at most `chunk_bytes` long."""
  if chunk_bytes < 1:
    raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
  view = memoryview(payload)
  for offset in range(0, len(payload), chunk_bytes):
    yield offset, bytes(view[offset:offset + chunk_bytes])


class Reassembler:
  """Rebuilds a payload from offset-tagged chunks that must arrive in order.

  Memory grows with the bytes that actually arrived, never with the size a header declared: a sender that
  declares a large payload and sends nothing costs nothing. `into`: a buffer of exactly the declared size
  that the receiver already holds (a reused one, see `wire.BufferPool`) to copy the chunks into instead.
  """

  def __init__(self, total_size: int, what: str = "payload", into: bytearray | None = None):
    if total_size < 0:
      raise ProtocolError("oversize", f"{what}: negative declared size {total_size}")
    self.total_size = int(total_size)
    self._what = what
    if into is not None and len(into) != self.total_size:
      raise ValueError(f"{what}: a buffer of {len(into)} bytes for {self.total_size}")
    self._into = into
    self._received = 0
    self._buf = bytearray()

  @property
  def received(self) -> int:
    return self._received

  def add(self, offset: int, data: bytes) -> None:
    if offset != self._received:
      raise ProtocolError("sequence", f"{self._what}: chunk out of sequence: offset {offset}, expected "
                          f"{self._received}")
    if self._received + len(data) > self.total_size:
      raise ProtocolError("oversize", f"{self._what} exceeds its declared size of {self.total_size} bytes")
    if self._into is not None:
      self._into[offset:offset + len(data)] = data
    else:
      self._buf += data
    self._received += len(data)

  def finish(self, *, copy: bool = True) -> bytes | bytearray:
    """The payload. `copy=False` hands over the buffer itself (a bytearray, one payload-sized copy fewer;
    the caller then owns it and must not change it while the payload is in use)."""
    if self._received != self.total_size:
      raise ProtocolError("truncated", f"truncated {self._what}: declared {self.total_size} bytes, received "
                          f"{self._received}")
    buf = self._into if self._into is not None else self._buf
    out, self._buf, self._into = (bytes(buf) if copy else buf), bytearray(), None
    return out


class BufferPool:
  """Payload buffers kept for reuse: a fresh buffer of a fragment's size costs the kernel's page faults,
  about twice the transfer itself on loopback, more than a copy into a warm one (docs/benchmarks.md),
  and the same sizes come back every round. Buffers enter the pool only after a transfer filled them (`adopt`), never on a declared size,
  and one is handed out again (`take`) only when nothing else references it: the core drops a push's
  payload when its round closes, a learner its pulled payload once decoded, the downlink its full
  answer when the next version replaces it (CPython reference counts, so
  a buffer anyone still reads is never reused). At most `limit_bytes` are kept."""

  def __init__(self, limit_bytes: int):
    self.limit_bytes = limit_bytes
    self._buffers: list[bytearray] = []
    self._lock = threading.Lock()

  def take(self, size: int) -> bytearray | None:
    """A pooled buffer of exactly `size` bytes that nobody holds, or None."""
    with self._lock:
      for buf in self._buffers:
        # References: the pool's list, this loop variable, getrefcount's argument.
        if len(buf) == size and sys.getrefcount(buf) <= 3:
          return buf
    return None

  def adopt(self, buf: bytearray) -> None:
    """Keep `buf` (just filled by a transfer) for reuse, if it fits the limit (else the oldest free
    buffers make room, or it is not kept)."""
    with self._lock:
      if any(b is buf for b in self._buffers):
        return
      held = sum(len(b) for b in self._buffers)
      for old in list(self._buffers):
        if held + len(buf) <= self.limit_bytes:
          break
        if sys.getrefcount(old) <= 4:  # the pool's list, the copy iterated, `old`, the argument: free
          self._buffers.remove(old)
          held -= len(old)
      if held + len(buf) <= self.limit_bytes:
        self._buffers.append(buf)


# ---- the two interfaces ----------------------------------------------------------------------------------


@runtime_checkable
class Transport(Protocol):
  """A learner's connection to the syncer. Refusals raise `Rejected`. `bytes_sent` / `bytes_received`
  count this client's traffic (payload bytes in process; the gRPC client adds its framing)."""

  @property
  def bytes_sent(self) -> int:
    ...

  @property
  def bytes_received(self) -> int:
    ...

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    """Enter the quorum; returns {fragment: version} of the global model (a `Versions`, which also
    carries the syncer's epoch and history, when the syncer sends them)."""
    ...

  def leave(self, learner_id: int) -> None:
    ...

  def push(self, push: Push) -> PushReceipt:
    ...

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The fragment once its version >= min_version (None after `timeout_s`). `have_version`, `have_epoch`:
    the version whose reference the learner holds (-1: none) and the syncer epoch it came from; the answer
    is a delta from it when the syncer can serve one, else the full fragment."""
    ...

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease; `step_time_s`: recent inner-step time (0: unknown); `step` (the learner's
    inner-step counter, None: unknown) and `blocked` (waiting on the syncer) tell the syncer whether the
    learner makes progress. Returns the syncer's epoch."""
    ...

  def status(self) -> dict:
    ...

  def close(self) -> None:
    ...


@runtime_checkable
class SyncerAPI(Protocol):
  """What a transport calls on the syncer's side; `syncer.core.SyncerCore` implements it."""

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    ...

  def leave(self, learner_id: int) -> None:
    ...

  def push(self, push: Push) -> PushReceipt:
    ...

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    ...

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease; `step_time_s`: recent inner-step time (0: unknown); `step`: the inner step
    (None: unknown); `blocked`: waiting on the syncer. Returns the syncer's epoch."""
    ...

  def status(self) -> dict:
    ...

  def max_payload_bytes(self) -> int:
    """The largest payload a valid push can carry: the service never buffers more for one push."""
    ...

  @property
  def epoch(self) -> int:
    """The syncer's epoch (random per lifetime)."""
    ...

  def check_learner_id(self, learner_id: int) -> None:
    """Raise `Rejected("learner_id")` unless the id is one of this run's learners (calls whose core
    method takes no learner id, such as `pull`, are checked with it by the transport)."""
    ...


# ---- the run token ---------------------------------------------------------------------------------------


def read_token(token_file: str | None = None) -> str:
  """The run token from `token_file`, else from $DILOCO_TOKEN. Raises ValueError if there is none.

  Never from a command line: argv is visible to every user of the machine.
  """
  if token_file:
    path = pathlib.Path(token_file)
    mode = path.stat().st_mode
    if mode & 0o077:
      log.warning("token file %s is readable by other users (mode %o); chmod 600 it", path, mode & 0o777)
    token = path.read_text().strip()
    if not token:
      raise ValueError(f"token file {path} is empty")
    return token
  token = os.environ.get(TOKEN_ENV, "").strip()
  if not token:
    raise ValueError(f"no run token: pass --token-file or set ${TOKEN_ENV}")
  return token

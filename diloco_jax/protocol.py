"""What crosses the line between a learner and the syncer.

Both sides import this module and nothing of each other:

* the messages: `Push` (a learner's outer gradient for one fragment), `PushReceipt`, `Published` (a global
  fragment as served, full or delta);
* refusals: `Rejected` with one of `REASONS`;
* chunking: payloads travel as offset-tagged chunks (`chunks`), reassembled by `Reassembler` on the
  receiving end (the gRPC service for pushes, the gRPC client for pulls);
* `Transport`: what a learner's comms worker calls (join, push, pull, heartbeat, leave, status), served in
  one process by `transports.inprocess` and over the network by `transports.grpc`;
* `SyncerAPI`: what a transport calls on the syncer side (implemented by `syncer.core.SyncerCore`);
* the run token: `read_token`, shared by the syncer and learner processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Iterator, Protocol, runtime_checkable

log = logging.getLogger(__name__)

# Why the syncer refuses a push (or another request). Each has a counter in the syncer's status.
REASONS = ("unknown_learner", "fingerprint", "not_member", "unknown_fragment", "codec", "shape",
           "checksum", "metadata", "nonfinite", "future_version")
# Rejections that mean "the syncer forgot this learner" (it restarted, or the lease lapsed): join again.
REJOIN_REASONS = ("not_member", "unknown_learner")

TOKEN_ENV = "DILOCO_TOKEN"
REASON_METADATA_KEY = "diloco-reason"  # gRPC trailing metadata: the machine-readable reason of a refusal


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


@dataclasses.dataclass(frozen=True)
class PushReceipt:
  fragment: int
  round: int  # the round of the fragment this contribution went into
  late: bool  # base_version < the fragment's version when the push arrived
  version: int = -1  # the version whose publication merges this contribution; -1: unknown


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
  declares a large payload and sends nothing costs nothing.
  """

  def __init__(self, total_size: int, what: str = "payload"):
    if total_size < 0:
      raise ProtocolError("oversize", f"{what}: negative declared size {total_size}")
    self.total_size = int(total_size)
    self._what = what
    self._buf = bytearray()

  @property
  def received(self) -> int:
    return len(self._buf)

  def add(self, offset: int, data: bytes) -> None:
    if offset != len(self._buf):
      raise ProtocolError("sequence", f"{self._what}: chunk out of sequence: offset {offset}, expected "
                          f"{len(self._buf)}")
    if len(self._buf) + len(data) > self.total_size:
      raise ProtocolError("oversize", f"{self._what} exceeds its declared size of {self.total_size} bytes")
    self._buf += data

  def finish(self) -> bytes:
    if len(self._buf) != self.total_size:
      raise ProtocolError("truncated", f"truncated {self._what}: declared {self.total_size} bytes, received "
                          f"{len(self._buf)}")
    out, self._buf = bytes(self._buf), bytearray()
    return out


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
    """Enter the quorum; returns {fragment: version} of the global model."""
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

  def heartbeat(self, learner_id: int, step_time_s: float) -> None:
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

  def heartbeat(self, learner_id: int, step_time_s: float) -> None:
    ...

  def status(self) -> dict:
    ...

  def max_payload_bytes(self) -> int:
    """The largest payload a valid push can carry: the service never buffers more for one push."""
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

"""Payloads as offset-tagged chunks: `chunks` cuts them, `Reassembler` rebuilds them on the receiving end (the
gRPC service for pushes, the gRPC client for pulls, both ends of the data plane), `BufferPool` keeps payload
buffers for reuse, and a stream that breaks the rules raises `ProtocolError`."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

from diloco_jax.protocol.reasons import Reason


class ProtocolError(ValueError):
  """A stream that breaks the chunking rules. `reason`: `Reason.SEQUENCE`, `OVERSIZE` or `TRUNCATED` (over gRPC
  it travels as a malformed request, INVALID_ARGUMENT, whichever rule it broke)."""

  def __init__(self, reason: Reason, message: str):
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
  that the receiver already holds (a reused one, see `BufferPool`) to copy the chunks into instead.
  """

  def __init__(self, total_size: int, what: str = "payload", into: bytearray | None = None):
    if total_size < 0:
      raise ProtocolError(Reason.OVERSIZE, f"{what}: negative declared size {total_size}")
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
      raise ProtocolError(Reason.SEQUENCE, f"{self._what}: chunk out of sequence: offset {offset}, expected "
                          f"{self._received}")
    if self._received + len(data) > self.total_size:
      raise ProtocolError(Reason.OVERSIZE, f"{self._what} exceeds its declared size of {self.total_size} bytes")
    if self._into is not None:
      self._into[offset:offset + len(data)] = data
    else:
      self._buf += data
    self._received += len(data)

  def finish(self, *, copy: bool = True) -> bytes | bytearray:
    """The payload. `copy=False` hands over the buffer itself (a bytearray, one payload-sized copy fewer;
    the caller then owns it and must not change it while the payload is in use)."""
    if self._received != self.total_size:
      raise ProtocolError(Reason.TRUNCATED, f"truncated {self._what}: declared {self.total_size} bytes, received "
                          f"{self._received}")
    buf = self._into if self._into is not None else self._buf
    out, self._buf, self._into = (bytes(buf) if copy else buf), bytearray(), None
    return out


class BufferPool:
  """Payload buffers kept for reuse: a fresh buffer of a fragment's size costs the kernel's page faults,
  about twice the transfer itself on loopback, more than a copy into a warm one (docs/benchmarks.md),
  and the same sizes come back every round. Buffers enter the pool only after a transfer filled them
  (`adopt`), never on a declared size, and one is handed out again (`take`) only when nothing else
  references it: the core drops a push's payload when its round closes, a learner its pulled payload once
  decoded, the downlink its full answer when the next version replaces it (CPython reference counts, so a
  buffer anyone still reads is never reused). At most `limit_bytes` are kept."""

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

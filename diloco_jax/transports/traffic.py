"""A client's bytes on the wire, both planes together, and the WAN emulation that paces them.

`sent(n)` is called before n bytes leave (the emulated link is paid first), `received(n)` after n bytes
arrived (counted, then paid). What n is, is each plane's: the gRPC client counts every message as its
serialized size plus gRPC's 5-byte frame header, the data-plane client every byte of its framing and
payloads (`grpc_client.py`, `dataplane_client.py`).
"""

from __future__ import annotations

import threading

from diloco_jax.transports import wan as wan_lib


class Traffic:
  """Byte counters of one client, paced by an optional `wan.WanLink`. Thread-safe."""

  def __init__(self, wan: wan_lib.WanLink | None = None):
    self.wan = wan
    self._lock = threading.Lock()
    self._sent = 0
    self._received = 0

  @property
  def bytes_sent(self) -> int:
    with self._lock:
      return self._sent

  @property
  def bytes_received(self) -> int:
    with self._lock:
      return self._received

  def sent(self, n: int, first: bool) -> None:
    """`n` bytes leave (first: a stream's first message, which pays the emulated latency)."""
    if self.wan is not None:
      self.wan.send(n, first=first)
    with self._lock:
      self._sent += n

  def received(self, n: int, first: bool) -> None:
    """`n` bytes arrived (first: a stream's first message)."""
    with self._lock:
      self._received += n
    if self.wan is not None:
      self.wan.receive(n, first=first)

  def connected(self, tls: bool) -> None:
    """A new connection is up: its set-up round trips are paid (`wan.WanLink.connect`)."""
    if self.wan is not None:
      self.wan.connect(tls)

  def piece_bytes(self, default: int) -> int:
    """The bytes to send at once: `default`, or on an emulated link what it carries in `wan.PIECE_S`
    (a slow link trickles, and the receiver's stall timers see bytes move)."""
    return self.wan.piece_bytes(default) if self.wan is not None else default

  def check_link(self) -> None:
    """Raise `errors.LinkDown` while the emulated link is cut off."""
    if self.wan is not None:
      self.wan.check_link()

"""Admission of the syncer's calls that may hold a thread long (gRPC Push and Pull streams, data-plane
transfers): slots, at most `total` at once and `per_caller` per caller. Shared by the gRPC front-end
(whose slots the gate holds, `gate.py`) and the data plane (`dataplane.py`), each with slots of its own
(their threads are their own)."""

from __future__ import annotations

import threading
from typing import Any

from diloco_jax.protocol.reasons import Reason


class Busy(Exception):
  """No slot is free: the caller backs off and retries (reason "busy"; gRPC RESOURCE_EXHAUSTED)."""

  reason = Reason.BUSY


class Slots:
  """At most `total` calls at once, `per_caller` per caller (any hashable key)."""

  def __init__(self, what: str, total: int, per_caller: int):
    self.what, self.total, self.per_caller = what, max(int(total), 1), max(int(per_caller), 1)
    self._held: dict[Any, int] = {}
    self._count = 0
    self._lock = threading.Lock()

  def acquire(self, caller) -> None:
    """Take a slot for `caller`, or raise Busy."""
    with self._lock:
      mine = self._held.get(caller, 0)
      if mine >= self.per_caller:
        raise Busy(f"this caller already has {mine} {self.what} in flight (at most {self.per_caller}); "
                   "retry later")
      if self._count >= self.total:
        raise Busy(f"the syncer is serving its maximum of {self.total} {self.what}; retry later")
      self._held[caller] = mine + 1
      self._count += 1

  def release(self, caller) -> None:
    with self._lock:
      left = self._held.get(caller, 0) - 1
      if left > 0:
        self._held[caller] = left
      else:
        self._held.pop(caller, None)
      self._count = max(self._count - 1, 0)

  @property
  def in_use(self) -> int:
    with self._lock:
      return self._count

"""Token buckets: the syncer's per-caller rate limits and the WAN emulator's bandwidth cap are the same
arithmetic, a pure function of an injectable clock."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any


class TokenBucket:
  """`rate` tokens per second up to `burst`; starts full. Thread-safe.

  Two ways to spend: `try_take(n)` spends only what is there (a rate limit: refuse, never owe), and
  `reserve(n)` may go into debt and says how long the caller must wait (a bandwidth cap: debt keeps the cap
  exact for chunks larger than the burst, and keeps arrival order fair between threads, since a later
  caller waits behind the bytes already reserved).
  """

  def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
    if rate <= 0:
      raise ValueError(f"rate must be > 0 per second, got {rate}")
    if burst < 0:
      raise ValueError(f"burst must be >= 0, got {burst}")
    self.rate = float(rate)
    self.burst = float(burst)
    self._clock = clock
    self._tokens = float(burst)
    self._last = clock()
    self._lock = threading.Lock()

  def _refill_locked(self) -> None:
    now = self._clock()
    self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
    self._last = now

  def try_take(self, n: float = 1.0) -> bool:
    """Spend n tokens if they are there; otherwise spend nothing and return False."""
    with self._lock:
      self._refill_locked()
      if self._tokens < n:
        return False
      self._tokens -= n
      return True

  def reserve(self, n: float) -> float:
    """Take n tokens now (possibly into debt); return the seconds the caller must wait."""
    with self._lock:
      self._refill_locked()
      self._tokens -= n
      return max(0.0, -self._tokens / self.rate)


class RateLimiter:
  """One `TokenBucket` per key (a caller), spent one call at a time; `rate_per_s` 0 means unlimited.

  At most `max_keys` buckets are kept (the least recently used is dropped, as if that caller had been idle
  long enough to refill), so callers inventing keys cannot grow the syncer's memory.
  """

  def __init__(self, rate_per_s: float, burst: float, clock: Callable[[], float] = time.monotonic,
               max_keys: int = 4096):
    self.rate, self.burst, self._clock = rate_per_s, max(burst, 1.0), clock
    self._max_keys = max_keys
    self._buckets: collections.OrderedDict[Any, TokenBucket] = collections.OrderedDict()
    self._lock = threading.Lock()

  def allow(self, key) -> bool:
    if self.rate <= 0:
      return True
    with self._lock:
      bucket = self._buckets.get(key)
      if bucket is None:
        bucket = self._buckets[key] = TokenBucket(self.rate, self.burst, self._clock)
        while len(self._buckets) > self._max_keys:
          self._buckets.popitem(last=False)
      self._buckets.move_to_end(key)
    return bucket.try_take(1.0)

"""Retries of the calls to the syncer: while it is unreachable or busy a call is retried with exponential
backoff and jitter, and fails with `SyncerUnreachable` only after the deadline (a syncer restart from a
checkpoint takes seconds to minutes; learners keep training meanwhile).

Retried (`retryable`): UNAVAILABLE (down, restarting, network gone; also an emulated link that is cut off,
`LinkDown`), RESOURCE_EXHAUSTED (rate limit, long-call slots full; not an oversize payload),
DEADLINE_EXCEEDED (an attempt that took longer than its timeout) and CANCELLED (a stream the syncer cut, or
a syncer stopping) unless the transport was closed. Every call may be repeated: pushes carry an
idempotency key, so a retried push is merged once. Other failures are not retried (`translate`): a
refusal by the core is raised as the core's `Rejected` with the same reason, a bad token as `AuthError`.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from diloco_jax.protocol.reasons import REASONS, Reason, Rejected, shorten
from diloco_jax.transports.errors import AuthError, CallFailed, LinkDown, SyncerError, SyncerUnreachable

log = logging.getLogger(__name__)

RETRIED = ("UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED")

T = TypeVar("T")


def retryable(failure: CallFailed) -> bool:
  """Whether a failed call is worth another attempt (module docstring)."""
  if failure.status not in RETRIED:
    return False
  if failure.status == "RESOURCE_EXHAUSTED":  # busy, yes; a message over a size limit stays over it
    return failure.reason != Reason.OVERSIZE and "larger than max" not in failure.details
  return True


def translate(name: str, failure: CallFailed) -> Exception:
  """What a caller of `name` gets for a failure that is not retried."""
  if failure.status == Reason.UNAUTHENTICATED.status:
    return AuthError(f"{name}: syncer refused the run token: {failure.details}")
  if failure.reason in REASONS:
    prefix = f"rejected ({failure.reason}): "
    details = failure.details
    return Rejected(failure.reason, details[len(prefix):] if details.startswith(prefix) else details)
  return SyncerError(failure.status, f"{name}: {failure.details}")


class Retrier:
  """Runs a call's attempts until one answers (module docstring). Thread-safe.

  Args:
    target: the syncer's address (for messages).
    deadline_s: keep retrying this long before raising `SyncerUnreachable`.
    backoff_s, max_backoff_s: first and largest retry delay.
    closed: once set, calls and retry waits end (`SyncerUnreachable`).
    sleep: how to wait between retries; default: a wait that `closed` ends.
    check_link: called before each attempt; raises `LinkDown` while an emulated link is cut off.
  """

  def __init__(self, target: str, *, deadline_s: float, backoff_s: float, max_backoff_s: float,
               closed: threading.Event, sleep: Callable[[float], None] | None = None,
               check_link: Callable[[], None] = lambda: None):
    self.target = target
    self.deadline_s, self.backoff_s, self.max_backoff_s = deadline_s, backoff_s, max_backoff_s
    self._closed = closed
    self._sleep = sleep or closed.wait
    self._check_link = check_link
    self._lock = threading.Lock()
    self._retries = 0

  @property
  def retries(self) -> int:
    """Attempts repeated so far, over all calls."""
    with self._lock:
      return self._retries

  def _gone(self, name: str) -> SyncerUnreachable:
    return SyncerUnreachable(f"{name}: the connection to {self.target} was closed")

  def call(self, name: str, attempt: Callable[[], T]) -> T:
    """`attempt()` until it answers; a `CallFailed` or `LinkDown` is retried or translated."""
    start = time.monotonic()
    delay = self.backoff_s
    while True:
      if self._closed.is_set():
        raise self._gone(name)
      try:
        self._check_link()
        return attempt()
      except (CallFailed, LinkDown) as e:
        if self._closed.is_set():
          raise self._gone(name) from None
        failure = e if isinstance(e, CallFailed) else CallFailed("UNAVAILABLE", None, str(e))
        if not retryable(failure):
          raise translate(name, failure) from None
        waited = time.monotonic() - start
        if waited + delay > self.deadline_s:
          raise SyncerUnreachable(f"syncer at {self.target} unreachable or busy for {waited:.1f}s ({name}; "
                                  f"last: {failure.status} {shorten(failure.details or '', 200)})") from None
        with self._lock:
          self._retries += 1
        log.info("%s: syncer %s: %s, retrying in %.1fs (waited %.1fs of %gs)", name, self.target, failure.status,
                 delay, waited, self.deadline_s)
        self._sleep(delay * random.uniform(0.8, 1.2))
        delay = min(delay * 2, self.max_backoff_s)

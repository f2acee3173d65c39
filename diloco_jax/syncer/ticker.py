"""The thread that closes rounds on time: a round's grace window ends without any call arriving."""

from __future__ import annotations

import logging
import threading
import time

from diloco_jax.syncer.core import SyncerCore

log = logging.getLogger(__name__)

ERROR_LOG_EVERY_S = 60.0  # a failing tick logs its traceback at most this often (each one is counted)


class Ticker:
  """A daemon thread that calls `core.tick()` at `core.next_deadline()`, and at least every `period_s`
  seconds (a deadline set after the thread went to sleep is then at most `period_s` late).

  It survives an exception in the core: the exception is counted (`counters["tick_errors"]` in the core's
  status), logged with its traceback (at most every `ERROR_LOG_EVERY_S` seconds), and the thread keeps
  ticking, so deadline-driven round closes never silently stop.
  """

  def __init__(self, core: SyncerCore, period_s: float = 0.05, start: bool = True):
    self.core = core
    self.period_s = period_s
    self._stop = threading.Event()
    self._last_logged = -float("inf")
    self._thread = threading.Thread(target=self._run, name="syncer-ticker", daemon=True)
    if start:
      self.start()

  def start(self) -> Ticker:
    self._thread.start()
    return self

  def _wait_s(self) -> float:
    deadline = self.core.next_deadline()
    if deadline is None:
      return self.period_s
    return min(self.period_s, max(deadline - self.core.clock(), 0.001))

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self.core.tick()
        wait = self._wait_s()
      except Exception:  # noqa: BLE001 - the ticker must outlive any one bad tick
        self.core.count("tick_errors")
        now = time.monotonic()
        if now - self._last_logged >= ERROR_LOG_EVERY_S:
          self._last_logged = now
          log.exception("syncer tick failed (counted in tick_errors; ticking on)")
        wait = self.period_s
      self._stop.wait(wait)

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def stop(self, timeout_s: float | None = 5.0) -> None:
    """Stop the thread and wait for it to end."""
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout_s)

  def __enter__(self) -> Ticker:
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

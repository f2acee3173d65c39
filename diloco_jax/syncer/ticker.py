"""The thread that closes rounds on time: a round's grace window ends without any call arriving."""

from __future__ import annotations

import threading

from diloco_jax.syncer.core import SyncerCore


class Ticker:
  """A daemon thread that calls `core.tick()` at `core.next_deadline()`, and at least every `period_s`
  seconds (a deadline set after the thread went to sleep is then at most `period_s` late)."""

  def __init__(self, core: SyncerCore, period_s: float = 0.05, start: bool = True):
    self.core = core
    self.period_s = period_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="syncer-ticker", daemon=True)
    if start:
      self.start()

  def start(self) -> "Ticker":
    self._thread.start()
    return self

  def _run(self) -> None:
    while not self._stop.is_set():
      self.core.tick()
      deadline = self.core.next_deadline()
      wait = self.period_s
      if deadline is not None:
        wait = min(wait, max(deadline - self.core.clock(), 0.001))
      self._stop.wait(wait)

  def stop(self, timeout_s: float | None = 5.0) -> None:
    """Stop the thread and wait for it to end."""
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout_s)

  def __enter__(self) -> "Ticker":
    return self

  def __exit__(self, *exc) -> None:
    self.stop()

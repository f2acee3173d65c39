"""How a learner talks to the syncer: the `Transport` interface and its in-process implementation.

The learner's background worker codes against `Transport`; `InProcessTransport` calls a `SyncerCore` in
the same process (tests, quick experiments), and the gRPC client implements the same methods over the
network. Both raise `syncer.core.Rejected` for refused requests.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable

from diloco_jax.syncer.core import Published, Push, PushReceipt, SyncerCore


@runtime_checkable
class Transport(Protocol):
  """A learner's connection to the syncer. `bytes_sent` / `bytes_received` count this client's traffic
  (payload bytes for the in-process transport; the gRPC one adds its framing)."""

  bytes_sent: int
  bytes_received: int

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    ...

  def push(self, push: Push) -> PushReceipt:
    ...

  def pull(self, fragment: int, min_version: int, timeout_s: float, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The fragment once its version >= min_version (None after `timeout_s`). `have_version`, `have_epoch`:
    the version whose reference the learner holds (-1: none) and the syncer epoch it came from
    (`Published.epoch`); the answer is a delta from it when the syncer has one and the epoch is its own
    (`Published.kind`), else the full fragment."""
    ...

  def heartbeat(self, learner_id: int, step_time_s: float) -> None:
    ...

  def status(self) -> dict:
    ...


class InProcessTransport:
  """One learner's transport to a `SyncerCore` shared in-process. Counts payload bytes both ways; a
  refused push still counts as sent (it crossed the "wire")."""

  def __init__(self, core: SyncerCore):
    self.core = core
    self.bytes_sent = 0
    self.bytes_received = 0
    self._lock = threading.Lock()  # the counters may be updated from a learner's several threads

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    return self.core.join(learner_id, fingerprint)

  def leave(self, learner_id: int) -> None:
    self.core.leave(learner_id)

  def push(self, push: Push) -> PushReceipt:
    with self._lock:
      self.bytes_sent += len(push.payload)
    return self.core.push(push)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    published = self.core.pull(fragment, min_version, timeout_s, have_version=have_version, have_epoch=have_epoch)
    if published is not None:
      with self._lock:
        self.bytes_received += len(published.payload)
    return published

  def heartbeat(self, learner_id: int, step_time_s: float) -> None:
    self.core.heartbeat(learner_id, step_time_s)

  def status(self) -> dict:
    return self.core.status()


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

"""The gRPC service's stream watch: a Push or Pull stream that moves no payload bytes for `stall_s` (a stalled
client, or one sending empty chunks), or lasts longer than `deadline_s` (not counting a Pull's long-poll
wait), is cancelled. (The data plane bounds its transfers with socket timeouts instead.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Stream:
  """One watched stream: when it last moved payload bytes, and whether the watch cut it."""

  def __init__(self, context, now: float):
    self.context = context
    self.started = self.progressed = now
    self.waiting = False  # a Pull's long-poll wait: bounded by max_pull_wait_s, not watched
    self.cut: str | None = None  # why the watch cut it

  def progress(self) -> None:
    """Payload bytes moved (only bytes are progress: empty chunks do not keep a stream alive)."""
    self.progressed = time.monotonic()

  def restart(self) -> None:
    """A Pull's long-poll wait is over: its stream's clocks start now."""
    self.waiting = False
    self.started = self.progressed = time.monotonic()


class StreamWatch:
  """One daemon thread that cancels streams that stall (no payload bytes for `stall_s`) or outlive
  `deadline_s`, calling `on_cut()` for each; a cancelled stream's request iterator ends and its handler
  answers nobody."""

  def __init__(self, stall_s: float, deadline_s: float, on_cut: Callable[[], None], poll_s: float = 0.2):
    self.stall_s, self.deadline_s, self._on_cut, self._poll = stall_s, deadline_s, on_cut, poll_s
    self._streams: set[Stream] = set()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="syncer-stream-watch", daemon=True)
    self._thread.start()

  def watch(self, context) -> Stream:
    """Start watching the stream of `context` (a gRPC call's)."""
    stream = Stream(context, time.monotonic())
    with self._lock:
      self._streams.add(stream)
    return stream

  def done(self, stream: Stream) -> None:
    with self._lock:
      self._streams.discard(stream)

  def _run(self) -> None:
    while not self._stop.wait(self._poll):
      now = time.monotonic()
      with self._lock:
        streams = list(self._streams)
      for st in streams:
        if st.cut or st.waiting:
          continue
        if now - st.progressed > self.stall_s:
          st.cut = f"no payload bytes for {self.stall_s:g}s"
        elif now - st.started > self.deadline_s:
          st.cut = f"longer than {self.deadline_s:g}s"
        if st.cut:
          self._on_cut()
          st.context.cancel()

  def stop(self) -> None:
    self._stop.set()

"""The syncer's metrics over time: a thread that samples `SyncerCore.status()` and writes a record to a
`metrics.MetricsLog` (JSONL and TensorBoard, `metrics.SYNCER_TAGS`) whenever something moved.

Used by the `syncer` process (`syncer/app.py`) and the in-process run (`inprocess.py`) alike. A record:
`step` (rounds closed, the sum of the fragment versions), `versions`, `live` (live learners), `rounds`,
`contributors_per_round` and `grace_wait_s` (means over the rounds closed since the previous record),
`contributions_merged`, `contributions_late`, `rejected` (total) and `rejected_by_reason`, `bytes_in`,
`bytes_out`, `tokens_merged` (the core's count: summed over fragments) and `goodput` (the core's
`goodput_estimate`). Counters are cumulative, as the core keeps them.
"""

from __future__ import annotations

import logging
import threading

from diloco_jax.syncer.core import SyncerCore

log = logging.getLogger(__name__)


def syncer_record(status: dict, previous: dict | None) -> dict:
  """The metrics record of a core `status()`, with per-round means since the `previous` status."""
  c, now = status["counters"], status["since_start"]
  before = (previous or {}).get("since_start", {})
  rounds = now["rounds"] - before.get("rounds", 0)
  per_round = lambda key: (now[key] - before.get(key, 0)) / rounds if rounds > 0 else None
  return {
      "step": sum(status["versions"]), "versions": status["versions"], "live": len(status["live"]),
      "rounds": c["rounds"], "contributors_per_round": per_round("contributors"),
      "grace_wait_s": per_round("grace_wait_s"), "contributions_merged": c["contributions_merged"],
      "contributions_late": c["contributions_late"], "rejected": c["contributions_rejected"],
      "rejected_by_reason": {r: n for r, n in c["rejected"].items() if n}, "bytes_in": c["bytes_in"],
      "bytes_out": c["bytes_out"], "tokens_merged": c["tokens_merged"], "goodput": status["goodput_estimate"],
  }


def _moved(status: dict, previous: dict | None) -> bool:
  if previous is None:
    return True
  key = lambda s: (s["versions"], s["live"], s["counters"]["contributions_rejected"],
                   s["counters"]["contributions_merged"])
  return key(status) != key(previous)


class SyncerMonitor:
  """Samples `core.status()` every `interval_s` and writes `syncer_record`s to `log` when rounds, live
  learners, merges or rejections changed; `stop()` writes a last record and closes nothing (the caller
  owns `log`)."""

  def __init__(self, core: SyncerCore, metrics_log, interval_s: float = 2.0):
    self._core, self._log, self._interval = core, metrics_log, interval_s
    self._previous: dict | None = None
    self._stop = threading.Event()
    self._lock = threading.Lock()  # the thread and the final sample
    self._thread = threading.Thread(target=self._run, name="syncer-monitor", daemon=True)
    self._thread.start()

  def sample(self, force: bool = False) -> None:
    with self._lock:
      status = self._core.status()
      if force or _moved(status, self._previous):
        self._log.write(syncer_record(status, self._previous))
        self._previous = status

  def _run(self) -> None:
    while not self._stop.wait(self._interval):
      try:
        self.sample()
      except Exception:  # a full disk must not stop the syncer
        log.exception("syncer metrics sample failed")

  def stop(self) -> None:
    self._stop.set()
    self._thread.join()
    self.sample(force=True)

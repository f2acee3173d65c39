"""Metrics on disk and progress on screen: JSONL records in the workdir, a progress bar, summary.json."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import threading
import time
from typing import Any, Callable

import numpy as np
from tqdm import tqdm


def _jsonable(value: Any) -> Any:
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if isinstance(value, (np.generic, np.ndarray)):
    return value.tolist()
  if hasattr(value, "item") and getattr(value, "shape", None) == ():
    return value.item()
  return value


class MetricsLog:
  """Appends one JSON object per line to `<workdir>/<name>.jsonl`; thread-safe enough for one writer per
  file (lines are written whole and flushed)."""

  def __init__(self, workdir: str | os.PathLike, name: str = "metrics"):
    self.path = pathlib.Path(workdir) / f"{name}.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._file = open(self.path, "a", buffering=1)

  def write(self, record: dict) -> None:
    self._file.write(json.dumps(_jsonable({"time": time.time(), **record})) + "\n")

  def close(self) -> None:
    self._file.close()


class DrainLog:
  """A daemon thread that appends the records `drain()` returns to `<workdir>/<name>.jsonl` every
  `period_s` seconds, and once more at `close()` (the syncer's per-round decision records: the core builds
  them, this writes them, outside the core's lock)."""

  def __init__(self, drain: Callable[[], list[dict]], workdir: str | os.PathLike, name: str,
               period_s: float = 1.0):
    self._drain, self._period_s = drain, period_s
    self._log = MetricsLog(workdir, name)
    self.path = self._log.path
    self.written = 0
    self._stop = threading.Event()
    self._lock = threading.Lock()  # the thread and close() never write at once
    self._thread = threading.Thread(target=self._run, name=f"drain-{name}", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self._period_s):
      self.flush()

  def flush(self) -> None:
    with self._lock:
      for record in self._drain():
        self._log.write(record)
        self.written += 1

  def close(self) -> None:
    """Stop the thread and write what is left."""
    self._stop.set()
    self._thread.join()
    self.flush()
    self._log.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def write_summary(workdir: str | os.PathLike, summary: dict) -> pathlib.Path:
  path = pathlib.Path(workdir) / "summary.json"
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
  tmp.replace(path)  # atomic: a reader never sees half a summary
  return path


def progress(total: int, initial: int = 0, desc: str = "train", position: int = 0) -> tqdm:
  """A progress bar on stderr; plain periodic lines when stderr is not a terminal (CI logs)."""
  return tqdm(total=total, initial=initial, desc=desc, position=position, dynamic_ncols=True,
              file=sys.stderr, mininterval=1.0 if sys.stderr.isatty() else 10.0, leave=True)

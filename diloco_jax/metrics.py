"""Metrics on disk and progress on screen: JSONL records and TensorBoard event files in the workdir, a
progress bar, summary.json.

Every producer (the baseline, each learner, the syncer, the global-model evaluator) writes through one
`MetricsLog`: each record goes whole to `<workdir>/<name>.jsonl`, and the fields named in the producer's
tag table go to TensorBoard (tensorboardX event files in `<workdir>`). The tables below share their tags,
so that a data-parallel run and a Decoupled DiLoCo run overlay in one TensorBoard
(`tensorboard --logdir runs`): `train/loss` of the baseline and of every learner, `eval/loss` of the
baseline's model and of the syncer's global model. The step of every record is counted in global steps of
`data.global_batch` sequences (the baseline's step; a learner's own step, since M learners at step s have
read as much as the baseline at step s; the global model's progress, tokens merged / tokens per step), so
the curves line up on the same token budget.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import tensorboardX
from tqdm import tqdm

# Record field -> TensorBoard tag, per producer. A list value is written as `<tag>/<index>`, a dict value
# as `<tag>/<key>`; fields a table does not name go to the JSONL file only.
_TRAIN_TAGS = {"loss": "train/loss", "grad_norm": "train/grad_norm", "tokens_per_s": "train/tokens_per_s",
               "comm_bytes": "comm/bytes"}
BASELINE_TAGS = {**_TRAIN_TAGS, "eval_loss": "eval/loss"}  # its model is the global model
LEARNER_TAGS = {**_TRAIN_TAGS, "blocked_s": "train/blocked_s", "eval_loss": "eval/local_loss",
                "versions": "learner/base_version"}
GLOBAL_EVAL_TAGS = {"eval_loss": "eval/loss", "tokens": "eval/tokens_merged"}
SYNCER_TAGS = {"rounds": "syncer/rounds", "contributors_per_round": "syncer/contributors_per_round",
               "grace_wait_s": "syncer/grace_wait_s", "live": "syncer/live_learners",
               "contributions_merged": "syncer/contributions_merged",
               "contributions_late": "syncer/contributions_late", "rejected": "syncer/rejected",
               "bytes_in": "syncer/bytes_in", "bytes_out": "syncer/bytes_out",
               "tokens_merged": "syncer/tokens_merged", "versions": "syncer/version",
               "goodput": "syncer/goodput_estimate"}
_TB_FLUSH_S = 10  # event files reach the disk at least this often (TensorBoard reads them live)


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


def _scalars(tag: str, value: Any):
  """(tag, float) pairs of a record value: numbers as they are, lists and dicts element-wise."""
  if isinstance(value, Mapping):
    for k, v in value.items():
      yield from _scalars(f"{tag}/{k}", v)
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      yield from _scalars(f"{tag}/{i}", v)
  elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    if math.isfinite(float(value)):
      yield tag, float(value)


class MetricsLog:
  """The one metrics writer: appends each record as one JSON line to `<workdir>/<name>.jsonl` and, with
  `tags` (a table above), writes the fields it names as TensorBoard scalars into `<workdir>` at the
  record's `step`, stamped with the record's wall time. One writer per file; lines are written whole and
  flushed, event files every few seconds and at `close`.
  """

  def __init__(self, workdir: str | os.PathLike, name: str = "metrics", *, tags: Mapping[str, str] | None = None):
    self.path = pathlib.Path(workdir) / f"{name}.jsonl"
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._file = open(self.path, "a", buffering=1)
    self._tags = dict(tags or {})
    self._tb = (tensorboardX.SummaryWriter(str(self.path.parent), flush_secs=_TB_FLUSH_S)
                if self._tags else None)

  def write(self, record: dict) -> None:
    record = _jsonable({"time": time.time(), **record})
    self._file.write(json.dumps(record) + "\n")
    if self._tb is not None and "step" in record:
      for field, tag in self._tags.items():
        for name, value in _scalars(tag, record.get(field)):
          self._tb.add_scalar(name, value, global_step=int(record["step"]), walltime=record["time"])

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()


def ring_allreduce_bytes(num_params: int, workers: int, bytes_per_param: int = 4) -> float:
  """Bytes one worker sends and receives in a ring all-reduce of the gradient, per step: the data-parallel
  reference for bytes on the wire, 2 (n - 1) / n x gradient bytes."""
  return 2.0 * (workers - 1) / workers * num_params * bytes_per_param


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


def write_summary(workdir: str | os.PathLike, summary: dict, resumed_fields: tuple[str, ...] | None = None
                  ) -> dict:
  """Write `summary` to `<workdir>/summary.json`; returns what it wrote. `resumed_fields`: the run was
  resumed, and these figures of `summary` are this segment's alone: the summary written covers the whole run
  (`whole_run`, with the summary an earlier segment left there)."""
  path = pathlib.Path(workdir) / "summary.json"
  if resumed_fields is not None:
    try:
      summary = whole_run(json.loads(path.read_text()), summary, resumed_fields)
    except (OSError, ValueError):
      pass  # no earlier segment finished (or its summary is unreadable): this one is all there is
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
  tmp.replace(path)  # atomic: a reader never sees half a summary
  return summary


def whole_run(previous: dict, summary: dict, fields: tuple[str, ...]) -> dict:
  """The summary of a run resumed after `previous` (its summary so far) with this segment's `summary`: the
  `fields` summed over the segments (wall time, bytes: each segment counts its own), `tokens_per_s` over
  the whole run, the first segment's `initial_eval_loss`, and `segments`: each segment's `fields` and the
  run's tokens at its end. Every other figure is this segment's (steps, versions and tokens: the run's so
  far)."""
  def own(s: dict) -> dict:
    return {k: s[k] for k in ("tokens", *fields) if k in s}

  out = dict(summary)
  segments = previous.get("segments") or [own(previous)]
  out["segments"] = [*segments, own(summary)]
  for key in fields:
    if isinstance(summary.get(key), (int, float)) and isinstance(previous.get(key), (int, float)):
      out[key] = previous[key] + summary[key]
  if out.get("initial_eval_loss") is None and previous.get("initial_eval_loss") is not None:
    out["initial_eval_loss"] = previous["initial_eval_loss"]
  if out.get("wall_s") and "tokens" in out:
    out["tokens_per_s"] = out["tokens"] / out["wall_s"]
  return out


def progress(total: int, initial: int = 0, desc: str = "train", position: int = 0) -> tqdm | PlainProgress:
  """A progress bar on stderr when it is a terminal, else `PlainProgress` (a log file gets lines, not a
  bar's redraws). Before the first step it says that the step compiles (the bar would sit at 0 meanwhile)."""
  if initial < total:
    print(f"{desc}: compiling before the first step (minutes with a cold compilation cache, seconds with a "
          "warm one)", file=sys.stderr, flush=True)
  if not sys.stderr.isatty():
    return PlainProgress(total, initial, desc)
  return tqdm(total=total, initial=initial, desc=desc, position=position, dynamic_ncols=True,
              file=sys.stderr, mininterval=1.0, leave=True)


class PlainProgress:
  """A progress bar's interface (`update`, `set_postfix`, `n`, `close`) as plain lines on stderr: one at
  most every `every_s` seconds of progress, and one at `close`."""

  def __init__(self, total: int, initial: int = 0, desc: str = "train", every_s: float = 10.0,
               clock: Callable[[], float] = time.monotonic):
    self.total, self.n, self.desc, self.every_s = total, initial, desc, every_s
    self._clock, self._initial = clock, initial
    self._start = self._last = clock()
    self._postfix: dict[str, Any] = {}
    self._closed = False

  def set_postfix(self, refresh: bool = False, **fields) -> None:
    """Figures shown after the count on the next line (`refresh` is tqdm's; a line is written on progress)."""
    del refresh
    self._postfix = fields

  def update(self, n: int = 1) -> None:
    """`n` more done; a line when `every_s` passed since the last one."""
    self.n += n
    if n and self._clock() - self._last >= self.every_s:
      self._line()

  def _line(self) -> None:
    now = self._clock()
    self._last = now
    elapsed = now - self._start
    rate = (self.n - self._initial) / elapsed if elapsed > 0 else 0.0
    extra = "".join(f", {k}={v}" for k, v in self._postfix.items())
    print(f"{self.desc}: {self.n}/{self.total} ({100 * self.n / max(self.total, 1):.0f}%) in {elapsed:.0f}s, "
          f"{rate:.2f}/s{extra}", file=sys.stderr, flush=True)

  def close(self) -> None:
    """The last line (once)."""
    if not self._closed:
      self._closed = True
      self._line()

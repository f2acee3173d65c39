"""Timelines of a multi-process run: version advances, monotonicity, stalls (used by `chaos` and tests)."""

from __future__ import annotations

import json
import pathlib
from typing import Iterable, Sequence


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
  """The complete JSON lines of a file (a line being written, or cut by a crash, is skipped)."""
  out = []
  try:
    text = pathlib.Path(path).read_text(errors="replace")
  except OSError:
    return out
  for line in text.splitlines():
    try:
      out.append(json.loads(line))
    except ValueError:
      continue
  return out


def commits(syncer_dir: str | pathlib.Path) -> list[tuple[float, list[int]]]:
  """(wall time, versions) each time the syncer's versions moved, over all its lifetimes, in order
  (`WORKDIR/versions.jsonl`, written by the syncer's journal)."""
  return [(float(r["t"]), [int(v) for v in r["versions"]]) for r in read_jsonl(pathlib.Path(syncer_dir) /
                                                                               "versions.jsonl")]


def monotone(sequence: Iterable[Sequence[int]]) -> bool:
  """Whether no entry of a sequence of version vectors ever decreases."""
  previous = None
  for versions in sequence:
    if previous is not None and any(b < a for a, b in zip(previous, versions)):
      return False
    previous = versions
  return True


def learner_versions(learner_dir: str | pathlib.Path) -> list[list[int]]:
  """The versions a learner held, at each of its metrics records (over its restarts)."""
  return [r["versions"] for r in read_jsonl(pathlib.Path(learner_dir) / "metrics.jsonl") if "versions" in r]


def advance_times(timeline: Sequence[tuple[float, Sequence[int]]]) -> list[float]:
  """Wall times at which some version advanced."""
  out, previous = [], None
  for t, versions in timeline:
    if previous is not None and any(b > a for a, b in zip(previous, versions)):
      out.append(t)
    previous = versions
  return out


def longest_gap(times: Sequence[float], start: float, end: float,
                excluded: Sequence[tuple[float, float]] = ()) -> float:
  """The longest time within [start, end] without any of `times`, not counting the `excluded` intervals
  (e.g. while the syncer is down)."""
  points = sorted([start] + [t for t in times if start < t < end] + [end])
  best = 0.0
  for a, b in zip(points, points[1:]):
    overlap = sum(max(0.0, min(b, e1) - max(a, s1)) for s1, e1 in excluded)
    best = max(best, b - a - overlap)
  return best

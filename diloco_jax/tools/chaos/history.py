"""What a chaos run's files say happened: the syncer's version commits over its lifetimes, each learner's
versions and step records, and the measures taken on them (monotone versions, gaps without an advance,
intervals without a training learner, steps trained twice)."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterable, Sequence


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


def merged_tokens(syncer_dir: str | pathlib.Path, num_fragments: int) -> list[tuple[float, float]]:
  """(wall time, tokens merged into the global model) at each version change (per-fragment sums / P)."""
  return [(float(r["t"]), r.get("tokens_merged", 0) / num_fragments)
          for r in read_jsonl(pathlib.Path(syncer_dir) / "versions.jsonl")]


def value_at(series: Sequence[tuple[float, float]], t: float) -> float:
  """The value of a step function given as (time, value) changes, at time `t` (0 before the first)."""
  value = 0.0
  for ts, v in series:
    if ts > t:
      break
    value = v
  return value


def step_records(learner_dir: str | pathlib.Path) -> list[tuple[float, int]]:
  """(wall time, step) of a learner's (or the baseline's) metrics records, over its restarts."""
  return [(float(r["time"]), int(r["step"])) for r in read_jsonl(pathlib.Path(learner_dir) / "metrics.jsonl")
          if "time" in r and "step" in r]


def first_done(learner_dirs, steps: int) -> float | None:
  """When the first learner logged its last step (every learner is still training until then)."""
  done = [min((t for t, s in step_records(d) if s >= steps), default=None) for d in learner_dirs]
  done = [t for t in done if t is not None]
  return min(done) if done else None


def redone_steps(learner_dir: str | pathlib.Path, log_every: int) -> int:
  """Steps a learner trained twice: a restart resumes from its last checkpoint, before the last step it
  logged when it died (known to the logging interval)."""
  records = step_records(learner_dir)
  # After a restart from checkpoint step c, the first record is at c + log_every.
  return sum(a - (b - log_every) for (_, a), (_, b) in zip(records, records[1:]) if b <= a)


def idle_intervals(learner_states: dict, finish: Sequence[float], start: float, end: float,
                   records: Sequence[Sequence[tuple[float, int]]] = ()) -> list[tuple[float, float]]:
  """The intervals within [start, end] during which no learner was up and still training. A learner
  restarted after a kill counts from its first step record (before it, it starts up and compiles);
  `records[i]`: learner i's (time, step) records."""
  active = []
  for i, t_done in enumerate(finish):
    previous = None
    for a, b, state in learner_states.get(i, learner_states.get(str(i), [])):
      if state == "up" and previous == "dead" and i < len(records):
        a = min([t for t, _ in records[i] if t >= a] + [b])
      if state == "up" and min(b, t_done) > a:
        active.append((a, min(b, t_done)))
      previous = state
  idle, t = [], start
  for a, b in sorted(active):
    if a > t:
      idle.append((t, min(a, end)))
    t = max(t, b)
  if t < end:
    idle.append((t, end))
  return [(a, b) for a, b in idle if b > a]


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

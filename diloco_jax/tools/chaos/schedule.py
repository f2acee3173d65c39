"""Fault schedules of the chaos command: the events (kill -9, SIGSTOP, cut-off of a learner; kill -9 and
SIGTERM of the syncer), the standard seeded mix, and schedule files."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

KINDS = ("learner_kill", "learner_stop", "learner_cutoff", "syncer_kill", "syncer_term")
LEARNER_KINDS = ("learner_kill", "learner_stop", "learner_cutoff")


@dataclasses.dataclass(frozen=True)
class Event:
  """One fault. `at_s`: seconds after every learner took its first steps. `duration_s`: how long a
  learner is stopped or cut off, or the repair delay before a killed learner or a stopped syncer is
  started again. `target`: the learner (learner events)."""

  at_s: float
  kind: str
  target: int = -1
  duration_s: float = 0.0

  def describe(self) -> str:
    """The event in words, as the log and the report print it."""
    return {
        "learner_kill": f"kill -9 learner {self.target} (restart in {self.duration_s:g} s)",
        "learner_stop": f"SIGSTOP learner {self.target} for {self.duration_s:g} s",
        "learner_cutoff": f"cut learner {self.target} off the syncer for {self.duration_s:g} s",
        "syncer_kill": f"kill -9 the syncer (restart in {self.duration_s:g} s)",
        "syncer_term": f"SIGTERM the syncer (restart in {self.duration_s:g} s)",
    }[self.kind]


SETTLE_S = 20.0  # after a syncer restart or a learner kill: repair, start-up, recovery, and a push


def standard_schedule(seed: int, learners: int, train_s: float) -> list[Event]:
  """The standard mix over a run whose undisturbed training takes `train_s` seconds: a learner kill -9
  (restarted after 10 s), a 20 s straggler (SIGSTOP) and a 10 s cut-off, on three different learners (when
  there are three), one after the other in a seeded order, so that at any time at most one learner is
  faulty (what "one learner stopped, dead or cut off" means); and a syncer kill -9 and a syncer SIGTERM
  (each restarted after 2-5 s), in a seeded order, `SETTLE_S` (+ 0-5 s) apart, and never while the killed
  learner is down or starting again (killing a learner while a syncer restart settles would make it lose
  work the restart made it take back, docs/operations.md). Times are seeded."""
  rng = np.random.default_rng(seed)
  order = rng.permutation(learners)
  killed, straggler, cut = (int(order[i % learners]) for i in range(3))
  learner_faults = [Event(0.0, "learner_kill", killed, 10.0), Event(0.0, "learner_stop", straggler, 20.0),
                    Event(0.0, "learner_cutoff", cut, 10.0)]
  busy = {"learner_kill": 10.0 + 15.0, "learner_stop": 20.0 + 3.0, "learner_cutoff": 10.0 + 3.0}
  events, t, kill_window = [], round(float(rng.uniform(0.05, 0.15)) * train_s, 1), (0.0, 0.0)
  for k in rng.permutation(3):
    event = dataclasses.replace(learner_faults[k], at_s=t)
    events.append(event)
    if event.kind == "learner_kill":
      kill_window = (t - SETTLE_S, t + busy[event.kind])
    t = round(t + busy[event.kind] + float(rng.uniform(0, 5)), 1)
  t = round(float(rng.uniform(0.1, 0.3)) * train_s, 1)
  for kind in rng.permutation(["syncer_kill", "syncer_term"]):
    if kill_window[0] < t < kill_window[1]:
      t = round(kill_window[1], 1)
    events.append(Event(t, str(kind), duration_s=round(float(rng.uniform(2, 5)), 1)))
    t = round(t + SETTLE_S + float(rng.uniform(0, 5)), 1)
  return sorted(events, key=lambda e: e.at_s)


def load_schedule(path: str, learners: int) -> list[Event]:
  """A schedule file: a JSON list of {"at_s", "kind", "target", "duration_s"}; errors name the entry."""
  try:
    entries = json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError) as e:
    raise ValueError(f"--schedule {path}: {e}") from None
  if not isinstance(entries, list):
    raise ValueError(f"--schedule {path}: expected a JSON list of events")
  events = []
  for n, entry in enumerate(entries):
    where = f"--schedule {path}, event {n}"
    if not isinstance(entry, dict) or set(entry) - {f.name for f in dataclasses.fields(Event)}:
      raise ValueError(f"{where}: expected an object with at_s, kind, target, duration_s; got {entry!r:.100}")
    try:
      event = Event(float(entry["at_s"]), str(entry["kind"]), int(entry.get("target", -1)),
                    float(entry.get("duration_s", 0.0)))
    except (KeyError, TypeError, ValueError) as e:
      raise ValueError(f"{where}: {e!r}") from None
    if event.kind not in KINDS:
      raise ValueError(f"{where}: kind must be one of {KINDS}, got {event.kind!r}")
    if not (math.isfinite(event.at_s) and event.at_s >= 0 and math.isfinite(event.duration_s)
            and event.duration_s >= 0):
      raise ValueError(f"{where}: at_s and duration_s must be finite and >= 0")
    if event.kind in LEARNER_KINDS and not 0 <= event.target < learners:
      raise ValueError(f"{where}: target must be a learner in [0, {learners}), got {event.target}")
    events.append(event)
  return sorted(events, key=lambda e: e.at_s)

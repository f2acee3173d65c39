"""A multi-process run under a seeded fault schedule: `python -m diloco_jax chaos`.

    python -m diloco_jax chaos --config configs/tiny_cpu.py --learners 3 --seed 0 \\
        [--schedule FILE] [--workdir runs/chaos] [--config.train.steps=2000]

It first runs the same job undisturbed (the reference; `--reference report.json` reuses one), then again
under the schedule (the standard one of `--seed`, or a JSON list of events from `--schedule`): kill -9 of a
learner and its restart after a repair delay, SIGSTOP/SIGCONT of a straggler, a learner cut off from the
syncer (the WAN emulator drops its traffic while a file exists), kill -9 and SIGTERM of the syncer and
its restart on the same port and workdir. Both runs use `launch_local`'s launcher. Each event is printed as
it happens; at the end: finished or not, whether versions stayed monotone (the syncer's over its
lifetimes, every learner's), the longest time without any version advancing (outside syncer outages,
beside the undisturbed run's), each syncer restart's time back to merging, contributions pushed / merged
/ rejected by reason / rolled back or dropped by crashes (and pushed again) / lost, goodput (tokens merged
into the global model over the tokens the same learners process in the same wall time undisturbed) and
the final eval loss beside the undisturbed one. `WORKDIR/report.json` holds it all, `WORKDIR/timeline.png`
draws it. Exit status 1 if a check failed. See docs/operations.md, "Chaos".
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import heapq
import json
import math
import os
import pathlib
import shutil
import signal
import sys
import time
from typing import Iterable, Sequence

import numpy as np
from absl import flags

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.runs import local as launch_local


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


# ---- fault schedules -----------------------------------------------------------------------------------

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


# ---- running a job under a schedule ---------------------------------------------------------------------


LEARNER_CHECKPOINT_EVERY = 100  # steps, when the config checkpoints learners only at the end


def chaos_config_argv(config, config_argv: list[str], learners: int) -> list[str]:
  """Set `learners.num`, keeping the config's per-learner batch (the global batch scales with it), and give
  learners periodic checkpoints if the config has none (a killed learner resumes from its last one)."""
  per_learner = config.data.global_batch // config.learners.num
  config.learners.num = learners
  config.data.global_batch = per_learner * learners
  extra = [f"--config.learners.num={learners}", f"--config.data.global_batch={per_learner * learners}"]
  if not config.train.checkpoint_every:
    config.train.checkpoint_every = LEARNER_CHECKPOINT_EVERY
    extra.append(f"--config.train.checkpoint_every={LEARNER_CHECKPOINT_EVERY}")
  return config_argv + extra


class _Job:
  """One multi-process run (launch_local's Launcher and Child) under a list of events, with a record of
  what happened when."""

  def __init__(self, config, config_argv: list[str], workdir: pathlib.Path, run_id: str, events: list[Event],
               say, timeout_s: float):
    self.config, self.workdir, self.events, self.say = config, workdir, list(events), say
    self.timeout_s = timeout_s
    cut_dir = workdir / "cutoff"
    cut_dir.mkdir(parents=True, exist_ok=True)
    self.cut_pattern = str(cut_dir / "learner_{learner}")
    argv = config_argv + [f"--config.emulation.cutoff_file={self.cut_pattern}"]
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    launch_local.write_token(workdir / "token")
    self.launcher = launch_local.Launcher(config, argv, workdir, run_id, stop_timeout_s=60.0,
                                          start_timeout_s=300.0)
    self.log: list[dict] = []  # {"t", "what", "kind", "target"}: every action taken, wall time
    self.syncer_down: list[list[float]] = []  # [signal time, restarted process start]
    self.learner_states: dict[int, list[list]] = {}  # learner -> [[start, end, state]]
    self.expected_exit: set[int] = set()  # pids we killed
    self._starting = None  # when the syncer being restarted was started (until it serves)

  def _note(self, what: str, kind: str = "", target: int = -1) -> None:
    t = time.time()
    self.log.append({"t": t, "what": what, "kind": kind, "target": target})
    self.say(f"chaos {t - self.t_launch:7.1f}s  {what}")

  def _state(self, learner: int, state: str) -> None:
    now = time.time()
    spans = self.learner_states.setdefault(learner, [])
    if spans and spans[-1][1] is None:
      spans[-1][1] = now
    spans.append([now, None, state])

  def _learner_dirs(self):
    return [self.workdir / f"learner_{i}" for i in range(self.config.learners.num)]

  def run(self) -> dict:
    """Run to the end (every learner done) or the timeout; returns the raw record of the run."""
    self.t_launch = time.time()
    la = self.launcher
    pending: list[tuple[float, int, str, object]] = []  # heap of (wall time, seq, action, argument)
    seq = 0
    finished, failure, t_train = False, None, None
    try:
      la.start_syncer()
      port = la.port
      self._note(f"syncer up on port {port}")
      la.start_learners()
      for i in range(self.config.learners.num):
        self._state(i, "up")
      deadline = self.t_launch + self.timeout_s
      todo = list(self.events)
      while True:
        now = time.time()
        if now > deadline:
          failure = f"timed out after {self.timeout_s:.0f} s"
          break
        if t_train is None and all(launch_local.learner_progress(d)["step"] >= 1 for d in self._learner_dirs()):
          t_train = now
          self._note("every learner trains: the schedule starts")
        while t_train is not None and todo and t_train + todo[0].at_s <= now:
          event = todo.pop(0)
          for action in self._start(event, port):
            heapq.heappush(pending, (now + action[0], seq, action[1], action[2]))
            seq += 1
        while pending and pending[0][0] <= now:
          _, _, action, arg = heapq.heappop(pending)
          self._finish(action, arg, port)
        try:
          if self._starting is not None and la.syncer_serving():
            self._note(f"the restarted syncer serves ({time.time() - self._starting:.1f} s after its start)")
            self._starting = None
        except launch_local.ChildFailed as e:
          failure = f"the restarted syncer failed: {e}"
          break
        # Children: a learner done (0) stays done; anything else we did not cause is a failure.
        if la.syncer.poll() is not None and la.syncer.pid not in self.expected_exit:
          failure = f"the syncer exited with status {la.syncer.poll()}"
          break
        for i, child in enumerate(la.learners):
          rc = child.poll()
          if rc not in (None, 0) and child.pid not in self.expected_exit:
            failure = f"learner {i} exited with status {rc}"
        if failure:
          break
        if all(c.poll() == 0 for c in la.learners):  # events still to come never happen
          finished = True
          break
        time.sleep(0.2)
      t_end = time.time()
      status = la.syncer_status() if finished else None
    finally:
      for f in (self.workdir / "cutoff").glob("learner_*"):
        f.unlink()
      for child in la.learners:
        if child.poll() is None:
          try:
            os.kill(child.pid, signal.SIGCONT)
          except ProcessLookupError:
            pass
      codes = la.stop_all()
    for spans in self.learner_states.values():
      if spans and spans[-1][1] is None:
        spans[-1][1] = t_end
    if failure:
      self._note(f"FAILED: {failure}")
    return {"finished": finished, "failure": failure, "t_launch": self.t_launch, "t_train": t_train,
            "t_end": t_end, "status": status, "exit_codes": codes, "log": self.log,
            "syncer_down": self.syncer_down, "learner_states": self.learner_states}

  def _start(self, event: Event, port: int) -> list[tuple[float, str, object]]:
    """Carry out an event; returns its follow-ups as (delay, action, argument)."""
    la = self.launcher
    if event.kind in LEARNER_KINDS:
      child = la.learners[event.target]
      if child.poll() is not None:
        self._note(f"skipped ({event.describe()}): learner {event.target} already exited", event.kind,
                   event.target)
        return []
    if event.kind == "learner_kill":
      self.expected_exit.add(child.pid)
      child.proc.send_signal(signal.SIGCONT)  # a stopped process dies on SIGKILL too; be explicit
      child.proc.kill()
      child.proc.wait()
      self._state(event.target, "dead")
      self._note(event.describe(), event.kind, event.target)
      return [(event.duration_s, "learner_restart", event.target)]
    if event.kind == "learner_stop":
      child.proc.send_signal(signal.SIGSTOP)
      self._state(event.target, "stopped")
      self._note(event.describe(), event.kind, event.target)
      return [(event.duration_s, "learner_cont", (event.target, child.pid))]
    if event.kind == "learner_cutoff":
      pathlib.Path(self.cut_pattern.replace("{learner}", str(event.target))).touch()
      self._state(event.target, "cut off")
      self._note(event.describe(), event.kind, event.target)
      return [(event.duration_s, "learner_reconnect", event.target)]
    # The syncer.
    syncer = la.syncer
    if syncer.poll() is not None or self._starting is not None:
      self._note(f"skipped ({event.describe()}): the syncer is down or starting", event.kind)
      return []
    self.expected_exit.add(syncer.pid)
    self.syncer_down.append([time.time(), None])
    if event.kind == "syncer_kill":
      syncer.proc.kill()
      self._note(event.describe(), event.kind)
    else:
      syncer.terminate()
      self._note(event.describe(), event.kind)
    syncer.wait(120.0)
    syncer.close()
    return [(event.duration_s, "syncer_restart", None)]

  def _finish(self, action: str, arg, port: int) -> None:
    la = self.launcher
    if action == "learner_restart":
      la.learners[arg].close()
      la.learners[arg], = la.start_learner(arg, add=False)
      self._state(arg, "up")
      self._note(f"learner {arg} restarted (resumes from its checkpoint)", action, arg)
    elif action == "learner_cont":
      i, pid = arg
      if la.learners[i].pid == pid and la.learners[i].poll() is None:
        la.learners[i].proc.send_signal(signal.SIGCONT)
      self._state(i, "up")
      self._note(f"SIGCONT learner {i}", action, i)
    elif action == "learner_reconnect":
      pathlib.Path(self.cut_pattern.replace("{learner}", str(arg))).unlink(missing_ok=True)
      self._state(arg, "up")
      self._note(f"learner {arg} reconnected", action, arg)
    elif action == "syncer_restart":
      la.start_syncer(port, wait=False)  # the schedule goes on while it starts
      self.syncer_down[-1][1] = time.time()
      self._starting = time.time()
      self._note(f"syncer restarted on port {port} (same workdir)", action)


# ---- the report -----------------------------------------------------------------------------------------


def analyze(config, workdir: pathlib.Path, raw: dict, reference: dict | None, eval_loss: float | None) -> dict:
  """The report of one run: finished, monotone versions, stalls, restarts back to merging, contributions,
  tokens lost, goodput and eval loss beside the reference (undisturbed) run."""
  learners = config.learners.num
  dirs = [workdir / f"learner_{i}" for i in range(learners)]
  timeline = commits(workdir / "syncer")
  advances = advance_times(timeline)
  summaries = []
  for d in dirs:
    try:
      summaries.append(json.loads((d / "summary.json").read_text()))
    except (OSError, ValueError):
      summaries.append(None)
  t_train, t_end = raw["t_train"] or raw["t_launch"], raw["t_end"]
  outages = []
  for down, up in raw["syncer_down"]:
    back = next((t for t in advances if up is not None and t > up), None)
    outages.append({"down_at": down, "process_started": up, "first_merge": back,
                    "back_to_merging_s": None if back is None or up is None else back - up,
                    "down_s": None if up is None else up - down})
  # Outside syncer outages (from the signal to the first merge after the restart), and outside the times
  # when no learner trains (all stopped, dead, cut off or finished): nothing could be merged then.
  excluded = [(o["down_at"], o["first_merge"] or t_end) for o in outages]
  finish = [min((t for t, s in step_records(d) if s >= config.train.steps), default=t_end) for d in dirs]
  excluded += idle_intervals(raw["learner_states"], finish, t_train, t_end, [step_records(d) for d in dirs])
  # Stalls count until the last version advance: after it the learners only write checkpoints and exit.
  last = max([t for t in advances if t > t_train], default=t_end)
  status = raw["status"] or {}
  counters = status.get("counters", {})
  num_fragments = config.outer.num_fragments
  wall = t_end - raw["t_launch"]
  tokens = [s["tokens"] if s else 0 for s in summaries]
  by_fragment = counters.get("tokens_merged_by_fragment", [0] * num_fragments)
  short = [max(0, sum(tokens) - int(m)) for m in by_fragment]
  # A killed learner takes with it the work it had not pushed: at most two pushes' worth per fragment
  # (its steps since its last push, and a push the syncer had not accepted). More is lost work.
  kills = sum(1 for e in raw["log"] if e["kind"] == "learner_kill")
  tokens_per_step = config.data.global_batch // learners * config.data.seq_len
  permitted = kills * 2 * config.outer.sync_every * tokens_per_step
  lost = [max(0, x - permitted) for x in short]
  total_merged = sum(by_fragment) / num_fragments
  report = {
      "finished": bool(raw["finished"] and all(s and s.get("completed") for s in summaries)),
      "failure": raw["failure"],
      "learners": learners, "steps": config.train.steps, "wall_s": wall,
      "train_s": t_end - t_train,
      "versions": status.get("versions"),
      "versions_monotone": bool(monotone(v for _, v in timeline) and
                                all(monotone(learner_versions(d)) for d in dirs)),
      "longest_stall_s": longest_gap(advances, t_train, last, excluded),
      "longest_stall_raw_s": longest_gap(advances, t_train, last),
      "syncer_restarts": outages,
      "faults_applied": {k: sum(1 for e in raw["log"] if e["kind"] == k and not e["what"].startswith("skipped"))
                         for k in KINDS},
      "contributions": {
          "pushed": counters.get("contributions_accepted", 0) + counters.get("contributions_rejected", 0),
          "accepted": counters.get("contributions_accepted", 0),
          "merged": counters.get("contributions_merged", 0),
          "rejected": {k: v for k, v in counters.get("rejected", {}).items() if v},
          "rolled_back_by_crashes": counters.get("contributions_rolled_back", 0),
          "dropped_by_crashes": counters.get("contributions_lost_open", 0),
          "closed_at_stop_rounds": counters.get("rounds_closed_at_stop", 0),
          "tokens_short_by_fragment": short,
          "tokens_short_permitted": permitted,
          "lost_tokens_by_fragment": lost,
      },
      "tokens_processed": sum(tokens), "tokens_merged": total_merged,
      "steps_pushed_again": sum(s.get("steps_taken_back", 0) for s in summaries if s),
      "recoveries": [s.get("recoveries", 0) if s else None for s in summaries],
      "blocked_s": [s.get("blocked_s") if s else None for s in summaries],
      "learner_stalls": counters.get("learner_stalls", 0),
      # One step: the undisturbed run's wall time per step while every learner trains (all overheads in).
      "step_time_s": (reference or {}).get("step_time_s") or (
          ((first_done(dirs, config.train.steps) or t_end) - t_train) / config.train.steps),
      "eval_loss": eval_loss,
      "events": raw["log"], "learner_states": raw["learner_states"], "timeline": timeline,
      "t_launch": raw["t_launch"], "t_train": t_train, "t_end": t_end,
  }
  report["contributions"]["lost"] = sum(1 for x in lost if x)
  # Goodput: tokens merged into the global model per provisioned learner-second, over the undisturbed
  # run's. A learner is provisioned from the moment every learner trains until it finished its steps
  # (stopped, dead or cut off meanwhile: still provisioned; finished: released, as a learner of a longer
  # run would go on). Tokens a killed learner trains twice (between its checkpoint and its death) are
  # not counted.
  tokens_per_step = config.data.global_batch // learners * config.data.seq_len
  redone = sum(redone_steps(d, config.train.log_every) for d in dirs) * tokens_per_step
  series = merged_tokens(workdir / "syncer", num_fragments)
  provisioned = sum(max(f - t_train, 0.0) for f in finish)
  useful = value_at(series, t_end) - value_at(series, t_train) - redone
  report.update(provisioned_learner_s=provisioned, tokens_redone=redone, tokens_merged_while_training=useful,
                merge_rate=useful / max(provisioned, 1e-9))
  if reference is not None:
    rate = reference["merge_rate"]
    report["reference"] = {k: reference[k] for k in ("wall_s", "train_s", "tokens_processed", "eval_loss",
                                                     "longest_stall_s", "step_time_s", "merge_rate",
                                                     "provisioned_learner_s")}
    report["goodput"] = report["merge_rate"] / rate if rate > 0 else None
    report["eval_loss_ratio"] = (eval_loss / reference["eval_loss"]
                                 if eval_loss and reference.get("eval_loss") else None)
    report["excess_stall_s"] = report["longest_stall_s"] - reference["longest_stall_s"]
  return report


def stall_bound_s(config, report: dict) -> float:
  """What a stall beyond the undisturbed cadence may cost: the stall bound (outer.max_grace_s by default)
  plus one step."""
  return config_lib.resolve(config).outer.stall_s + report["step_time_s"]


def verdict(config, report: dict) -> dict:
  """The checks of docs/operations.md ("Chaos"): each True, False, or None when not measured."""
  restarts = report["syncer_restarts"]
  excess = report.get("excess_stall_s")
  return {
      "finished": report["finished"],
      "versions_monotone": report["versions_monotone"],
      "no_stall_beyond_bound": None if excess is None else excess <= stall_bound_s(config, report),
      "restarts_back_within_30s": all(o["back_to_merging_s"] is not None and o["back_to_merging_s"] <= 30
                                      for o in restarts),
      "nothing_lost": report["contributions"]["lost"] == 0,
  }


def format_report(config, report: dict) -> str:
  c = report["contributions"]
  applied = ", ".join(f"{n} {k}" for k, n in report["faults_applied"].items() if n)
  lines = [f"chaos: {'finished' if report['finished'] else 'NOT finished (' + str(report['failure']) + ')'}; "
           f"{report['learners']} learners x {report['steps']} steps in {report['wall_s']:.0f} s; versions "
           f"{report['versions']} {'monotone' if report['versions_monotone'] else 'WENT BACKWARDS'}; faults: "
           f"{applied or 'none'}",
           f"  longest time without any version advancing: {report['longest_stall_s']:.2f} s outside syncer "
           f"outages ({report['longest_stall_raw_s']:.2f} s with them)"
           + (f"; undisturbed {report['reference']['longest_stall_s']:.2f} s, excess "
              f"{report['excess_stall_s']:.2f} s (bound: stall "
              f"{config_lib.resolve(config).outer.stall_s:g} s + one step "
              f"{report['step_time_s']:.3f} s)" if "reference" in report else "")]
  for n, o in enumerate(report["syncer_restarts"]):
    back = o["back_to_merging_s"]
    lines.append(f"  syncer restart {n + 1}: down {o['down_s'] or 0:.1f} s, back to merging "
                 + (f"{back:.1f} s after its process started" if back is not None else "NEVER"))
  lines.append(f"  contributions: {c['pushed']} pushed, {c['merged']} merged, rejected {c['rejected'] or 'none'}, "
               f"{c['rolled_back_by_crashes']} merged then rolled back and {c['dropped_by_crashes']} dropped "
               f"by crashes (pushed again: {report['steps_pushed_again']} steps); lost {c['lost']} (tokens short per "
               f"fragment {c['tokens_short_by_fragment']}, of which a killed learner's unpushed work may be "
               f"{c['tokens_short_permitted']:,})")
  if "reference" in report:
    ref = report["reference"]
    lines.append(f"  goodput {100 * report['goodput']:.1f}%: {report['merge_rate']:,.0f} tokens merged into the "
                 f"global model per provisioned learner-second ({report['provisioned_learner_s']:.0f} learner-s; "
                 f"{report['tokens_redone']:,} tokens trained twice not counted) vs {ref['merge_rate']:,.0f} "
                 f"undisturbed")
    if report["eval_loss"] is not None and ref["eval_loss"] is not None:
      lines.append(f"  eval loss {report['eval_loss']:.4f} vs undisturbed {ref['eval_loss']:.4f} "
                   f"({100 * (report['eval_loss_ratio'] - 1):+.2f}%)")
  checks = verdict(config, report)
  lines.append("  checks: " + ", ".join(f"{k} {'ok' if v else ('n/a' if v is None else 'FAILED')}"
                                        for k, v in checks.items()))
  return "\n".join(lines)


def plot_timeline(report: dict, path: pathlib.Path, num_fragments: int) -> None:
  """Learners alive (and stopped, dead, cut off), the syncer's outages, each fragment's version, and the
  events, against wall time."""
  import matplotlib  # lazy: only this figure needs it

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  t0 = report["t_launch"]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
  colors = {"up": "tab:green", "stopped": "tab:orange", "dead": "tab:red", "cut off": "tab:purple"}
  learners = report["learners"]
  for i in range(learners):
    for start, end, state in report["learner_states"].get(str(i), report["learner_states"].get(i, [])):
      top.barh(i, end - start, left=start - t0, color=colors[state], height=0.6)
  for o in report["syncer_restarts"]:
    up = o["process_started"] or report["t_end"]
    top.barh(learners, up - o["down_at"], left=o["down_at"] - t0, color="tab:red", height=0.6)
    if o["first_merge"]:
      top.barh(learners, o["first_merge"] - up, left=up - t0, color="tab:gray", height=0.6)
  top.barh(learners, 0, left=0)
  top.set_yticks(range(learners + 1), [f"learner {i}" for i in range(learners)] + ["syncer"])
  top.legend(handles=[matplotlib.patches.Patch(color=c, label=s) for s, c in colors.items()]
             + [matplotlib.patches.Patch(color="tab:gray", label="syncer recovering")],
             loc="upper right", fontsize=7, ncol=5)
  times = [t - t0 for t, _ in report["timeline"]]
  for p in range(num_fragments):
    bottom.step(times, [v[p] for _, v in report["timeline"]], where="post", label=f"fragment {p}")
  for e in report["events"]:
    if e["kind"] in KINDS:
      for ax in (top, bottom):
        ax.axvline(e["t"] - t0, color="black", lw=0.6, ls="--")
      bottom.annotate(e["what"], (e["t"] - t0, 0), rotation=90, fontsize=6, va="bottom")
  bottom.set_xlabel("seconds since launch")
  bottom.set_ylabel("version")
  bottom.legend(loc="upper left", fontsize=8)
  top.set_title("chaos: " + ("finished" if report["finished"] else "not finished")
                + (f", goodput {100 * report['goodput']:.0f}%" if report.get("goodput") is not None else ""))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary_table(reports: Sequence[dict]) -> str:
  """A markdown table of several chaos reports (one row per report; `--summarize`)."""
  rows = ["| seed | finished | monotone | faults | longest stall: chaos / undisturbed / excess (s) | "
          "restarts back to merging (s) | contributions lost | goodput | eval loss vs undisturbed | checks |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    faults = " ".join(f"{n}{k.replace('learner_', 'L-').replace('syncer_', 'S-')}"
                      for k, n in r["faults_applied"].items() if n)
    backs = ", ".join(f"{o['back_to_merging_s']:.1f}" if o["back_to_merging_s"] is not None else "never"
                      for o in r["syncer_restarts"])
    ref = r.get("reference", {})
    checks = r.get("checks", {})
    failed = [k for k, v in checks.items() if v is False]
    rows.append(
        f"| {r.get('seed', '-')} | {'yes' if r['finished'] else 'NO'} | {'yes' if r['versions_monotone'] else 'NO'} "
        f"| {faults} | {r['longest_stall_s']:.2f} / {ref.get('longest_stall_s', float('nan')):.2f} / "
        f"{r.get('excess_stall_s', float('nan')):+.2f} | {backs} | {r['contributions']['lost']} | "
        f"{100 * r['goodput']:.1f}% | {100 * (r['eval_loss_ratio'] - 1):+.2f}% | "
        f"{'all ok' if not failed else 'FAILED: ' + ', '.join(failed)} |")
  return "\n".join(rows)


# ---- the command ---------------------------------------------------------------------------------------


def run_job(config, config_argv, workdir: pathlib.Path, run_id: str, events: list[Event], *, say,
            timeout_s: float, reference: dict | None, evaluate: bool = True, eval_batches: int = 0) -> dict:
  """Run the job under `events` in `workdir` and return its report (beside `reference`, if given). The
  final global model is evaluated on `eval_batches` batches (0: the config's `data.eval_batches`)."""
  if workdir.exists():
    shutil.rmtree(workdir)
  workdir.mkdir(parents=True)
  raw = _Job(config, config_argv, workdir, run_id, events, say, timeout_s).run()
  (workdir / "raw.json").write_text(json.dumps(raw, default=str) + "\n")  # to analyze again
  eval_batches = eval_batches or config.data.eval_batches
  eval_config = copy.deepcopy(config)
  eval_config.data.eval_batches = eval_batches
  eval_loss = (launch_local.evaluate_global(eval_config, workdir / "syncer", run_id)
               if evaluate and raw["finished"] else None)
  report = analyze(config, workdir, raw, reference, eval_loss)
  report["eval_batches"] = eval_batches
  report["schedule"] = [dataclasses.asdict(e) for e in events]
  return report


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_integer("learners", 3, "learner processes (the per-learner batch of the config is kept)",
                       flag_values=fv)
  flags.DEFINE_integer("seed", 0, "seed of the standard schedule (times and targets)", flag_values=fv)
  flags.DEFINE_string("schedule", None, "a JSON list of events instead of the standard schedule",
                      flag_values=fv)
  flags.DEFINE_string("workdir", "runs/chaos", "run directory: reference/, chaos/, report.json, timeline.png",
                      flag_values=fv)
  flags.DEFINE_string("reference", None, "reuse the undisturbed run of this report.json (same config and "
                      "learners) instead of measuring it", flag_values=fv)
  flags.DEFINE_float("timeout-s", 3600.0, "give up on a run after this long", flag_values=fv)
  flags.DEFINE_string("run-id", "chaos", "run id", flag_values=fv)
  flags.DEFINE_integer("eval-batches", 0, "batches the final global model of both runs is evaluated on (0: "
                       "the config's data.eval_batches; the few a config evaluates on during training are "
                       "too noisy to compare two runs' final losses)", flag_values=fv)
  flags.DEFINE_list("summarize", None, "instead of running: print a markdown table of these report.json "
                    "files (e.g. runs/sweep/seed*/report.json)", flag_values=fv)


def main(argv) -> int:
  """`python -m diloco_jax chaos --config C --learners N --seed S [--schedule FILE]`; see the docstring."""
  # --summarize only reads reports: it needs no --config.
  summarize = any(a == "--summarize" or a.startswith("--summarize=") for a in argv[1:])
  fv = cli.parse(argv, _define_flags, doc=__doc__, config=not summarize)
  if summarize:
    paths = sorted({p for pattern in fv.summarize for p in glob.glob(pattern)})
    reports = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    print(summary_table(sorted(reports, key=lambda r: r.get("seed", 0))))
    return 0
  config = fv.config
  learners = fv.learners
  if learners < 1:
    raise cli.UsageError(f"--learners must be >= 1, got {learners}")
  config_argv = chaos_config_argv(config, launch_local.config_args(argv), learners)
  cli.validated(config, learners * config.learners.devices, learners=True)
  if fv.schedule:
    try:
      load_schedule(fv.schedule, learners)
    except ValueError as e:
      raise cli.UsageError(str(e)) from None
  # The launcher's own jax (the final evals) gets one learner's worth of CPU devices; set before first use.
  os.environ.update({k: v for k, v in launch_local.child_env(config.learners.devices).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  workdir = pathlib.Path(fv.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  say = lambda line: print(line, file=sys.stderr, flush=True)
  run_id = fv["run-id"].value
  timeout_s = fv["timeout-s"].value
  eval_batches = fv["eval-batches"].value or config.data.eval_batches
  if eval_batches < 1:
    raise cli.UsageError(f"--eval-batches must be >= 0, got {fv['eval-batches'].value}")
  if fv.reference:
    reference = json.loads(pathlib.Path(fv.reference).read_text())["reference_run"]
    if reference.get("eval_batches", config.data.eval_batches) != eval_batches:
      raise cli.UsageError(f"--reference {fv.reference} evaluated its final model on "
                           f"{reference.get('eval_batches')} batches, this run on {eval_batches}: "
                           "pass the same --eval-batches")
    say(f"chaos: undisturbed run from {fv.reference}: {reference['wall_s']:.0f} s")
  else:
    say(f"chaos: undisturbed run of {config.train.steps} steps x {learners} learners (the reference)")
    reference = run_job(config, config_argv, workdir / "reference", run_id, [], say=say, timeout_s=timeout_s,
                        reference=None, eval_batches=eval_batches)
    if not reference["finished"]:
      say(f"chaos: the undisturbed run did not finish: {reference['failure']}")
      return 1
  events = (load_schedule(fv.schedule, learners) if fv.schedule
            else standard_schedule(fv.seed, learners, reference["train_s"]))
  say("chaos: schedule\n" + "\n".join(f"  {e.at_s:7.1f}s  {e.describe()}" for e in events))
  report = run_job(config, config_argv, workdir / "chaos", run_id, events, say=say, timeout_s=timeout_s,
                   reference=reference, eval_batches=eval_batches)
  report["seed"] = fv.seed
  report["checks"] = verdict(config, report)
  report["reference_run"] = {k: v for k, v in reference.items() if k not in ("events", "timeline")}
  (workdir / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
  plot_timeline(report, workdir / "timeline.png", config.outer.num_fragments)
  print(format_report(config, report))
  print(f"chaos: report {workdir / 'report.json'}, timeline {workdir / 'timeline.png'}")
  return 0 if all(v is not False for v in report["checks"].values()) else 1

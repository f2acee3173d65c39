"""One multi-process run (the `local` launcher's syncer and learners) under a fault schedule, with a
record of what happened when, and its report (`run_job`)."""

from __future__ import annotations

import copy
import dataclasses
import heapq
import json
import os
import pathlib
import shutil
import signal
import time

from diloco_jax.runs import children as run_children
from diloco_jax.runs import launcher as run_launcher
from diloco_jax.runs import local as launch_local
from diloco_jax.tools.chaos import analysis
from diloco_jax.tools.chaos.schedule import LEARNER_KINDS, Event

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
    run_children.write_token(workdir / "token")
    self.launcher = run_launcher.Launcher(config, argv, workdir, run_id, stop_timeout_s=60.0,
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
    try:
      la.start_syncer()
      port = la.port
      self._note(f"syncer up on port {port}")
      la.start_learners()
      for i in range(self.config.learners.num):
        self._state(i, "up")
      finished, failure, t_train = self._drive(port)
      t_end = time.time()
      status = la.syncer_status() if finished else None
    finally:
      codes = self._release()
    for spans in self.learner_states.values():
      if spans and spans[-1][1] is None:
        spans[-1][1] = t_end
    if failure:
      self._note(f"FAILED: {failure}")
    return {"finished": finished, "failure": failure, "t_launch": self.t_launch, "t_train": t_train,
            "t_end": t_end, "status": status, "exit_codes": codes, "log": self.log,
            "syncer_down": self.syncer_down, "learner_states": self.learner_states}

  def _drive(self, port: int) -> tuple[bool, str | None, float | None]:
    """Applies the schedule (from when every learner trains) until every learner is done, a process fails
    or the timeout; returns (finished, failure, when the schedule started)."""
    pending: list[tuple[float, int, str, object]] = []  # heap of (wall time, seq, action, argument)
    seq = 0
    t_train = None
    deadline = self.t_launch + self.timeout_s
    todo = list(self.events)
    while True:
      now = time.time()
      if now > deadline:
        return False, f"timed out after {self.timeout_s:.0f} s", t_train
      if t_train is None and all(run_launcher.learner_progress(d)["step"] >= 1 for d in self._learner_dirs()):
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
      failure = self._failure()
      if failure:
        return False, failure, t_train
      if all(c.poll() == 0 for c in self.launcher.learners):  # events still to come never happen
        return True, None, t_train
      time.sleep(0.2)

  def _failure(self) -> str | None:
    """What failed that we did not cause, if anything (a learner done, status 0, stays done); notes when a
    restarted syncer serves again."""
    la = self.launcher
    try:
      if self._starting is not None and la.syncer_serving():
        self._note(f"the restarted syncer serves ({time.time() - self._starting:.1f} s after its start)")
        self._starting = None
    except run_children.ChildFailed as e:
      return f"the restarted syncer failed: {e}"
    if la.syncer.poll() is not None and la.syncer.pid not in self.expected_exit:
      return f"the syncer exited with status {la.syncer.poll()}"
    failure = None
    for i, child in enumerate(la.learners):
      rc = child.poll()
      if rc not in (None, 0) and child.pid not in self.expected_exit:
        failure = f"learner {i} exited with status {rc}"
    return failure

  def _release(self) -> list:
    """Lifts every cut-off and stop, and stops every process; returns their exit codes."""
    la = self.launcher
    for f in (self.workdir / "cutoff").glob("learner_*"):
      f.unlink()
    for child in la.learners:
      if child.poll() is None:
        try:
          os.kill(child.pid, signal.SIGCONT)
        except ProcessLookupError:
          pass
    return la.stop_all()

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


def summary(report: dict) -> dict:
  """A run's report without its event log and timeline: what a later run needs of it as its reference."""
  return {k: v for k, v in report.items() if k not in ("events", "timeline")}


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
  report = analysis.analyze(config, workdir, raw, reference, eval_loss)
  report["eval_batches"] = eval_batches
  report["schedule"] = [dataclasses.asdict(e) for e in events]
  return report

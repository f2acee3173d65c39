"""Emulated mixed hardware: a learner's inner steps stretched to a given speed, with step-time noise.

`StepPacer` makes learner i behave like hardware of relative speed `emulation.speeds[i]`: after each inner
step has finished on the device it sleeps until the step took `step_s / speed * g` seconds of wall time
(g ~ Gamma of mean 1 and coefficient of variation `emulation.step_cv`), where `step_s` is
`emulation.step_s` or, when that is 0, the median of the learner's own measured step times. A step whose
computation already took longer is not shortened (an "overrun", counted). The sleep is part of the inner
step: reported in its step time (the syncer's grace window) and counted as compute, never as blocked time.

`StepClock`: the step time a learner reports, less its waits on the syncer and its XLA compilation
(`compile_seconds`).
"""

from __future__ import annotations

import collections
import statistics
import threading
import time

import jax
import numpy as np

_MEDIAN_WINDOW = 32  # measured steps behind the step_s = 0 estimate

# Lowering to XLA and compiling it (or reading it from the persistent cache). Not jaxpr tracing: an outer
# function's trace holds the traces of the jitted functions it calls, so its events nest.
_COMPILE_EVENTS = frozenset({"/jax/core/compile/jaxpr_to_mlir_module_duration",
                             "/jax/core/compile/backend_compile_duration"})
_compiling = threading.local()
_listening = threading.Lock()
_listener_registered = False


def _on_duration(event: str, duration_s: float, **_) -> None:
  if event in _COMPILE_EVENTS:
    _compiling.seconds = getattr(_compiling, "seconds", 0.0) + duration_s


def compile_seconds() -> float:
  """Seconds the calling thread has spent lowering and compiling for XLA since this was first called (jax
  reports both in the thread that compiles). A learner leaves them out of its reported step time: the first
  sync, adoption and eval of a run compile in the middle of the inner loop (seconds each with a cold cache),
  and a step time inflated by them made the syncer's grace window plan for steps 5-10x too long for the
  first rounds, so a fast learner's sync came back after the fragment was due again and it waited."""
  global _listener_registered
  if not _listener_registered:  # checked again under the lock: the step path takes no lock once registered
    with _listening:
      if not _listener_registered:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listener_registered = True
  return getattr(_compiling, "seconds", 0.0)


class StepPacer:
  """Stretches one learner's inner steps (see the module docstring). Not thread-safe: the inner loop
  owns it. `active` is False (and `stretch` returns at once) without emulated speed or noise."""

  def __init__(self, speed: float = 1.0, step_cv: float = 0.0, step_s: float = 0.0, seed: int = 0):
    if not 0 < speed <= 100:
      raise ValueError(f"emulation.speeds: a speed must be in (0, 100], got {speed}")
    if not 0 <= step_cv < 1:
      raise ValueError(f"emulation.step_cv must be in [0, 1), got {step_cv}")
    if step_s < 0:
      raise ValueError(f"emulation.step_s must be >= 0, got {step_s}")
    self.speed, self.step_cv, self.step_s = float(speed), float(step_cv), float(step_s)
    self.active = speed != 1.0 or step_cv > 0 or step_s > 0
    self._rng = np.random.default_rng(seed)
    self._measured: collections.deque[float] = collections.deque(maxlen=_MEDIAN_WINDOW)
    self.steps = 0
    self.overruns = 0  # steps whose computation took longer than their target
    self.slept_s = 0.0

  @classmethod
  def from_spec(cls, spec, learner_id: int) -> StepPacer:
    """Learner `learner_id`'s pacer from a resolved spec's `emulation` (speed, step_cv, step_s), seeded per
    learner."""
    em = spec.emulation
    return cls(em.speeds[learner_id], float(em.step_cv), float(em.step_s),
               seed=(int(spec.seed) * 1_000_003 + learner_id) % 2**32)

  def noise(self) -> float:
    """One draw of g: mean 1, coefficient of variation step_cv (exactly 1 without noise)."""
    if self.step_cv == 0:
      return 1.0
    shape = 1.0 / self.step_cv**2
    return float(self._rng.gamma(shape, 1.0 / shape))

  def target_s(self, measured_s: float) -> float:
    """The wall time this step should take, given that its computation took `measured_s`."""
    self._measured.append(measured_s)
    base = self.step_s or statistics.median(self._measured)
    return base / self.speed * self.noise()

  def stretch(self, measured_s: float) -> float:
    """Sleep out the rest of this step's target; returns the seconds slept."""
    if not self.active:
      return 0.0
    self.steps += 1
    extra = self.target_s(measured_s) - measured_s
    if extra <= 0:
      self.overruns += 1
      return 0.0
    time.sleep(extra)
    self.slept_s += extra
    return extra

  def stats(self) -> dict:
    return {"speed": self.speed, "step_cv": self.step_cv, "step_s": self.step_s, "paced_steps": self.steps,
            "overrun_steps": self.overruns, "stretch_s": self.slept_s}


class StepClock:
  """A learner's pace, step by step: the wall time from the end of one step to the end of the next (the
  loop's metrics fetches and evals between steps are part of it), less the time the inner loop waited on the
  syncer or compiled for XLA in between (`compile_seconds`). `Comms.report_step_time` takes each lap."""

  def __init__(self):
    self._last_end: float | None = None
    self._excluded_s = 0.0  # blocked and compiling, by the end of the last step

  def lap(self, start: float, end: float, blocked_s: float) -> float:
    """The pace in seconds of the step that ended at `end`, given the learner's blocked time so far. The
    first lap is the whole first step from its `start`, compilation included (`Comms.report_step_time`
    leaves it out)."""
    excluded = blocked_s + compile_seconds()
    first = self._last_end is None
    pace = end - start if first else max(0.0, end - self._last_end - (excluded - self._excluded_s))
    self._last_end, self._excluded_s = end, excluded
    return pace

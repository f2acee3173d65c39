"""A learner's pace (`learner/pace.py`): the step pacer of emulated speeds and its noise, and the compile
time left out of the reported step time."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.learner import pace


def test_pacer_stretches_each_step_to_its_speed(monkeypatch):
  slept = []
  monkeypatch.setattr(pace.time, "sleep", slept.append)
  p = pace.StepPacer(speed=0.5, step_cv=0.0, step_s=0.1)
  assert p.active
  assert p.stretch(0.05) == pytest.approx(0.15)  # the step takes 0.1 / 0.5 = 0.2 s in all
  assert p.stretch(0.3) == 0.0 and p.overruns == 1  # longer than its target: not shortened
  assert slept == [pytest.approx(0.15)]
  # step_s = 0: the median of the learner's own measured steps stands in for a speed-1 step.
  q = pace.StepPacer(speed=0.8, step_s=0.0)
  for measured in (1.0, 0.1, 0.1, 0.1):  # a first step that compiled, then 0.1 s steps
    q.stretch(measured)
  assert slept[-1] == pytest.approx(0.1 / 0.8 - 0.1)
  assert not pace.StepPacer().active and pace.StepPacer().stretch(1.0) == 0.0


def test_pacer_noise_has_mean_one_and_the_asked_cv():
  p = pace.StepPacer(speed=1.0, step_cv=0.1, step_s=1.0, seed=3)
  draws = np.array([p.noise() for _ in range(20_000)])
  assert abs(draws.mean() - 1.0) < 0.005 and abs(draws.std() - 0.1) < 0.005 and (draws > 0).all()
  # Seeded per learner: two learners draw different noise, the same learner the same noise.
  config = config_lib.base_config()
  config.emulation.step_cv = 0.1
  a, b, a2 = (pace.StepPacer.from_spec(config_lib.resolve(config), i) for i in (0, 1, 0))
  assert a.noise() == a2.noise() != b.noise()
  with pytest.raises(ValueError, match="speeds"):
    pace.StepPacer(speed=0.0)


def test_compile_seconds_counts_this_threads_compiles_and_not_anothers():
  # A shape never compiled before in this process: a real lowering and XLA compile (or a cache read).
  fn = jax.jit(lambda x: jnp.tanh(x @ x.T) * 3.0 + 1.0)
  before = pace.compile_seconds()
  fn(jnp.ones((7, 13))).block_until_ready()
  compiled = pace.compile_seconds() - before
  assert compiled > 0
  fn(jnp.ones((7, 13))).block_until_ready()  # cached in memory: nothing compiles
  assert pace.compile_seconds() - before == compiled

  def other_thread():
    pace.compile_seconds()
    fn(jnp.ones((5, 11))).block_until_ready()  # another shape: compiles, in that thread
    seen.append(pace.compile_seconds())

  seen = []
  thread = threading.Thread(target=other_thread)
  thread.start()
  thread.join()
  assert seen[0] > 0 and pace.compile_seconds() - before == compiled


def test_the_step_clock_leaves_out_waits_on_the_syncer_and_compilation():
  clock = pace.StepClock()
  assert clock.lap(10.0, 12.0, blocked_s=0.0) == 2.0  # the first step: all of it
  assert clock.lap(12.5, 13.0, blocked_s=0.0) == pytest.approx(1.0)  # from the last end: work between steps
  assert clock.lap(13.0, 16.0, blocked_s=2.5) == pytest.approx(0.5)  # 2.5 s blocked on the syncer left out
  before = pace.compile_seconds()
  jax.jit(lambda x: jnp.sin(x) * 5.0 - x)(jnp.ones((3, 17))).block_until_ready()  # compiles, this thread
  compiled = pace.compile_seconds() - before
  assert compiled > 0
  assert clock.lap(16.0, 20.0, blocked_s=3.0) == pytest.approx(4.0 - 0.5 - compiled)

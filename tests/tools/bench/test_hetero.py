"""`bench hetero`: its simulator row and goals."""

import json
import statistics

import pytest

from diloco_jax import config as config_lib
from diloco_jax.tools.bench import hetero as bench_hetero


def test_bench_hetero_simulator_row_and_lockstep():
  """The simulator row `bench hetero` prints: for its default learner set, K = M runs at the slow
  learners' pace (the lockstep expectation) and K = 1 (+ grace) never blocks."""
  config = config_lib.base_config()
  config.outer.sync_every, config.outer.num_fragments, config.outer.max_grace_s = 10, 2, 0.5
  speeds = bench_hetero.learner_speeds((), 4)
  assert speeds == pytest.approx((1 / 1.18, 1 / 1.18, 1.0, 1.0))
  sim_all, lockstep = bench_hetero.simulated(config, "all", speeds, 0.1, 0.05, 0.005, repeats=1)
  assert lockstep == pytest.approx(statistics.fmean([min(speeds) / v for v in speeds]))
  assert abs(sim_all - lockstep) < 0.02
  sim_k1, _ = bench_hetero.simulated(config, "k1grace", speeds, 0.1, 0.05, 0.005, repeats=1)
  assert sim_k1 > 0.99
  assert bench_hetero.learner_speeds(((0.5, 1), (1.0, 3)), 4) == (0.5, 1.0, 1.0, 1.0)
  result = {"all": {"goodput": 0.92, "sim_goodput": 0.923, "eval_loss": 2.0, "rx_mib": 10.0},
            "k1grace": {"goodput": 0.99, "sim_goodput": 1.0, "eval_loss": 2.01, "rx_mib": 14.0}}
  assert all(bench_hetero.goals(result).values())
  result["k1grace"]["eval_loss"], result["k1grace"]["rx_mib"] = 2.03, 16.0
  goals = bench_hetero.goals(result)
  assert not goals["k1grace_loss_within_1pct_of_k_all"] and not goals["downlink_within_1.5x_of_k_all"]
  json.dumps(bench_hetero.goals(result))

"""`bench chaos`: Poisson failures, and the simulator configs of a shipped config."""

import json

import numpy as np
import pytest

from diloco_jax.tools.bench import chaos as bench_chaos
from diloco_jax.tools.chaos import job as chaos_job
from diloco_jax.tools.sim import goodput as sim_goodput


def test_poisson_failures_for_the_benchmark():
  events = bench_chaos.failure_schedule(0, 3, 40.0, 10.0, horizon_s=40_000)
  gaps = np.diff([0.0] + [e.at_s for e in events])
  assert 0.9 * 40 < gaps.mean() < 1.1 * 40 and len(events) > 900
  assert {e.target for e in events} == {0, 1, 2} and all(e.kind == "learner_kill" for e in events)
  assert events[:5] == bench_chaos.failure_schedule(0, 3, 40.0, 10.0, horizon_s=40_000)[:5]


def test_simulator_configs_of_the_shipped_config(tiny_config):
  """The simulator gets the run's real settings, `outer.max_in_flight = 0` (the schedule's need) resolved as
  the learners resolve it, and both configurations simulate."""
  assert tiny_config.outer.max_in_flight == 0
  chaos_job.chaos_config_argv(tiny_config, [], 6)
  sims = bench_chaos.sim_configs(
      tiny_config, 6, 15.0, dp={"restart_cost_s": 3.0}, diloco={"learner_restart_cost_s": 5.0},
      diloco_ref={"step_time_s": 0.1}, dp_ref={"window_s": 100.0, "steps_in_window": 1000}, repair_s=10.0)
  o = tiny_config.outer
  assert sims["diloco"].max_in_flight == -(-o.tau * o.num_fragments // o.sync_every) + 1 >= 1
  assert sims["diloco"].learners == 6 and sims["dp"].restart_s == 13.0
  for cfg in sims.values():
    result = sim_goodput.simulate(cfg, repeats=1, seed=0)
    assert 0.0 < result.goodput <= 1.0


def test_a_reused_reference_of_another_budget_is_refused_before_anything_runs(tmp_path, capsys):
  reference = tmp_path / "bench_chaos.json"
  reference.write_text(json.dumps({"reference_run": {"steps": 3000, "learners": 6}}))
  with pytest.raises(SystemExit) as e:
    bench_chaos.bench_chaos(["bench chaos", "--config=configs/tiny_cpu.py", "--config.train.steps=1500",
                             f"--diloco-reference={reference}", f"--workdir={tmp_path / 'w'}"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "--diloco-reference" in err and "3000 steps" in err and "1500" in err
  assert not (tmp_path / "w" / "diloco").exists()


def test_the_prediction_at_the_failure_rate_a_run_took_is_the_simulator_at_that_rate(tiny_config):
  """Failures drawn for a target already down are skipped: fewer taken than drawn gives a longer mean time
  between them and a higher simulated goodput than the nominal one; a run that took none gets no figure."""
  chaos_job.chaos_config_argv(tiny_config, [], 6)  # sets the checkpoint interval a chaos run uses
  sims = bench_chaos.sim_configs(
      tiny_config, 6, 15.0, dp={"restart_cost_s": 3.0}, diloco={"learner_restart_cost_s": 5.0},
      diloco_ref={"step_time_s": 0.1}, dp_ref={"window_s": 100.0, "steps_in_window": 1000}, repair_s=10.0)
  result = {"learners": 6, "diloco": {"provisioned_learner_s": 6 * 180.0, "failures": 6},
            "dp": {"window_s": 300.0, "failures": 10}}
  assert bench_chaos.applied_mtbf_s(result) == {"diloco": 30.0, "dp": 30.0}
  at_applied = bench_chaos.predicted_at_applied_rate(sims, result, repeats=3, seed=0)
  for k in ("diloco", "dp"):
    nominal = sim_goodput.simulate(sims[k], repeats=3, seed=0).goodput
    assert at_applied[k] > nominal
  result["dp"]["failures"] = 0
  assert bench_chaos.predicted_at_applied_rate(sims, result, repeats=1, seed=0)["dp"] is None

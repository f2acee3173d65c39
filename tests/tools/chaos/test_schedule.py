"""The chaos command's pieces: fault schedules, the timeline measures; and (slow) a whole chaos run."""

import json
import subprocess
import sys

import numpy as np
import pytest

import helpers
from diloco_jax.tools.chaos import history as chaos_history
from diloco_jax.tools.chaos import job as chaos_job
from diloco_jax.tools.chaos import schedule as chaos_schedule
from diloco_jax.runs import local as launch_local
from diloco_jax.tools.bench import chaos as bench_chaos
from diloco_jax.tools.sim import goodput as sim_goodput


@pytest.mark.parametrize("seed", range(40))
def test_standard_schedule_holds_every_fault_one_learner_fault_at_a_time(seed):
  events = chaos_schedule.standard_schedule(seed, 3, 120.0)
  assert events == chaos_schedule.standard_schedule(seed, 3, 120.0)  # seeded
  kinds = [e.kind for e in events]
  assert sorted(kinds) == sorted(chaos_schedule.KINDS)
  learner = [e for e in events if e.kind in chaos_schedule.LEARNER_KINDS]
  assert len({e.target for e in learner}) == 3
  ends = {"learner_kill": 25.0, "learner_stop": 23.0, "learner_cutoff": 13.0}
  for a, b in zip(learner, learner[1:]):
    assert b.at_s >= a.at_s + ends[a.kind]  # never two learners faulty at once
  syncer = [e for e in events if e.kind.startswith("syncer")]
  assert syncer[1].at_s - syncer[0].at_s >= chaos_schedule.SETTLE_S
  kill = next(e for e in events if e.kind == "learner_kill")
  for e in syncer:
    assert not kill.at_s - chaos_schedule.SETTLE_S < e.at_s < kill.at_s + 25.0
    assert 2 <= e.duration_s <= 5


def test_schedule_files_are_checked(tmp_path):
  path = tmp_path / "s.json"
  path.write_text(json.dumps([{"at_s": 5, "kind": "syncer_kill", "duration_s": 2},
                              {"at_s": 1, "kind": "learner_stop", "target": 2, "duration_s": 3}]))
  events = chaos_schedule.load_schedule(str(path), 3)
  assert [e.kind for e in events] == ["learner_stop", "syncer_kill"] and events[0].target == 2
  for bad, match in (([{"at_s": 1, "kind": "reboot"}], "kind"),
                     ([{"at_s": 1, "kind": "learner_kill", "target": 3}], "target"),
                     ([{"at_s": -1, "kind": "syncer_kill"}], "finite"),
                     ([{"at_s": 1, "kind": "syncer_kill", "when": 3}], "expected an object"),
                     ({"at_s": 1}, "JSON list")):
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match) as e:
      chaos_schedule.load_schedule(str(path), 3)
    assert "--schedule" in str(e.value)


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


def test_timeline_measures(tmp_path):
  assert chaos_history.monotone([[0, 0], [1, 0], [1, 2]]) and not chaos_history.monotone([[0, 3], [1, 2]])
  timeline = [(1.0, [0, 0]), (2.0, [1, 0]), (2.5, [1, 0]), (6.0, [1, 1])]
  assert chaos_history.advance_times(timeline) == [2.0, 6.0]
  # [0, 10]: gaps 2, 4, 4; excluding [3, 5] the middle one is 2.
  assert chaos_history.longest_gap([2.0, 6.0], 0.0, 10.0) == 4.0
  assert chaos_history.longest_gap([2.0, 6.0], 0.0, 10.0, [(3.0, 5.0), (7.0, 10.0)]) == 2.0
  assert chaos_history.value_at([(1.0, 10.0), (3.0, 20.0)], 2.0) == 10.0
  assert chaos_history.value_at([(1.0, 10.0)], 0.5) == 0
  # Learner 0 up, stopped 5-10, up; learner 1 up until it finished at 8: nobody trains during 8-10.
  states = {0: [[0, 5, "up"], [5, 10, "stopped"], [10, 20, "up"]], 1: [[0, 20, "up"]]}
  assert chaos_history.idle_intervals(states, [20, 8], 0, 20) == [(8, 10)]
  # A restarted learner counts from its first step record, not from its process start.
  states = {0: [[0, 5, "up"], [5, 8, "dead"], [8, 20, "up"]]}
  assert chaos_history.idle_intervals(states, [20], 0, 20, [[(1.0, 10), (12.0, 110)]]) == [(5, 12.0)]
  learner = tmp_path / "learner_0"
  learner.mkdir()
  records = [{"time": t, "step": s} for t, s in ((1, 10), (2, 20), (3, 30), (4, 40), (9, 30), (10, 40))]
  (learner / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{cut")
  # Died after logging step 40, resumed from the checkpoint at 20 (first record 30): steps 20-40 twice.
  assert chaos_history.redone_steps(learner, 10) == 20
  assert chaos_history.first_done([learner], 40) == 4


@pytest.mark.slow
def test_chaos_command_runs_a_schedule_of_every_fault(tmp_path):
  """The whole command on a small run: every kind of fault, a finished run, monotone versions, nothing
  lost, a report and a timeline."""
  schedule = tmp_path / "schedule.json"
  schedule.write_text(json.dumps([
      {"at_s": 2, "kind": "learner_stop", "target": 0, "duration_s": 6},
      {"at_s": 3, "kind": "syncer_kill", "duration_s": 1},
      {"at_s": 20, "kind": "learner_kill", "target": 1, "duration_s": 2},
      {"at_s": 45, "kind": "learner_cutoff", "target": 2, "duration_s": 4},
      {"at_s": 47, "kind": "syncer_term", "duration_s": 1},
  ]))
  workdir = tmp_path / "chaos"
  argv = [sys.executable, "-m", "diloco_jax", "chaos", *helpers.shipped_overrides(steps=1500, learners=3),
          "--learners", "3", "--schedule", str(schedule), "--workdir", str(workdir),
          "--config.emulation.min_step_s=0.05", "--eval-batches", "3"]
  proc = subprocess.run(argv, cwd=helpers.REPO, env=launch_local.child_env(1), capture_output=True, text=True,
                        timeout=1800)
  report = json.loads((workdir / "report.json").read_text())
  assert report["finished"] and report["versions_monotone"], proc.stderr[-4000:]
  assert all(report["faults_applied"][k] == 1 for k in chaos_schedule.KINDS), report["faults_applied"]
  assert report["contributions"]["lost"] == 0 and report["checks"]["restarts_back_within_30s"]
  assert (workdir / "timeline.png").stat().st_size > 10_000
  assert "goodput" in proc.stdout and proc.returncode in (0, 1)
  # Both final models evaluated on --eval-batches, not the config's few.
  assert report["eval_batches"] == report["reference_run"]["eval_batches"] == 3
  # --summarize only reads reports: no --config needed.
  table = subprocess.run([sys.executable, "-m", "diloco_jax", "chaos", "--summarize", str(workdir / "report.json")],
                         cwd=helpers.REPO, capture_output=True, text=True, timeout=120)
  rows = [line for line in table.stdout.splitlines() if line.startswith("| ")]  # the header and one report
  assert table.returncode == 0 and len(rows) == 2 and rows[1].startswith("| 0 | yes"), table.stderr[-2000:]

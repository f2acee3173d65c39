"""(slow) A whole chaos run: the launcher's processes under a schedule of every fault."""

import json
import subprocess
import sys

import pytest

import helpers
from diloco_jax.runs import children as run_children
from diloco_jax.tools.chaos import schedule as chaos_schedule


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
  proc = subprocess.run(argv, cwd=helpers.REPO, env=run_children.child_env(1), capture_output=True, text=True,
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

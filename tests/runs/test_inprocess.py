"""Decoupled DiLoCo end to end, in one process: learners on device slices with the syncer core."""

import json
import threading

import jax
import numpy as np
import pytest

import helpers
from diloco_jax import commands
from diloco_jax import config as config_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.runs import inprocess
from diloco_jax.syncer import build


def test_one_learner_every_step_full_outer_step_equals_plain_training(tiny_config, tmp_path):
  """M=1, H=1, P=1, outer lr 1, momentum 0, fp32, tau=0: each round sets the global model to the
  learner's parameters, so training is exactly the inner optimizer's."""
  c = tiny_config
  c.learners.num, c.learners.devices = 1, 2
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 1, 1, 0
  c.outer.lr, c.outer.momentum = 1.0, 0.0
  c.outer.codec = c.outer.downlink_codec = "fp32"
  c.outer.min_quorum, c.outer.max_grace_s = 1, 0.0
  steps = 6
  devices = jax.devices()[:2]

  plain = trainer_lib.MeshTrainer(c, devices, None, batch_size=c.data.global_batch)
  for _ in range(steps):
    plain.train_step()

  job = inprocess.InProcessRun(c, None, devices=devices)
  learner, core = job.learners[0], job.core
  learner.join()
  for _ in range(steps):
    learner.train_step()
  job.close()
  assert core.status()["versions"] == [steps]
  assert learner.stats.adopted == steps
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               plain.state.params, learner.trainer.state.params)
  # And the outer loop did move the parameters through the syncer: the global model equals them too.
  global_params = build.global_params(core, learner.plan, jax.tree.map(np.asarray, plain.state.params))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, np.asarray(b), rtol=1e-5, atol=1e-6),
               global_params, plain.state.params)


def test_four_learners_on_two_device_slices_lower_the_eval_loss(tiny_config, tmp_path):
  # The shipped tiny_cpu config, unchanged: with its default merge safety (claim bounds, the norm-outlier
  # check, idempotency), no legitimate push is refused, early, late or flushed.
  c = tiny_config
  summary = inprocess.run(c, str(tmp_path), quiet=True)
  assert len(summary["learners"]) == 4
  assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 1.0, summary
  assert summary["outer_rounds"] >= 2 * c.outer.num_fragments  # the global model advanced
  assert summary["contributions_merged"] >= 4
  assert summary["contributions_rejected"] == 0
  assert all(x["bytes_sent"] > 0 and x["bytes_received"] > 0 for x in summary["learners"])
  assert all(x["adopt_lag_steps"] >= c.outer.tau > 0 for x in summary["learners"])  # adopted mid-run, overlapped
  assert summary["tokens"] == c.train.steps * c.data.global_batch * c.data.seq_len
  # Nothing lost: after the final flush every learner's every token reached the global model.
  assert summary["tokens_merged"] == summary["tokens"]


def test_a_learner_that_crashes_leaves_and_the_others_finish(tiny_config, tmp_path, monkeypatch):
  """K = M, two learners: learner 1 fails at step 3. It leaves the quorum at once, so learner 0 (which
  would otherwise wait for learner 1's pushes at every round and in its final flush) finishes, and the
  run reports learner 1's error instead of hanging."""
  c = tiny_config
  c.learners.num, c.learners.devices = 2, 1
  c.train.steps, c.train.eval_every, c.outer.sync_every = 12, 1000, 4
  c.outer.min_quorum = 0
  real_step = loop_lib.Learner.train_step
  both_joined = threading.Barrier(2, timeout=120)  # each learner joins before its first step

  def failing(self):
    if self.trainer.step == 0:  # neither trains before both joined: learner 0 has learner 1 to wait for
      both_joined.wait()
    if self.learner_id == 1 and self.trainer.step == 3:
      raise RuntimeError("learner 1 broke")
    real_step(self)

  monkeypatch.setattr(loop_lib.Learner, "train_step", failing)
  with pytest.raises(RuntimeError, match="learner 1 broke"):
    inprocess.run(c, str(tmp_path), quiet=True)
  records = [json.loads(line) for line in (tmp_path / "syncer" / "rounds.jsonl").read_text().splitlines()]
  # Rounds went on without learner 1: in every fragment, the last round holding learner 0's push holds only
  # it. (Not "the last round is learner 0's": a push learner 1 made before its crash may still arrive after
  # learner 0's last one, its first encode compiling on a cold cache; it is honest work, merged in a round of
  # its own: seen once in a clean-clone CI run.)
  for p in range(c.outer.num_fragments):
    with_0 = [r["contributors"] for r in records if r["fragment"] == p and 0 in r["contributors"]]
    assert with_0 and with_0[-1] == [0], (p, records)


def test_a_front_loaded_learner_syncs_on_its_schedule_and_no_push_is_refused(tiny_config, monkeypatch):
  # The shipped tiny_cpu outer loop (int4 both ways, P = 2, tau = 2, the outlier check on) with the
  # front-loaded schedule: the learner snapshots each fragment exactly at the plan's steps, as many times
  # as periodically, and the syncer accepts every push, short early ones and long late ones.
  c = tiny_config
  c.learners.num, c.learners.devices = 1, 2
  c.outer.sync_schedule = "front_loaded"
  job = inprocess.InProcessRun(c, None, devices=jax.devices()[:2])
  learner, core = job.learners[0], job.core
  snapshots = []
  real_snapshot = learner._snapshot
  monkeypatch.setattr(learner, "_snapshot", lambda p, step: (snapshots.append((p, step)), real_snapshot(p, step)))
  learner.join()
  for _ in range(c.train.steps):
    learner.train_step()
  scheduled = sorted((step, p) for p, steps in enumerate(learner.plan.sync_steps) for step in steps)
  assert sorted((step, p) for p, step in snapshots) == scheduled
  assert [len(s) for s in learner.plan.sync_steps] == [6, 6]  # 60 steps / H = 10, as periodic
  assert learner.plan.sync_steps[0][0] == 2 and learner.plan.longest_gap > c.outer.sync_every
  learner.flush()
  job.close()
  assert core.counters["contributions_rejected"] == 0
  assert core.counters["contributions_accepted"] == len(snapshots)


def test_train_on_a_workdir_of_another_config_is_one_line_and_writes_nothing(tiny_config, tmp_path, capsys):
  workdir = tmp_path / "run"
  tiny_config.learners.num = 2  # another run: learners.num enters the fingerprint
  config_lib.save_resolved(tiny_config, workdir, inprocess.RUN_ID)
  before = {p.name: p.read_bytes() for p in workdir.iterdir()}
  with pytest.raises(SystemExit) as e:
    commands.main(["python -m diloco_jax", "train", "--config", str(helpers.REPO / "configs" / "tiny_cpu.py"),
                   "--workdir", str(workdir)])
  assert e.value.code == 2
  lines = [line for line in capsys.readouterr().err.splitlines() if "fake CPU devices" not in line]
  assert len(lines) == 1 and lines[0].startswith(f"error: {workdir} holds a run of another config"), lines
  assert "use a new --workdir" in lines[0]
  assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before

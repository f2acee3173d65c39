"""The inner trainer: the loss falls, and a resumed run equals an uninterrupted one."""

import jax
import numpy as np

from diloco_jax import metrics
from diloco_jax.runs import baseline


def test_tiny_baseline_loss_falls(tiny_config, tmp_path):
  tiny_config.train.steps = 40
  tiny_config.train.eval_every = 40
  summary = baseline.run(tiny_config, str(tmp_path), quiet=True)
  records = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert records[0]["step"] == 0 and records[-1]["step"] == 40
  first, last = summary["initial_eval_loss"], summary["final_eval_loss"]
  assert first > 5.0  # about ln(256) = 5.55 for an untrained byte model
  assert last < first - 1.5, (first, last)
  assert records[-1]["loss"] < records[1]["loss"]
  assert summary["tokens"] == 40 * tiny_config.data.global_batch * tiny_config.data.seq_len
  assert summary["comm_bytes"] == metrics.ring_allreduce_bytes(summary["params"], 8) * 40
  assert (tmp_path / "summary.json").exists()


def _final_params(config, workdir):
  t = baseline.make_trainer(config, str(workdir))
  t.restore()
  params = jax.tree.map(np.asarray, t.state.params)
  step = t.step
  t.close()
  return params, step


def test_resume_equals_straight_run(tiny_config, tmp_path):
  tiny_config.train.steps = 12
  tiny_config.train.log_every = 4
  tiny_config.train.eval_every = 12
  baseline.run(tiny_config, str(tmp_path / "straight"), quiet=True)
  # Half the run with the same config (the lr schedule depends on train.steps), checkpoint, stop; then a
  # fresh process-like start on the same workdir resumes and finishes.
  resumed_dir = tmp_path / "resumed"
  t = baseline.make_trainer(tiny_config, str(resumed_dir))
  for _ in range(6):
    t.train_step()
  t.save()
  t.close()
  del t
  baseline.run(tiny_config, str(resumed_dir), quiet=True)
  straight, s1 = _final_params(tiny_config, tmp_path / "straight")
  resumed, s2 = _final_params(tiny_config, resumed_dir)
  assert s1 == s2 == 12
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), straight, resumed)

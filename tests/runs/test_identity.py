"""Decoupled DiLoCo reduces exactly to data-parallel training when its outer loop is switched off.

M learners with H = 1, P = 1, tau = 0, outer lr 1, momentum 0 and fp32 both ways average their parameters
after every inner step. With plain SGD as the inner optimizer (no clipping: the update is linear in the
gradient) the average of the M learners' steps is one SGD step on the mean of their gradients, and the
mean of M equal-sized batch means is the mean over their concatenation: the data-parallel SGD step on that
global batch. The baseline reads its batches with `data.baseline_order = "learner_shards"` (the default),
so its batch at step s is exactly the learners' batches of step s side by side; both runs go through the
real commands' code (`baseline.run`, `inprocess.run`: the syncer core, its merges and Nesterov step, the
in-process transport, the learners' snapshots and adoptions). Any future gap between the two is therefore
the inner optimizer's or the outer loop's, never the plumbing's.
"""

import jax
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax import metrics
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.runs import baseline, inprocess


def _averaging_every_step(c, optimizer: str):
  c.train.optimizer = optimizer
  c.train.grad_clip = 0.0
  c.train.steps = 12
  c.train.warmup_steps = 3
  c.train.log_every = 1
  c.train.eval_every = 6
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 1, 1, 0
  c.outer.lr, c.outer.momentum = 1.0, 0.0
  c.outer.codec = c.outer.downlink_codec = "fp32"
  c.outer.min_quorum = 0
  # Every round must hold all M learners: a learner compiling or evaluating makes no progress for longer
  # than the default stall bound, and the round would close without it (right for a run, not for an
  # identity of the arithmetic).
  c.outer.stall_s = 600.0
  return c


def _losses(path):
  return {r["step"]: r["loss"] for r in metrics.read_jsonl(path) if "loss" in r}


def test_learners_averaged_every_step_with_sgd_are_data_parallel_sgd(tiny_config, tmp_path):
  c = _averaging_every_step(tiny_config, "sgd")
  c.train.lr = 0.5  # plain SGD needs a larger step than AdamW to move visibly in 12 steps
  dp = baseline.run(c, str(tmp_path / "dp"), quiet=True)
  dl = inprocess.run(c, str(tmp_path / "diloco"), quiet=True)
  assert dl["outer_rounds"] == c.train.steps  # one merge per step: the outer loop really ran

  # The trajectory: at every step the data-parallel loss on the global batch is the mean of the learners'
  # losses on their quarters (each computed on the parameters the previous merge produced).
  dp_losses = _losses(tmp_path / "dp" / "metrics.jsonl")
  learner_losses = [_losses(tmp_path / "diloco" / f"learner_{k}" / "metrics.jsonl") for k in range(4)]
  assert sorted(dp_losses) == list(range(1, c.train.steps + 1))
  for step, loss in dp_losses.items():
    mean = np.mean([losses[step] for losses in learner_losses])
    np.testing.assert_allclose(mean, loss, rtol=2e-5, err_msg=f"step {step}")
  assert dp_losses[c.train.steps] < dp_losses[1] - 0.5  # and training did move

  # The end point: the syncer's global model scores as the data-parallel model, and every learner holds
  # the data-parallel parameters (it adopted the last merge).
  np.testing.assert_allclose(dl["final_eval_loss"], dp["final_eval_loss"], rtol=1e-5)
  dp_params = _restored_params(baseline.make_trainer(c, str(tmp_path / "dp")))
  for k in range(4):
    learner = trainer_lib.MeshTrainer(c, jax.devices()[2 * k:2 * k + 2], str(tmp_path / "diloco" / f"learner_{k}"),
                                      batch_size=c.data.global_batch // 4, num_shards=4, shard_index=k,
                                      train_cfg=config_lib.resolve(c).learners.inner)
    learner_params = _restored_params(learner)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), learner_params, dp_params)


def test_with_adamw_the_same_run_is_not_data_parallel(tiny_config, tmp_path):
  """The control: the same plumbing with AdamW inside departs from the data-parallel trajectory (each
  learner normalizes its update by its own second moment), so the identity above is the optimizer's
  linearity, not a test that cannot fail."""
  c = _averaging_every_step(tiny_config, "adamw")
  baseline.run(c, str(tmp_path / "dp"), quiet=True)
  inprocess.run(c, str(tmp_path / "diloco"), quiet=True)
  dp_losses = _losses(tmp_path / "dp" / "metrics.jsonl")
  learner_losses = [_losses(tmp_path / "diloco" / f"learner_{k}" / "metrics.jsonl") for k in range(4)]
  last = c.train.steps
  np.testing.assert_allclose(np.mean([losses[1] for losses in learner_losses]), dp_losses[1], rtol=2e-5)  # same start
  assert abs(np.mean([losses[last] for losses in learner_losses]) - dp_losses[last]) > 1e-3


def _restored_params(t: trainer_lib.MeshTrainer):
  """The parameters of the latest checkpoint in the trainer's workdir."""
  assert t.restore() and t.step == 12
  params = jax.tree.map(np.asarray, t.state.params)
  t.close()
  return params

"""The inner optimizer's settings: the learners' own section, its validation, the optimizer choice, and the
baseline's batches built from the learners' shards."""

import jax
import numpy as np
import optax
import pytest

from diloco_jax import config as config_lib
from diloco_jax.compute import inner
from diloco_jax.data import pipeline as data


def test_learners_inner_overrides_train_field_by_field(tiny_config):
  c = tiny_config
  c.learners.inner.lr = 1e-2
  c.learners.inner.grad_clip = 0.0
  t = config_lib.resolve(c).learners.inner
  assert t.lr == 1e-2 and t.grad_clip == 0.0
  for field in ("b1", "b2", "eps", "weight_decay", "optimizer", "steps"):
    assert t[field] == c.train[field]
  assert c.train.lr != 1e-2  # the baseline's section is untouched


@pytest.mark.parametrize("field,value", [("lr", -1.0), ("b2", 1.0), ("eps", -1e-8), ("optimizer", "lion"),
                                         ("warmup_steps", 10_000), ("grad_clip", -1.0)])
def test_a_bad_learner_override_names_its_field(tiny_config, field, value):
  tiny_config.learners.inner[field] = value
  with pytest.raises(config_lib.ConfigError, match=rf"config\.learners\.inner\.{field}:"):
    config_lib.validate(tiny_config, learners=True)
  config_lib.validate(tiny_config, learners=False)  # the baseline does not use it


def test_a_bad_train_field_names_train(tiny_config):
  tiny_config.train.b2 = 1.5
  with pytest.raises(config_lib.ConfigError, match=r"config\.train\.b2:"):
    config_lib.validate(tiny_config, learners=False)


def test_sgd_is_plain_sgd_and_clipping_off_at_zero(tiny_config):
  t = tiny_config.train
  t.optimizer, t.grad_clip, t.weight_decay, t.warmup_steps, t.lr = "sgd", 0.0, 0.0, 0, 0.5
  tx = inner.make_optimizer(t)
  params = {"w": jax.numpy.ones((2, 2)), "b": jax.numpy.ones((2,))}
  grads = {"w": jax.numpy.full((2, 2), 10.0), "b": jax.numpy.full((2,), -4.0)}  # norm well above 1
  updates, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(updates["w"], -0.5 * 10.0)
  np.testing.assert_allclose(updates["b"], -0.5 * -4.0)
  t.grad_clip = 1.0
  tx = inner.make_optimizer(t)
  updates, _ = tx.update(grads, tx.init(params), params)
  assert float(optax.tree.norm(updates)) == pytest.approx(0.5)


def test_baseline_batches_are_the_learners_batches_side_by_side(tiny_config):
  c = tiny_config.data
  m = tiny_config.learners.num
  dp = data.baseline_iterator(c, num_learners=m, seed=3)
  shards = [data.train_iterator(c, batch_size=c.global_batch // m, num_shards=m, shard_index=k, seed=3)
            for k in range(m)]
  for _ in range(3):
    np.testing.assert_array_equal(next(dp)["tokens"], np.concatenate([next(s)["tokens"] for s in shards]))
  # Its state restores the position of every shard.
  state = dp.get_state()
  expected = next(dp)["tokens"]
  again = data.baseline_iterator(c, num_learners=m, seed=3)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["tokens"], expected)
  with pytest.raises(ValueError, match="shard states"):
    data.baseline_iterator(c, num_learners=2, seed=3).set_state(state)


def test_baseline_batches_follow_learners_of_different_sizes(tiny_config):
  """Learners with 1 and 3 devices read 4 and 12 sequences per step from their shards: the baseline's
  batch is those side by side, and shares that do not add up to the global batch are refused."""
  c = tiny_config.data
  dp = data.baseline_iterator(c, num_learners=2, seed=3, batches=[4, 12])
  shards = [data.train_iterator(c, batch_size=b, num_shards=2, shard_index=k, seed=3) for k, b in enumerate((4, 12))]
  for _ in range(2):
    np.testing.assert_array_equal(next(dp)["tokens"], np.concatenate([next(s)["tokens"] for s in shards]))
  with pytest.raises(data.ConfigError, match="global_batch"):
    data.baseline_iterator(c, num_learners=2, seed=3, batches=[4, 8])


def test_shuffled_baseline_order_is_one_shuffle_of_all_windows(tiny_config):
  c = tiny_config.data
  c.baseline_order = "shuffled"
  dp = data.baseline_iterator(c, num_learners=4, seed=3)
  plain = data.train_iterator(c, batch_size=c.global_batch, seed=3)
  np.testing.assert_array_equal(next(dp)["tokens"], next(plain)["tokens"])


def test_learner_shards_order_needs_the_batch_to_split(tiny_config):
  tiny_config.data.global_batch = 18
  with pytest.raises(config_lib.ConfigError, match=r"config\.data\.global_batch:"):
    config_lib.validate(tiny_config, learners=False)
  tiny_config.data.baseline_order = "shuffled"
  config_lib.validate(tiny_config, learners=False)

"""The outer Nesterov step: by hand, against optax, and its momentum from old and new checkpoints."""

import jax
import numpy as np
import optax
import pytest

from diloco_jax.outer import merge as outer
from diloco_jax.outer import nesterov
from diloco_jax.tools.bench import outer_reference


def test_nesterov_matches_hand_recurrence():
  lr, mu = 0.7, 0.9
  tx = outer_reference.make_outer_optimizer(lr, mu)
  rng = np.random.default_rng(2)
  theta = rng.standard_normal(33).astype(np.float32)
  state = outer_reference.init_outer_state(tx, theta)
  ref_theta, m = theta.astype(np.float64), np.zeros(33)
  for _ in range(3):
    g = rng.standard_normal(33).astype(np.float32)
    theta, state = outer_reference.outer_step(tx, theta, state, g)
    m = mu * m + g
    ref_theta = ref_theta - lr * (g + mu * m)
    assert theta.dtype == np.float32
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-5)
  # The momentum survives a numpy round trip (what checkpoints store).
  restored = outer_reference.state_from_numpy(tx, theta, outer_reference.state_to_numpy(state))
  g = np.ones(33, np.float32)
  a, _ = outer_reference.outer_step(tx, theta, state, g)
  b, _ = outer_reference.outer_step(tx, theta, restored, g)
  np.testing.assert_array_equal(a, b)


def test_lr1_momentum0_is_plain_overwrite():
  tx = outer_reference.make_outer_optimizer(1.0, 0.0)
  glob = np.arange(16, dtype=np.float32) / 8
  local = glob - np.arange(16, dtype=np.float32)[::-1] / 64
  state = outer_reference.init_outer_state(tx, glob)
  new, _ = outer_reference.outer_step(tx, glob, state, outer.outer_gradient(glob, local))
  np.testing.assert_array_equal(new, local)


@pytest.mark.parametrize("lr,mu", [(0.7, 0.9), (0.8, 0.5), (1.0, 0.0)])
def test_numpy_nesterov_matches_optax_to_float32_rounding(lr, mu):
  """`delayed_nesterov_step_`'s plain step (numpy, in place) against optax's sgd(nesterov=True), jitted: XLA
  contracts each multiply-add into a fused multiply-add, numpy rounds twice, so the two agree to an ulp or two
  a step."""
  tx = outer_reference.make_outer_optimizer(lr, mu)
  rng = np.random.default_rng(3)
  theta = rng.standard_normal(4099).astype(np.float32)
  state = outer_reference.init_outer_state(tx, theta)
  mine, momentum = theta.copy(), np.zeros_like(theta)
  for step in range(5):
    g = (rng.standard_normal(theta.size) * 0.1).astype(np.float32)
    theta, state = outer_reference.outer_step(tx, theta, state, g)
    g_before = g.copy()
    nesterov.delayed_nesterov_step_(mine, momentum, g, lr, mu)
    np.testing.assert_array_equal(g, g_before)  # the gradient is kept
    # Each of the three roundings is within half an ulp of the operands' magnitude (|theta|, |g| ~ 1).
    np.testing.assert_allclose(mine, theta, rtol=0, atol=(step + 1) * 4 * 2.0**-24 * np.abs(theta).max())
    assert (mine == theta).mean() > 0.5  # mostly bitwise equal: the formulas are the same
    np.testing.assert_allclose(momentum, jax.tree.leaves(state)[0], rtol=1e-6, atol=1e-7)
  if mu == 0.0 and lr == 1.0:  # nothing to contract: bitwise
    np.testing.assert_array_equal(mine, theta)


def test_momentum_from_old_and_new_checkpoints():
  tx = optax.sgd(learning_rate=0.7, momentum=0.9, nesterov=True)  # what older syncers stepped with
  theta = np.arange(5, dtype=np.float32)
  state = tx.init(theta)
  updates, state = tx.update(np.ones(5, np.float32), state, theta)
  old_entry = outer_reference.state_to_numpy(state)  # what syncer checkpoints held before: optax's state tree
  m = outer.momentum_from_state(old_entry, 5)
  np.testing.assert_array_equal(m, jax.tree.leaves(state)[0])
  assert m.flags.writeable and m.dtype == np.float32
  np.testing.assert_array_equal(outer.momentum_from_state(m, 5), m)
  # As a checkpoint restores it: named tuples as plain ones, in any nesting; None holds no array.
  np.testing.assert_array_equal(outer.momentum_from_state({"opt": [None, tuple(map(tuple, old_entry))]}, 5), m)
  with pytest.raises(ValueError, match="elements"):
    outer.momentum_from_state(m, 6)
  with pytest.raises(ValueError, match="arrays"):
    outer.momentum_from_state((m, m), 5)

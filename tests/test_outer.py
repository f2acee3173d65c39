"""Outer math: merge rules against their formulas, the Nesterov outer step against a hand recurrence."""

import numpy as np
import pytest

from diloco_jax import outer


def test_outer_gradient():
  base = np.array([1.0, 2.0, 3.0], np.float32)
  local = np.array([0.5, 2.5, 3.0], np.float32)
  np.testing.assert_array_equal(outer.outer_gradient(base, local), [0.5, -0.5, 0.0])
  with pytest.raises(ValueError):
    outer.outer_gradient(base, local[:2])


def test_raw_weight_rules():
  tokens, steps = [100, 300, 50], [10, 20, 1]
  np.testing.assert_allclose(outer.raw_weights(tokens, steps, "tokens"), tokens)
  np.testing.assert_allclose(outer.raw_weights(tokens, steps, "tokens_sq_per_step"),
                             [100**2 / 10, 300**2 / 20, 50**2 / 1])
  np.testing.assert_allclose(outer.raw_weights(tokens, steps, "uniform"), [1, 1, 1])
  np.testing.assert_allclose(outer.raw_weights([0], [0], "tokens_sq_per_step"), [0])  # no 0/0
  with pytest.raises(ValueError, match="outer.merge"):
    outer.raw_weights(tokens, steps, "median")
  with pytest.raises(ValueError, match=">= 0"):
    outer.raw_weights([-1], [1])


def test_merge_coefficients_are_shares_of_the_period_with_the_discount_kept():
  tokens = np.array([100.0, 300.0, 50.0])
  # The round answers for learners whose periods weigh 450 together: a full round, the weighted mean.
  np.testing.assert_allclose(outer.merge_coefficients(tokens, 450.0, 3), tokens / 450)
  # Part of the learners (k of n, equal periods): each push moves the model by its share, 1/n.
  np.testing.assert_allclose(outer.merge_coefficients([100.0], 400.0, 4), [0.25])
  # A learner with two periods in one round: both count in full (summed, not averaged).
  np.testing.assert_allclose(outer.merge_coefficients([100.0, 100.0, 100.0], 200.0, 2), [0.5, 0.5, 0.5])
  stale, beta = [0, 1, 3], 0.5
  np.testing.assert_allclose(outer.merge_coefficients(tokens, 450.0, 3, stale, beta),
                             tokens / 450 * (1.0 + np.array(stale))**-beta)
  # A lone stale push keeps its discount: nothing renormalizes it back to full weight.
  for b in (0.0, 1.0, 4.0):
    np.testing.assert_allclose(outer.merge_coefficients([100.0], 100.0, 1, [1], b), [2.0**-b])
  # No tokens reported anywhere: 1 / learners each (a closed round still moves the model).
  np.testing.assert_allclose(outer.merge_coefficients([0.0, 0.0], 0.0, 4), [0.25, 0.25])
  with pytest.raises(ValueError):
    outer.merge_coefficients([1.0], 1.0, 1, [-1])


def test_merge_weighted_sum():
  rng = np.random.default_rng(0)
  deltas = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
  w = np.array([0.2, 0.3, 0.5])
  expected = sum(wi * d.astype(np.float64) for wi, d in zip(w, deltas))
  np.testing.assert_allclose(outer.merge(deltas, w), expected, rtol=1e-5, atol=1e-6)
  # Coefficients are used as given: a quarter share moves a quarter as far.
  np.testing.assert_allclose(outer.merge(deltas, w / 4), expected / 4, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError):
    outer.merge(deltas, [0.1, np.nan, 0.2])


def test_merge_rda_formula():
  rng = np.random.default_rng(1)
  deltas = [rng.standard_normal(64).astype(np.float32) * s for s in (1.0, 3.0, 0.5)]
  w = np.array([1.0, 2.0, 1.0])
  wn = w / w.sum()
  norms = np.array([np.linalg.norm(d.astype(np.float64)) for d in deltas])
  radial = (wn * norms).sum()
  direction = sum(wi * d / n for wi, d, n in zip(wn, deltas, norms))
  expected = radial * direction / np.linalg.norm(direction)
  got = outer.merge(deltas, wn, rda=True)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # Homogeneous in the coefficients, like the plain sum.
  np.testing.assert_allclose(outer.merge(deltas, wn / 4, rda=True), expected / 4, rtol=1e-5, atol=1e-6)
  # The merged norm is the weighted mean norm, unlike the plain mean of near-orthogonal vectors.
  np.testing.assert_allclose(np.linalg.norm(got), radial, rtol=1e-5)
  # Four near-orthogonal deltas of equal norm: the plain mean shrinks by about 1/2, RDA does not.
  ortho = [rng.standard_normal(4096).astype(np.float32) for _ in range(4)]
  mean_norm = np.mean([np.linalg.norm(d) for d in ortho])
  assert np.linalg.norm(outer.merge(ortho, [0.25] * 4)) < 0.6 * mean_norm
  np.testing.assert_allclose(np.linalg.norm(outer.merge(ortho, [0.25] * 4, rda=True)), mean_norm, rtol=1e-4)
  # Identical deltas: RDA equals the plain mean.
  same = [deltas[0]] * 3
  np.testing.assert_allclose(outer.merge(same, wn, rda=True), deltas[0], rtol=1e-5)


def test_nesterov_matches_hand_recurrence():
  lr, mu = 0.7, 0.9
  tx = outer.make_outer_optimizer(lr, mu)
  rng = np.random.default_rng(2)
  theta = rng.standard_normal(33).astype(np.float32)
  state = outer.init_outer_state(tx, theta)
  ref_theta, m = theta.astype(np.float64), np.zeros(33)
  for _ in range(3):
    g = rng.standard_normal(33).astype(np.float32)
    theta, state = outer.outer_step(tx, theta, state, g)
    m = mu * m + g
    ref_theta = ref_theta - lr * (g + mu * m)
    assert theta.dtype == np.float32
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-5)
  # The momentum survives a numpy round trip (what checkpoints store).
  restored = outer.state_from_numpy(tx, theta, outer.state_to_numpy(state))
  g = np.ones(33, np.float32)
  a, _ = outer.outer_step(tx, theta, state, g)
  b, _ = outer.outer_step(tx, theta, restored, g)
  np.testing.assert_array_equal(a, b)


def test_lr1_momentum0_is_plain_overwrite():
  tx = outer.make_outer_optimizer(1.0, 0.0)
  glob = np.arange(16, dtype=np.float32) / 8
  local = glob - np.arange(16, dtype=np.float32)[::-1] / 64
  new, _ = outer.outer_step(tx, glob, outer.init_outer_state(tx, glob), outer.outer_gradient(glob, local))
  np.testing.assert_array_equal(new, local)

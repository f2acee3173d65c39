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


def test_merge_weight_rules():
  tokens, steps = [100, 300, 50], [10, 20, 1]
  np.testing.assert_allclose(outer.merge_weights(tokens, steps, "tokens"), np.array(tokens) / 450)
  sq = np.array([100**2 / 10, 300**2 / 20, 50**2 / 1])
  np.testing.assert_allclose(outer.merge_weights(tokens, steps, "tokens_sq_per_step"), sq / sq.sum())
  np.testing.assert_allclose(outer.merge_weights(tokens, steps, "uniform"), [1 / 3] * 3)
  stale = [0, 1, 3]
  beta = 0.5
  raw = np.array(tokens) * (1.0 + np.array(stale))**-beta
  np.testing.assert_allclose(outer.merge_weights(tokens, steps, "tokens", stale, beta), raw / raw.sum())
  # beta 0: staleness changes nothing.
  np.testing.assert_allclose(outer.merge_weights(tokens, steps, "tokens", stale, 0.0), np.array(tokens) / 450)
  # All-zero tokens fall back to uniform.
  np.testing.assert_allclose(outer.merge_weights([0, 0], [0, 0], "tokens"), [0.5, 0.5])
  with pytest.raises(ValueError, match="outer.merge"):
    outer.merge_weights(tokens, steps, "median")


def test_merge_weighted_mean():
  rng = np.random.default_rng(0)
  deltas = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
  w = np.array([0.2, 0.3, 0.5])
  expected = sum(wi * d.astype(np.float64) for wi, d in zip(w, deltas))
  np.testing.assert_allclose(outer.merge(deltas, w), expected, rtol=1e-5, atol=1e-6)
  # Unnormalized weights are normalized.
  np.testing.assert_allclose(outer.merge(deltas, 10 * w), expected, rtol=1e-5, atol=1e-6)


def test_merge_rda_formula():
  rng = np.random.default_rng(1)
  deltas = [rng.standard_normal(64).astype(np.float32) * s for s in (1.0, 3.0, 0.5)]
  w = np.array([1.0, 2.0, 1.0])
  wn = w / w.sum()
  norms = np.array([np.linalg.norm(d.astype(np.float64)) for d in deltas])
  radial = (wn * norms).sum()
  direction = sum(wi * d / n for wi, d, n in zip(wn, deltas, norms))
  expected = radial * direction / np.linalg.norm(direction)
  got = outer.merge(deltas, w, rda=True)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  # The merged norm is the weighted mean norm, unlike the plain mean of near-orthogonal vectors.
  np.testing.assert_allclose(np.linalg.norm(got), radial, rtol=1e-5)
  # Four near-orthogonal deltas of equal norm: the plain mean shrinks by about 1/2, RDA does not.
  ortho = [rng.standard_normal(4096).astype(np.float32) for _ in range(4)]
  mean_norm = np.mean([np.linalg.norm(d) for d in ortho])
  assert np.linalg.norm(outer.merge(ortho, [1.0] * 4)) < 0.6 * mean_norm
  np.testing.assert_allclose(np.linalg.norm(outer.merge(ortho, [1.0] * 4, rda=True)), mean_norm, rtol=1e-4)
  # Identical deltas: RDA equals the plain mean.
  same = [deltas[0]] * 3
  np.testing.assert_allclose(outer.merge(same, w, rda=True), deltas[0], rtol=1e-5)


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

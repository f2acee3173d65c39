"""Outer merges (`outer/merge.py`): the merge rules against their formulas, and the syncer's fused round
(in place, in chunks) against the unfused functions."""

import jax
import numpy as np
import pytest

from diloco_jax.outer import codec, codec_kernels
from diloco_jax.outer import merge as outer
from diloco_jax.tools.bench import outer_reference


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


# ---- the fused merge path (the syncer's): in place, in chunks, against the unfused reference ----------


def _contributions(size, codec_name, block, count, seed=0):
  rng = np.random.default_rng(seed)
  scales = rng.uniform(0.01, 2.0, count)
  vecs = [(rng.standard_normal(size) * s).astype(np.float32) for s in scales]
  return [codec.encode(v, codec_name, block) for v in vecs]


@pytest.mark.parametrize("codec_name", codec.CODECS)
@pytest.mark.parametrize("rda", [False, True])
@pytest.mark.parametrize("size,block", [(70_001, 64), (3001, 7)])
def test_fused_round_matches_unfused_reference(codec_name, rda, size, block, monkeypatch):
  """`apply_round` (decode, weigh, sum and step chunk by chunk, in place) against decoding every payload,
  `merge`, scaling, and optax's step: equal to float32 rounding, and bitwise the same on 1 or 3 threads."""
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 4096)  # many chunks, and a ragged last one
  payloads = _contributions(size, codec_name, block, 4)
  decoded = [codec.decode(p, codec_name, size, block) for p in payloads]
  raw = outer.raw_weights([100, 250, 0, 75], [10, 10, 10, 5], "tokens_sq_per_step")
  weights = outer.merge_coefficients(raw, float(raw.sum()), 4, [0, 1, 0, 2], 0.5)
  weights = weights / weights.sum()  # `apply_round` normalizes; its `scale` says how far the round moves
  norms = [float(np.linalg.norm(d.astype(np.float64))) for d in decoded]
  np.testing.assert_allclose([np.sqrt(codec.sum_squares(codec.parse(p, codec_name, size, block)))
                              for p in payloads], norms, rtol=1e-12)
  tx = outer_reference.make_outer_optimizer(0.7, 0.9)
  rng = np.random.default_rng(1)
  theta0 = rng.standard_normal(size).astype(np.float32)
  ref_theta, ref_state = theta0, outer_reference.init_outer_state(tx, theta0)
  fused = {t: (theta0.copy(), np.zeros(size, np.float32)) for t in (1, 3)}
  for scale in (1.0, 0.75):  # two rounds: the second one steps with momentum
    merged = outer.merge(decoded, weights, rda=rda) * scale
    ref_theta, ref_state = outer_reference.outer_step(tx, ref_theta, ref_state, merged)
    for threads, (theta, momentum) in fused.items():
      outer.apply_round(theta, momentum, payloads, weights, codec_name=codec_name, block=block, lr=0.7, mu=0.9,
                        rda=rda, norms=norms, scale=scale, threads=threads)
  theta, momentum = fused[1]
  np.testing.assert_array_equal(theta, fused[3][0])
  np.testing.assert_array_equal(momentum, fused[3][1])
  ref_momentum = jax.tree.leaves(ref_state)[0]
  top = np.abs(ref_momentum).max()
  np.testing.assert_allclose(momentum, ref_momentum, rtol=1e-5, atol=1e-6 * top)
  np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-6 * np.abs(ref_theta).max())
  assert not np.array_equal(theta, theta0)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_delayed_nesterov_matches_the_optimizer(threads, monkeypatch):
  """Partial rounds through `apply_round` (the pending sum folded into the momentum vector, `share_after`)
  against the reference `outer_step` with the same shares: the global equals the optimizer's to float32 rounding, and
  the momentum vector holds the optimizer's momentum once a cycle closes, mu x it + the pending sum while
  one is open (quarter rounds, a carry beyond a full round, a full round after)."""
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 4096)
  size = 20_000
  rng = np.random.default_rng(5)
  tx = outer_reference.make_outer_optimizer(0.7, 0.9)
  theta0 = rng.standard_normal(size).astype(np.float32)
  ref_theta, ref_state = theta0, outer_reference.init_outer_state(tx, theta0)
  theta, momentum = theta0.copy(), np.zeros(size, np.float32)
  pending_share, opened, fulls = 0.0, False, []
  for share in (0.25, 0.25, 0.25, 0.25, 0.6, 0.6, 1.0, 0.3):
    payload = codec.encode((0.01 * rng.standard_normal(size)).astype(np.float32), "int8")
    merged = codec.decode(payload, "int8", size) * np.float32(share)
    ref_theta, ref_state = outer_reference.outer_step(tx, ref_theta, ref_state, merged, share)
    full, pending_share = outer.share_after(pending_share, share)
    result = outer.apply_round(theta, momentum, [payload], [1.0], codec_name="int8", block=64, lr=0.7, mu=0.9,
                               scale=share, threads=threads, opened=opened, full=full)
    assert result.applied
    opened = not full
    fulls.append(full)
    np.testing.assert_allclose(pending_share, float(ref_state.share), atol=1e-6)
    np.testing.assert_allclose(theta, ref_theta, rtol=1e-5, atol=1e-6 * np.abs(ref_theta).max())
    want = np.asarray(ref_state.trace) * np.float32(0.9) + np.asarray(ref_state.pending) if opened else ref_state.trace
    np.testing.assert_allclose(momentum, want, rtol=1e-5, atol=1e-6 * max(np.abs(momentum).max(), 1e-30))
  # Quarter rounds complete a full share on the 4th; 0.6 + 0.6 on the 2nd (0.2 carried); 1.0 at once.
  assert fulls == [False, False, False, True, False, True, True, False]


def test_fused_round_edge_cases():
  size = 1000
  zero = codec.encode(np.zeros(size, np.float32), "int4")
  other = codec.encode(np.linspace(-1, 1, size).astype(np.float32), "int4")
  theta, momentum = np.ones(size, np.float32), np.zeros(size, np.float32)
  # RDA over zero deltas only: no direction, a zero gradient (the momentum, 0, stays 0).
  outer.apply_round(theta, momentum, [zero, zero], [1, 1], codec_name="int4", block=64, lr=0.7, mu=0.9,
                    rda=True, norms=[0.0, 0.0])
  np.testing.assert_array_equal(theta, 1.0)
  # A zero weight contributes nothing: the same as leaving it out.
  a = (np.ones(size, np.float32), np.zeros(size, np.float32))
  b = (np.ones(size, np.float32), np.zeros(size, np.float32))
  outer.apply_round(*a, [other, zero], [1.0, 0.0], codec_name="int4", block=64, lr=0.7, mu=0.9)
  outer.apply_round(*b, [other], [1.0], codec_name="int4", block=64, lr=0.7, mu=0.9)
  np.testing.assert_array_equal(a[0], b[0])
  with pytest.raises(ValueError, match="weights"):
    outer.apply_round(theta, momentum, [other], [0.0], codec_name="int4", block=64, lr=0.7, mu=0.9)
  with pytest.raises(ValueError, match="one weight per payload"):
    outer.apply_round(theta, momentum, [other, other], [1.0], codec_name="int4", block=64, lr=0.7, mu=0.9)
  with pytest.raises(ValueError, match="writable float32"):
    outer.apply_round(theta.astype(np.float64), momentum, [other], [1.0], codec_name="int4", block=64, lr=0.7,
                      mu=0.9)
  with pytest.raises(codec.CodecError):
    outer.apply_round(theta, momentum, [other[:-1]], [1.0], codec_name="int4", block=64, lr=0.7, mu=0.9)


@pytest.mark.parametrize("threads", [1, 3])
def test_fused_round_is_all_or_nothing(threads, monkeypatch):
  """The in-place step writes only a result proven or checked finite: the same values whichever way, the
  new norms with them, and nothing at all when any chunk of the result would overflow."""
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 4096)
  size = 50_000
  rng = np.random.default_rng(3)
  theta0 = rng.standard_normal(size).astype(np.float32)
  momentum0 = (0.01 * rng.standard_normal(size)).astype(np.float32)
  vecs = [(0.01 * rng.standard_normal(size)).astype(np.float32) for _ in range(2)]
  payloads = [codec.encode(v, "int4") for v in vecs]
  norms = [codec.norm(codec.parse(p, "int4", size, 64)) for p in payloads]
  state_norms = (float(np.linalg.norm(theta0)), float(np.linalg.norm(momentum0)))
  kw = dict(codec_name="int4", block=64, lr=0.7, mu=0.9, norms=norms, threads=threads)
  proven = (theta0.copy(), momentum0.copy())
  checked = (theta0.copy(), momentum0.copy())
  r1 = outer.apply_round(*proven, payloads, [1.0, 2.0], state_norms=state_norms, **kw)
  r2 = outer.apply_round(*checked, payloads, [1.0, 2.0], **kw)  # no state norms: nothing to prove with
  assert r1.applied and not r1.checked and r2.applied and r2.checked
  np.testing.assert_array_equal(proven[0], checked[0])
  np.testing.assert_array_equal(proven[1], checked[1])
  assert not np.array_equal(proven[0], theta0)
  np.testing.assert_allclose([r1.global_norm, r1.momentum_norm],
                             [np.linalg.norm(proven[0].astype(np.float64)),
                              np.linalg.norm(proven[1].astype(np.float64))], rtol=1e-5)
  # A finite result beyond what the norms can prove (a huge global) is checked first, then written.
  big = theta0 * np.float32(1e37)
  big_state = (big.copy(), momentum0.copy())
  r3 = outer.apply_round(*big_state, payloads, [1.0, 2.0],
                         state_norms=(float(np.linalg.norm(big.astype(np.float64))), state_norms[1]), **kw)
  assert r3.applied and r3.checked and np.isfinite(big_state[0]).all()
  # Overflow in the last chunk only: nothing written, and what would have overflowed is named.
  hostile = vecs[0].copy()
  hostile[-10:] = 3e38
  bad = [codec.encode(hostile, "fp32")] * 2
  bad_norms = [codec.norm(codec.parse(bad[0], "fp32", size, 64))] * 2
  state = (theta0.copy(), momentum0.copy())
  r4 = outer.apply_round(*state, bad, [1.0, 1.0], codec_name="fp32", block=64, lr=0.7, mu=0.9, norms=bad_norms,
                         state_norms=state_norms, threads=threads)
  assert not r4.applied and r4.checked and "new global fragment" in r4.nonfinite
  np.testing.assert_array_equal(state[0], theta0)
  np.testing.assert_array_equal(state[1], momentum0)


def test_rda_reports_how_far_the_outer_gradients_point_one_way():
  """`coherence`: 1 for outer gradients in one direction, 1 / sqrt(2) for two orthogonal ones of equal
  weight (whatever their norms), 1 / sqrt(4) for four; NaN without RDA."""
  n = 256
  e = np.eye(4, n, dtype=np.float32)
  cases = (([e[0], 3 * e[0]], 1.0), ([e[0], 5 * e[1]], 1 / np.sqrt(2)), ([e[0], e[1], e[2], e[3]], 0.5))
  for vectors, expected in cases:
    payloads = [codec.encode(v, "fp32", 64) for v in vectors]
    norms = [float(np.linalg.norm(v)) for v in vectors]
    theta, momentum = np.zeros(n, np.float32), np.zeros(n, np.float32)
    result = outer.apply_round(theta, momentum, payloads, [1.0] * len(vectors), codec_name="fp32", block=64,
                               lr=1.0, mu=0.0, rda=True, norms=norms)
    assert result.coherence == pytest.approx(expected, rel=1e-6)
  plain = outer.apply_round(np.zeros(n, np.float32), np.zeros(n, np.float32), payloads, [1.0] * 4,
                            codec_name="fp32", block=64, lr=1.0, mu=0.0)
  assert np.isnan(plain.coherence)

"""Error feedback (outer/feedback.py): the residual is what the payloads have not carried yet, per fragment."""

import numpy as np

from diloco_jax.outer import codec
from diloco_jax.outer.feedback import ErrorFeedback


def test_payloads_plus_the_residual_add_up_to_the_gradients_sent():
  rng = np.random.default_rng(0)
  feedback = ErrorFeedback("int2", 16)
  grads = [rng.standard_normal(100).astype(np.float32) for _ in range(5)]
  carried = np.zeros(100, np.float64)
  for g in grads:
    carried += codec.decode(feedback.encode(0, g), "int2", 100, 16)
  residual = np.sum(grads, axis=0, dtype=np.float64) - carried
  assert abs(feedback.residual_norm(0) - np.linalg.norm(residual)) <= 1e-4 * np.linalg.norm(residual)
  assert feedback.residual_norm(1) == 0.0  # another fragment: untouched


def test_a_nonfinite_gradient_leaves_no_residual_and_a_resized_fragment_starts_afresh():
  feedback = ErrorFeedback("int2", 16)
  feedback.encode(0, np.linspace(-1, 1, 50, dtype=np.float32))
  assert feedback.residual_norm(0) > 0
  bad = np.ones(50, np.float32)
  bad[3] = np.nan
  feedback.encode(0, bad)  # the syncer refuses this push: nothing of it is carried on
  assert feedback.residual_norm(0) == 0.0
  feedback.encode(0, np.linspace(-1, 1, 50, dtype=np.float32))
  payload = feedback.encode(0, np.ones(30, np.float32))  # another size: the old residual cannot apply
  np.testing.assert_allclose(codec.decode(payload, "int2", 30, 16), 1.0)

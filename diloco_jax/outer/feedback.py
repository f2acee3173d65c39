"""Error feedback for the uplink: what a push's codec rounds away is carried into the next push.

A learner keeps, per fragment, the residual e of its last push: it sends Q(g + e) for its outer gradient g,
then keeps e <- g + e - decode(Q(g + e)) (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback
Fixes SignSGD"). Nothing is lost to the codec, only delayed: a coarse codec (int2) then costs little
quality. `outer.error_feedback`; docs/algorithm.md, "Codecs". The residual lives in host memory (one
float32 vector per fragment) and is not checkpointed: a learner that restarts starts from zero.
"""

from __future__ import annotations

import threading

import numpy as np

from diloco_jax.outer import codec as codec_lib


class ErrorFeedback:
  """Per-fragment residuals of one learner's pushes (thread-safe: fragments sync on a pool of workers)."""

  def __init__(self, codec: str, block: int):
    self.codec, self.block = codec, block
    self._residuals: dict[int, np.ndarray] = {}
    self._lock = threading.Lock()

  def encode(self, fragment: int, vec: np.ndarray) -> bytes:
    """The payload of `vec` plus the fragment's residual; the residual becomes what this payload misses."""
    vec = np.asarray(vec, np.float32).reshape(-1)
    with self._lock:
      residual = self._residuals.pop(fragment, None)
    target = vec + residual if residual is not None and residual.shape == vec.shape else vec.copy()
    sent = np.zeros_like(target)
    payload = codec_lib.encode_residual(target, sent, self.codec, self.block)
    target -= sent
    if np.isfinite(target).all():  # a non-finite push is refused by the syncer: do not carry it on
      with self._lock:
        self._residuals[fragment] = target
    return payload

  def residual_norm(self, fragment: int) -> float:
    """The L2 norm of what the fragment's pushes have not carried yet (0 before its first push)."""
    with self._lock:
      residual = self._residuals.get(fragment)
    return 0.0 if residual is None else float(np.linalg.norm(residual.astype(np.float64)))

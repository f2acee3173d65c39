"""The outer loop's math: outer gradients, merge rules, and the Nesterov outer optimizer.

Pure functions on flat float32 host vectors (one per fragment). Merging is numpy; the outer optimizer is
optax, jitted once per optimizer and run on the host CPU device, so the syncer never touches an
accelerator.

Merge weights (before normalization to sum 1), for a contribution with `tokens` tokens over `steps` inner
steps and staleness `s` (global versions it is behind):

    tokens:               w = tokens
    tokens_sq_per_step:   w = tokens^2 / steps     ("quantity x quality", Decoupled DiLoCo)
    uniform:              w = 1
    times the staleness discount (1 + s)^-beta   (beta = 0: no discount)

Merged outer gradient: the weighted mean `sum_i w_i v_i`, or with RDA (radial-directional averaging)
`(sum w |v|) * unit(sum w unit(v))` (weights normalized), which keeps the merged norm from shrinking like
1/sqrt(M) when the outer gradients are nearly orthogonal.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import numpy as np
import optax

MERGE_RULES = ("tokens", "tokens_sq_per_step", "uniform")


def outer_gradient(base: np.ndarray, local: np.ndarray) -> np.ndarray:
  """delta = base - local: the outer "gradient" of a learner's inner steps since it adopted `base`."""
  base = np.asarray(base, np.float32)
  local = np.asarray(local, np.float32)
  if base.shape != local.shape:
    raise ValueError(f"base {base.shape} and local {local.shape} fragments differ in shape")
  return base - local


def merge_weights(
    tokens: Sequence[float],
    steps: Sequence[float],
    rule: str = "tokens",
    staleness: Sequence[float] | None = None,
    beta: float = 0.0,
) -> np.ndarray:
  """Normalized merge weights (float64, summing to 1), see the module docstring.

  If every raw weight is 0 (e.g. all contributions report 0 tokens), the weights fall back to uniform
  (times the staleness discount): a round that closed should still move the model.
  """
  if rule not in MERGE_RULES:
    raise ValueError(f"outer.merge must be one of {MERGE_RULES}, got {rule!r}")
  tokens = np.asarray(tokens, np.float64)
  steps = np.asarray(steps, np.float64)
  if tokens.ndim != 1 or tokens.shape != steps.shape or tokens.size == 0:
    raise ValueError(f"tokens {tokens.shape} and steps {steps.shape} must be equal, non-empty 1-D")
  if (tokens < 0).any() or (steps < 0).any():
    raise ValueError("tokens and steps must be >= 0")
  if rule == "tokens":
    w = tokens.copy()
  elif rule == "tokens_sq_per_step":
    w = tokens**2 / np.maximum(steps, 1.0)  # 0 steps means 0 tokens too; avoid 0/0
  else:
    w = np.ones_like(tokens)
  discount = np.ones_like(tokens)
  if staleness is not None:
    staleness = np.asarray(staleness, np.float64)
    if staleness.shape != tokens.shape or (staleness < 0).any():
      raise ValueError(f"staleness must be >= 0 with shape {tokens.shape}, got {staleness}")
    discount = (1.0 + staleness)**-float(beta)
  w = w * discount
  if w.sum() <= 0:
    w = discount.copy()
  return w / w.sum()


def merge(deltas: Sequence[np.ndarray], weights: Sequence[float], rda: bool = False) -> np.ndarray:
  """The merged outer gradient (float32): the weighted mean of `deltas`, or its RDA form."""
  if len(deltas) == 0 or len(deltas) != len(weights):
    raise ValueError(f"need one weight per delta, got {len(deltas)} deltas and {len(weights)} weights")
  w = np.asarray(weights, np.float64)
  if (w < 0).any() or w.sum() <= 0:
    raise ValueError(f"weights must be >= 0 with a positive sum, got {w}")
  w = w / w.sum()
  shape = np.shape(deltas[0])
  for d in deltas:
    if np.shape(d) != shape:
      raise ValueError(f"deltas differ in shape: {shape} vs {np.shape(d)}")
  if not rda:
    out = np.zeros(shape, np.float32)
    for wi, d in zip(w, deltas):
      out += np.float32(wi) * np.asarray(d, np.float32)
    return out
  radial = 0.0
  direction = np.zeros(shape, np.float32)
  for wi, d in zip(w, deltas):
    d = np.asarray(d, np.float32)
    norm = float(np.linalg.norm(d.astype(np.float64)))
    radial += wi * norm
    if norm > 0:  # unit(0) = 0: a zero delta carries no direction
      direction += np.float32(wi / norm) * d
  dnorm = float(np.linalg.norm(direction.astype(np.float64)))
  if dnorm == 0:
    return np.zeros(shape, np.float32)
  return direction * np.float32(radial / dnorm)


def make_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformation:
  """The DiLoCo outer optimizer: SGD with Nesterov momentum (m = mu m + g; update = -lr (g + mu m))."""
  return optax.sgd(learning_rate=lr, momentum=momentum, nesterov=True)


def _cpu() -> jax.Device:
  return jax.devices("cpu")[0]


@functools.lru_cache(maxsize=32)
def _jitted_step(tx: optax.GradientTransformation):
  # One jitted function per optimizer (jax caches the compilation per shape); lru_cache keeps tx alive.
  def step(params, opt_state, grad):
    updates, opt_state = tx.update(grad, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(step)


def init_outer_state(tx: optax.GradientTransformation, global_vec: np.ndarray) -> Any:
  """The outer optimizer state for one fragment, on the host CPU device."""
  return tx.init(jax.device_put(np.asarray(global_vec, np.float32), _cpu()))


def outer_step(
    tx: optax.GradientTransformation, global_vec: np.ndarray, opt_state: Any, merged_delta: np.ndarray
) -> tuple[np.ndarray, Any]:
  """One outer step: the merged outer gradient is the optimizer's gradient. Returns the new global
  fragment (a float32 numpy array) and the new optimizer state (on the host CPU device)."""
  global_vec = np.asarray(global_vec, np.float32)
  merged_delta = np.asarray(merged_delta, np.float32)
  if global_vec.shape != merged_delta.shape:
    raise ValueError(f"global {global_vec.shape} and merged delta {merged_delta.shape} differ in shape")
  params, opt_state, grad = jax.device_put((global_vec, opt_state, merged_delta), _cpu())
  new_params, new_state = _jitted_step(tx)(params, opt_state, grad)
  return np.array(new_params, np.float32), new_state


def all_finite(tree: Any) -> bool:
  """Whether every leaf of `tree` (numpy or jax arrays, scalars) holds only finite values."""
  return all(bool(np.isfinite(np.asarray(x)).all()) for x in jax.tree.leaves(tree))


def state_to_numpy(opt_state: Any) -> Any:
  """The optimizer state with every array copied to a numpy array (for checkpoints)."""
  return jax.tree.map(lambda x: np.array(x), opt_state)


def state_from_numpy(tx: optax.GradientTransformation, global_vec: np.ndarray, saved: Any) -> Any:
  """An optimizer state of the structure `tx` builds for `global_vec`, with the leaves of `saved`."""
  template = init_outer_state(tx, global_vec)
  treedef = jax.tree.structure(template)
  leaves = jax.tree.leaves(saved)
  if len(leaves) != treedef.num_leaves:
    raise ValueError(f"saved outer state has {len(leaves)} arrays, the optimizer needs {treedef.num_leaves}")
  for got, want in zip(leaves, jax.tree.leaves(template)):
    if np.shape(got) != np.shape(want):
      raise ValueError(f"saved outer state array of shape {np.shape(got)}, expected {np.shape(want)}")
  return jax.device_put(jax.tree.unflatten(treedef, leaves), _cpu())


def participation(contributors: int, live_learners: int) -> float:
  """The share of the live learners a round merged: k / n, capped at 1 (a learner whose lease lapsed
  after it pushed still counts as a contributor).

  Scaling a round's merged outer gradient by it makes quorum K < M sound: when the M learners' pushes
  arrive in several rounds instead of one, their outer gradients still enter the outer optimizer with the
  same total weight (about 1), instead of each single-learner round taking a full Nesterov step.
  """
  if contributors <= 0:
    return 0.0
  return min(1.0, contributors / max(live_learners, 1))


def tokens_merged(fragment_tokens_merged: int, num_fragments: int) -> float:
  """Tokens whose work reached the global model. The syncer counts a contribution's tokens per fragment,
  so a learner's period of work is counted once for each of the P fragments it syncs: divide by P."""
  return fragment_tokens_merged / max(num_fragments, 1)

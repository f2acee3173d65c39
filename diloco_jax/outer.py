"""The outer loop's math: outer gradients, merge coefficients, and the Nesterov outer optimizer.

Pure functions on flat float32 host vectors (one per fragment). Merging is numpy; the outer optimizer is
optax, jitted once per optimizer and run on the host CPU device, so the syncer never touches an
accelerator.

A round merges pushes j (one period of one learner's work each: `tokens` tokens over `steps` inner steps,
based on a global version `s` behind) into one outer gradient

    merged = sum_j c_j v_j,     c_j = w_j / W * (1 + s_j)^-beta

with the rule's raw weight w_j (`raw_weights`):

    tokens:               w = tokens
    tokens_sq_per_step:   w = tokens^2 / steps     ("quantity x quality", Decoupled DiLoCo)
    uniform:              w = 1

and W the raw weight of one period of every learner the round answers for (the syncer's choice, see
`syncer/core.py`: every live learner, so that a round holding part of them moves the model by their share
of the work, or only the round's contributors, a plain weighted mean). A learner that pushes two periods
into one round has both merged, each with its own weight: its periods add up, they are not averaged. The
staleness discount multiplies the coefficient after that normalization, so it holds even for a lone stale
push. With RDA (radial-directional averaging) the merged vector is `(sum c |v|) * unit(sum c unit(v))`,
which keeps the merged norm from shrinking like 1/sqrt(M) when the outer gradients are nearly orthogonal.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
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


def raw_weights(tokens: Sequence[float], steps: Sequence[float], rule: str = "tokens") -> np.ndarray:
  """Each push's weight under `rule` before normalization (float64), see the module docstring."""
  if rule not in MERGE_RULES:
    raise ValueError(f"outer.merge must be one of {MERGE_RULES}, got {rule!r}")
  tokens = np.asarray(tokens, np.float64)
  steps = np.asarray(steps, np.float64)
  if tokens.ndim != 1 or tokens.shape != steps.shape:
    raise ValueError(f"tokens {tokens.shape} and steps {steps.shape} must be equal 1-D")
  if (tokens < 0).any() or (steps < 0).any():
    raise ValueError("tokens and steps must be >= 0")
  if rule == "tokens":
    return tokens.copy()
  if rule == "tokens_sq_per_step":
    return tokens**2 / np.maximum(steps, 1.0)  # 0 steps means 0 tokens too; avoid 0/0
  return np.ones_like(tokens)


def merge_coefficients(raw: Sequence[float], period_weight: float, learners: int,
                       staleness: Sequence[float] | None = None, beta: float = 0.0) -> np.ndarray:
  """The coefficients c_j = raw_j / period_weight * (1 + s_j)^-beta of a round's pushes (float64).

  `period_weight`: W, the raw weight of one period of each of the `learners` learners the round answers
  for. If it is 0 (no push reported any tokens), each push gets 1 / learners: a round that closed should
  still move the model. The discount is never renormalized away.
  """
  raw = np.asarray(raw, np.float64)
  if raw.ndim != 1 or raw.size == 0 or (raw < 0).any():
    raise ValueError(f"raw weights must be a non-empty 1-D array >= 0, got {raw}")
  if learners < 1:
    raise ValueError(f"a round answers for >= 1 learner, got {learners}")
  discount = np.ones_like(raw)
  if staleness is not None:
    staleness = np.asarray(staleness, np.float64)
    if staleness.shape != raw.shape or (staleness < 0).any():
      raise ValueError(f"staleness must be >= 0 with shape {raw.shape}, got {staleness}")
    discount = (1.0 + staleness)**-float(beta)
  if period_weight > 0:
    return raw / float(period_weight) * discount
  return discount / learners


def merge(deltas: Sequence[np.ndarray], coefficients: Sequence[float], rda: bool = False) -> np.ndarray:
  """The merged outer gradient (float32): `sum_j c_j v_j`, or its RDA form `(sum c|v|) unit(sum c unit(v))`.

  The coefficients are used as given (not renormalized): they already say how far the round moves.
  """
  if len(deltas) == 0 or len(deltas) != len(coefficients):
    raise ValueError(f"need one coefficient per delta, got {len(deltas)} deltas and {len(coefficients)}")
  c = np.asarray(coefficients, np.float64)
  if (c < 0).any() or not np.isfinite(c).all():
    raise ValueError(f"coefficients must be finite and >= 0, got {c}")
  shape = np.shape(deltas[0])
  for d in deltas:
    if np.shape(d) != shape:
      raise ValueError(f"deltas differ in shape: {shape} vs {np.shape(d)}")
  if not rda:
    out = np.zeros(shape, np.float32)
    for ci, d in zip(c, deltas):
      out += np.float32(ci) * np.asarray(d, np.float32)
    return out
  radial = 0.0
  direction = np.zeros(shape, np.float32)
  for ci, d in zip(c, deltas):
    d = np.asarray(d, np.float32)
    norm = float(np.linalg.norm(d.astype(np.float64)))
    radial += ci * norm
    if norm > 0:  # unit(0) = 0: a zero delta carries no direction
      direction += np.float32(ci / norm) * d
  dnorm = float(np.linalg.norm(direction.astype(np.float64)))
  if dnorm == 0:
    return np.zeros(shape, np.float32)
  return direction * np.float32(radial / dnorm)


class OuterState(NamedTuple):
  """The outer optimizer's state for one fragment."""

  trace: jax.Array  # the Nesterov momentum m
  pending: jax.Array  # the merged outer gradients since m last moved
  share: jax.Array  # the share of a full round they hold (a float32 scalar in [0, 1))


def make_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformationExtraArgs:
  """The DiLoCo outer optimizer, SGD with Nesterov momentum, with the momentum moved once per full round
  of work however many rounds that work arrives in.

  A round that holds a full round's share of the learners' work (`share` = 1: K = M, or any round when
  partial rounds are not scaled) takes the plain Nesterov step, m <- mu m + g, theta <- theta - lr (g +
  mu m). A partial round (share < 1, e.g. one learner of four under K = 1) applies its gradient part
  -lr g at once, and adds g to a pending sum; when the pending rounds add up to a full share, the
  momentum moves once with their sum, m <- mu m + sum g, and theta <- theta - lr mu m. So the outer
  trajectory does not depend on how a period of work is split into rounds: four quarter rounds move the
  model as one full round with their sum would, instead of decaying the momentum four times per period
  and amplifying every stale single-learner gradient through it (the momentum is where staleness hurts;
  delayed Nesterov momentum, as in asynchronous Local-SGD).
  """

  def init(params):
    return OuterState(jnp.zeros_like(params), jnp.zeros_like(params), jnp.zeros([], jnp.float32))

  def update(grads, state, params=None, *, share=1.0, **extra):
    del params, extra
    pending = state.pending + grads
    total = state.share + jnp.asarray(share, jnp.float32)
    full = total >= 1.0 - _SHARE_EPS
    trace = jnp.where(full, momentum * state.trace + pending, state.trace)
    updates = -lr * (grads + jnp.where(full, momentum * trace, jnp.zeros_like(trace)))
    carry = jnp.maximum(total - jnp.floor(total + _SHARE_EPS), 0.0)  # a share beyond a full round
    return updates, OuterState(trace, jnp.where(full, jnp.zeros_like(pending), pending),
                               jnp.where(full, carry, total))

  return optax.GradientTransformationExtraArgs(init, update)


_SHARE_EPS = 1e-4  # shares are sums of token ratios: 0.25 * 4 must count as a full round


def _cpu() -> jax.Device:
  return jax.devices("cpu")[0]


@functools.lru_cache(maxsize=32)
def _jitted_step(tx: optax.GradientTransformationExtraArgs):
  # One jitted function per optimizer (jax caches the compilation per shape); lru_cache keeps tx alive.
  def step(params, opt_state, grad, share):
    updates, opt_state = tx.update(grad, opt_state, params, share=share)
    return optax.apply_updates(params, updates), opt_state
  return jax.jit(step)


def init_outer_state(tx: optax.GradientTransformation, global_vec: np.ndarray) -> Any:
  """The outer optimizer state for one fragment, on the host CPU device."""
  return tx.init(jax.device_put(np.asarray(global_vec, np.float32), _cpu()))


def outer_step(
    tx: optax.GradientTransformationExtraArgs, global_vec: np.ndarray, opt_state: Any, merged_delta: np.ndarray,
    share: float = 1.0,
) -> tuple[np.ndarray, Any]:
  """One outer step: the merged outer gradient is the optimizer's gradient, `share` the share of a full
  round of work the round held (`make_outer_optimizer`). Returns the new global fragment (a float32 numpy
  array) and the new optimizer state (on the host CPU device)."""
  global_vec = np.asarray(global_vec, np.float32)
  merged_delta = np.asarray(merged_delta, np.float32)
  if global_vec.shape != merged_delta.shape:
    raise ValueError(f"global {global_vec.shape} and merged delta {merged_delta.shape} differ in shape")
  if not (np.isfinite(share) and share >= 0):
    raise ValueError(f"a round's share must be finite and >= 0, got {share}")
  params, opt_state, grad, share = jax.device_put((global_vec, opt_state, merged_delta, np.float32(share)), _cpu())
  new_params, new_state = _jitted_step(tx)(params, opt_state, grad, share)
  return np.array(new_params, np.float32), new_state


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


def tokens_merged(fragment_tokens_merged: int, num_fragments: int) -> float:
  """Tokens whose work reached the global model. The syncer counts a contribution's tokens per fragment,
  so a learner's period of work is counted once for each of the P fragments it syncs: divide by P."""
  return fragment_tokens_merged / max(num_fragments, 1)

"""The outer optimizer written with optax and jitted on the host CPU: the reference for the syncer's numpy
step (`outer/nesterov.py`, fused into `outer/merge.apply_round`), which the tests check against it and
`bench syncer`'s unfused baseline runs. The runtime never imports it (the syncer imports no jax).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.outer import merge


class OuterState(NamedTuple):
  """The outer optimizer's state for one fragment."""

  trace: jax.Array  # the Nesterov momentum m
  pending: jax.Array  # the merged outer gradients since m last moved
  share: jax.Array  # the share of a full round they hold (a float32 scalar in [0, 1))


def make_outer_optimizer(lr: float = 0.7, momentum: float = 0.9) -> optax.GradientTransformationExtraArgs:
  """The DiLoCo outer optimizer, SGD with Nesterov momentum, with the momentum moved once per full round
  of work however many rounds that work arrives in (the delayed Nesterov step of `outer/nesterov.py`).

  A round that holds a full round's share of the learners' work (`share` = 1: K = M, or any round when
  partial rounds are not scaled) takes the plain Nesterov step, m <- mu m + g, theta <- theta - lr (g +
  mu m). A partial round (share < 1) applies its gradient part -lr g at once, and adds g to a pending
  sum; when the pending rounds add up to a full share, the momentum moves once with their sum,
  m <- mu m + sum g, and theta <- theta - lr mu m.
  """

  def init(params):
    return OuterState(jnp.zeros_like(params), jnp.zeros_like(params), jnp.zeros([], jnp.float32))

  def update(grads, state, params=None, *, share=1.0, **extra):
    del params, extra
    pending = state.pending + grads
    total = state.share + jnp.asarray(share, jnp.float32)
    full = total >= 1.0 - merge.SHARE_EPS
    trace = jnp.where(full, momentum * state.trace + pending, state.trace)
    updates = -lr * (grads + jnp.where(full, momentum * trace, jnp.zeros_like(trace)))
    carry = jnp.maximum(total - jnp.floor(total + merge.SHARE_EPS), 0.0)  # a share beyond a full round
    return updates, OuterState(trace, jnp.where(full, jnp.zeros_like(pending), pending),
                               jnp.where(full, carry, total))

  return optax.GradientTransformationExtraArgs(init, update)


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
  """The optimizer state with every array copied to a numpy array (what checkpoints store)."""
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

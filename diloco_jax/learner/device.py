"""A learner's fragments on its devices (`DeviceFragments`): the base (the global fragments last adopted,
sharded like the parameters; the host only ever holds the fragments in flight) and the jitted per-fragment
functions that compute an outer gradient and adopt a merged global fragment, on the leaves that hold the
fragment's pieces only (docs/algorithm.md, "Learner", 3-4)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.protocol import messages as protocol


def take(leaf, shape, a: int, b: int):
  """The piece [a, b) of a leaf's flattened elements as a flat vector (whole rows sliced as rows)."""
  row = math.prod(shape[1:]) if len(shape) > 1 else 1
  if a == 0 and b == math.prod(shape):
    return leaf.reshape(-1)
  if a % row == 0 and b % row == 0:
    return leaf[a // row:b // row].reshape(-1)
  return leaf.reshape(-1)[a:b]


def put(leaf, shape, a: int, b: int, values):
  """`leaf` with the piece [a, b) of its flattened elements replaced by the flat `values`."""
  row = math.prod(shape[1:]) if len(shape) > 1 else 1
  if a == 0 and b == math.prod(shape):
    return values.reshape(shape)
  if a % row == 0 and b % row == 0:
    return leaf.at[a // row:b // row].set(values.reshape((b - a) // row, *shape[1:]))
  return leaf.reshape(-1).at[a:b].set(values).reshape(shape)


def fragment_fns(plan: fragments_lib.FragmentPlan, p: int, mesh, param_shardings):
  """Jitted (outer_gradient, {Kind.FULL: adopt, Kind.DELTA: adopt_delta}) for fragment p, on the leaves that
  hold its pieces only (`fragment_leaves`: a tuple in plan order; the rest of the state is not passed,
  so a call costs the fragment's leaves, not the model's).

  `outer_gradient(base, params)` -> the flat float32 vector base - params over the fragment's pieces.
  `adopt(params, base, global_vec, snapshot_vec, alpha, keep_progress)` -> (params, base) takes the new
  global fragment; `adopt_delta` takes the syncer's delta and rebuilds the global fragment as base + delta,
  one float32 add per element: the same IEEE operation as the syncer's numpy reference update, so the base
  stays bitwise equal to its reference. A fragment is a list of pieces of leaves (whole leaves unless the
  plan split them, `fragments.py`): each function reads and writes only its fragment's pieces.
  """
  pieces = plan.pieces(p)
  sizes = [b - a for _, _, a, b in pieces]
  replicated = mesh_lib.replicated(mesh)
  shardings = tuple(fragments_lib.flatten(param_shardings)[k] for k, *_ in pieces)

  def outer_gradient(base, params):
    return jnp.concatenate([(take(b, shape, lo, hi) - take(t, shape, lo, hi)).astype(jnp.float32)
                            for b, t, (_, shape, lo, hi) in zip(base, params, pieces)])

  def split(vec):
    return jnp.split(vec, np.cumsum(sizes)[:-1])

  def mix(params, base, new_global, snapshot_vec, alpha, keep_progress):
    # progress = theta - theta_snapshot, with theta_snapshot = base - snapshot_delta (old base).
    out_params, out_base = [], []
    for theta, old_base, (_, shape, lo, hi), v, snap in zip(params, base, pieces, new_global, split(snapshot_vec)):
      th, ob = take(theta, shape, lo, hi), take(old_base, shape, lo, hi)
      mixed = (alpha * th + (1.0 - alpha) * (v + keep_progress * (th - ob + snap))).astype(th.dtype)
      out_params.append(put(theta, shape, lo, hi, mixed))
      out_base.append(put(old_base, shape, lo, hi, v.astype(ob.dtype)))
    return tuple(out_params), tuple(out_base)

  def adopt(params, base, global_vec, snapshot_vec, alpha, keep_progress):
    return mix(params, base, split(global_vec), snapshot_vec, alpha, keep_progress)

  def adopt_delta(params, base, delta_vec, snapshot_vec, alpha, keep_progress):
    new_global = [take(b, shape, lo, hi).astype(jnp.float32) + d
                  for b, (_, shape, lo, hi), d in zip(base, pieces, split(delta_vec))]
    return mix(params, base, new_global, snapshot_vec, alpha, keep_progress)

  grad_fn = jax.jit(outer_gradient, in_shardings=(shardings, shardings), out_shardings=replicated)
  adopt_fns = {
      kind: jax.jit(fn, in_shardings=(shardings, shardings, replicated, replicated, None, None),
                    out_shardings=(shardings, shardings), donate_argnums=(0, 1))
      for kind, fn in ((protocol.Kind.FULL, adopt), (protocol.Kind.DELTA, adopt_delta))
  }
  return grad_fn, adopt_fns


class DeviceFragments:
  """The base of a learner's trainer and the jitted functions of each fragment of `plan`, applied to the
  trainer's parameters and the base."""

  def __init__(self, plan: fragments_lib.FragmentPlan, trainer: trainer_lib.MeshTrainer):
    self.plan, self._trainer = plan, trainer
    n = plan.num_fragments
    mesh, sh = trainer.mesh, trainer.shardings
    self._fns = [fragment_fns(plan, p, mesh, sh.params) for p in range(n)]
    keys = fragments_lib.leaf_keys(trainer.state.params)
    self._keys = [tuple(keys[k] for k in plan.paths[p]) for p in range(n)]
    # The base starts as a device copy of the initial parameters; the syncer starts from the same ones.
    self.base = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=sh.params)(trainer.state.params)
    # The snapshot of an adoption without one (joining, rebasing): no progress to keep.
    self.zeros = [jax.device_put(np.zeros(plan.size(p), np.float32), mesh_lib.replicated(mesh)) for p in range(n)]

  def outer_gradient(self, p: int) -> jax.Array:
    """base_p - theta_p, fragment p's outer gradient, as a flat float32 vector replicated on the mesh."""
    grad_fn, _ = self._fns[p]
    keys = self._keys[p]
    return grad_fn(fragments_lib.get_leaves(self.base, keys),
                   fragments_lib.get_leaves(self._trainer.state.params, keys))

  def adopt(self, p: int, kind: protocol.Kind, vec, snapshot: jax.Array, alpha: float, keep: float) -> None:
    """theta_p and base_p <- fragment p's adoption of `vec` (`fragment_fns`); `vec` (a host vector or a
    replicated array) goes to the devices as the jitted function's replicated argument."""
    _, adopt_fns = self._fns[p]
    state, keys = self._trainer.state, self._keys[p]
    params, base = adopt_fns[kind](fragments_lib.get_leaves(state.params, keys),
                                   fragments_lib.get_leaves(self.base, keys), vec, snapshot, alpha, keep)
    self.base = fragments_lib.set_leaves(self.base, keys, base)
    self._trainer.set_state(dataclasses.replace(state, params=fragments_lib.set_leaves(state.params, keys, params)))

  def rebase(self, p: int, vec) -> None:
    """base_p <- vec, theta unchanged: the fragment's full adopt with alpha = 1 (theta exactly kept), a
    function already compiled (a restart must not wait for a compilation while others may wait for us)."""
    self.adopt(p, protocol.Kind.FULL, vec, self.zeros[p], 1.0, 0.0)

"""A learner's fragments on its devices (`DeviceFragments`): the base (the global fragments last adopted,
sharded like the parameters) and the jitted per-fragment functions that compute an outer gradient and adopt
a merged global fragment, on the leaves that hold the fragment's pieces only (docs/algorithm.md, "Learner",
3-4). Every fragment-sized buffer on the devices (outer gradients in flight, the adopted global) is a tuple
of pieces, each sharded like the leaf it comes from (`piece_sharding`): a device holds its shard of a
fragment, never the whole vector (docs/architecture.md, "Memory")."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.protocol import messages as protocol


def _row(shape) -> int:
  return math.prod(shape[1:]) if len(shape) > 1 else 1


def piece_shape(shape, a: int, b: int) -> tuple[int, ...]:
  """The shape a piece [a, b) of a leaf's flattened elements has on the devices: the leaf's shape for the
  whole leaf, its rows for whole rows, else flat."""
  if a == 0 and b == math.prod(shape):
    return tuple(shape)
  row = _row(shape)
  if a % row == 0 and b % row == 0:
    return ((b - a) // row, *shape[1:])
  return (b - a,)


def piece_sharding(leaf_sharding, shape, a: int, b: int, mesh) -> NamedSharding:
  """The sharding of a piece (`piece_shape`): its leaf's partition, less the axes that do not divide the
  piece's dimensions; a flat piece of a leaf (neither whole nor whole rows) is replicated."""
  pshape = piece_shape(shape, a, b)
  if len(pshape) != len(shape):
    return mesh_lib.replicated(mesh)
  spec = tuple(leaf_sharding.spec) + (None,) * (len(pshape) - len(leaf_sharding.spec))
  kept = []
  for dim, axes in zip(pshape, spec):
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    kept.append(axes if dim % math.prod(mesh.shape[n] for n in names) == 0 else None)
  return NamedSharding(mesh, P(*kept))


def take(leaf, shape, a: int, b: int):
  """The piece [a, b) of a leaf's flattened elements, in its `piece_shape`."""
  pshape = piece_shape(shape, a, b)
  if pshape == tuple(shape):
    return leaf
  if len(pshape) == len(shape):
    return leaf[a // _row(shape):b // _row(shape)]
  return leaf.reshape(-1)[a:b]


def put(leaf, shape, a: int, b: int, values):
  """`leaf` with the piece [a, b) of its flattened elements replaced by `values` (in its `piece_shape`)."""
  pshape = piece_shape(shape, a, b)
  if pshape == tuple(shape):
    return values
  if len(pshape) == len(shape):
    return leaf.at[a // _row(shape):b // _row(shape)].set(values)
  return leaf.reshape(-1).at[a:b].set(values).reshape(shape)


def host_pieces(plan: fragments_lib.FragmentPlan, p: int, vec: np.ndarray) -> tuple[np.ndarray, ...]:
  """Fragment p's flat host vector as its pieces in their `piece_shape`s (views, no copies)."""
  out, start = [], 0
  for _, shape, a, b in plan.pieces(p):
    out.append(vec[start:start + b - a].reshape(piece_shape(shape, a, b)))
    start += b - a
  return tuple(out)


def fragment_fns(plan: fragments_lib.FragmentPlan, p: int, mesh, param_shardings):
  """Jitted (outer_gradient, {Kind.FULL: adopt, Kind.DELTA: adopt_delta}, zeros) for fragment p, on the
  leaves that hold its pieces only (`fragment_leaves`: a tuple in plan order; the rest of the state is not
  passed, so a call costs the fragment's leaves, not the model's).

  `outer_gradient(base, params)` -> the float32 pieces base - params of the fragment (`piece_shape`, each
  sharded like its leaf: `piece_sharding`).
  `adopt(params, base, global, snapshot, alpha, keep_progress)` -> (params, base) takes the new global
  fragment (pieces, or host arrays of the pieces' shapes); `adopt_delta` takes the syncer's delta and
  rebuilds the global fragment as base + delta, one float32 add per element: the same IEEE operation as
  the syncer's numpy reference update, so the base stays bitwise equal to its reference. `zeros()`: a
  fragment of zeros in the pieces' shardings (the snapshot of an adoption that keeps no progress), made
  when needed, never kept. A fragment is a list of pieces of leaves (whole leaves unless the plan split
  them, `fragments.py`): each function reads and writes only its fragment's pieces.
  """
  pieces = plan.pieces(p)
  leaf_shardings = tuple(fragments_lib.flatten(param_shardings)[k] for k, *_ in pieces)
  vec_shardings = tuple(piece_sharding(s, shape, lo, hi, mesh) for s, (_, shape, lo, hi) in zip(leaf_shardings, pieces))

  def outer_gradient(base, params):
    return tuple((take(b, shape, lo, hi) - take(t, shape, lo, hi)).astype(jnp.float32)
                 for b, t, (_, shape, lo, hi) in zip(base, params, pieces))

  def mix(params, base, new_global, snapshot, alpha, keep_progress):
    # progress = theta - theta_snapshot, with theta_snapshot = base - snapshot_delta (old base).
    out_params, out_base = [], []
    for theta, old_base, (_, shape, lo, hi), v, snap in zip(params, base, pieces, new_global, snapshot):
      th, ob = take(theta, shape, lo, hi), take(old_base, shape, lo, hi)
      mixed = (alpha * th + (1.0 - alpha) * (v + keep_progress * (th - ob + snap))).astype(th.dtype)
      out_params.append(put(theta, shape, lo, hi, mixed))
      out_base.append(put(old_base, shape, lo, hi, v.astype(ob.dtype)))
    return tuple(out_params), tuple(out_base)

  def adopt_delta(params, base, delta, snapshot, alpha, keep_progress):
    new_global = [take(b, shape, lo, hi).astype(jnp.float32) + d
                  for b, (_, shape, lo, hi), d in zip(base, pieces, delta)]
    return mix(params, base, new_global, snapshot, alpha, keep_progress)

  grad_fn = jax.jit(outer_gradient, in_shardings=(leaf_shardings, leaf_shardings), out_shardings=vec_shardings)
  adopt_fns = {
      kind: jax.jit(fn, in_shardings=(leaf_shardings, leaf_shardings, vec_shardings, vec_shardings, None, None),
                    out_shardings=(leaf_shardings, leaf_shardings), donate_argnums=(0, 1))
      for kind, fn in ((protocol.Kind.FULL, mix), (protocol.Kind.DELTA, adopt_delta))
  }
  shapes = tuple(piece_shape(shape, lo, hi) for _, shape, lo, hi in pieces)
  zeros = jax.jit(lambda: tuple(jnp.zeros(s, jnp.float32) for s in shapes), out_shardings=vec_shardings)
  return grad_fn, adopt_fns, zeros.lower().compile(), vec_shardings


class DeviceFragments:
  """The base of a learner's trainer and the jitted functions of each fragment of `plan`, applied to the
  trainer's parameters and the base."""

  def __init__(self, plan: fragments_lib.FragmentPlan, trainer: trainer_lib.MeshTrainer):
    self.plan, self._trainer = plan, trainer
    n = plan.num_fragments
    mesh, sh = trainer.mesh, trainer.shardings
    self._fns = [fragment_fns(plan, p, mesh, sh.params) for p in range(n)]
    # The sharding of each piece of each fragment on the devices (`piece_sharding`).
    self.shardings = [fns[3] for fns in self._fns]
    self.shapes = [tuple(piece_shape(shape, a, b) for _, shape, a, b in plan.pieces(p)) for p in range(n)]
    keys = fragments_lib.leaf_keys(trainer.state.params)
    self._keys = [tuple(keys[k] for k in plan.paths[p]) for p in range(n)]
    # The base starts as a device copy of the initial parameters; the syncer starts from the same ones.
    self.base = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=sh.params)(trainer.state.params)

  def outer_gradient(self, p: int) -> tuple[jax.Array, ...]:
    """base_p - theta_p, fragment p's outer gradient, as float32 pieces sharded like their leaves."""
    keys = self._keys[p]
    return self._fns[p][0](fragments_lib.get_leaves(self.base, keys),
                           fragments_lib.get_leaves(self._trainer.state.params, keys))

  def adopt(self, p: int, kind: protocol.Kind, vec, snapshot, alpha: float, keep: float) -> None:
    """theta_p and base_p <- fragment p's adoption of `vec` (`fragment_fns`): a flat host vector (each
    device receives its shards of it only) or the fragment's pieces on the devices (`multihost`'s
    broadcast). `snapshot`: the outer gradient pushed (pieces), or None for no progress to keep."""
    adopt_fns, zeros = self._fns[p][1], self._fns[p][2]
    if isinstance(vec, np.ndarray):
      vec = host_pieces(self.plan, p, np.asarray(vec, np.float32))
    if snapshot is None:
      snapshot = zeros()
    state, keys = self._trainer.state, self._keys[p]
    params, base = adopt_fns[kind](fragments_lib.get_leaves(state.params, keys),
                                   fragments_lib.get_leaves(self.base, keys), vec, snapshot, alpha, keep)
    self.base = fragments_lib.set_leaves(self.base, keys, base)
    self._trainer.set_state(dataclasses.replace(state, params=fragments_lib.set_leaves(state.params, keys, params)))

  def rebase(self, p: int, vec) -> None:
    """base_p <- vec, theta unchanged: the fragment's full adopt with alpha = 1 (theta exactly kept), a
    function already compiled (a restart must not wait for a compilation while others may wait for us)."""
    self.adopt(p, protocol.Kind.FULL, vec, None, 1.0, 0.0)

"""Fragment plans: which parameters travel together, and when each fragment is due.

The parameters (a nested dict pytree, e.g. flax nnx's pure dict; list indices may be int keys) are split
into P fragments. A learner syncs fragment p every H = `sync_every` inner steps, at the steps s with
`s % H == offsets[p]`; offsets are spread evenly over H (`round(p * H / P)`) so the network carries one
fragment at a time instead of the whole model at once (Streaming DiLoCo).

A leaf is named by its path, `"/".join(str(k) for k in keys)`, e.g. `"layers/0/attn/q/kernel"`.

Two plans:

* `strided`: transformer layer i (the path element after `"layers"`) goes to fragment `i % P`, so every
  fragment holds layers from the whole depth. Embeddings (and every other top-level group, e.g. rotary
  tables) go to fragment 0; the final norm and the output head (top-level keys starting with `"final"`,
  `"lm_head"` or `"head"`) go to fragment P - 1, so that both ends of the network do not sync together.
* `balanced`: whole groups (each layer, and each other top-level key) are bin-packed greedily by bytes,
  largest first, into the currently lightest fragment (ties: the lower fragment index; groups of equal
  size are taken in path order), which evens out the bytes per sync when the embedding is large.

Every leaf is in exactly one fragment, and no fragment may be empty: a P larger than the number of groups
raises ValueError naming `outer.num_fragments`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

PLANS = ("strided", "balanced")
_TAIL_PREFIXES = ("final", "lm_head", "head")


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
  """How the parameters split into fragments and when each fragment is due."""

  num_fragments: int
  sync_every: int
  paths: tuple[tuple[str, ...], ...]  # paths[p]: sorted leaf paths in fragment p
  shapes: tuple[tuple[tuple[int, ...], ...], ...]  # shapes[p][i]: the shape of paths[p][i]
  offsets: tuple[int, ...]  # offsets[p] in [0, sync_every)

  def size(self, p: int) -> int:
    """Number of float elements in fragment p (the length of its flat vector)."""
    return sum(math.prod(s) for s in self.shapes[p])

  def fragment_of(self, path: str) -> int:
    """The fragment that holds leaf `path` (KeyError if none)."""
    for p, paths in enumerate(self.paths):
      if path in paths:
        return p
    raise KeyError(path)


def _iter_leaves(tree: Any, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
  if isinstance(tree, Mapping):
    for k in tree:
      yield from _iter_leaves(tree[k], prefix + (k,))
  elif isinstance(tree, (list, tuple)) and not hasattr(tree, "shape"):
    for i, v in enumerate(tree):
      yield from _iter_leaves(v, prefix + (i,))
  else:
    yield prefix, tree


def _path_str(keys: tuple) -> str:
  return "/".join(str(k) for k in keys)


def flatten(params: Any) -> dict[str, Any]:
  """`{path: leaf}` of a nested dict pytree (a mapping already keyed by paths maps to itself)."""
  return {_path_str(keys): leaf for keys, leaf in _iter_leaves(params)}


def leaf_paths(params: Any) -> list[str]:
  """All leaf paths of `params`, sorted."""
  return sorted(flatten(params))


def _group(keys: tuple) -> tuple[str, int | None]:
  """The group a leaf belongs to: ("layers/i", i) for a layer's leaf, else (top-level key, None)."""
  strs = [str(k) for k in keys]
  for j, k in enumerate(strs[:-1]):
    if k == "layers" and strs[j + 1].lstrip("-").isdigit():
      return "/".join(strs[:j + 2]), int(strs[j + 1])
  return strs[0], None


def _shape(leaf: Any) -> tuple[int, ...]:
  return tuple(int(d) for d in (leaf.shape if hasattr(leaf, "shape") else np.shape(leaf)))


def _nbytes(leaf: Any) -> int:
  return math.prod(_shape(leaf)) * np.dtype(getattr(leaf, "dtype", np.float32)).itemsize


def make_plan(params: Any, num_fragments: int, sync_every: int, kind: str = "strided") -> FragmentPlan:
  """A fragment plan for `params` (arrays or `jax.ShapeDtypeStruct` leaves). See the module docstring."""
  if num_fragments < 1:
    raise ValueError(f"outer.num_fragments must be >= 1, got {num_fragments}")
  if sync_every < 1:
    raise ValueError(f"outer.sync_every must be >= 1, got {sync_every}")
  if num_fragments > sync_every:
    raise ValueError(f"outer.num_fragments ({num_fragments}) must be <= outer.sync_every ({sync_every}) "
                     "so that fragment offsets are distinct")
  if kind not in PLANS:
    raise ValueError(f"outer.fragment_plan must be one of {PLANS}, got {kind!r}")
  leaves = list(_iter_leaves(params))
  if not leaves:
    raise ValueError("params hold no leaves")
  groups: dict[str, list[tuple[str, Any]]] = {}
  layer_of: dict[str, int | None] = {}
  for keys, leaf in leaves:
    name, layer = _group(keys)
    groups.setdefault(name, []).append((_path_str(keys), leaf))
    layer_of[name] = layer

  P = num_fragments
  assign: dict[str, int] = {}
  if kind == "strided":
    for name, layer in layer_of.items():
      if layer is not None:
        assign[name] = layer % P
      elif name.startswith(_TAIL_PREFIXES):
        assign[name] = P - 1
      else:
        assign[name] = 0
  else:
    if P > len(groups):
      raise ValueError(f"outer.num_fragments ({P}) exceeds the {len(groups)} parameter groups "
                       f"(layers and top-level modules) that the balanced plan can spread")
    size = {name: sum(_nbytes(leaf) for _, leaf in members) for name, members in groups.items()}
    load = [0] * P
    # Largest first into the lightest bin: the classic LPT greedy, within 4/3 of the best split.
    for name in sorted(groups, key=lambda n: (-size[n], n)):
      p = min(range(P), key=lambda b: (load[b], b))
      assign[name] = p
      load[p] += size[name]

  by_fragment: list[dict[str, tuple[int, ...]]] = [{} for _ in range(P)]
  for name, members in groups.items():
    for path, leaf in members:
      by_fragment[assign[name]][path] = _shape(leaf)
  empty = [p for p in range(P) if not by_fragment[p]]
  if empty:
    raise ValueError(f"outer.num_fragments ({P}) is too large for the {kind} plan of these params: "
                     f"fragments {empty} would be empty")
  paths = tuple(tuple(sorted(f)) for f in by_fragment)
  shapes = tuple(tuple(f[path] for path in ps) for f, ps in zip(by_fragment, paths))
  offsets = tuple(int(round(p * sync_every / P)) for p in range(P))
  return FragmentPlan(num_fragments=P, sync_every=sync_every, paths=paths, shapes=shapes, offsets=offsets)


def due_fragments(plan: FragmentPlan, step: int) -> list[int]:
  """Fragments due at inner step `step` (steps counted from 1; step 0 is the initial state, never due)."""
  if step <= 0:
    return []
  phase = step % plan.sync_every
  return [p for p, o in enumerate(plan.offsets) if o == phase]


def gather(plan: FragmentPlan, params: Any, p: int) -> np.ndarray:
  """Fragment p of `params` (nested dict or `{path: array}`) as one flat float32 host vector, its leaves
  concatenated in plan order. jax arrays are copied to the host."""
  flat = flatten(params)
  out = np.empty(plan.size(p), np.float32)
  start = 0
  for path, shape in zip(plan.paths[p], plan.shapes[p]):
    leaf = np.asarray(flat[path])
    if leaf.shape != shape:
      raise ValueError(f"leaf {path} has shape {leaf.shape}, the fragment plan expects {shape}")
    n = leaf.size
    out[start:start + n] = leaf.reshape(-1)
    start += n
  return out


def scatter(plan: FragmentPlan, p: int, vec: np.ndarray) -> dict[str, np.ndarray]:
  """The inverse of `gather`: `{path: array}` for fragment p, reshaped views into `vec`."""
  vec = np.asarray(vec)
  if vec.ndim != 1 or vec.size != plan.size(p):
    raise ValueError(f"fragment {p} has {plan.size(p)} elements, got a vector of shape {vec.shape}")
  out, start = {}, 0
  for path, shape in zip(plan.paths[p], plan.shapes[p]):
    n = math.prod(shape)
    out[path] = vec[start:start + n].reshape(shape)
    start += n
  return out


def assemble(plan: FragmentPlan, vectors: Sequence[np.ndarray], template: Any) -> Any:
  """The parameters held by the P fragment `vectors` (the inverse of gathering every fragment), as a
  nested dict shaped like `template` (arrays or abstract shapes: every leaf is replaced)."""
  if len(vectors) != plan.num_fragments:
    raise ValueError(f"got {len(vectors)} fragment vectors, the plan has {plan.num_fragments} fragments")
  leaves = {}
  for p, vec in enumerate(vectors):
    leaves.update(scatter(plan, p, vec))
  return replace_leaves(template, leaves)


def replace_leaves(params: Any, updates: Mapping[str, Any]) -> Any:
  """A copy of the nested dict `params` with the leaves named in `updates` (`{path: value}`) replaced;
  the other leaves are shared, not copied."""
  def rec(tree, prefix):
    if isinstance(tree, Mapping):
      return {k: rec(v, prefix + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "shape"):
      return type(tree)(rec(v, prefix + (i,)) for i, v in enumerate(tree))
    return updates.get(_path_str(prefix), tree)
  missing = set(updates) - set(flatten(params))
  if missing:
    raise KeyError(f"no such leaves: {sorted(missing)}")
  return rec(params, ())

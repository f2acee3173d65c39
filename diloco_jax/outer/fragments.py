"""Fragment plans: which parameters travel together, as one flat float32 vector per fragment.

The parameters (a nested dict pytree, e.g. flax nnx's pure dict; list indices may be int keys) are split
into P fragments, each synced on its own schedule (`schedule.py`). A leaf is named by its path,
`"/".join(str(k) for k in keys)`, e.g. `"layers/0/attn/q/kernel"`.

Two plans (`make_plan` gives the rules, the splitting of fragments when P exceeds the layer groups too):
`strided` puts transformer layer i in fragment `i % P` (embeddings in fragment 0, the final norm and head
in P - 1); `balanced` bin-packs whole groups by bytes. A fragment is a list of pieces `(path, start, stop)`
of flattened leaves (`FragmentPlan.ranges`), whole leaves unless split; every element of every leaf is in
exactly one fragment. docs/algorithm.md, "Learner", 2. Due fragments.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from diloco_jax.outer import schedule

PLANS = ("strided", "balanced")
_TAIL_PREFIXES = ("final", "lm_head", "head")


@dataclasses.dataclass(frozen=True)
class FragmentPlan:
  """How the parameters split into fragments and when each fragment is due."""

  num_fragments: int
  sync_every: int
  paths: tuple[tuple[str, ...], ...]  # paths[p]: sorted leaf paths in fragment p
  shapes: tuple[tuple[tuple[int, ...], ...], ...]  # shapes[p][i]: the (whole) shape of paths[p][i]
  offsets: tuple[int, ...]  # offsets[p] in [0, sync_every)
  # ranges[p][i]: the (start, stop) of paths[p][i]'s flattened elements in fragment p (all of them unless
  # the leaf was split, see `make_plan`). Fragment p's vector: these pieces, in order.
  ranges: tuple[tuple[tuple[int, int], ...], ...] = ()
  # sync_steps[p]: the steps fragment p is due at, ascending, under a non-periodic schedule; () = periodic.
  sync_steps: tuple[tuple[int, ...], ...] = ()

  def __post_init__(self):
    if not self.ranges:  # whole leaves
      object.__setattr__(self, "ranges", tuple(tuple((0, math.prod(s)) for s in shapes) for shapes in self.shapes))

  @property
  def longest_gap(self) -> int:
    """The most inner steps one sync of a fragment covers under the schedule (H when periodic)."""
    if not self.sync_steps:
      return self.sync_every
    return max(max(schedule.gaps(steps)) for steps in self.sync_steps)

  def size(self, p: int) -> int:
    """Number of float elements in fragment p (the length of its flat vector)."""
    return sum(b - a for a, b in self.ranges[p])

  def pieces(self, p: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """Fragment p's pieces (path, whole leaf shape, start, stop), in the order of its vector."""
    return [(path, shape, a, b) for path, shape, (a, b) in zip(self.paths[p], self.shapes[p], self.ranges[p])]

  def fragments_of(self, path: str) -> list[int]:
    """The fragments that hold (a piece of) leaf `path`, in order."""
    return [p for p, paths in enumerate(self.paths) if path in paths]

  def fragment_of(self, path: str) -> int:
    """The fragment that holds leaf `path`, the first one if the leaf was split (KeyError if none)."""
    owners = self.fragments_of(path)
    if not owners:
      raise KeyError(path)
    return owners[0]


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


def plan_for_config(params: Any, config) -> FragmentPlan:
  """The run's fragment plan for `params` from `config.outer` (and `train.steps` for the schedule): the one
  learners, syncer and evaluator all build."""
  o = config.outer
  plan = make_plan(params, o.num_fragments, o.sync_every, o.fragment_plan)
  steps = schedule.schedule_steps(o.sync_schedule, int(config.train.steps), o.sync_every, plan.offsets,
                                  float(o.schedule_power), schedule.min_spacing(o.sync_schedule, o.sync_every,
                                                                                int(o.tau)))
  return dataclasses.replace(plan, sync_steps=steps) if steps else plan


def make_plan(params: Any, num_fragments: int, sync_every: int, kind: str = "strided") -> FragmentPlan:
  """A periodic fragment plan for `params` (arrays or `jax.ShapeDtypeStruct` leaves).

  * `strided`: transformer layer i (the path element after `"layers"`) goes to fragment `i % P`, so every
    fragment holds layers from the whole depth. Embeddings (and every other top-level group, e.g. rotary
    tables) go to fragment 0; the final norm and the output head (top-level keys starting with `"final"`,
    `"lm_head"` or `"head"`) go to fragment P - 1, so that both ends of the network do not sync together.
  * `balanced`: whole groups (each layer, and each other top-level key) are bin-packed greedily by bytes,
    largest first, into the currently lightest fragment (ties: the lower fragment index; groups of equal
    size are taken in path order), which evens out the bytes per sync when the embedding is large.

  Splitting. When the groups run out before P fragments (P = H, one fragment due every step, as Decoupled
  DiLoCo does, asks for more fragments than a model has layers), the plan takes the largest P' < P for which
  the rule above fills every fragment with at least half of the final mean (total / P / 2; else simply the
  largest P' it fills: no sliver such as a final norm alone keeps a sync slot to itself), then splits the
  largest fragment's flat vector in two (ties: the lower index; the cut at its middle element, moved to the
  nearest row boundary of the leaf it falls in when that leaves both halves non-empty) and puts the second
  half right after it, until there are P. A P that cannot be reached (more fragments than elements, or than
  `sync_every` allows) raises ValueError naming `outer.num_fragments`."""
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
  total = sum(math.prod(_shape(leaf)) for _, leaf in leaves)
  if num_fragments > total:
    raise ValueError(f"outer.num_fragments ({num_fragments}) exceeds the {total} parameters to split")
  by_fragment = _group_plan(leaves, num_fragments, kind)
  if by_fragment is None:  # split: start from the most whole-group fragments that are not slivers
    floor = total / num_fragments / 2
    plans = [plan for plan in (_group_plan(leaves, base, kind) for base in range(num_fragments - 1, 0, -1))
             if plan is not None]
    by_fragment = next((plan for plan in plans if min(_elements(f) for f in plan) >= floor), plans[0])
  frags = [[(path, shape, 0, math.prod(shape)) for path, shape in sorted(f.items())] for f in by_fragment]
  while len(frags) < num_fragments:
    sizes = [sum(b - a for *_, a, b in f) for f in frags]
    p = max(range(len(frags)), key=lambda i: (sizes[i], -i))
    frags[p:p + 1] = _split(frags[p], sizes[p])
  offsets = tuple(int(round(p * sync_every / num_fragments)) for p in range(num_fragments))
  return FragmentPlan(num_fragments=num_fragments, sync_every=sync_every,
                      paths=tuple(tuple(x[0] for x in f) for f in frags),
                      shapes=tuple(tuple(x[1] for x in f) for f in frags), offsets=offsets,
                      ranges=tuple(tuple((x[2], x[3]) for x in f) for f in frags))


def _elements(fragment: dict[str, tuple[int, ...]]) -> int:
  return sum(math.prod(shape) for shape in fragment.values())


def _split(pieces: list[tuple[str, tuple[int, ...], int, int]], size: int) -> list[list]:
  """A fragment's pieces cut in two at its middle element (moved to a row boundary of the leaf it falls in
  when both halves stay non-empty)."""
  cut = size // 2
  first, second, seen = [], [], 0
  for path, shape, a, b in pieces:
    n = b - a
    if seen + n <= cut:
      first.append((path, shape, a, b))
    elif seen >= cut:
      second.append((path, shape, a, b))
    else:
      at = a + cut - seen  # within the leaf's flat range (a, b)
      row = math.prod(shape[1:]) if len(shape) > 1 else 1
      aligned = a + round((at - a) / row) * row
      if a < aligned < b:
        at = aligned
      first.append((path, shape, a, at))
      second.append((path, shape, at, b))
    seen += n
  return [first, second]


def _group_plan(leaves: list[tuple[tuple, Any]], P: int, kind: str) -> list[dict[str, tuple[int, ...]]] | None:
  """{path: shape} per fragment under the strided or balanced rule with P fragments, or None if some
  fragment would be empty."""
  groups: dict[str, list[tuple[str, Any]]] = {}
  layer_of: dict[str, int | None] = {}
  for keys, leaf in leaves:
    name, layer = _group(keys)
    groups.setdefault(name, []).append((_path_str(keys), leaf))
    layer_of[name] = layer

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
      return None
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
  if any(not f for f in by_fragment):
    return None
  return by_fragment


def gather(plan: FragmentPlan, params: Any, p: int) -> np.ndarray:
  """Fragment p of `params` (nested dict or `{path: array}`) as one flat float32 host vector, its pieces
  concatenated in plan order. jax arrays are copied to the host."""
  flat = flatten(params)
  out = np.empty(plan.size(p), np.float32)
  start = 0
  for path, shape, a, b in plan.pieces(p):
    leaf = np.asarray(flat[path])
    if leaf.shape != shape:
      raise ValueError(f"leaf {path} has shape {leaf.shape}, the fragment plan expects {shape}")
    out[start:start + b - a] = leaf.reshape(-1)[a:b]
    start += b - a
  return out


def _check_vector(plan: FragmentPlan, p: int, vec) -> np.ndarray:
  vec = np.asarray(vec)
  if vec.ndim != 1 or vec.size != plan.size(p):
    raise ValueError(f"fragment {p} has {plan.size(p)} elements, got a vector of shape {vec.shape}")
  return vec


def scatter(plan: FragmentPlan, p: int, vec: np.ndarray) -> dict[str, np.ndarray]:
  """The inverse of `gather` for a fragment of whole leaves: `{path: array}`, reshaped views into `vec`.
  A fragment that holds pieces of split leaves has no leaves of its own: use `assemble`."""
  vec = _check_vector(plan, p, vec)
  out, start = {}, 0
  for path, shape, a, b in plan.pieces(p):
    if b - a != math.prod(shape):
      raise ValueError(f"fragment {p} holds a piece of leaf {path}: assemble the leaves from every fragment")
    out[path] = vec[start:start + b - a].reshape(shape)
    start += b - a
  return out


def assemble(plan: FragmentPlan, vectors: Sequence[np.ndarray], template: Any) -> Any:
  """The parameters held by the P fragment `vectors` (the inverse of gathering every fragment; split
  leaves put back together from their pieces), as a nested dict of float32 host arrays shaped like
  `template` (arrays or abstract shapes: every leaf is replaced)."""
  if len(vectors) != plan.num_fragments:
    raise ValueError(f"got {len(vectors)} fragment vectors, the plan has {plan.num_fragments} fragments")
  leaves: dict[str, np.ndarray] = {}
  for p, vec in enumerate(vectors):
    vec = _check_vector(plan, p, np.asarray(vec, np.float32).reshape(-1))
    start = 0
    for path, shape, a, b in plan.pieces(p):
      if path not in leaves:
        leaves[path] = np.empty(shape, np.float32)
      leaves[path].reshape(-1)[a:b] = vec[start:start + b - a]
      start += b - a
  return replace_leaves(template, leaves)


def leaf_keys(params: Any) -> dict[str, tuple]:
  """{path: the tuple of keys that reaches the leaf}: for `get_leaves` / `set_leaves`, which skip the
  walk over the whole tree (a learner touches one fragment's leaves at every step)."""
  return {_path_str(keys): keys for keys, _ in _iter_leaves(params)}


def get_leaves(params: Any, keys: tuple[tuple, ...]) -> tuple:
  """The leaves of `params` at `keys` (tuples from `leaf_keys`), in order."""
  out = []
  for path in keys:
    node = params
    for k in path:
      node = node[k]
    out.append(node)
  return tuple(out)


def set_leaves(params: Any, keys: tuple[tuple, ...], values) -> Any:
  """A copy of `params` with the leaves at `keys` replaced by `values`: only the dicts, lists and tuples
  on the way to them are copied, every other subtree is shared."""
  return _set(params, [(tuple(path), value) for path, value in zip(keys, values)])


def _set(node, items: list[tuple[tuple, Any]]):
  if not items[0][0]:
    return items[0][1]
  groups: dict[Any, list] = {}
  for path, value in items:
    groups.setdefault(path[0], []).append((path[1:], value))
  if type(node) is dict or isinstance(node, Mapping):
    out = dict(node)
    for k, sub in groups.items():
      out[k] = _set(node[k], sub)
    return out
  out = list(node)
  for k, sub in groups.items():
    out[k] = _set(node[k], sub)
  return type(node)(out)


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

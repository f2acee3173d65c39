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

from diloco_jax import chunked
from diloco_jax import codec

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


def apply_round(global_vec: np.ndarray, momentum: np.ndarray, payloads: Sequence[bytes | codec.Encoded],
                weights: Sequence[float], *, codec_name: str, block: int, lr: float, mu: float,
                rda: bool = False, norms: Sequence[float] | None = None, scale: float = 1.0,
                threads: int = 1) -> None:
  """One round's merge and outer step, in place and in one chunked pass (no fragment-sized temporary):

      g = scale * merge([decode(p) for p in payloads], weights, rda)
      global_vec, momentum <- the Nesterov step of `make_outer_optimizer(lr, mu)` with gradient g

  the same as `merge` + `outer_step` on the decoded vectors up to float32 rounding (the weights are folded
  into the per-block scales; the step itself is `nesterov_step_`). Each chunk of the fragment is decoded,
  weighted and summed over the contributions in the cache, then stepped; with `threads` > 1 the chunks are
  shared among that many threads, with results that do not depend on the thread count.

  `weights`: one per payload, >= 0 with a positive sum (normalized here). `rda`: radial-directional
  averaging; `norms`: then the contributions' L2 norms (`codec.sum_squares` ** 0.5), and the merged norm
  takes a first pass over the payloads. `global_vec`, `momentum`: writable float32 vectors of the
  fragment's size.
  """
  n = global_vec.size
  for name, arr in (("global_vec", global_vec), ("momentum", momentum)):
    if arr.dtype != np.float32 or arr.shape != (n,) or not arr.flags.writeable:
      raise ValueError(f"{name} must be a writable float32 vector of {n} elements")
  encs = [p if isinstance(p, codec.Encoded) else codec.parse(p, codec_name, n, block) for p in payloads]
  if any(e.size != n for e in encs):
    raise ValueError(f"payloads must encode {n} elements")
  if len(encs) == 0 or len(encs) != len(weights):
    raise ValueError(f"need one weight per payload, got {len(encs)} payloads and {len(weights)} weights")
  w = np.asarray(weights, np.float64)
  if (w < 0).any() or w.sum() <= 0:
    raise ValueError(f"weights must be >= 0 with a positive sum, got {w}")
  w = w / w.sum()
  step = codec.chunk_elems(block)
  work = codec.scratch_elems(block)
  lr32, mu32, scale32 = np.float32(lr), np.float32(mu), np.float32(scale)

  def direction(a, b, buf):
    """The chunk [a, b) of sum_i coeffs_i * decode(payload_i), in buf[work:]."""
    g = buf[work:work + b - a]
    written = False
    for enc, c in zip(encs, coeffs):
      if c != 0:
        codec.decode_range(enc, a, b, g, buf[:work], weight=c, accumulate=written)
        written = True
    if not written:
      g[:] = 0
    return g

  if not rda:
    coeffs, factor = w, scale32
  else:
    if norms is None or len(norms) != len(encs):
      raise ValueError("rda needs one norm per payload")
    norms = np.asarray(norms, np.float64)
    radial = float((w * norms).sum())
    coeffs = np.where(norms > 0, w / np.where(norms > 0, norms, 1.0), 0.0)  # unit(0) = 0
    # The direction's norm needs the whole vector before any step: a first pass, reading only payloads.
    def squares(a, b, buf):
      v = direction(a, b, buf).astype(np.float64)
      return float(v @ v)

    sq = chunked.run(squares, n, step, threads, work + step)
    dnorm = float(np.sqrt(sum(sq)))
    factor = np.float32(radial / dnorm) * scale32 if dnorm > 0 else np.float32(0)

  def kernel(a, b, buf):
    g = direction(a, b, buf)
    if factor != 1:
      g *= factor
    nesterov_step_(global_vec[a:b], momentum[a:b], g, lr32, mu32, out=buf[:b - a])

  chunked.run(kernel, n, step, threads, work + step)


def nesterov_step_(global_vec: np.ndarray, momentum: np.ndarray, grad: np.ndarray, lr: float, mu: float,
                   out: np.ndarray | None = None) -> None:
  """The Nesterov SGD step of `make_outer_optimizer(lr, mu)` in place, in float32:

      momentum <- grad + mu * momentum;   global_vec <- global_vec - lr * (grad + mu * momentum)

  the operations optax's `sgd(nesterov=True)` performs (trace, then scale by -lr, then add), in the same
  order. `out`: an optional float32 work array of grad's size (else one is allocated). `grad` is kept."""
  mu, lr = np.float32(mu), np.float32(lr)
  tmp = np.empty_like(grad) if out is None else out
  np.multiply(momentum, mu, out=momentum)
  np.add(momentum, grad, out=momentum)
  np.multiply(momentum, mu, out=tmp)
  np.add(tmp, grad, out=tmp)
  np.multiply(tmp, lr, out=tmp)
  np.subtract(global_vec, tmp, out=global_vec)


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


def momentum_from_state(saved: Any, size: int) -> np.ndarray:
  """A fragment's Nesterov momentum (a writable float32 vector) from a checkpoint's entry: the vector, or
  the optax state tree that older syncer checkpoints hold (its one array is the trace)."""
  leaves = jax.tree.leaves(saved)
  if len(leaves) != 1:
    raise ValueError(f"saved outer state has {len(leaves)} arrays, the Nesterov step keeps 1 (the momentum)")
  momentum = np.array(leaves[0], np.float32).reshape(-1)
  if momentum.size != size:
    raise ValueError(f"saved momentum of {momentum.size} elements, the fragment has {size}")
  return momentum


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

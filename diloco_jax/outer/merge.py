"""The outer loop's math: outer gradients, merge coefficients, and the Nesterov outer optimizer.

Pure functions on flat float32 host vectors (one per fragment). The syncer merges and steps in one fused,
chunked numpy pass in place (`apply_round`); `merge` (numpy) and `outer_step` (the optax optimizer of
`make_outer_optimizer`, jitted once and run on the host CPU device) are the same math written plainly,
the reference the fused pass is tested against. The syncer never touches an accelerator.

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

import dataclasses
import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco_jax.outer import chunked
from diloco_jax.outer import codec

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


# A round whose values provably stay below this (a margin of 2^8 under float32's largest value, far more
# than float32 rounding can add) is written in place in one pass; see `apply_round`.
_PROVABLY_FINITE = float(np.finfo(np.float32).max) / 256


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What `apply_round` did. `nonfinite`: what would have held a non-finite value ("merged outer
  gradient", "new global fragment", "outer optimizer state"); then nothing was written. Otherwise the L2
  norms of the new global and momentum (float32 sums per chunk, as `chunked.norm`). `checked`: whether a
  read-only check pass ran first (the inputs' norms could not prove the result finite)."""

  nonfinite: tuple[str, ...]
  global_norm: float = float("nan")
  momentum_norm: float = float("nan")
  checked: bool = False

  @property
  def applied(self) -> bool:
    return not self.nonfinite


def apply_round(global_vec: np.ndarray, momentum: np.ndarray, payloads: Sequence[bytes | codec.Encoded],
                weights: Sequence[float], *, codec_name: str, block: int, lr: float, mu: float,
                rda: bool = False, norms: Sequence[float] | None = None, scale: float = 1.0,
                threads: int = 1, state_norms: tuple[float, float] | None = None,
                opened: bool = False, full: bool = True) -> RoundResult:
  """One round's merge and outer step, in place and in one chunked pass (no fragment-sized temporary):

      g = scale * merge([decode(p) for p in payloads], weights, rda)
      global_vec, momentum <- the step of `make_outer_optimizer(lr, mu)` with gradient g

  the same as `merge` + `outer_step` on the decoded vectors up to float32 rounding (the weights are folded
  into the per-block scales; the step itself is `delayed_nesterov_step_`, with `opened` and `full` as
  there: the defaults take the plain Nesterov step, a round holding a full share of work with nothing
  pending). Each chunk of the fragment is decoded,
  weighted and summed over the contributions in the cache, then stepped; with `threads` > 1 the chunks are
  shared among that many threads, with results that do not depend on the thread count.

  All or nothing: if g, the new global or the new momentum would hold a non-finite value, nothing is
  written (the result's `nonfinite` says what). The one pass writes in place only when the inputs prove
  the result finite: every |value| is at most a vector's L2 norm, so |g| <= |factor| x sum_i coeff_i
  |payload_i| and the step's values are bounded from `norms` and `state_norms` (the current L2 norms of
  `global_vec` and `momentum`); honest rounds are far below float32's range. Otherwise (norms not given,
  or too large) a read-only pass computes every chunk's result first and the writing pass follows only if
  all of it is finite (the same operations: the same values).

  `weights`: one per payload, >= 0 with a positive sum (normalized here). `norms`: the payloads' L2 norms
  (`codec.norm`); needed with `rda` (radial-directional averaging: the merged norm takes a first pass over
  the payloads). `global_vec`, `momentum`: writable float32 vectors of the fragment's size.
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
  if norms is not None:
    norms = np.asarray(norms, np.float64)
    if norms.shape != (len(encs),):
      raise ValueError(f"need one norm per payload, got {norms.shape[0] if norms.ndim else 0}")
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
    if norms is None:
      raise ValueError("rda needs one norm per payload")
    radial = float((w * norms).sum())
    coeffs = np.where(norms > 0, w / np.where(norms > 0, norms, 1.0), 0.0)  # unit(0) = 0
    # The direction's norm needs the whole vector before any step: a first pass, reading only payloads.
    def squares(a, b, buf):
      v = direction(a, b, buf).astype(np.float64)
      return float(v @ v)

    with np.errstate(over="ignore", invalid="ignore"):
      sq = chunked.run(squares, n, step, threads, work + step)
      dnorm = float(np.sqrt(sum(sq)))
      factor = np.float32(radial / dnorm) * scale32 if dnorm > 0 else np.float32(0)

  def stepped(a, b, buf):
    """Whether the chunk's merged gradient, new global and new optimizer state are finite: computed as
    `kernel` does, into copies in buf (nothing written)."""
    with np.errstate(over="ignore", invalid="ignore"):  # per thread: overflow is what this looks for
      g = direction(a, b, buf)
      if factor != 1:
        g *= factor
      new_global = buf[work + step:work + step + b - a]
      new_momentum = buf[work + 2 * step:work + 2 * step + b - a]
      np.copyto(new_global, global_vec[a:b])
      np.copyto(new_momentum, momentum[a:b])
      delayed_nesterov_step_(new_global, new_momentum, g, lr32, mu32, opened=opened, full=full, out=buf[:b - a])
      return (bool(np.isfinite(g).all()), bool(np.isfinite(new_global).all()),
              bool(np.isfinite(new_momentum).all()))

  def kernel(a, b, buf):
    """The chunk stepped in place; returns the float32 sums of squares of its new global and momentum."""
    g = direction(a, b, buf)
    if factor != 1:
      g *= factor
    theta, m = global_vec[a:b], momentum[a:b]
    delayed_nesterov_step_(theta, m, g, lr32, mu32, opened=opened, full=full, out=buf[:b - a])
    with np.errstate(over="ignore"):  # a finite but huge result: its norm is inf (the next round checks)
      return float(np.dot(theta, theta)), float(np.dot(m, m))

  checked = not _provably_finite(coeffs, norms, factor, state_norms, lr, mu, opened, full)
  if checked:
    ok = np.array(chunked.run(stepped, n, step, threads, work + 3 * step)).reshape(-1, 3).all(axis=0)
    names = ("merged outer gradient", "new global fragment", "outer optimizer state")
    bad = tuple(name for name, fine in zip(names, ok) if not fine)
    if bad:
      return RoundResult(nonfinite=bad, checked=True)
  sums = np.array(chunked.run(kernel, n, step, threads, work + step), np.float64).reshape(-1, 2).sum(axis=0)
  return RoundResult(nonfinite=(), global_norm=float(np.sqrt(sums[0])), momentum_norm=float(np.sqrt(sums[1])),
                     checked=checked)


def _provably_finite(coeffs, norms, factor, state_norms, lr: float, mu: float, opened: bool = False,
                     full: bool = True) -> bool:
  """Whether a round's every value stays below `_PROVABLY_FINITE` (see `apply_round`), by the triangle
  inequality in float64: |g| <= G = |factor| sum_i coeff_i norm_i, |momentum'| <= (mu, or 1 once
  `opened`) |momentum| + G, and |global'| <= |global| + lr (G + mu |momentum'|) (+ lr G alone for a partial
  round), each |vector| bounded by its L2 norm."""
  if norms is None or state_norms is None:
    return False
  global_norm, momentum_norm = (float(x) for x in state_norms)
  with np.errstate(over="ignore", invalid="ignore"):
    g = abs(float(factor)) * float(np.dot(np.abs(coeffs), norms))
    m = (1.0 if opened else abs(mu)) * momentum_norm + g
    update = abs(mu) * m + g if full else g
    theta = global_norm + abs(lr) * update
  return all(np.isfinite(x) and x < _PROVABLY_FINITE for x in (g, m, update, theta))


def share_after(pending_share: float, share: float) -> tuple[bool, float]:
  """(full, the pending share after): whether a round holding `share` of a full round's work, with
  `pending_share` already pending, completes a full share (the momentum moves), and what stays pending
  (beyond a full round, the excess; `make_outer_optimizer` computes the same in float32)."""
  total = pending_share + share
  if total >= 1.0 - _SHARE_EPS:
    return True, max(total - float(np.floor(total + _SHARE_EPS)), 0.0)
  return False, total


def nesterov_step_(global_vec: np.ndarray, momentum: np.ndarray, grad: np.ndarray, lr: float, mu: float,
                   out: np.ndarray | None = None) -> None:
  """The Nesterov SGD step of `make_outer_optimizer(lr, mu)` in place, in float32:

      momentum <- grad + mu * momentum;   global_vec <- global_vec - lr * (grad + mu * momentum)

  the operations optax's `sgd(nesterov=True)` performs (trace, then scale by -lr, then add), in the same
  order. `out`: an optional float32 work array of grad's size (else one is allocated). `grad` is kept."""
  delayed_nesterov_step_(global_vec, momentum, grad, lr, mu, out=out)


def delayed_nesterov_step_(global_vec: np.ndarray, momentum: np.ndarray, grad: np.ndarray, lr: float, mu: float,
                           *, opened: bool = False, full: bool = True, out: np.ndarray | None = None) -> None:
  """The step of `make_outer_optimizer(lr, mu)` in place, in float32, with its pending sum folded into the
  momentum vector (no extra fragment-sized buffer). A cycle of work opens with its first round, which
  takes m <- mu m + g as the plain step does; the rounds after it in the same cycle (`opened`) add,
  m <- m + g; so once the cycle's shares add up to a full round, m = mu m_before + sum g, the optimizer's
  momentum. The round that completes it (`full`) steps with it, global <- global - lr (g + mu m); a
  partial round applies its gradient alone, global <- global - lr g. The defaults (a new cycle, full) are
  optax's `sgd(nesterov=True)` step, in the same order of operations. In between, the stored momentum is
  the optimizer's momentum times mu plus the pending sum (`OuterState.trace`, `.pending`): what the next
  full round needs. `out`: an optional float32 work array of grad's size (else one is allocated); `grad`
  is kept."""
  mu, lr = np.float32(mu), np.float32(lr)
  tmp = np.empty_like(grad) if out is None else out
  if not opened:
    np.multiply(momentum, mu, out=momentum)
  np.add(momentum, grad, out=momentum)
  if full:
    np.multiply(momentum, mu, out=tmp)
    np.add(tmp, grad, out=tmp)
  else:
    np.copyto(tmp, grad)
  np.multiply(tmp, lr, out=tmp)
  np.subtract(global_vec, tmp, out=global_vec)


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


def tokens_merged(fragment_tokens_merged: int, num_fragments: int) -> float:
  """Tokens whose work reached the global model. The syncer counts a contribution's tokens per fragment,
  so a learner's period of work is counted once for each of the P fragments it syncs: divide by P."""
  return fragment_tokens_merged / max(num_fragments, 1)

"""The outer loop's merge: outer gradients, merge weights and coefficients, and a round's fused merge and step.

Numpy functions on flat float32 host vectors (one per fragment); the syncer never touches an accelerator.
The syncer merges and steps in one fused, chunked pass in place (`apply_round`, with the step of
`nesterov.py`); `merge` is the same merge written plainly, and with the optax optimizer of
`tools/bench/outer_reference.py` the reference the fused pass is tested against.

A round merges pushes j (one period of one learner's work each, based on a global version `s_j` behind)
into one outer gradient

    merged = sum_j c_j v_j,     c_j = w_j / W * (1 + s_j)^-beta

with w_j the rule's raw weight (`raw_weights`) and W the raw weight of one period of every learner the
round answers for (`merge_coefficients`); optionally in RDA form (`merge`). docs/algorithm.md, "Syncer",
4. Merge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from diloco_jax.outer import chunked, codec, codec_kernels, fragments, nesterov

MERGE_RULES = ("tokens", "tokens_sq_per_step", "uniform")


def outer_gradient(base: np.ndarray, local: np.ndarray) -> np.ndarray:
  """delta = base - local: the outer "gradient" of a learner's inner steps since it adopted `base`."""
  base = np.asarray(base, np.float32)
  local = np.asarray(local, np.float32)
  if base.shape != local.shape:
    raise ValueError(f"base {base.shape} and local {local.shape} fragments differ in shape")
  return base - local


def raw_weights(tokens: Sequence[float], steps: Sequence[float], rule: str = "tokens") -> np.ndarray:
  """Each push's weight under `rule` before normalization (float64), for a push of `tokens` tokens over
  `steps` inner steps:

      tokens:               w = tokens
      tokens_sq_per_step:   w = tokens^2 / steps     ("quantity x quality", Decoupled DiLoCo)
      uniform:              w = 1
  """
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
  for (the syncer's choice, see `syncer/rules/rounds.py`: every counted learner, so that a round holding
  part of them moves the model by their share of the work, or only the round's contributors, a plain
  weighted mean). A learner that pushes two periods into one round has both merged, each with its own
  weight: its periods add up, they are not averaged. If W is 0 (no push reported any tokens), each push gets
  1 / learners: a round that closed should still move the model. The staleness discount multiplies the
  coefficient after that normalization, so it holds even for a lone stale push: it is never renormalized
  away.
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
  """The merged outer gradient (float32): `sum_j c_j v_j`, or its RDA form `(sum c|v|) unit(sum c unit(v))`
  (radial-directional averaging), which keeps the merged norm from shrinking like 1/sqrt(M) when the outer
  gradients are nearly orthogonal.

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


SHARE_EPS = 1e-4  # shares are sums of token ratios: 0.25 * 4 must count as a full round


# A round whose values provably stay below this (a margin of 2^8 under float32's largest value, far more
# than float32 rounding can add) is written in place in one pass; see `apply_round`.
_PROVABLY_FINITE = float(np.finfo(np.float32).max) / 256


@dataclasses.dataclass(frozen=True)
class RoundResult:
  """What `apply_round` did. `nonfinite`: what would have held a non-finite value ("merged outer
  gradient", "new global fragment", "outer optimizer state"); then nothing was written. Otherwise the L2
  norms of the new global and momentum (float32 sums per chunk, as `chunked.norm`). `checked`: whether a
  read-only check pass ran first (the inputs' norms could not prove the result finite). `coherence` (with
  RDA only, else NaN): |sum_i w_i unit(v_i)| for the normalized weights, 1 when the outer gradients point
  one way, about 1 / sqrt(k) for k orthogonal ones of equal weight (where plain averaging loses step size)."""

  nonfinite: tuple[str, ...]
  global_norm: float = float("nan")
  momentum_norm: float = float("nan")
  checked: bool = False
  coherence: float = float("nan")

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
      global_vec, momentum <- the delayed Nesterov step with gradient g (`nesterov.delayed_nesterov_step_`)

  the same as `merge` + the reference optimizer's step on the decoded vectors up to float32 rounding (the
  weights are folded into the per-block scales; `opened` and `full` as in the step: the defaults take the
  plain Nesterov step, a round holding a full share of work with nothing pending). Each chunk of the
  fragment is decoded, weighted and summed over the contributions in the cache, then stepped; with
  `threads` > 1 the chunks are shared among that many threads, with results that do not depend on the
  thread count.

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
  encs, w, norms = _round_inputs(global_vec, momentum, payloads, weights, norms, codec_name, block)
  grad = _merged_gradient(encs, w, norms, rda, scale, block, threads)
  step = _OuterStep(np.float32(lr), np.float32(mu), opened, full)
  checked = not _provably_finite(grad.coeffs, norms, grad.factor, state_norms, lr, mu, opened, full)
  if checked:
    bad = _nonfinite_parts(grad, step, global_vec, momentum, threads)
    if bad:
      return RoundResult(nonfinite=bad, checked=True)
  global_norm, momentum_norm = _step_in_place(grad, step, global_vec, momentum, threads)
  return RoundResult(nonfinite=(), global_norm=global_norm, momentum_norm=momentum_norm, checked=checked,
                     coherence=grad.coherence)


def _round_inputs(global_vec: np.ndarray, momentum: np.ndarray, payloads: Sequence[bytes | codec.Encoded],
                  weights: Sequence[float], norms: Sequence[float] | None, codec_name: str,
                  block: int) -> tuple[list[codec.Encoded], np.ndarray, np.ndarray | None]:
  """`apply_round`'s inputs checked: (the parsed payloads, the weights normalized, the norms as float64)."""
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
  if norms is not None:
    norms = np.asarray(norms, np.float64)
    if norms.shape != (len(encs),):
      raise ValueError(f"need one norm per payload, got {norms.shape[0] if norms.ndim else 0}")
  return encs, w / w.sum(), norms


@dataclasses.dataclass(frozen=True)
class _Gradient:
  """A round's merged outer gradient, chunk by chunk: factor * sum_i coeffs_i * decode(payload_i). A chunk
  kernel's buffer holds the decode's scratch (`work` elements) first, then the chunk's gradient."""

  encs: Sequence[codec.Encoded]
  coeffs: np.ndarray
  chunk: int  # elements per chunk
  work: int
  factor: np.float32 = np.float32(1)
  coherence: float = float("nan")  # RDA's direction norm (`RoundResult.coherence`)

  def __call__(self, a: int, b: int, buf: np.ndarray) -> np.ndarray:
    """The chunk [a, b), in buf[work:]."""
    g = buf[self.work:self.work + b - a]
    written = False
    for enc, c in zip(self.encs, self.coeffs):
      if c != 0:
        codec_kernels.decode_range(enc, a, b, g, buf[:self.work], weight=c, accumulate=written)
        written = True
    if not written:
      g[:] = 0
    if self.factor != 1:
      g *= self.factor
    return g


def _merged_gradient(encs: Sequence[codec.Encoded], w: np.ndarray, norms: np.ndarray | None, rda: bool,
                     scale: float, block: int, threads: int) -> _Gradient:
  """The round's gradient: the weighted sum times `scale`, or with `rda` its radial-directional form, whose
  factor (the radial norm over the direction's norm) takes a first pass over the payloads."""
  grad = _Gradient(encs, w, codec_kernels.chunk_elems(block), codec_kernels.scratch_elems(block))
  scale32 = np.float32(scale)
  if not rda:
    return dataclasses.replace(grad, factor=scale32)
  if norms is None:
    raise ValueError("rda needs one norm per payload")
  radial = float((w * norms).sum())
  coeffs = np.where(norms > 0, w / np.where(norms > 0, norms, 1.0), 0.0)  # unit(0) = 0
  direction = dataclasses.replace(grad, coeffs=coeffs)

  def squares(a, b, buf):
    v = direction(a, b, buf).astype(np.float64)
    return float(v @ v)

  with np.errstate(over="ignore", invalid="ignore"):
    sq = chunked.run(squares, encs[0].size, grad.chunk, threads, grad.work + grad.chunk)
    dnorm = float(np.sqrt(sum(sq)))
    factor = np.float32(radial / dnorm) * scale32 if dnorm > 0 else np.float32(0)
  return dataclasses.replace(direction, factor=factor, coherence=dnorm)


@dataclasses.dataclass(frozen=True)
class _OuterStep:
  """The round's delayed Nesterov step on one chunk (`nesterov.delayed_nesterov_step_`)."""

  lr: np.float32
  mu: np.float32
  opened: bool
  full: bool

  def __call__(self, theta: np.ndarray, m: np.ndarray, g: np.ndarray, out: np.ndarray) -> None:
    nesterov.delayed_nesterov_step_(theta, m, g, self.lr, self.mu, opened=self.opened, full=self.full, out=out)


_ROUND_PARTS = ("merged outer gradient", "new global fragment", "outer optimizer state")


def _nonfinite_parts(grad: _Gradient, step: _OuterStep, global_vec: np.ndarray, momentum: np.ndarray,
                     threads: int) -> tuple[str, ...]:
  """The parts of the round (`_ROUND_PARTS`) that would hold a non-finite value, from a read-only pass that
  computes each chunk's gradient and new state as `_step_in_place` does, into copies (nothing written)."""
  c, work = grad.chunk, grad.work

  def stepped(a, b, buf):
    with np.errstate(over="ignore", invalid="ignore"):  # per thread: overflow is what this looks for
      g = grad(a, b, buf)
      new_global = buf[work + c:work + c + b - a]
      new_momentum = buf[work + 2 * c:work + 2 * c + b - a]
      np.copyto(new_global, global_vec[a:b])
      np.copyto(new_momentum, momentum[a:b])
      step(new_global, new_momentum, g, out=buf[:b - a])
      return (bool(np.isfinite(g).all()), bool(np.isfinite(new_global).all()),
              bool(np.isfinite(new_momentum).all()))

  ok = np.array(chunked.run(stepped, global_vec.size, c, threads, work + 3 * c)).reshape(-1, 3).all(axis=0)
  return tuple(name for name, fine in zip(_ROUND_PARTS, ok) if not fine)


def _step_in_place(grad: _Gradient, step: _OuterStep, global_vec: np.ndarray, momentum: np.ndarray,
                   threads: int) -> tuple[float, float]:
  """The round written: each chunk's gradient computed and stepped in place. Returns the L2 norms of the new
  global and momentum (float32 sums of squares per chunk, added in float64)."""

  def kernel(a, b, buf):
    g = grad(a, b, buf)
    theta, m = global_vec[a:b], momentum[a:b]
    step(theta, m, g, out=buf[:b - a])
    with np.errstate(over="ignore"):  # a finite but huge result: its norm is inf (the next round checks)
      return float(np.dot(theta, theta)), float(np.dot(m, m))

  sums = chunked.run(kernel, global_vec.size, grad.chunk, threads, grad.work + grad.chunk)
  sums = np.array(sums, np.float64).reshape(-1, 2).sum(axis=0)
  return float(np.sqrt(sums[0])), float(np.sqrt(sums[1]))

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
  (beyond a full round, the excess; the reference optimizer computes the same in float32). A full share
  takes the full delayed Nesterov step (`nesterov.delayed_nesterov_step_`)."""
  total = pending_share + share
  if total >= 1.0 - SHARE_EPS:
    return True, max(total - float(np.floor(total + SHARE_EPS)), 0.0)
  return False, total


def momentum_from_state(saved: Any, size: int) -> np.ndarray:
  """A fragment's Nesterov momentum (a writable float32 vector) from a checkpoint's entry: the vector, or
  the optax state tree that older syncer checkpoints hold (nested tuples, lists or dicts of arrays whose one
  array is the trace; None holds none, as in a jax pytree)."""
  leaves = [leaf for leaf in fragments.flatten(saved).values() if leaf is not None]
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

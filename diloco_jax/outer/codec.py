"""Flat float32 vectors <-> bytes: fp32, bf16, and block-quantized int8 / int4 / int2, with checksums.

Formats (`n` elements, `block` elements per block, `nb = ceil(n / block)` blocks; byte layouts: `encode`):

* `fp32`: the raw float32 values, 4n bytes. Exact.
* `bf16`: float32 rounded to nearest even to its top 16 bits, 2n bytes. Relative error <= 2^-8 (normal x).
* `int8`: symmetric absmax quantization per block, `scale = absmax(block) / 127`, q in [-127, 127]:
  nb * block codes, then nb float32 scales. |err| <= scale / 2 per element.
* `int4`: the same with `scale = absmax(block) / 7`, q in [-7, 7], two codes per byte.
* `int2`: the same with `scale = absmax(block)`, q in [-1, 1] (ternary), four codes per byte; coarse: meant
  for outer gradients with error feedback (`ErrorFeedback`), which carries what a push rounds away.

The bounds in full (subnormal, tiny and near-overflow values): docs/algorithm.md, "Codecs", and
`error_bound`. Non-finite inputs are not rejected here; the receiver's finiteness check (`finite`) catches
them in every format. The passes run chunk by chunk (`codec_kernels.py`).
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

from diloco_jax.outer import chunked
from diloco_jax.outer import codec_kernels as kernels
from diloco_jax.outer.codec_kernels import Encoded

CODECS = ("fp32", "bf16", "int8", "int4", "int2")
# Float32 rounding in x * (qmax / absmax) and q * scale moves the result by a few ulps; the bound allows it.
_ROUNDING_SLACK = 2.0**-12


class CodecError(ValueError):
  """A payload or codec name that cannot be decoded (unknown codec, wrong length)."""


def _check(codec: str, block: int) -> None:
  if codec not in CODECS:
    raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
  if codec in kernels.QMAX and block < 1:
    raise CodecError(f"codec block must be >= 1, got {block}")


def encoded_size(size: int, codec: str, block: int = 64) -> int:
  """Bytes of the payload that encodes `size` elements with `codec`."""
  _check(codec, block)
  if codec == "fp32":
    return 4 * size
  if codec == "bf16":
    return 2 * size
  nb = kernels.num_blocks(size, block)
  return -(-nb * block // kernels.CODES_PER_BYTE[codec]) + 4 * nb


def _blocks(vec: np.ndarray, block: int) -> np.ndarray:
  """`vec` zero-padded to whole blocks, shape [nb, block]."""
  nb = kernels.num_blocks(vec.size, block)
  if nb * block == vec.size:
    return vec.reshape(nb, block)
  padded = np.zeros(nb * block, np.float32)
  padded[:vec.size] = vec
  return padded.reshape(nb, block)


def parse(payload: bytes, codec: str, size: int, block: int = 64) -> Encoded:
  """The views of `payload` (no copy). CodecError if its length does not match `size` elements."""
  expected = encoded_size(size, codec, block)
  if len(payload) != expected:
    raise CodecError(f"{codec} payload for {size} elements (block {block}) must be {expected} bytes, "
                     f"got {len(payload)}")
  if codec == "fp32":
    return Encoded(codec, size, block, np.frombuffer(payload, "<f4"), None)
  if codec == "bf16":
    return Encoded(codec, size, block, np.frombuffer(payload, "<u2"), None)
  nb = kernels.num_blocks(size, block)
  scales = np.frombuffer(payload, "<f4", count=nb, offset=expected - 4 * nb)
  codes = np.frombuffer(payload, np.int8 if codec == "int8" else np.uint8, count=expected - 4 * nb)
  return Encoded(codec, size, block, codes, scales)


def _new_payload(size: int, codec: str, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(payload bytes as uint8, its scales as a float32 view; empty for fp32 / bf16)."""
  total = encoded_size(size, codec, block)
  out = np.empty(total, np.uint8)
  nb = kernels.num_blocks(size, block) if codec in kernels.QMAX else 0
  return out, out[total - 4 * nb:].view("<f4")


def encode(vec: np.ndarray, codec: str, block: int = 64, *, threads: int = 1) -> bytes:
  """`vec` (any shape, read as flat float32) as the payload bytes of `codec`.

  All little-endian; `n` elements, `nb = ceil(n / block)` blocks:

  * `fp32`: the raw float32 values, 4n bytes.
  * `bf16`: the top 16 bits of each float32 after round-to-nearest-even, 2n bytes. |err| <= 2^-8 |x| for
    normal values (half a unit in the last place of an 8-bit significand); values below the float32 normal
    range (|x| < 2^-126) have an absolute error <= 2^-134; values within half a bf16 ulp of the float32
    maximum round to +-inf.
  * `int8`: `scale = absmax(block) / 127`, `q = round(x / scale)` in [-127, 127]. Payload: nb * block int8
    codes (the last block zero-padded), then nb float32 scales. |err| <= scale / 2 per element (up to
    float32 rounding, a relative 2^-12 slack).
  * `int4`: `scale = absmax(block) / 7` and q in [-7, 7], stored as the nibble q + 8, two per byte (element
    2i in the low nibble of byte i, 2i + 1 in the high nibble): ceil(nb * block / 2) bytes of codes, then nb
    float32 scales. |err| <= scale / 2 per element (same slack).
  * `int2`: `scale = absmax(block)` and q in [-1, 1], stored as 2-bit fields q + 2, four per byte (element
    4i + k in bits 2k and 2k + 1 of byte i): ceil(nb * block / 4) bytes of codes, then nb float32 scales.
    |err| <= scale / 2 per element (same slack).

  A block of zeros has scale 0 and decodes to exact zeros. A block whose largest magnitude is tiny (below
  2^-112, where qmax / absmax would overflow float32 or the scale is subnormal) is quantized in float64
  against its stored scale, which is rounded up when float32 rounded it down: the bound is then half that
  stored scale. Non-finite inputs are not rejected: with the quantized formats they poison their block's
  scale and decode as NaN, so the receiver's finiteness check (the syncer's "nonfinite" rejection) catches
  them in every format.
  """
  _check(codec, block)
  vec = np.ascontiguousarray(vec, dtype=np.float32).reshape(-1)
  if codec == "fp32":
    return vec.astype("<f4", copy=False).tobytes()
  out, scales = _new_payload(vec.size, codec, block)
  chunked.run(lambda a, b, buf: kernels.encode_range(vec[a:b], codec, block, a, out, scales, buf), vec.size,
              kernels.chunk_elems(block), threads, kernels.scratch_elems(block))
  return out.tobytes()


def encode_residual(target: np.ndarray, reference: np.ndarray, codec: str, block: int = 64, *,
                    threads: int = 1) -> bytes:
  """payload = encode(target - reference), and in place reference += decode(payload), in one chunked
  pass: the reference-tracking downlink's update (`syncer/downlink.py`), bitwise the same as the two
  unfused steps. `reference`: a writable float32 vector of target's size."""
  _check(codec, block)
  target = np.ascontiguousarray(target, dtype=np.float32).reshape(-1)
  if reference.dtype != np.float32 or reference.shape != target.shape or not reference.flags.writeable:
    raise ValueError(f"reference must be a writable float32 vector of shape {target.shape}")
  out, scales = _new_payload(target.size, codec, block)

  def kernel(a, b, buf):
    diff = buf[:b - a]
    np.subtract(target[a:b], reference[a:b], out=diff)
    kernels.encode_range(diff, codec, block, a, out, scales, buf, owned=True, residual=reference[a:b])

  chunked.run(kernel, target.size, kernels.chunk_elems(block), threads, kernels.scratch_elems(block))
  return out.tobytes()


def decode(payload: bytes, codec: str, size: int, block: int = 64, *, threads: int = 1) -> np.ndarray:
  """The float32[size] vector that `payload` encodes. CodecError if its length does not match."""
  _check(codec, block)
  enc = parse(payload, codec, size, block)
  out = np.empty(size, np.float32)
  chunked.run(lambda a, b, buf: kernels.decode_range(enc, a, b, out[a:b], buf), size, kernels.chunk_elems(block),
              threads, kernels.scratch_elems(block))
  return out


def decode_accumulate(payload: bytes | Encoded, codec: str, out: np.ndarray, weight: float, block: int = 64, *,
                      threads: int = 1) -> None:
  """out += weight * decode(payload), in place and in chunks (no fragment-sized temporary). `out`: a
  writable float32 vector of the payload's size. Within one float32 rounding per element of the unfused
  `out + np.float32(weight) * decode(payload)` (the weight is folded into the per-block scales)."""
  _check(codec, block)
  if out.dtype != np.float32 or out.ndim != 1 or not out.flags.writeable:
    raise ValueError("out must be a writable float32 vector")
  enc = payload if isinstance(payload, Encoded) else parse(payload, codec, out.size, block)
  if enc.size != out.size:
    raise CodecError(f"payload of {enc.size} elements, out has {out.size}")
  chunked.run(lambda a, b, buf: kernels.decode_range(enc, a, b, out[a:b], buf, weight=weight, accumulate=True),
              out.size, kernels.chunk_elems(block), threads, kernels.scratch_elems(block))


def finite(enc: Encoded, *, threads: int = 1) -> bool:
  """Whether every decoded value of `enc` is finite, without decoding it whole: fp32 and bf16 check their
  values chunk by chunk; the quantized codecs check their scales, and decode only the blocks whose scale
  times the largest code magnitude could leave the float32 range (honest payloads have none)."""
  if enc.codec == "fp32":
    return all(chunked.run(lambda a, b, buf: bool(np.isfinite(enc.codes[a:b]).all()), enc.size,
                           kernels.CHUNK_ELEMS, threads))
  if enc.codec == "bf16":
    return all(chunked.run(lambda a, b, buf: bool(((enc.codes[a:b] & 0x7F80) != 0x7F80).all()), enc.size,
                           kernels.CHUNK_ELEMS, threads))
  if not np.isfinite(enc.scales).all():
    return False
  largest_code = {"int8": 128, "int4": 8, "int2": 2}[enc.codec]  # what a hostile payload's codes can reach
  risky = np.flatnonzero(np.abs(enc.scales) > np.finfo(np.float32).max / largest_code)
  buf = np.empty(kernels.scratch_elems(enc.block), np.float32)
  for b in risky:
    start = int(b) * enc.block
    stop = min(start + enc.block, enc.size)
    while start % kernels.CODES_PER_BYTE[enc.codec]:  # a range starts on a byte: take blocks before too
      start -= enc.block
    seg = np.empty(stop - start, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing to inf is what we look for
      kernels.decode_range(enc, start, stop, seg, buf)
    if not np.isfinite(seg).all():
      return False
  return True


def sum_squares(enc: Encoded, *, threads: int = 1) -> float:
  """sum(decode(enc) ** 2) in float64, chunk by chunk (for RDA's norms)."""

  work = kernels.scratch_elems(enc.block)

  def kernel(a, b, buf):
    vals = buf[work:work + b - a]
    kernels.decode_range(enc, a, b, vals, buf[:work])
    v64 = vals.astype(np.float64)
    return float(np.dot(v64, v64))

  return float(sum(chunked.run(kernel, enc.size, kernels.chunk_elems(enc.block), threads,
                               work + kernels.chunk_elems(enc.block))))


@functools.cache
def _squares_table(codec: str) -> np.ndarray:
  """float32[65536]: for each little-endian uint16 word of a quantized payload's codes, the sum of its
  codes' squares (int2: eight codes, q = field - 2; int4: four, q = nibble - 8; int8: two)."""
  word = np.arange(1 << 16, dtype=np.int64)
  if codec == "int2":
    codes = [((word >> (2 * k)) & 3) - 2 for k in range(8)]
  elif codec == "int4":
    codes = [((word >> (4 * k)) & 15) - 8 for k in range(4)]
  else:
    codes = [((word >> (8 * k)) & 255 ^ 128) - 128 for k in range(2)]
  return sum(c * c for c in codes).astype(np.float32)


def norm(enc: Encoded, *, threads: int = 1) -> float:
  """The L2 norm of decode(enc), without decoding a quantized payload: per block, its scale squared times
  the sum of its codes' squares (from a table of code pairs or quads), which is the decoded vector's norm
  up to float32's rounding of the decoded values (a relative 2^-23). fp32: float32 sums of squares per
  chunk, added in float64; bf16 and blocks that do not hold whole code words: `sum_squares`."""
  if enc.codec == "fp32":
    return chunked.norm(enc.codes, threads=threads)
  per_word = {"int2": 8, "int4": 4, "int8": 2}.get(enc.codec)
  if per_word is None or enc.block % per_word:
    return float(np.sqrt(sum_squares(enc, threads=threads)))
  block = enc.block
  whole = enc.size // block  # the blocks of `size` elements; a partial last one is decoded (its padding
  # codes are no part of the vector)
  words = enc.codes.view("<u2")
  table = _squares_table(enc.codec)
  per_block = block // per_word
  ones = np.ones(per_block, np.float32)
  step = max(1, chunked.CHUNK_ELEMS // block)  # blocks per chunk

  def kernel(a, b, buf):
    squares = buf[:(b - a) * per_block]
    np.take(table, words[a * per_block:b * per_block], out=squares, mode="wrap")  # (no bounds check: < 2^16)
    code_sums = squares.reshape(b - a, per_block) @ ones  # exact: small integers
    scales = enc.scales[a:b].astype(np.float64)
    return float(np.dot(code_sums.astype(np.float64), scales * scales))

  total = sum(chunked.run(kernel, whole, step, threads, step * per_block)) if whole else 0.0
  if whole < -(-enc.size // block):
    tail = np.empty(enc.size - whole * block, np.float32)
    kernels.decode_range(enc, whole * block, enc.size, tail, np.empty(kernels.scratch_elems(block), np.float32))
    total += float(np.dot(tail.astype(np.float64), tail.astype(np.float64)))
  return float(np.sqrt(total))


def checksum(payload: bytes) -> int:
  """CRC-32 of the payload, as an unsigned int."""
  return zlib.crc32(payload) & 0xFFFFFFFF


def error_bound(vec: np.ndarray, codec: str, block: int = 64) -> np.ndarray:
  """The documented per-element bound on |decode(encode(vec)) - vec| (float64, shape [vec.size])."""
  _check(codec, block)
  vec = np.asarray(vec, np.float32).reshape(-1)
  if codec == "fp32":
    return np.zeros(vec.size)
  if codec == "bf16":
    return np.maximum(np.abs(vec.astype(np.float64)) * 2.0**-8, 2.0**-134)
  absmax = np.max(np.abs(_blocks(vec, block)), axis=1)
  qmax = kernels.QMAX[codec]
  scale = np.maximum(absmax.astype(np.float64) / qmax, kernels.block_scales(absmax, qmax).astype(np.float64))
  half_scale = scale / 2 * (1 + _ROUNDING_SLACK)
  return np.repeat(half_scale, block)[:vec.size]

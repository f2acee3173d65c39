"""Flat float32 vectors <-> bytes: fp32, bf16, and block-quantized int8 / int4, with checksums.

Formats (all little-endian; `n` elements, `block` elements per block, `nb = ceil(n / block)` blocks):

* `fp32`: the raw float32 values, 4n bytes. Exact.
* `bf16`: the top 16 bits of each float32 after round-to-nearest-even, 2n bytes. Relative error
  |err| <= 2^-8 |x| for normal values (half a unit in the last place of an 8-bit significand); values
  below the float32 normal range (|x| < 2^-126) have an absolute error <= 2^-134; values within half a
  bf16 ulp of the float32 maximum round to +-inf.
* `int8`: symmetric absmax quantization per block. `scale = absmax(block) / 127`,
  `q = round(x / scale)` in [-127, 127]. Payload: nb * block int8 codes (the last block zero-padded), then
  nb float32 scales. |err| <= scale / 2 per element (up to float32 rounding, a relative 2^-12 slack).
* `int4`: the same with `scale = absmax(block) / 7` and q in [-7, 7], stored as the nibble q + 8, two per
  byte (element 2i in the low nibble of byte i, 2i + 1 in the high nibble): ceil(nb * block / 2) bytes of
  codes, then nb float32 scales. |err| <= scale / 2 per element (same slack).

A block of zeros has scale 0 and decodes to exact zeros. A block whose largest magnitude is tiny (below
2^-112, where qmax / absmax would overflow float32 or the scale is subnormal) is quantized in float64
against its stored scale, which is rounded up when float32 rounded it down: the bound is then half that
stored scale. Non-finite inputs are not rejected here: with the
quantized formats they poison their block's scale and decode as NaN, so the receiver's finiteness check
(the syncer's "nonfinite" rejection) catches them in every format.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np

from diloco_jax.outer import chunked

CODECS = ("fp32", "bf16", "int8", "int4")
_QMAX = {"int8": 127, "int4": 7}
# Float32 rounding in x * (qmax / absmax) and q * scale moves the result by a few ulps; the bound allows it.
_ROUNDING_SLACK = 2.0**-12


class CodecError(ValueError):
  """A payload or codec name that cannot be decoded (unknown codec, wrong length)."""


def _check(codec: str, block: int) -> None:
  if codec not in CODECS:
    raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")
  if codec in _QMAX and block < 1:
    raise CodecError(f"codec block must be >= 1, got {block}")


def _num_blocks(size: int, block: int) -> int:
  return -(-size // block)


def encoded_size(size: int, codec: str, block: int = 64) -> int:
  """Bytes of the payload that encodes `size` elements with `codec`."""
  _check(codec, block)
  if codec == "fp32":
    return 4 * size
  if codec == "bf16":
    return 2 * size
  nb = _num_blocks(size, block)
  codes = nb * block if codec == "int8" else -(-nb * block // 2)
  return codes + 4 * nb


def _blocks(vec: np.ndarray, block: int) -> np.ndarray:
  """`vec` zero-padded to whole blocks, shape [nb, block]."""
  nb = _num_blocks(vec.size, block)
  if nb * block == vec.size:
    return vec.reshape(nb, block)
  padded = np.zeros(nb * block, np.float32)
  padded[:vec.size] = vec
  return padded.reshape(nb, block)


# Encoding and decoding go through the vector in chunks of about this many elements (see `chunked`): their
# temporaries stay in the cache whatever the fragment's size, so a learner's host memory is its fragments
# in flight, not a multiple of them, and a pass costs about the bytes it must read and write.
_CHUNK_ELEMS = chunked.CHUNK_ELEMS


def chunk_elems(block: int) -> int:
  """Elements per chunk: a whole, even number of blocks (so that int4 chunks start on a byte boundary)."""
  return max(2, (_CHUNK_ELEMS // block) // 2 * 2) * block


def scratch_elems(block: int) -> int:
  """float32 work elements a chunk kernel needs: two halves of a chunk plus two blocks each."""
  return 2 * (chunk_elems(block) + 2 * block)


def _bf16_bits(vec: np.ndarray) -> np.ndarray:
  bits = vec.view(np.uint32)
  # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate (in place).
  rounded = bits >> 16
  rounded &= np.uint32(1)
  rounded += np.uint32(0x7FFF)
  rounded += bits
  rounded >>= 16
  top = rounded.astype("<u2")
  nan = np.isnan(vec)
  if nan.any():  # Rounding could carry a NaN's payload into the exponent and make it inf or zero.
    top[nan] = 0x7FC0
  return top


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A payload parsed once (its length checked) into numpy views of its codes and scales: what the range
  kernels read. `codes`: float32 (fp32), uint16 (bf16), int8 (int8) or packed uint8 (int4); `scales`:
  float32 per block, or None."""

  codec: str
  size: int
  block: int
  codes: np.ndarray
  scales: np.ndarray | None


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
  nb = _num_blocks(size, block)
  scales = np.frombuffer(payload, "<f4", count=nb, offset=expected - 4 * nb)
  codes = np.frombuffer(payload, np.int8 if codec == "int8" else np.uint8, count=expected - 4 * nb)
  return Encoded(codec, size, block, codes, scales)


def decode_range(enc: Encoded, start: int, stop: int, out: np.ndarray, buf: np.ndarray, *, weight: float = 1.0,
                 accumulate: bool = False) -> None:
  """out (float32[stop - start]) = or += weight * decode(enc)[start:stop]. `start` is a multiple of
  `chunk_elems(block)` (or of 2 x block), `buf` a float32 work array of `scratch_elems(block)` elements.

  With weight 1 and accumulate False the values are bitwise those of `decode`; otherwise the weight is
  folded into the per-block scales (quantized codecs), one float32 rounding away from weight * decode."""
  n = stop - start
  w = np.float32(weight)
  if enc.codec in ("fp32", "bf16"):
    if enc.codec == "fp32":
      vals = enc.codes[start:stop]
    else:
      bits = buf[:n].view(np.uint32)
      np.copyto(bits, enc.codes[start:stop])
      bits <<= 16
      vals = bits.view(np.float32)
    if w != 1:
      tmp = buf[n:2 * n] if enc.codec == "bf16" else buf[:n]
      np.multiply(vals, w, out=tmp)
      vals = tmp
    if accumulate:
      np.add(out, vals, out=out)
    else:
      np.copyto(out, vals)
    return
  block = enc.block
  b0 = start // block
  nbc = -(-n // block)
  q = buf[:nbc * block]
  if enc.codec == "int8":
    np.copyto(q, enc.codes[start:start + nbc * block])
  else:
    # Each byte b -> the code pair (b & 15, b >> 4) as the two bytes of a little-endian uint16
    # ((b << 4 | b) & 0x0F0F), so that the uint16 array read as bytes holds the codes in order.
    nbytes = -(-nbc * block // 2)
    half = buf.size // 2
    pairs = buf[half:half + nbytes].view(np.uint16)[:nbytes]  # within the second half: q stays free
    packed = buf[half + nbytes:half + 2 * nbytes].view(np.uint16)[:nbytes]
    np.copyto(packed, enc.codes[start // 2:start // 2 + nbytes])
    np.left_shift(packed, 4, out=pairs)
    pairs |= packed
    pairs &= 0x0F0F
    np.copyto(q, pairs.view(np.uint8)[:nbc * block])
    q -= 8
  q = q.reshape(nbc, block)
  scales = enc.scales[b0:b0 + nbc]
  if w != 1:
    scales = scales * w
  if not accumulate and n == nbc * block:
    np.multiply(q, scales[:, None], out=out.reshape(nbc, block))
    return
  np.multiply(q, scales[:, None], out=q)
  if accumulate:
    np.add(out, q.reshape(-1)[:n], out=out)
  else:
    np.copyto(out, q.reshape(-1)[:n])


def _encode_range(x: np.ndarray, codec: str, block: int, start: int, out: np.ndarray, scales_out: np.ndarray,
                  buf: np.ndarray, *, owned: bool = False, residual: np.ndarray | None = None) -> None:
  """Encode x, the vector's elements [start, start + x.size), into the payload array `out` (uint8, codes
  from the payload's start) and `scales_out` (float32 per block). `buf`: a float32 work array of
  `scratch_elems(block)` elements; `owned`: x is buf[:x.size] (it is then overwritten). With `residual`
  (float32[x.size]), also residual += the decoded chunk, bitwise as `decode` computes it."""
  n = x.size
  half = buf.size // 2
  if codec == "fp32":
    out[4 * start:4 * (start + n)].view("<f4")[:] = x
    if residual is not None:
      residual += x
    return
  if codec == "bf16":
    top = _bf16_bits(x)
    out[2 * start:2 * (start + n)].view("<u2")[:] = top
    if residual is not None:
      dec = buf[half:half + n].view(np.uint32)
      np.copyto(dec, top)
      dec <<= 16
      residual += dec.view(np.float32)
    return
  qmax = _QMAX[codec]
  nbc = -(-n // block)
  m = nbc * block
  xa = buf[:m]
  if not owned:
    xa[:n] = x
  xa[n:] = 0  # the vector's last block, zero-padded
  xb = xa.reshape(nbc, block)
  # |x| as the float's bits without the sign: ordered like the values (NaN above inf), and an integer
  # max over a block is several times faster than a float one.
  magnitude = buf[half:half + m].view(np.int32)
  np.bitwise_and(xa.view(np.int32), 0x7FFFFFFF, out=magnitude)
  absmax = np.max(magnitude.reshape(nbc, block), axis=1).view(np.float32)
  b0 = start // block
  scales = scales_out[b0:b0 + nbc]
  np.divide(absmax, np.float32(qmax), out=scales)
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # where() keeps only finite results
    tiny = (absmax > 0) & (absmax < _TINY_ABSMAX)
    tiny_codes = None
    if tiny.any():
      # qmax / absmax would overflow float32 (or the scale is subnormal, coarsely rounded): these rare
      # blocks are quantized in float64 against their stored scale, rounded up so |x| / scale <= qmax.
      scales[tiny] = _scales(absmax[tiny], qmax)
      tiny_codes = np.clip(np.rint(xb[tiny].astype(np.float64) / scales[tiny, None].astype(np.float64)),
                           -qmax, qmax)
    inv = np.where(absmax >= _TINY_ABSMAX, np.float32(qmax) / absmax, np.float32(0)).astype(np.float32)
    np.multiply(xb, inv[:, None], out=xb)
    np.rint(xb, out=xb)
    np.clip(xb, -qmax, qmax, out=xb)
    if tiny_codes is not None:
      xb[tiny] = tiny_codes
    if residual is not None:
      dec = buf[half:half + m].reshape(nbc, block)
      np.multiply(xb, scales[:, None], out=dec)
      residual += dec.reshape(-1)[:n]
    # NaN blocks get garbage codes, but their scale is NaN too.
    if codec == "int8":
      np.copyto(out[start:start + m].view(np.int8), xa, casting="unsafe")
      return
    xa += 8
    nbytes = -(-m // 2)
    codes = buf[half:half + nbytes].view(np.uint8)[:2 * nbytes]
    np.copyto(codes[:m], xa, casting="unsafe")
  codes[m:] = 0  # an odd number of codes ends in a zero nibble
  # Code pairs (c0, c1) as little-endian uint16 words c0 + 256 c1 -> the bytes c0 | c1 << 4.
  words = codes.view(np.uint16)
  packed = buf[half + nbytes:half + 2 * nbytes].view(np.uint16)[:nbytes]
  np.right_shift(words, 4, out=packed)
  packed |= words
  np.copyto(out[start // 2:start // 2 + nbytes], packed, casting="unsafe")


# Below this block absmax the block is quantized in float64 (`_encode_range`): qmax / absmax overflows
# float32 under about 2^-120, and absmax / qmax is subnormal (coarsely rounded) under about 2^-119.
_TINY_ABSMAX = np.float32(2.0**-112)


def _scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
  """The float32 scale of each block: absmax / qmax, rounded up where float32 rounded it down (only matters
  for subnormal scales, whose rounding is coarse), so that |x| / scale <= qmax holds for every element."""
  exact = absmax.astype(np.float64) / qmax
  scales = exact.astype(np.float32)
  low = scales.astype(np.float64) < exact
  if low.any():
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
  return scales


def _new_payload(size: int, codec: str, block: int) -> tuple[np.ndarray, np.ndarray]:
  """(payload bytes as uint8, its scales as a float32 view; empty for fp32 / bf16)."""
  total = encoded_size(size, codec, block)
  out = np.empty(total, np.uint8)
  nb = _num_blocks(size, block) if codec in _QMAX else 0
  return out, out[total - 4 * nb:].view("<f4")


def encode(vec: np.ndarray, codec: str, block: int = 64, *, threads: int = 1) -> bytes:
  """`vec` (any shape, read as flat float32) as the payload bytes of `codec` (see the module docstring)."""
  _check(codec, block)
  vec = np.ascontiguousarray(vec, dtype=np.float32).reshape(-1)
  if codec == "fp32":
    return vec.astype("<f4", copy=False).tobytes()
  out, scales = _new_payload(vec.size, codec, block)
  chunked.run(lambda a, b, buf: _encode_range(vec[a:b], codec, block, a, out, scales, buf), vec.size,
              chunk_elems(block), threads, scratch_elems(block))
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
    _encode_range(diff, codec, block, a, out, scales, buf, owned=True, residual=reference[a:b])

  chunked.run(kernel, target.size, chunk_elems(block), threads, scratch_elems(block))
  return out.tobytes()


def decode(payload: bytes, codec: str, size: int, block: int = 64, *, threads: int = 1) -> np.ndarray:
  """The float32[size] vector that `payload` encodes. CodecError if its length does not match."""
  _check(codec, block)
  enc = parse(payload, codec, size, block)
  out = np.empty(size, np.float32)
  chunked.run(lambda a, b, buf: decode_range(enc, a, b, out[a:b], buf), size, chunk_elems(block), threads,
              scratch_elems(block))
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
  chunked.run(lambda a, b, buf: decode_range(enc, a, b, out[a:b], buf, weight=weight, accumulate=True),
              out.size, chunk_elems(block), threads, scratch_elems(block))


def finite(enc: Encoded, *, threads: int = 1) -> bool:
  """Whether every decoded value of `enc` is finite, without decoding it whole: fp32 and bf16 check their
  values chunk by chunk; the quantized codecs check their scales, and decode only the blocks whose scale
  times the largest code magnitude could leave the float32 range (honest payloads have none)."""
  if enc.codec == "fp32":
    return all(chunked.run(lambda a, b, buf: bool(np.isfinite(enc.codes[a:b]).all()), enc.size,
                           _CHUNK_ELEMS, threads))
  if enc.codec == "bf16":
    return all(chunked.run(lambda a, b, buf: bool(((enc.codes[a:b] & 0x7F80) != 0x7F80).all()), enc.size,
                           _CHUNK_ELEMS, threads))
  if not np.isfinite(enc.scales).all():
    return False
  largest_code = 128 if enc.codec == "int8" else 8  # what a hostile payload's codes can reach
  risky = np.flatnonzero(np.abs(enc.scales) > np.finfo(np.float32).max / largest_code)
  buf = np.empty(scratch_elems(enc.block), np.float32)
  for b in risky:
    start = int(b) * enc.block
    stop = min(start + enc.block, enc.size)
    if enc.codec == "int4" and start % 2:  # an int4 range starts on a byte: take the block before too
      start -= enc.block
    seg = np.empty(stop - start, np.float32)
    with np.errstate(over="ignore", invalid="ignore"):  # overflowing to inf is what we look for
      decode_range(enc, start, stop, seg, buf)
    if not np.isfinite(seg).all():
      return False
  return True


def sum_squares(enc: Encoded, *, threads: int = 1) -> float:
  """sum(decode(enc) ** 2) in float64, chunk by chunk (for RDA's norms)."""

  work = scratch_elems(enc.block)

  def kernel(a, b, buf):
    vals = buf[work:work + b - a]
    decode_range(enc, a, b, vals, buf[:work])
    v64 = vals.astype(np.float64)
    return float(np.dot(v64, v64))

  return float(sum(chunked.run(kernel, enc.size, chunk_elems(enc.block), threads,
                               work + chunk_elems(enc.block))))


@functools.cache
def _squares_table(codec: str) -> np.ndarray:
  """float32[65536]: for each little-endian uint16 word of a quantized payload's codes, the sum of its
  codes' squares (int4: four codes, q = nibble - 8; int8: two)."""
  word = np.arange(1 << 16, dtype=np.int64)
  if codec == "int4":
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
  per_word = {"int4": 4, "int8": 2}.get(enc.codec)
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
    decode_range(enc, whole * block, enc.size, tail, np.empty(scratch_elems(block), np.float32))
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
  scale = np.maximum(absmax.astype(np.float64) / _QMAX[codec], _scales(absmax, _QMAX[codec]).astype(np.float64))
  half_scale = scale / 2 * (1 + _ROUNDING_SLACK)
  return np.repeat(half_scale, block)[:vec.size]

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
2^-120, where qmax / absmax would overflow float32) is quantized in float64 against its stored scale, which
is rounded up when it is subnormal: the bound is then half that stored scale. Non-finite inputs are not rejected here: with the
quantized formats they poison their block's scale and decode as NaN, so the receiver's finiteness check
(the syncer's "nonfinite" rejection) catches them in every format.
"""

from __future__ import annotations

import zlib

import numpy as np

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


# Below this block absmax, qmax / absmax would overflow float32 (qmax / 2^-120 < 2^127 still fits): such
# blocks are quantized in float64 against their stored scale instead.
_TINY_ABSMAX = np.float32(2.0**-120)


def _scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
  """The float32 scale of each block: absmax / qmax, rounded up where float32 rounded it down (only matters
  for subnormal scales, whose rounding is coarse), so that |x| / scale <= qmax holds for every element."""
  exact = absmax.astype(np.float64) / qmax
  scales = exact.astype(np.float32)
  low = scales.astype(np.float64) < exact
  if low.any():
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
  return scales


def _quantize(vec: np.ndarray, codec: str, block: int) -> tuple[np.ndarray, np.ndarray]:
  """Codes q (int8, [nb, block]) and scales (float32, [nb]) of the block absmax quantization."""
  qmax = _QMAX[codec]
  blocks = _blocks(vec, block)
  absmax = np.max(np.abs(blocks), axis=1)
  with np.errstate(invalid="ignore"):
    scales = _scales(absmax, qmax)
    tiny = (absmax > 0) & (absmax < _TINY_ABSMAX)
  with np.errstate(invalid="ignore"):
    normal = ~(absmax < _TINY_ABSMAX)  # NaN blocks too: their codes are garbage and their scale is NaN
    inv = np.divide(np.float32(qmax), absmax, out=np.zeros_like(absmax), where=normal)
    q = blocks * inv[:, None]
    if tiny.any():
      # qmax / absmax overflows float32 here: divide by the stored scale in float64 (exact enough).
      q[tiny] = blocks[tiny].astype(np.float64) / scales[tiny, None].astype(np.float64)
    np.rint(q, out=q)
    np.clip(q, -qmax, qmax, out=q)
    codes = q.astype(np.int8)  # NaN codes are garbage, but their block's scale is NaN too.
  return codes, scales


# Encoding and decoding go through the vector in chunks of about this many elements, so that their
# temporaries stay a few MB whatever the fragment's size: a learner's host memory is then its fragments in
# flight, not a multiple of them.
_CHUNK_ELEMS = 1 << 20


def _chunk_blocks(block: int) -> int:
  """Blocks per chunk: even, so that int4 chunks start on a byte boundary."""
  return max(2, (_CHUNK_ELEMS // block) // 2 * 2)


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


def encode(vec: np.ndarray, codec: str, block: int = 64) -> bytes:
  """`vec` (any shape, read as flat float32) as the payload bytes of `codec` (see the module docstring)."""
  _check(codec, block)
  vec = np.ascontiguousarray(vec, dtype=np.float32).reshape(-1)
  if codec == "fp32":
    return vec.astype("<f4", copy=False).tobytes()
  if codec == "bf16":
    out = np.empty(vec.size, "<u2")
    for start in range(0, vec.size, _CHUNK_ELEMS):
      out[start:start + _CHUNK_ELEMS] = _bf16_bits(vec[start:start + _CHUNK_ELEMS])
    return out.tobytes()
  nb = _num_blocks(vec.size, block)
  codes_len = encoded_size(vec.size, codec, block) - 4 * nb
  out = np.empty(codes_len + 4 * nb, np.uint8)
  scales = np.empty(nb, "<f4")
  step = _chunk_blocks(block)
  for b0 in range(0, nb, step):
    b1 = min(nb, b0 + step)
    codes, scales[b0:b1] = _quantize(vec[b0 * block:b1 * block], codec, block)
    if codec == "int8":
      out[b0 * block:b1 * block] = codes.reshape(-1).view(np.uint8)
    else:
      nibbles = (codes.reshape(-1) + 8).astype(np.uint8)
      if nibbles.size % 2:
        nibbles = np.concatenate([nibbles, np.zeros(1, np.uint8)])
      first = b0 * block // 2
      out[first:first + nibbles.size // 2] = nibbles[0::2] | (nibbles[1::2] << 4)
  out[codes_len:] = scales.view(np.uint8)
  return out.tobytes()


def decode(payload: bytes, codec: str, size: int, block: int = 64) -> np.ndarray:
  """The float32[size] vector that `payload` encodes. CodecError if its length does not match."""
  expected = encoded_size(size, codec, block)
  if len(payload) != expected:
    raise CodecError(f"{codec} payload for {size} elements (block {block}) must be {expected} bytes, "
                     f"got {len(payload)}")
  if codec == "fp32":
    return np.frombuffer(payload, "<f4").astype(np.float32)  # a writable copy
  out = np.empty(size, np.float32)
  if codec == "bf16":
    bits = np.frombuffer(payload, "<u2")
    for start in range(0, size, _CHUNK_ELEMS):
      out[start:start + _CHUNK_ELEMS] = (bits[start:start + _CHUNK_ELEMS].astype(np.uint32) << 16).view(np.float32)
    return out
  nb = _num_blocks(size, block)
  scales = np.frombuffer(payload, "<f4", count=nb, offset=expected - 4 * nb)
  step = _chunk_blocks(block)
  for b0 in range(0, nb, step):
    b1 = min(nb, b0 + step)
    n = (b1 - b0) * block
    if codec == "int8":
      q = np.frombuffer(payload, np.int8, count=n, offset=b0 * block).astype(np.float32)
    else:
      packed = np.frombuffer(payload, np.uint8, count=-(-n // 2), offset=b0 * block // 2)
      nibbles = np.empty(2 * packed.size, np.int8)
      nibbles[0::2] = packed & 0x0F
      nibbles[1::2] = packed >> 4
      q = nibbles[:n].astype(np.float32)
      q -= 8
    q = q.reshape(b1 - b0, block)
    q *= scales[b0:b1, None]
    stop = min(b1 * block, size)
    out[b0 * block:stop] = q.reshape(-1)[:stop - b0 * block]
  return out


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

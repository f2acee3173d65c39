"""The codecs' chunk kernels: one range of a vector encoded into, or decoded from, a payload in place.

`codec.py` defines the formats and runs these kernels over a vector chunk by chunk (`chunked.run`): every
temporary lives in a float32 work buffer of `scratch_elems(block)` elements that the kernel may overwrite,
so a pass costs about the bytes it must read and write, whatever the fragment's size. A range starts on a
multiple of `chunk_elems(block)` (whole, even numbers of blocks: int4 ranges start on a byte boundary).
The results are bitwise those of one pass over the whole vector, on any number of threads.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diloco_jax.outer import chunked

QMAX = {"int8": 127, "int4": 7, "int2": 1}  # the largest code magnitude of each quantized codec
CODES_PER_BYTE = {"int8": 1, "int4": 2, "int2": 4}
# Encoding and decoding go through the vector in chunks of about this many elements: their temporaries stay
# in the cache whatever the fragment's size, so a learner's host memory is its fragments in flight, not a
# multiple of them. (Tests turn it down to cross many chunk boundaries.)
CHUNK_ELEMS = chunked.CHUNK_ELEMS
# Below this block absmax the block is quantized in float64 (`_quantize_range`): qmax / absmax overflows
# float32 under about 2^-120, and absmax / qmax is subnormal (coarsely rounded) under about 2^-119.
_TINY_ABSMAX = np.float32(2.0**-112)


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A payload parsed once (its length checked, `codec.parse`) into numpy views of its codes and scales:
  what the range kernels read. `codes`: float32 (fp32), uint16 (bf16), int8 (int8) or packed uint8 (int4);
  `scales`: float32 per block, or None."""

  codec: str
  size: int
  block: int
  codes: np.ndarray
  scales: np.ndarray | None


def num_blocks(size: int, block: int) -> int:
  """Blocks of `block` elements that hold `size` elements (the last one possibly partial)."""
  return -(-size // block)


def chunk_elems(block: int) -> int:
  """Elements per chunk: a whole number of blocks, a multiple of 4 (so that int4 and int2 chunks start on a
  byte boundary)."""
  return max(4, (CHUNK_ELEMS // block) // 4 * 4) * block


def scratch_elems(block: int) -> int:
  """float32 work elements a chunk kernel needs: two halves of a chunk plus two blocks each."""
  return 2 * (chunk_elems(block) + 2 * block)


def bf16_bits(vec: np.ndarray) -> np.ndarray:
  """The bf16 codes (little-endian uint16) of a float32 vector: its top 16 bits after round-to-nearest-even."""
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


def block_scales(absmax: np.ndarray, qmax: int) -> np.ndarray:
  """The float32 scale of each block: absmax / qmax, rounded up where float32 rounded it down (only matters
  for subnormal scales, whose rounding is coarse), so that |x| / scale <= qmax holds for every element."""
  exact = absmax.astype(np.float64) / qmax
  scales = exact.astype(np.float32)
  low = scales.astype(np.float64) < exact
  if low.any():
    scales[low] = np.nextafter(scales[low], np.float32(np.inf))
  return scales


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
  nbc = -(-n // block)
  q = _codes_range(enc, start, nbc * block, buf)
  scales = enc.scales[start // block:start // block + nbc]
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


def _codes_range(enc: Encoded, start: int, m: int, buf: np.ndarray) -> np.ndarray:
  """The m codes of a quantized payload from element `start` on (whole blocks), as float32 in buf[:m],
  shaped [m / block, block]."""
  q = buf[:m]
  if enc.codec == "int8":
    np.copyto(q, enc.codes[start:start + m])
  elif enc.codec == "int2":
    # Byte b holds codes (b >> 2k) & 3 for k = 0..3, each q + 2.
    nbytes = -(-m // 4)
    half = buf.size // 2
    quads = buf[half:half + nbytes].view(np.uint8)[:4 * nbytes].reshape(nbytes, 4)
    packed = enc.codes[start // 4:start // 4 + nbytes]
    for k in range(4):
      np.right_shift(packed, 2 * k, out=quads[:, k])
    quads &= 3
    np.copyto(q, quads.reshape(-1)[:m])
    q -= 2
  else:
    # Each byte b -> the code pair (b & 15, b >> 4) as the two bytes of a little-endian uint16
    # ((b << 4 | b) & 0x0F0F), so that the uint16 array read as bytes holds the codes in order.
    nbytes = -(-m // 2)
    half = buf.size // 2
    pairs = buf[half:half + nbytes].view(np.uint16)[:nbytes]  # within the second half: q stays free
    packed = buf[half + nbytes:half + 2 * nbytes].view(np.uint16)[:nbytes]
    np.copyto(packed, enc.codes[start // 2:start // 2 + nbytes])
    np.left_shift(packed, 4, out=pairs)
    pairs |= packed
    pairs &= 0x0F0F
    np.copyto(q, pairs.view(np.uint8)[:m])
    q -= 8
  return q.reshape(m // enc.block, enc.block)


def encode_range(x: np.ndarray, codec: str, block: int, start: int, out: np.ndarray, scales_out: np.ndarray,
                 buf: np.ndarray, *, owned: bool = False, residual: np.ndarray | None = None) -> None:
  """Encode x, the vector's elements [start, start + x.size), into the payload array `out` (uint8, codes
  from the payload's start) and `scales_out` (float32 per block). `buf`: a float32 work array of
  `scratch_elems(block)` elements; `owned`: x is buf[:x.size] (it is then overwritten). With `residual`
  (float32[x.size]), also residual += the decoded chunk, bitwise as `decode` computes it."""
  n = x.size
  if codec == "fp32":
    out[4 * start:4 * (start + n)].view("<f4")[:] = x
    if residual is not None:
      residual += x
    return
  if codec == "bf16":
    top = bf16_bits(x)
    out[2 * start:2 * (start + n)].view("<u2")[:] = top
    if residual is not None:
      half = buf.size // 2
      dec = buf[half:half + n].view(np.uint32)
      np.copyto(dec, top)
      dec <<= 16
      residual += dec.view(np.float32)
    return
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # where() keeps only finite results
    codes = _quantize_range(x, QMAX[codec], block, start, scales_out, buf, owned=owned, residual=residual)
    # NaN blocks get garbage codes, but their scale is NaN too.
    if codec == "int8":
      np.copyto(out[start:start + codes.size].view(np.int8), codes, casting="unsafe")
    elif codec == "int2":
      _pack_int2(codes, start, out, buf)
    else:
      _pack_int4(codes, start, out, buf)


def _quantize_range(x: np.ndarray, qmax: int, block: int, start: int, scales_out: np.ndarray, buf: np.ndarray, *,
                    owned: bool, residual: np.ndarray | None) -> np.ndarray:
  """x's blocks quantized: their codes in [-qmax, qmax] as float32 in buf[:m] (m: x's whole blocks, the last
  one zero-padded), their scales written to `scales_out`; with `residual`, residual += the decoded codes."""
  n = x.size
  half = buf.size // 2
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
  tiny = (absmax > 0) & (absmax < _TINY_ABSMAX)
  tiny_codes = None
  if tiny.any():
    # qmax / absmax would overflow float32 (or the scale is subnormal, coarsely rounded): these rare
    # blocks are quantized in float64 against their stored scale, rounded up so |x| / scale <= qmax.
    scales[tiny] = block_scales(absmax[tiny], qmax)
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
  return xa


def _fields(codes: np.ndarray, offset: int, per_byte: int, pad: int, buf: np.ndarray) -> tuple[np.ndarray, int]:
  """The float32 codes (buf[:m]) plus `offset` as uint8 fields, one per code, padded with `pad` to whole
  bytes of `per_byte` codes, in the second half of `buf`; and the packed length in bytes. `codes` is
  overwritten."""
  m = codes.size
  half = buf.size // 2
  codes += offset
  nbytes = -(-m // per_byte)
  fields = buf[half:half + nbytes].view(np.uint8)[:per_byte * nbytes]
  np.copyto(fields[:m], codes, casting="unsafe")
  fields[m:] = pad
  return fields, nbytes


def _pack_int4(codes: np.ndarray, start: int, out: np.ndarray, buf: np.ndarray) -> None:
  """The float32 codes (buf[:m], in [-7, 7]) as nibbles q + 8, two per byte, into `out` from element
  `start` on (element 2i in the low nibble of byte i). `codes` is overwritten."""
  half = buf.size // 2
  nibbles, nbytes = _fields(codes, 8, 2, 0, buf)  # an odd number of codes ends in a zero nibble
  # Code pairs (c0, c1) as little-endian uint16 words c0 + 256 c1 -> the bytes c0 | c1 << 4.
  words = nibbles.view(np.uint16)
  packed = buf[half + nbytes:half + 2 * nbytes].view(np.uint16)[:nbytes]
  np.right_shift(words, 4, out=packed)
  packed |= words
  np.copyto(out[start // 2:start // 2 + nbytes], packed, casting="unsafe")


def _pack_int2(codes: np.ndarray, start: int, out: np.ndarray, buf: np.ndarray) -> None:
  """The float32 codes (buf[:m], in [-1, 1]) as 2-bit fields q + 2, four per byte, into `out` from element
  `start` on (element 4i + k in bits 2k..2k+1 of byte i). `codes` is overwritten."""
  fields, nbytes = _fields(codes, 2, 4, 2, buf)  # codes past the vector's end are zeros (field 2)
  quads = fields.reshape(nbytes, 4)
  packed = out[start // 4:start // 4 + nbytes]
  np.copyto(packed, quads[:, 0])
  for k in range(1, 4):
    packed |= quads[:, k] << np.uint8(2 * k)

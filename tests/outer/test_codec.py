"""Codecs: round-trip error within the documented bound, sizes, checksums, malformed payloads."""

import warnings

import numpy as np
import pytest

from diloco_jax.outer import codec, codec_kernels


def vectors():
  rng = np.random.default_rng(1)
  for size in (1, 7, 63, 64, 65, 1000, 4099):
    yield rng.standard_normal(size).astype(np.float32) * rng.uniform(1e-3, 1e3)
  v = rng.standard_normal(300).astype(np.float32)
  v[64:128] = 0.0  # a whole zero block
  v[200] = 1e4  # one outlier block
  yield v


@pytest.mark.parametrize("name", codec.CODECS)
@pytest.mark.parametrize("block", [64, 7, 32])
def test_roundtrip_within_bound(name, block):
  for vec in vectors():
    payload = codec.encode(vec, name, block)
    assert len(payload) == codec.encoded_size(vec.size, name, block)
    out = codec.decode(payload, name, vec.size, block)
    assert out.dtype == np.float32 and out.shape == vec.shape
    err = np.abs(out.astype(np.float64) - vec)
    bound = codec.error_bound(vec, name, block)
    assert (err <= bound).all(), (name, block, vec.size, float((err - bound).max()))
    if name == "fp32":
      np.testing.assert_array_equal(out, vec)
    if vec.size == 300:
      np.testing.assert_array_equal(out[64:128], 0.0)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_quantized_error_is_not_trivially_zero(name):
  # The bound is tight enough to mean something: the error reaches a good part of it.
  vec = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
  out = codec.decode(codec.encode(vec, name), name, vec.size)
  ratio = np.abs(out - vec).max() / codec.error_bound(vec, name).max()
  assert 0.5 < ratio <= 1.0


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("magnitude", [1e-30, 3e-37, 1e-38, 1e-40, 1e-43, 1e-45])
def test_tiny_blocks_stay_within_the_bound(name, magnitude):
  """Blocks whose largest magnitude is below ~1e-37 used to overflow qmax / absmax: every nonzero element
  decoded as +-absmax (up to 254x the bound) with a RuntimeWarning. Now within the bound, silently."""
  rng = np.random.default_rng(3)
  vec = (rng.standard_normal(256) * magnitude).astype(np.float32)
  vec[:64] = rng.standard_normal(64).astype(np.float32)  # a normal block beside the tiny ones
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = codec.decode(codec.encode(vec, name, 64), name, vec.size, 64)
  err = np.abs(out.astype(np.float64) - vec)
  bound = codec.error_bound(vec, name, 64)
  assert (err <= bound).all(), float((err / bound).max())
  # And the bound is about half a step of the block's own scale, not the normal block's.
  assert bound[64:].max() <= max(float(np.abs(vec[64:]).max()) / {"int8": 127, "int4": 7, "int2": 1}[name], 2.0**-149)


def test_bf16_rounds_to_nearest_even():
  vec = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, -np.inf], np.float32)
  out = codec.decode(codec.encode(vec, "bf16"), "bf16", vec.size)
  np.testing.assert_array_equal(out, [1.0, 1.0 + 4 * 2**-8, -2.5, np.inf, -np.inf])
  nan = codec.decode(codec.encode(np.array([np.nan], np.float32), "bf16"), "bf16", 1)
  assert np.isnan(nan).all()


@pytest.mark.parametrize("name", codec.CODECS)
def test_nonfinite_input_decodes_nonfinite(name):
  vec = np.ones(100, np.float32)
  vec[70] = np.nan
  out = codec.decode(codec.encode(vec, name), name, vec.size)
  assert not np.isfinite(out).all()


def test_sizes():
  assert codec.encoded_size(100, "fp32") == 400
  assert codec.encoded_size(100, "bf16") == 200
  assert codec.encoded_size(100, "int8", 64) == 2 * 64 + 2 * 4
  assert codec.encoded_size(100, "int4", 64) == 64 + 2 * 4
  assert codec.encoded_size(5, "int4", 5) == 3 + 4  # an odd number of codes rounds up to whole bytes
  assert codec.encoded_size(100, "int2", 64) == 32 + 2 * 4
  assert codec.encoded_size(5, "int2", 5) == 2 + 4  # four codes per byte, rounded up


@pytest.mark.parametrize("name", codec.CODECS)
def test_checksum_catches_flipped_byte_and_wrong_length_raises(name):
  vec = np.random.default_rng(3).standard_normal(129).astype(np.float32)
  payload = codec.encode(vec, name)
  crc = codec.checksum(payload)
  for i in (0, len(payload) // 2, len(payload) - 1):
    flipped = bytearray(payload)
    flipped[i] ^= 0x01
    assert codec.checksum(bytes(flipped)) != crc
  with pytest.raises(codec.CodecError):
    codec.decode(payload[:-1], name, vec.size)
  with pytest.raises(codec.CodecError):
    codec.decode(payload + b"\0", name, vec.size)
  with pytest.raises(codec.CodecError):
    codec.decode(payload, name, vec.size + 64)


def test_unknown_codec():
  with pytest.raises(codec.CodecError, match="unknown codec"):
    codec.encode(np.zeros(3, np.float32), "fp8")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int2"])
@pytest.mark.parametrize("block", [64, 7])
def test_chunked_coding_is_byte_identical_to_one_pass(fmt, block, monkeypatch):
  """Encoding in bounded chunks (what keeps host memory flat) changes no byte and no decoded value."""
  rng = np.random.default_rng(3)
  vec = rng.standard_normal(50_001).astype(np.float32) * np.repeat(rng.uniform(0.1, 10, 50_001 // 7 + 1), 7)[:50_001]
  one_pass = codec.encode(vec, fmt, block)
  decoded = codec.decode(one_pass, fmt, vec.size, block)
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 300)  # many chunks, and a ragged last one
  assert codec.encode(vec, fmt, block) == one_pass
  np.testing.assert_array_equal(codec.decode(one_pass, fmt, vec.size, block), decoded)


# ---- the chunk kernels against one-pass references ------------------------------------------------------


def _reference_encode(vec, name, block):
  """The codec formats written out in one pass, without chunks or tricks (the module docstring's words)."""
  vec = np.asarray(vec, np.float32).reshape(-1)
  if name == "fp32":
    return vec.tobytes()
  if name == "bf16":
    bits = vec.view(np.uint32).astype(np.uint64)
    top = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    return top.tobytes()
  qmax = {"int8": 127, "int4": 7, "int2": 1}[name]
  nb = -(-vec.size // block)
  blocks = np.zeros(nb * block, np.float32)
  blocks[:vec.size] = vec
  blocks = blocks.reshape(nb, block)
  absmax = np.abs(blocks).max(axis=1)
  scales = (absmax / np.float32(qmax)).astype(np.float32)
  with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
    inv = np.where(absmax > 0, np.float32(qmax) / np.where(absmax > 0, absmax, 1), 0).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[:, None]), -qmax, qmax)
  q[np.isinf(inv)] = np.nan_to_num(q[np.isinf(inv)], nan=0.0)  # a denormal absmax: zeros stay zeros
  q = q.astype(np.int8).reshape(-1)
  if name == "int8":
    return q.tobytes() + scales.astype("<f4").tobytes()
  if name == "int2":
    fields = (q + 2).astype(np.uint8)
    fields = np.append(fields, np.full(-fields.size % 4, 2, np.uint8)).reshape(-1, 4)
    packed = fields[:, 0] | (fields[:, 1] << 2) | (fields[:, 2] << 4) | (fields[:, 3] << 6)
    return packed.astype(np.uint8).tobytes() + scales.astype("<f4").tobytes()
  nibbles = (q + 8).astype(np.uint8)
  if nibbles.size % 2:
    nibbles = np.append(nibbles, np.uint8(0))
  return (nibbles[0::2] | (nibbles[1::2] << 4)).tobytes() + scales.astype("<f4").tobytes()


def _reference_decode(payload, name, size, block):
  if name == "fp32":
    return np.frombuffer(payload, "<f4").copy()
  if name == "bf16":
    return (np.frombuffer(payload, "<u2").astype(np.uint32) << 16).view(np.float32)
  nb = -(-size // block)
  scales = np.frombuffer(payload, "<f4", offset=len(payload) - 4 * nb)
  if name == "int8":
    q = np.frombuffer(payload, np.int8, count=nb * block).astype(np.float32)
  elif name == "int2":
    packed = np.frombuffer(payload, np.uint8, count=len(payload) - 4 * nb)
    q = np.stack([(packed >> (2 * k)) & 3 for k in range(4)], axis=1).reshape(-1)[:nb * block].astype(np.float32)
    q -= 2
  else:
    packed = np.frombuffer(payload, np.uint8, count=len(payload) - 4 * nb)
    q = np.stack([packed & 0x0F, packed >> 4], axis=1).reshape(-1)[:nb * block].astype(np.float32) - 8
  return (q.reshape(nb, block) * scales[:, None]).reshape(-1)[:size]


def _kernel_vectors():
  rng = np.random.default_rng(5)
  for size, block in ((1, 64), (63, 64), (129, 64), (5000, 7), (70_001, 64), (70_001, 1)):
    vec = (rng.standard_normal(size) * rng.uniform(1e-3, 1e3)).astype(np.float32)
    vec[size // 3:size // 3 + 2 * block] = 0.0  # whole zero blocks
    vec[size // 2] = -1e-40  # a denormal
    yield vec, block


@pytest.mark.parametrize("name", codec.CODECS)
def test_chunk_kernels_are_bitwise_the_one_pass_formats(name, monkeypatch):
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 4096)
  for vec, block in _kernel_vectors():
    payload = codec.encode(vec, name, block)
    assert payload == _reference_encode(vec, name, block), (vec.size, block)
    err = np.abs(codec.decode(payload, name, vec.size, block).astype(np.float64) - vec)
    assert (err <= codec.error_bound(vec, name, block)).all()  # a denormal's block included
    np.testing.assert_array_equal(codec.decode(payload, name, vec.size, block).view(np.uint32),
                                  _reference_decode(payload, name, vec.size, block).view(np.uint32))
    # encode_residual: encode(target - reference) and reference += decode(payload), bitwise.
    reference = np.random.default_rng(vec.size).standard_normal(vec.size).astype(np.float32)
    updated = reference.copy()
    residual_payload = codec.encode_residual(vec, updated, name, block, threads=2)
    assert residual_payload == _reference_encode(vec - reference, name, block)
    expected = reference + _reference_decode(residual_payload, name, vec.size, block)
    np.testing.assert_array_equal(updated.view(np.uint32), expected.view(np.uint32))
    # decode_accumulate: out += w * decode, within a float32 rounding of each product.
    out = reference.copy()
    codec.decode_accumulate(payload, name, out, 0.3, block)
    decoded = _reference_decode(payload, name, vec.size, block)
    np.testing.assert_allclose(out, reference + np.float32(0.3) * decoded, rtol=0,
                               atol=2 * 2.0**-24 * (np.abs(reference) + np.abs(decoded)).max())
    enc = codec.parse(payload, name, vec.size, block)
    assert codec.finite(enc)
    np.testing.assert_allclose(codec.sum_squares(enc, threads=3), np.sum(decoded.astype(np.float64)**2),
                               rtol=1e-12)


@pytest.mark.parametrize("name", codec.CODECS)
@pytest.mark.parametrize("size,block", [(70_001, 64), (3001, 7), (1000, 4), (5, 64), (200_000, 128)])
def test_norm_without_decoding_is_the_decoded_norm(name, size, block, monkeypatch):
  """`norm` (code tables and scales for int8 / int4) against the norm of the decoded vector: equal up to
  float32's rounding of the decoded values, on any thread count, whatever a payload's padding codes hold."""
  monkeypatch.setattr(codec_kernels, "CHUNK_ELEMS", 4096)  # many chunks, and a ragged last one
  rng = np.random.default_rng(size + block)
  vec = (rng.standard_normal(size) * rng.uniform(0.01, 3.0)).astype(np.float32)
  payload = bytearray(codec.encode(vec, name, block))
  if name in ("int8", "int4", "int2"):  # hostile padding: codes past `size` in the last block are no part of it
    padded = -(-size // block) * block
    per_byte = {"int8": 1, "int4": 2, "int2": 4}[name]
    first, last = -(-size // per_byte), -(-padded // per_byte)
    payload[first:last] = b"\x7f" * (last - first)
  payload = bytes(payload)
  decoded = codec.decode(payload, name, size, block).astype(np.float64)
  expected = np.sqrt(decoded @ decoded)
  enc = codec.parse(payload, name, size, block)
  got = codec.norm(enc)
  assert abs(got - expected) <= 2.0**-22 * expected
  assert codec.norm(enc, threads=3) == got
  zeros = codec.parse(codec.encode(np.zeros(size, np.float32), name, block), name, size, block)
  assert codec.norm(zeros) == 0.0


@pytest.mark.parametrize("name", codec.CODECS)
def test_finite_catches_every_nonfinite_decode(name):
  for bad in (np.nan, np.inf, -np.inf):
    vec = np.ones(1000, np.float32)
    vec[777] = bad
    payload = codec.encode(vec, name)
    assert not np.isfinite(codec.decode(payload, name, vec.size)).all()
    assert not codec.finite(codec.parse(payload, name, vec.size))


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
def test_finite_catches_hostile_codes_beyond_float32(name):
  """A finite scale whose block holds a code the honest encoder never writes (-128 for int8, nibble 0 =
  -8 for int4, field 0 = -2 for int2) can decode to -inf: `finite` looks at such blocks' values, not only
  at the scales."""
  size = 256
  payload = bytearray(codec.encode(np.ones(size, np.float32), name))
  nb = size // 64
  scales = np.frombuffer(payload, "<f4", offset=len(payload) - 4 * nb).copy()
  honest = {"int8": 127, "int4": 7, "int2": 1}[name]
  scales[2] = np.finfo(np.float32).max / (honest + 0.5)  # finite, and honest codes x scale stay finite
  payload[len(payload) - 4 * nb:] = scales.tobytes()
  enc = codec.parse(bytes(payload), name, size)
  assert codec.finite(enc)  # honest codes only: every value finite
  if name == "int8":
    payload[2 * 64 + 5] = 0x80  # -128
  elif name == "int2":
    payload[(2 * 64 + 5) // 4] &= ~np.uint8(3 << 2)  # element 4i + 1's field 0: code -2
  else:
    payload[(2 * 64 + 5) // 2] &= 0xF0  # low nibble 0: code -8
  hostile = codec.parse(bytes(payload), name, size)
  assert not np.isfinite(codec.decode(bytes(payload), name, size)).all()
  assert not codec.finite(hostile)

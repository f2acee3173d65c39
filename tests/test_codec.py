"""Codecs: round-trip error within the documented bound, sizes, checksums, malformed payloads."""

import warnings

import numpy as np
import pytest

from diloco_jax import codec


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


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_error_is_not_trivially_zero(name):
  # The bound is tight enough to mean something: the error reaches a good part of it.
  vec = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
  out = codec.decode(codec.encode(vec, name), name, vec.size)
  ratio = np.abs(out - vec).max() / codec.error_bound(vec, name).max()
  assert 0.5 < ratio <= 1.0


@pytest.mark.parametrize("name", ["int8", "int4"])
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
  assert bound[64:].max() <= max(float(np.abs(vec[64:]).max()) / {"int8": 127, "int4": 7}[name], 2.0**-149)


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


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("block", [64, 7])
def test_chunked_coding_is_byte_identical_to_one_pass(fmt, block, monkeypatch):
  """Encoding in bounded chunks (what keeps host memory flat) changes no byte and no decoded value."""
  rng = np.random.default_rng(3)
  vec = rng.standard_normal(50_001).astype(np.float32) * np.repeat(rng.uniform(0.1, 10, 50_001 // 7 + 1), 7)[:50_001]
  one_pass = codec.encode(vec, fmt, block)
  decoded = codec.decode(one_pass, fmt, vec.size, block)
  monkeypatch.setattr(codec, "_CHUNK_ELEMS", 300)  # many chunks, and a ragged last one
  assert codec.encode(vec, fmt, block) == one_pass
  np.testing.assert_array_equal(codec.decode(one_pass, fmt, vec.size, block), decoded)

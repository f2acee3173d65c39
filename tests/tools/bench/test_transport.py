"""`bench transport` (tools/bench/transport.py) end to end at a small size: its server half in a child
process, the real client over gRPC and the data plane, every codec pushed and pulled."""

import pytest

from diloco_jax.tools.bench import transport

pytestmark = pytest.mark.process  # it starts its server half as a child process


def test_every_codec_is_pushed_and_pulled_over_both_paths():
  rows = transport.run(0.25, repeats=1, chunk_kb=64)
  assert {(r["path"], r["codec"]) for r in rows} == {(p, c) for p in ("grpc", "data") for c in transport.CODECS}
  for r in rows:
    assert r["push_mb_s"] > 0 and r["pull_mb_s"] > 0, r

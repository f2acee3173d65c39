"""The learner/syncer line: chunking and reassembly, the interfaces' implementations, the run token."""

import os

import pytest

import helpers
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol.messages import ProtocolError, Reassembler, chunks
from diloco_jax.transports.grpc_client import GrpcTransport
from diloco_jax.transports.inprocess import InProcessTransport


def test_chunks_reassemble_to_the_payload():
  payload = os.urandom(10_000)
  pieces = list(chunks(payload, 4096))
  assert [o for o, _ in pieces] == [0, 4096, 8192] and [len(d) for _, d in pieces] == [4096, 4096, 1808]
  r = Reassembler(len(payload))
  for offset, data in pieces:
    r.add(offset, data)
  assert r.finish() == payload
  assert list(chunks(b"", 10)) == [] and Reassembler(0).finish() == b""


@pytest.mark.parametrize("feed,reason", [
    ([(0, b"abc"), (0, b"abc")], "sequence"),  # a repeated chunk
    ([(3, b"abc")], "sequence"),  # a gap
    ([(0, b"abcdefghijk")], "oversize"),  # more than declared
])
def test_reassembler_refuses_broken_streams(feed, reason):
  r = Reassembler(10)
  with pytest.raises(ProtocolError) as info:
    for offset, data in feed:
      r.add(offset, data)
  assert info.value.reason == reason


def test_reassembler_refuses_a_short_stream_and_allocates_only_what_arrived():
  r = Reassembler(1 << 40)  # a hostile declaration allocates nothing
  r.add(0, b"x" * 100)
  assert r.received == 100
  with pytest.raises(ProtocolError, match="truncated") as info:
    r.finish()
  assert info.value.reason == "truncated"


def test_both_transports_and_the_core_implement_the_interfaces():
  core = helpers.make_core((8,))
  assert isinstance(core, protocol.SyncerAPI)
  assert isinstance(InProcessTransport(core), protocol.Transport)
  t = GrpcTransport("127.0.0.1:1", "token", 0)
  try:
    assert isinstance(t, protocol.Transport)
  finally:
    t.close()


def test_read_token(tmp_path, monkeypatch):
  monkeypatch.delenv(protocol.TOKEN_ENV, raising=False)
  with pytest.raises(ValueError, match="no run token"):
    protocol.read_token(None)
  monkeypatch.setenv(protocol.TOKEN_ENV, " from-env \n")
  assert protocol.read_token(None) == "from-env"
  path = tmp_path / "token"
  path.write_text("from-file\n")
  path.chmod(0o600)
  assert protocol.read_token(str(path)) == "from-file"
  path.write_text("\n")
  with pytest.raises(ValueError, match="empty"):
    protocol.read_token(str(path))

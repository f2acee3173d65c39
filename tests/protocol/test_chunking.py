"""The learner/syncer line: chunking and reassembly, the interfaces' implementations, the run token."""

import os

import grpc
import pytest

import helpers
from diloco_jax.protocol import interfaces
from diloco_jax.protocol import run_token
from diloco_jax.protocol.chunking import ProtocolError, Reassembler, chunks
from diloco_jax.protocol.reasons import REASONS, REJOIN_REASONS, Reason, Rejected, status_of
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
  assert isinstance(core, interfaces.SyncerAPI)
  assert isinstance(InProcessTransport(core), interfaces.Transport)
  t = GrpcTransport("127.0.0.1:1", "token", 0)
  try:
    assert isinstance(t, interfaces.Transport)
  finally:
    t.close()


def test_read_token(tmp_path, monkeypatch):
  monkeypatch.delenv(run_token.TOKEN_ENV, raising=False)
  with pytest.raises(ValueError, match="no run token"):
    run_token.read_token(None)
  monkeypatch.setenv(run_token.TOKEN_ENV, " from-env \n")
  assert run_token.read_token(None) == "from-env"
  path = tmp_path / "token"
  path.write_text("from-file\n")
  path.chmod(0o600)
  assert run_token.read_token(str(path)) == "from-file"
  path.write_text("\n")
  with pytest.raises(ValueError, match="empty"):
    run_token.read_token(str(path))


def test_every_reason_has_a_status_code_and_every_core_reason_is_a_reason():
  for reason in Reason:
    assert isinstance(grpc.StatusCode[reason.status], grpc.StatusCode), reason
    assert isinstance(reason, str) and reason == reason.value and status_of(reason.value) == reason.status
  assert REASONS and all(isinstance(r, str) and Reason(r).by_core for r in REASONS)
  assert set(REASONS) == {r.value for r in Reason if r.by_core} and len(set(REASONS)) == len(REASONS)
  assert set(REJOIN_REASONS) <= set(REASONS)
  assert status_of("not a reason") == "INVALID_ARGUMENT"
  # A reason compares, hashes and prints as its string: counters keyed by reason strings keep working.
  e = Rejected("outlier", "too large")
  assert e.reason is Reason.OUTLIER and e.reason == "outlier" and {"outlier": 1}[e.reason] == 1
  assert str(e) == "outlier: too large" and f"{e.reason}" == "outlier"

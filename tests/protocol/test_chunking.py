"""Chunking and reassembly of payloads (`protocol/chunking.py`)."""

import os

import pytest

from diloco_jax.protocol.chunking import ProtocolError, Reassembler, chunks


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

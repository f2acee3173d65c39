"""The raw-TCP data plane's framing: Push and Pull payloads at socket speed, beside the gRPC control plane.
A connection (TLS when the service has TLS) carries transfers one after another; integers little-endian:

    server -> client   HELLO   magic b"DLCD", version (1 byte), nonce (32 random bytes), once
    client -> server   AUTH    HMAC-SHA256(run token, nonce) (32 bytes), once, before the first REQUEST
    client -> server   REQUEST op (b"P" push / b"G" pull), header length (u32), header: a PushHeader /
                               PullRequest protobuf
    push:  client -> server    the payload: exactly PushHeader.total_size bytes
           server -> client    REPLY (below) with a PushResponse
    pull:  server -> client    REPLY with a PullHeader; if found, PullHeader.total_size payload bytes
    REPLY   status (1 byte: 0 ok, 1 refused), body length (u32), body: the protobuf (ok) or UTF-8 JSON
            {"reason", "message"} (refused; the reason a `reasons.Reason`). A refusal ends the connection.

The token never crosses (`mac`), bodies are at most `MAX_HEADER_BYTES`, payloads are read against a declared
size the receiver bounds first (`recv_payload`). The syncer decides (`syncer/server/dataplane.py`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct

from diloco_jax.protocol.chunking import BufferPool, ProtocolError, Reassembler

MAGIC = b"DLCD"
VERSION = 2  # 2: a connection carries many transfers (1: one transfer per connection)
NONCE_BYTES = 32
MAC_BYTES = 32
HELLO_BYTES = len(MAGIC) + 1 + NONCE_BYTES
MAX_HEADER_BYTES = 64 << 10
OP_PUSH, OP_PULL = b"P", b"G"
OK, REFUSED = 0, 1
IO_CHUNK = 1 << 20  # bytes per socket read or write (and per WAN pacing step)


class WireError(ConnectionError):
  """A data-plane stream that breaks the framing, fails authentication, or ends early."""


def hello(nonce: bytes) -> bytes:
  return MAGIC + bytes([VERSION]) + nonce


def parse_hello(data: bytes) -> bytes:
  """The nonce of a HELLO (WireError if it is not one)."""
  if len(data) != HELLO_BYTES or data[:4] != MAGIC or data[4] != VERSION:
    raise WireError("not a diloco data-plane server (bad hello)")
  return data[5:]


def mac(token: str, nonce: bytes) -> bytes:
  """The client's proof of the run token for this connection: an HMAC of the server's fresh nonce (the
  token itself never crosses), which the server compares in constant time."""
  return hmac.new(token.encode(), b"diloco-data-plane:" + nonce, hashlib.sha256).digest()


def request(token: str, nonce: bytes, op: bytes, header: bytes) -> bytes:
  """A connection's first request: AUTH + op + the header, as one write."""
  return mac(token, nonce) + next_request(op, header)


def next_request(op: bytes, header: bytes) -> bytes:
  """A later request on an authenticated connection: op + the header, as one write."""
  if op not in (OP_PUSH, OP_PULL) or len(header) > MAX_HEADER_BYTES:
    raise ValueError(f"bad data-plane request: op {op!r}, header of {len(header)} bytes")
  return op + struct.pack("<I", len(header)) + header


def reply(status: int, body: bytes) -> bytes:
  return bytes([status]) + struct.pack("<I", len(body)) + body


def refusal(reason: str, message: str) -> bytes:
  return reply(REFUSED, json.dumps({"reason": reason, "message": message[:2000]}).encode())


def parse_refusal(body: bytes) -> tuple[str, str]:
  """(reason, message) of a REFUSED reply's body, both bounded."""
  try:
    d = json.loads(body.decode())
    return str(d["reason"])[:64], str(d["message"])[:2000]
  except (ValueError, KeyError, TypeError):
    return "protocol", "unreadable refusal"


def recv_exact(sock: socket.socket, n: int, what: str) -> bytes:
  """Exactly n bytes (n small: a frame's fixed part or a bounded header); WireError if the stream ends."""
  buf = bytearray(n)
  view = memoryview(buf)
  got = 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if not k:
      raise WireError(f"connection closed in the {what} ({got} of {n} bytes)")
    got += k
  return bytes(buf)


def recv_frame(sock: socket.socket, what: str) -> tuple[int, bytes]:
  """(status, body) of a REPLY, the body at most MAX_HEADER_BYTES."""
  head = recv_exact(sock, 5, what)
  status, length = head[0], struct.unpack("<I", head[1:])[0]
  if status not in (OK, REFUSED) or length > MAX_HEADER_BYTES:
    raise WireError(f"bad {what}: status {status}, {length} bytes")
  return status, recv_exact(sock, length, what)


def recv_payload(sock: socket.socket, total: int, what: str, on_chunk=lambda n: None,
                 pool: BufferPool | None = None) -> bytearray:
  """`total` bytes (declared by the sender and bounded by the caller) through a `chunking.Reassembler`,
  which holds only what arrived, so memory grows with what arrives (or copies into a free buffer of that
  size from `pool`, which keeps the result for later transfers); `on_chunk(n)` after each read (byte
  counts, WAN pacing)."""
  into = pool.take(total) if pool is not None else None
  payload = Reassembler(total, what, into=into)
  buf = bytearray(min(IO_CHUNK, max(total, 1)))
  view = memoryview(buf)
  while payload.received < total:
    k = sock.recv_into(view, min(len(buf), total - payload.received))
    if not k:
      raise WireError(f"connection closed in the {what} ({payload.received} of {total} bytes)")
    on_chunk(k)
    try:
      payload.add(payload.received, view[:k])
    except ProtocolError as e:  # cannot happen with in-order reads; kept as the one place that checks
      raise WireError(str(e)) from None
  out = payload.finish(copy=False)  # a bytearray: nobody else holds it
  if pool is not None:
    pool.adopt(out)
  return out


def send_payload(sock: socket.socket, payload, before_chunk=lambda n: None, chunk: int = IO_CHUNK) -> None:
  """`payload` in pieces of `chunk` bytes, `before_chunk(n)` ahead of each (WAN pacing, byte counts)."""
  view = memoryview(payload).cast("B")
  for offset in range(0, len(view), chunk):
    piece = view[offset:offset + chunk]
    before_chunk(len(piece))
    sock.sendall(piece)

"""The syncer's raw-TCP data plane (wire.py, syncer/dataplane.py) over real loopback sockets: payloads,
exact byte counts, the token, hostile streams, timeouts, refusals from the core, and the gRPC fallback."""

import socket
import struct
import threading
import time

import numpy as np
import pytest

import helpers
from diloco_jax.protocol import wire
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer.server import dataplane
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.syncer.server import limits as limits_lib
from diloco_jax.transports import errors
from diloco_jax.transports import grpc_client as grpc_transport

TOKEN = "data-plane-token-0123"
FP = helpers.FP


@pytest.fixture
def syncer():
  core = helpers.make_core((5000, 300), codec="int4", downlink="fp32")
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  yield core, handle
  handle.stop(grace=0)


def client(handle, **kw):
  kw.setdefault("unreachable_deadline_s", 2.0)
  return grpc_transport.GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, 0, **kw)


def push_of(core, fragment=0, **overrides):
  n = core.settings.sizes[fragment]
  return helpers.make_push(0, np.linspace(-0.01, 0.01, n), core=core, fragment=fragment, **overrides)


def test_push_and_pull_over_the_data_plane_count_every_byte(syncer):
  core, handle = syncer
  with client(handle) as t:
    t.join(0, FP)
    assert t.data_port == handle.data_plane.port != handle.port
    sent0, received0 = t.bytes_sent, t.bytes_received
    push = push_of(core)
    receipt = t.push(push)
    header = pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, base_version=0, steps=10, tokens=100,
                           codec="int4", checksum=push.checksum, total_size=len(push.payload))
    reply = pb.PushResponse(fragment=0, round=receipt.round, late=receipt.late, epoch=receipt.epoch,
                            version=receipt.version).ByteSize()
    assert receipt.version == 1  # the version that merges it, over the data plane too
    assert t.bytes_sent - sent0 == wire.MAC_BYTES + 1 + 4 + header.ByteSize() + len(push.payload)
    assert t.bytes_received - received0 == wire.HELLO_BYTES + 5 + reply
    assert core.status()["versions"] == [1, 0]
    published = t.pull(0, 1, timeout_s=5.0)
    assert published.payload == core.pull(0, 1).payload and published.version == 1
    assert t.pull(0, 2, timeout_s=0.2) is None  # the long-poll times out: not found
  counters = handle.gate.counters()
  assert counters["data_pushes"] == 1 and counters["data_pulls"] == 1 and counters["pushes"] == 1


def test_core_refusals_travel_back_with_their_reason(syncer):
  core, handle = syncer
  with client(handle) as t:
    t.join(0, FP)
    with pytest.raises(Rejected) as e:
      t.push(push_of(core, checksum=123))
    assert e.value.reason == "checksum"
    with pytest.raises(Rejected) as e:
      t.push(push_of(core, fingerprint="another-run"))
    assert e.value.reason == "fingerprint"
  assert core.status()["versions"] == [0, 0] and core.counters["rejected"]["checksum"] == 1


def _raw(handle):
  sock = socket.create_connection(("127.0.0.1", handle.data_plane.port), timeout=5)
  nonce = wire.parse_hello(wire.recv_exact(sock, wire.HELLO_BYTES, "hello"))
  return sock, nonce


def _refused(sock):
  status, body = wire.recv_frame(sock, "reply")
  assert status == wire.REFUSED
  return wire.parse_refusal(body)


def test_hostile_streams_are_refused_and_change_nothing(syncer):
  core, handle = syncer
  core.join(0, FP)
  push = push_of(core)
  header = pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, base_version=0, steps=1, tokens=1,
                         codec="int4", checksum=push.checksum, total_size=len(push.payload)).SerializeToString()
  # The wrong token (an HMAC under another key): refused before the header is read.
  sock, nonce = _raw(handle)
  with sock:
    sock.sendall(wire.request("not-the-token", nonce, wire.OP_PUSH, header))
    assert _refused(sock)[0] == "unauthenticated"
  # A replayed proof from another connection's nonce.
  sock1, nonce1 = _raw(handle)
  sock2, _ = _raw(handle)
  with sock1, sock2:
    sock2.sendall(wire.request(TOKEN, nonce1, wire.OP_PUSH, header))
    assert _refused(sock2)[0] == "unauthenticated"
  # A header length beyond the bound, and an unknown op.
  for op, length in ((wire.OP_PUSH, wire.MAX_HEADER_BYTES + 1), (b"X", 4)):
    sock, nonce = _raw(handle)
    with sock:
      sock.sendall(wire.mac(TOKEN, nonce) + op + struct.pack("<I", length))
      assert _refused(sock)[0] == "protocol"
  # A declared size beyond the largest valid payload: refused unread.
  sock, nonce = _raw(handle)
  with sock:
    big = pb.PushHeader.FromString(header)
    big.total_size = 1 << 40
    sock.sendall(wire.request(TOKEN, nonce, wire.OP_PUSH, big.SerializeToString()))
    assert _refused(sock)[0] == "oversize"
  # A payload cut short: the connection ends, nothing reaches the core.
  sock, nonce = _raw(handle)
  with sock:
    sock.sendall(wire.request(TOKEN, nonce, wire.OP_PUSH, header) + push.payload[:100])
  # Garbage instead of a protobuf header.
  sock, nonce = _raw(handle)
  with sock:
    sock.sendall(wire.request(TOKEN, nonce, wire.OP_PULL, b"\xff" * 40))
    assert _refused(sock)[0] == "protocol"
  # The server is done with every connection once it dropped the two that ended without a request: the
  # one whose nonce was replayed, and the push cut short.
  helpers.wait_for(lambda: handle.gate.counters().get("data_dropped", 0) >= 2, "both dropped connections", timeout=10,
                   poll=0.01)
  assert core.status()["versions"] == [0, 0] and core.counters["contributions_rejected"] == 0
  counters = handle.gate.counters()
  assert counters["refused_unauthenticated"] == 2 and counters.get("pushes", 0) == 0
  # The listener still serves an honest client.
  with client(handle) as t:
    t.join(0, FP)
    t.push(push)
  assert core.status()["versions"] == [1, 0]


def test_slow_senders_time_out_and_connections_are_bounded():
  core = helpers.make_core((5000,), codec="int4")
  core.join(0, FP)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN, data_plane=False)
  plane = dataplane.DataPlaneServer(handle.gate, TOKEN, limits=dataplane.DataPlaneLimits(
      max_connections=2, io_timeout_s=0.3, transfer_timeout_s=1.0))
  try:
    push = push_of(core)
    header = pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, base_version=0, steps=1, tokens=1,
                           codec="int4", checksum=push.checksum, total_size=len(push.payload))
    held = []
    for _ in range(2):  # two connections that say nothing hold both slots (each was served its hello)...
      held.append(socket.create_connection(("127.0.0.1", plane.port), timeout=5))
      wire.recv_exact(held[-1], wire.HELLO_BYTES, "hello")
    extra = socket.create_connection(("127.0.0.1", plane.port), timeout=5)  # ...a third is closed at once
    assert extra.recv(64) == b""
    t0 = time.monotonic()
    for sock in held:  # and each silent one is dropped after its read timeout
      assert sock.recv(64) == b""
    assert time.monotonic() - t0 < 5.0
    # A sender that trickles its payload byte by byte hits the transfer deadline.
    sock = socket.create_connection(("127.0.0.1", plane.port), timeout=5)
    nonce = wire.parse_hello(wire.recv_exact(sock, wire.HELLO_BYTES, "hello"))
    sock.sendall(wire.request(TOKEN, nonce, wire.OP_PUSH, header.SerializeToString()))
    t0 = time.monotonic()
    with pytest.raises((ConnectionError, BrokenPipeError, OSError)):
      for i in range(len(push.payload)):
        sock.sendall(push.payload[i:i + 1])
        time.sleep(0.2)  # the slow sender itself: a byte every 0.2 s (not a wait for the server)
    assert time.monotonic() - t0 < 5.0
    sock.close()
    assert core.status()["versions"] == [0]
  finally:
    plane.stop()
    handle.stop(grace=0)


def test_a_broken_data_plane_falls_back_to_grpc(syncer, caplog):
  core, handle = syncer
  with client(handle) as t:
    t.join(0, FP)
    handle.data_plane.stop()  # the port stops answering; gRPC still does
    t.push(push_of(core))
    assert t.pull(0, 1, timeout_s=5.0).version == 1
  assert "using gRPC" in caplog.text
  assert handle.gate.counters().get("data_pushes", 0) == 0 and handle.gate.counters()["pushes"] == 1


def test_concurrent_transfers():
  core = helpers.make_core((20_000,) * 4, codec="int4", k=1)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  try:
    errors = []

    def work(p):
      try:
        with client(handle) as t:
          t.join(0, FP)
          t.push(push_of(core, fragment=p))
          assert t.pull(p, 1, timeout_s=10.0).version == 1
      except BaseException as e:  # noqa: BLE001
        errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
    for th in threads:
      th.start()
    for th in threads:
      th.join(30)
    assert not errors and core.status()["versions"] == [1, 1, 1, 1]
    assert handle.gate.counters()["data_pushes"] == 4
  finally:
    handle.stop(grace=0)


def _send_pull(handle, learner_id, min_version=1, timeout_s=0.0):
  sock, nonce = _raw(handle)
  request = pb.PullRequest(learner_id=learner_id, fingerprint=FP, fragment=0, min_version=min_version,
                           timeout_s=timeout_s)
  sock.sendall(wire.request(TOKEN, nonce, wire.OP_PULL, request.SerializeToString()))
  return sock


def _answer(sock):
  status, body = wire.recv_frame(sock, "reply")
  return (status, wire.parse_refusal(body)[0] if status == wire.REFUSED else pb.PullHeader.FromString(body))


def test_a_push_whose_data_plane_reply_was_lost_is_merged_once_when_retried_over_grpc():
  core = helpers.make_core((5000,), codec="int4", k=2)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  try:
    for i in range(2):
      core.join(i, FP)
    push = push_of(core, incarnation=7, sequence=1)
    header = pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, base_version=0, steps=push.steps,
                           tokens=push.tokens, codec="int4", checksum=push.checksum, total_size=len(push.payload),
                           incarnation=7, sequence=1)
    sock, nonce = _raw(handle)
    with sock:  # the payload arrives, the reply is never read: the learner saw a broken transfer
      sock.sendall(wire.request(TOKEN, nonce, wire.OP_PUSH, header.SerializeToString()) + push.payload)
      helpers.wait_for(lambda: core.status()["open_rounds"].get("0", {}).get("contributions") == 1,
                       "the data-plane push to reach the core", timeout=10)
    with client(handle, data_plane=False) as t:  # its retry, over gRPC, with the same key
      t.join(0, FP)
      receipt = t.push(push)
    assert receipt.round == 0 and core.counters["pushes_duplicate"] == 1
    assert core.status()["open_rounds"]["0"]["contributions"] == 1
    core.push(push_of(core, learner_id=1))
    assert core.counters["contributions_merged"] == 2 and core.status()["versions"] == [1]
  finally:
    handle.stop(grace=0)


def test_observers_pull_and_ids_outside_the_run_are_refused(syncer):
  core, handle = syncer
  with _send_pull(handle, -1, min_version=0) as sock:  # protocol.OBSERVER_ID
    status, h = _answer(sock)
    assert status == wire.OK and h.found and h.version == 0
  for bad in (8, 1 << 30, -2):
    with _send_pull(handle, bad, min_version=0) as sock:
      assert _answer(sock) == (wire.REFUSED, "learner_id")
  # Refused by the gate (counted against the caller's rate): the core never sees them, so no lock or write.
  assert handle.gate.counters()["data_refused_learner_id"] == 3 and core.counters["rejected"]["learner_id"] == 0


def test_pulls_in_flight_and_call_rates_are_bounded_per_caller():
  core = helpers.make_core((5000,), codec="int4")
  limits = limits_lib.Limits.defaults(pulls_per_caller=2, rate_per_s=0.5, rate_burst=3)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN, limits=limits)
  try:
    waiting = [_send_pull(handle, 0, timeout_s=30.0) for _ in range(2)]  # long-polls for version 1
    helpers.wait_for(lambda: handle.data_plane.pull_slots.in_use == 2, "two pulls waiting", timeout=10)
    with _send_pull(handle, 0) as sock:  # a third from the same caller: busy, at once
      assert _answer(sock) == (wire.REFUSED, "busy")
    with _send_pull(handle, 1) as sock:  # another learner is served
      assert _answer(sock)[1].found is False
    with _send_pull(handle, 0) as sock:  # the caller's burst of 3 calls is spent: rate limited
      assert _answer(sock) == (wire.REFUSED, "rate_limit")
    with _send_pull(handle, 1) as sock:  # not the other's
      assert _answer(sock)[1].found is False
    for sock in waiting:  # clients that go away free their slots within the long-poll's slice
      sock.close()
    helpers.wait_for(lambda: handle.data_plane.pull_slots.in_use == 0, "pull slots to be freed", timeout=10)
    counters = handle.gate.counters()
    assert counters["data_refused_busy"] == 1 and counters["data_refused_rate_limit"] == 1
  finally:
    handle.stop(grace=0)


def test_a_busy_data_plane_sends_the_attempt_over_grpc_and_close_ends_its_transfers():
  # A data plane that refuses as busy or over the rate (its budget and slots may be another token holder's
  # on this host, issue 21) is not retried: the same attempt goes over gRPC, whose budget is this
  # connection's, and gRPC carries the payloads until the next Join offers the data plane again.
  core = helpers.make_core((5000,), codec="int4")
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN,
                         limits=limits_lib.Limits.defaults(rate_per_s=4, rate_burst=1))
  try:
    t = client(handle, backoff_s=0.05, unreachable_deadline_s=10.0)
    t.join(0, FP)  # a gRPC call: its own caller
    t.push(push_of(core))  # spends the data-plane burst
    assert t.pull(0, 1, timeout_s=5.0).version == 1  # refused there (rate limit), answered over gRPC
    assert t.data_port == 0
    counters = handle.gate.counters()
    assert counters["data_refused_rate_limit"] == 1 and counters.get("data_pulls", 0) == 0 and counters["pulls"] == 1
    time.sleep(0.3)  # real time for the rate limiter's buckets to refill (4 calls/s: a call in 0.25 s)
    t.join(0, FP)
    assert t.data_port == handle.data_plane.port
    failed = []

    def long_poll():
      try:
        t.pull(0, 2, timeout_s=30.0)
      except errors.SyncerUnreachable as e:
        failed.append(e)

    time.sleep(0.3)  # real time for the rate limiter's bucket to refill (4 calls/s: a call in 0.25 s)
    waiter = threading.Thread(target=long_poll)
    waiter.start()
    helpers.wait_for(lambda: handle.data_plane.pull_slots.in_use == 1, "the long-poll", timeout=10)
    t0 = time.monotonic()
    t.close()
    waiter.join(10)
    assert failed and time.monotonic() - t0 < 5.0
    helpers.wait_for(lambda: handle.data_plane.pull_slots.in_use == 0, "the server to notice", timeout=10)
  finally:
    handle.stop(grace=0)

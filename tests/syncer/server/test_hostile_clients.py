"""Hostile and broken clients against the real gRPC service on loopback (default limits): floods of
long-polls and stalled streams leave the control calls served, rate limits belong to the caller, cancelled
streams end quietly, wire strings are never echoed whole, and the client rides out a busy syncer."""

import logging
import threading
import time

import grpc
import numpy as np
import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax.protocol.messages import OBSERVER_ID
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.syncer.server import limits as limits_lib
from diloco_jax.transports import errors
from diloco_jax.transports import grpc_client as grpc_transport

TOKEN = "hostile-token-0123456789"
FP = helpers.FP
METADATA = (("authorization", f"Bearer {TOKEN}"),)
CONTROL_CALL_S = 3.0  # a control call that takes longer than this under attack counts as starved


@pytest.fixture
def syncer():
  core = helpers.make_core((4096, 512), num_learners=4)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)  # default limits and worker count
  yield core, handle
  handle.stop(grace=0)


def connection(handle):
  """A stub on a connection of its own (a separate TCP connection, as another process would have)."""
  channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}", options=[("grpc.use_local_subchannel_pool", 1)])
  return channel, pb_grpc.SyncerStub(channel)


def client(handle, learner_id=0, **kw):
  kw.setdefault("unreachable_deadline_s", 10.0)
  kw.setdefault("call_timeout_s", CONTROL_CALL_S)
  return grpc_transport.GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, learner_id, **kw)


def control_calls_stay_served(handle, seconds=2.0):
  """Heartbeats and Status from a legitimate learner for `seconds`: each answered within CONTROL_CALL_S,
  never refused, never retried."""
  with client(handle, learner_id=0, unreachable_deadline_s=0.5) as t:
    t.join(0, FP)
    end = time.monotonic() + seconds
    worst = 0.0
    while time.monotonic() < end:
      for call in (lambda: t.heartbeat(0, 0.1), t.status):
        start = time.monotonic()
        call()
        worst = max(worst, time.monotonic() - start)
      time.sleep(0.1)  # the learner's pace: a few calls a second (not a wait for the server)
    assert t.retries == 0
  return worst


def test_500_long_poll_pulls_leave_heartbeat_join_and_status_served(syncer):
  core, handle = syncer
  core.join(0, FP)
  channels, calls = [], []
  for _ in range(5):  # 5 connections x 100 pulls, under every learner id (the victim's, 0, included)
    channel, stub = connection(handle)
    channels.append(channel)
    for i in range(100):
      calls.append(stub.Pull(pb.PullRequest(learner_id=i % 4, fingerprint=FP, fragment=0, min_version=99,
                                            timeout_s=60.0), metadata=METADATA, timeout=120))
  try:
    # The pulls over the caps are refused at once; the rest wait.
    helpers.wait_for(lambda: sum(call.done() for call in calls) >= 400, "the pulls over the caps to be refused",
                     timeout=30, poll=0.1)
    worst = control_calls_stay_served(handle)
    assert worst < CONTROL_CALL_S
    with client(handle, learner_id=3) as t:
      assert t.join(3, FP).versions == {0: 0, 1: 0}
    status = core.status()
    assert status["versions"] == [0, 0]
    server = handle.gate.counters()
    assert handle.gate.pull_slots.in_use <= handle.gate.pull_slots.total
  finally:
    for call in calls:
      call.cancel()
    for channel in channels:
      channel.close()
  codes = [call.code() for call in calls]
  assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 400 and server["refused_resource_exhausted"] >= 400
  helpers.wait_for(lambda: handle.gate.pull_slots.in_use == 0, "pull slots to be released", timeout=30)


def test_40_stalled_push_streams_leave_heartbeats_served_and_are_cut(syncer):
  core, handle = syncer
  core.join(0, FP)
  release = threading.Event()
  good = helpers.make_push(0, np.full(4096, 1e-3, np.float32), core=core)

  def stalled(kind):
    header = pb.PushChunk(header=pb.PushHeader(learner_id=1, fingerprint=FP, fragment=0, codec="fp32",
                                               checksum=good.checksum, total_size=len(good.payload)))
    if kind == "silent":  # nothing at all, not even a header
      release.wait(60)
      return
    yield header
    if kind == "empty":  # a header, then empty chunks forever: no payload byte ever arrives
      while not release.wait(0.2):
        yield pb.PushChunk(data=b"", offset=0)
    else:  # a header and half the payload, then silence
      yield pb.PushChunk(data=good.payload[:1024], offset=0)
      release.wait(60)

  channels, futures = [], []
  for _ in range(10):
    channel, stub = connection(handle)
    channels.append(channel)
    for kind in ("silent", "empty", "half", "half"):
      futures.append(stub.Push.future(stalled(kind), metadata=METADATA, timeout=120))
  try:
    worst = control_calls_stay_served(handle)
    assert worst < CONTROL_CALL_S
    # Every stalled stream ends: cut after syncer.stream_stall_s without payload bytes (or refused at
    # once, over the push slots); none was merged. Then a legitimate push goes through.
    for f in futures:
      with pytest.raises(grpc.RpcError) as e:
        f.result(timeout=60)
      assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.RESOURCE_EXHAUSTED), e.value
    assert handle.gate.counters()["streams_cut"] >= handle.gate.push_slots.total
    assert core.counters["contributions_merged"] == 0 and core.status()["open_rounds"] == {}
    with client(handle, learner_id=0, unreachable_deadline_s=60) as t:
      t.join(0, FP)
      assert t.push(good).round == 0
  finally:
    release.set()
    for channel in channels:
      channel.close()
  assert core.status()["versions"] == [1, 0]
  helpers.wait_for(lambda: handle.gate.push_slots.in_use == 0, "push slots to be released", timeout=30)


def test_a_flood_under_the_victims_id_does_not_spend_its_rate(syncer):
  core, handle = syncer
  with client(handle, learner_id=0) as victim:
    victim.join(0, FP)
    channel, stub = connection(handle)
    refused = 0
    for _ in range(400):  # past the default burst of 200, as fast as the loop goes
      try:
        stub.Heartbeat(pb.HeartbeatRequest(learner_id=0, fingerprint=FP, step_time_s=0.1), metadata=METADATA)
      except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        refused += 1
    channel.close()
    assert refused > 0  # the flood itself is throttled
    for _ in range(5):
      victim.heartbeat(0, 0.2)
    assert victim.retries == 0
  assert core.status()["members"]["0"]["step_time_s"] == 0.2


def test_cancelled_streams_end_quietly(caplog):
  core = helpers.make_core((200_000,), num_learners=2)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN, limits=limits_lib.Limits.defaults(chunk_bytes=4096))
  caplog.set_level(logging.DEBUG)
  try:
    core.join(0, FP)
    good = helpers.make_push(0, np.full(200_000, 1e-3, np.float32), core=core)
    channel, stub = connection(handle)
    # A Push cancelled mid-stream.
    sent, done = threading.Event(), threading.Event()

    def half():
      yield pb.PushChunk(header=pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, codec="fp32",
                                              checksum=good.checksum, total_size=len(good.payload)))
      yield pb.PushChunk(data=good.payload[:4096], offset=0)
      sent.set()
      done.wait(30)  # the rest never comes

    future = stub.Push.future(half(), metadata=METADATA, timeout=60)
    assert sent.wait(10)
    # Cancelled while the server reads it: its handler holds a push slot.
    helpers.wait_for(lambda: handle.gate.push_slots.in_use == 1, "the push on the server", timeout=10, poll=0.01)
    future.cancel()
    done.set()
    # A Pull cancelled after its first chunks (the fragment is 200 chunks long).
    stream = stub.Pull(pb.PullRequest(learner_id=0, fingerprint=FP, fragment=0, min_version=0),
                       metadata=METADATA, timeout=60)
    assert next(stream).WhichOneof("kind") == "header"
    next(stream)
    stream.cancel()
    helpers.wait_for(lambda: handle.gate.pull_slots.in_use == 0 and handle.gate.push_slots.in_use == 0,
                     "the cancelled calls to end on the server", timeout=30)
    channel.close()
  finally:
    handle.stop(grace=0)
  text = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
  assert "Exception serializing message" not in text
  assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records if r.exc_info]
  assert core.counters["contributions_merged"] == 0


def test_wire_strings_are_never_echoed_whole(caplog):
  core = helpers.make_core((4096,), num_learners=4)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN, fingerprint=FP)  # as the syncer process does
  try:
    _echo_checks(core, handle, caplog)
  finally:
    handle.stop(grace=0)


def _echo_checks(core, handle, caplog):
  core.join(0, FP)
  caplog.set_level(logging.DEBUG)
  huge = "f" * (1 << 20)
  channel, stub = connection(handle)
  good = helpers.make_push(0, np.zeros(4096, np.float32), core=core)
  calls = [
      lambda: stub.Join(pb.JoinRequest(learner_id=1, fingerprint=huge), metadata=METADATA),
      lambda: stub.Heartbeat(pb.HeartbeatRequest(learner_id=0, fingerprint=huge), metadata=METADATA),
      lambda: list(stub.Pull(pb.PullRequest(learner_id=0, fingerprint=huge, fragment=0), metadata=METADATA)),
      lambda: stub.Push(iter([pb.PushChunk(header=pb.PushHeader(
          learner_id=0, fingerprint=FP, fragment=0, codec=huge, checksum=good.checksum,
          total_size=len(good.payload))), pb.PushChunk(data=good.payload, offset=0)]), metadata=METADATA),
      lambda: stub.Push(iter([pb.PushChunk(header=pb.PushHeader(
          learner_id=0, fingerprint=huge, fragment=0, codec="fp32", checksum=good.checksum,
          total_size=len(good.payload))), pb.PushChunk(data=good.payload, offset=0)]), metadata=METADATA),
  ]
  before = core.state_dict()["versions"]
  for call in calls:
    with pytest.raises(grpc.RpcError) as e:
      call()
    assert e.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    assert len(e.value.details()) < 500 and "(1048576 chars)" in e.value.details()
  channel.close()
  assert core.state_dict()["versions"] == before and core.status()["member_count"]["total"] == 1
  assert max(len(r.getMessage()) for r in caplog.records) < 2000


def test_ids_outside_the_run_are_refused_over_the_wire(syncer):
  core, handle = syncer
  channel, stub = connection(handle)
  for bad in (-2, -1, 4, 2**31 - 1):
    calls = [lambda bad=bad: stub.Join(pb.JoinRequest(learner_id=bad, fingerprint=FP), metadata=METADATA)]
    if bad != OBSERVER_ID:  # the observer (the global model's evaluator) pulls without ever joining
      calls.append(lambda bad=bad: list(stub.Pull(pb.PullRequest(learner_id=bad, fingerprint=FP, fragment=0),
                                          metadata=METADATA)))
    for call in calls:
      with pytest.raises(grpc.RpcError) as e:
        call()
      assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "learners.num=4" in e.value.details()
  observed = list(stub.Pull(pb.PullRequest(learner_id=OBSERVER_ID, fingerprint=FP, fragment=0), metadata=METADATA))
  assert observed[0].header.found and core.status()["member_count"]["total"] == 0
  channel.close()
  with client(handle, learner_id=9) as t:
    with pytest.raises(Rejected) as e:
      t.join(9, FP)
    assert e.value.reason == "learner_id"
  assert core.status()["member_count"]["total"] == 0


def test_the_client_retries_a_busy_or_slow_syncer_and_pushes_once(syncer, monkeypatch):
  core, handle = syncer
  with client(handle, learner_id=0, call_timeout_s=0.3, backoff_s=0.05) as t:
    t.join(0, FP)
    # The syncer answers the first heartbeat after a second: the attempt's deadline passes, and the call is
    # retried.
    heartbeat, answered = core.heartbeat, threading.Event()

    def slow_heartbeat(*args, **kwargs):
      if not answered.is_set():
        answered.set()
        time.sleep(1.0)  # the slow syncer itself (not a wait for the test)
      return heartbeat(*args, **kwargs)

    monkeypatch.setattr(core, "heartbeat", slow_heartbeat)
    t.heartbeat(0, 0.3)
    assert answered.is_set()
    assert t.retries >= 1
    # A push whose reply is lost is retried with the same key: one contribution, the original receipt.
    push = helpers.make_push(0, np.full(4096, 1e-3, np.float32), core=core, incarnation=123, sequence=1)
    first = t.push(push)
    assert t.push(push) == first
  assert core.counters["contributions_merged"] == 1 and core.counters["pushes_duplicate"] == 1


def test_close_ends_a_retrying_call_at_once():
  # Nobody listens: the call retries for up to 300 s, unless the transport is closed (a learner shutting
  # down), which ends it at once.
  t = grpc_transport.GrpcTransport(f"127.0.0.1:{helpers.free_port()}", TOKEN, 0, unreachable_deadline_s=300.0,
                                   backoff_s=1.0, max_backoff_s=5.0)
  unreachable = []

  def call():
    try:
      t.status()
    except errors.SyncerUnreachable as e:
      unreachable.append(e)

  worker = threading.Thread(target=call)
  worker.start()
  helpers.wait_for(lambda: t.retries >= 1, "the call to be retrying", timeout=10, poll=0.01)
  start = time.monotonic()
  t.close()
  worker.join(10)
  assert not worker.is_alive() and time.monotonic() - start < 5
  assert unreachable and "closed" in str(unreachable[0])


def test_slots_and_workers_follow_the_learners_fragments_in_flight():
  # outer.max_in_flight 0 (the default) means what the schedule needs: a learner at P = H with tau = 2
  # has 3 fragments in flight, so 3 comms workers (and a retry of each) may call at once.
  c = config_lib.base_config()
  c.learners.num, c.outer.num_fragments, c.outer.sync_every, c.outer.tau, c.outer.max_in_flight = 8, 20, 20, 2, 0
  limits = limits_lib.Limits.from_config(config_lib.resolve(c))
  assert limits.pushes_per_caller == limits.pulls_per_caller == 2 * 3
  assert limits_lib.workers_for(config_lib.resolve(c)) == 4 * 8 * 3
  c.outer.max_in_flight = 5
  assert limits_lib.Limits.from_config(config_lib.resolve(c)).pulls_per_caller == 10

"""The gRPC syncer service and client over real loopback sockets (ephemeral ports), with the real core."""

import shutil
import socket
import subprocess
import threading
import time

import grpc
import jax
import numpy as np
import pytest

import helpers
from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import PushReceipt
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import core as core_lib
from diloco_jax.syncer.server import auth
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.syncer.server import limits as limits_lib
from diloco_jax.transports import errors
from diloco_jax.transports import grpc_client as grpc_transport

TOKEN = "test-token-0123456789"
FP = helpers.FP
SIZES = (1000, 300)


def make_core(sizes=SIZES, codec="fp32", downlink_codec=None):
  return helpers.make_core(sizes, codec=codec, downlink=downlink_codec or codec)


@pytest.fixture
def syncer():
  core = make_core()
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  yield core, handle
  handle.stop(grace=0)


def client(handle, learner_id=0, **kw):
  kw.setdefault("unreachable_deadline_s", 2.0)
  return grpc_transport.GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, learner_id, **kw)


def make_push(core, fragment=0, learner_id=0, scale=0.01, **overrides):
  n = core.settings.sizes[fragment]
  delta = (scale * np.arange(n) / n).astype(np.float32)
  return helpers.make_push(learner_id, delta, core=core, fragment=fragment, tokens=640, **overrides)


def test_push_pull_round_trip(syncer):
  core, handle = syncer
  with client(handle) as t:
    versions = t.join(0, FP)
    assert versions.versions == {0: 0, 1: 0} and versions.epoch == core.epoch
    assert versions.history == core.history() and len(versions.history) == 1
    before = core.pull(0, 0).payload
    receipt = t.push(make_push(core))
    assert receipt == PushReceipt(fragment=0, round=0, late=False, epoch=core.epoch, version=1)  # v1 merges it
    published = t.pull(0, 1, timeout_s=5.0)
    assert published.version == 1 and published.fragment == 0
    assert published.payload == core.pull(0, 1).payload != before
    assert published.checksum == codec_lib.checksum(published.payload)
    # Nothing newer within the timeout: None, after roughly the timeout.
    start = time.monotonic()
    assert t.pull(0, 2, timeout_s=0.3) is None
    assert 0.25 < time.monotonic() - start < 3.0
    assert t.heartbeat(0, 0.25, step=7, blocked=True) == core.epoch
    status = t.status()
    assert status["versions"] == [1, 0] and status["members"]["0"]["step_time_s"] == 0.25
    assert status["members"]["0"]["step"] == 7 and status["members"]["0"]["blocked"]
    assert status["server"]["pushes"] == 1


def test_long_poll_wakes_on_publish(syncer):
  core, handle = syncer
  with client(handle) as t:
    t.join(0, FP)
    threading.Timer(0.3, lambda: core.push(make_push(core, fragment=1))).start()
    start = time.monotonic()
    published = t.pull(1, 1, timeout_s=10.0)
    assert published.version == 1 and time.monotonic() - start < 5.0


def test_byte_counters_are_messages_plus_frame_headers(syncer):
  core, handle = syncer
  frame = grpc_transport.GRPC_FRAME_BYTES
  with client(handle, chunk_bytes=1500, data_plane=False) as t:  # gRPC for the payloads too
    t.join(0, FP)
    assert t.data_port == 0
    sent0, received0 = t.bytes_sent, t.bytes_received
    assert sent0 == pb.JoinRequest(learner_id=0, fingerprint=FP).ByteSize() + frame
    push = make_push(core)
    receipt = t.push(push)
    header = pb.PushHeader(learner_id=0, fingerprint=FP, fragment=0, base_version=0, steps=10, tokens=640,
                           codec="fp32", checksum=push.checksum, total_size=len(push.payload))
    want = pb.PushChunk(header=header).ByteSize() + frame
    for off in range(0, len(push.payload), 1500):
      want += pb.PushChunk(data=push.payload[off:off + 1500], offset=off).ByteSize() + frame
    assert t.bytes_sent - sent0 == want
    assert len(push.payload) < want < len(push.payload) + 200  # 3 chunks: framing is small
    assert t.bytes_received - received0 == pb.PushResponse(
        fragment=0, round=receipt.round, late=False, epoch=receipt.epoch, version=receipt.version).ByteSize() + frame
    sent1, received1 = t.bytes_sent, t.bytes_received
    published = t.pull(0, 1)
    # The server chunks at 1 MiB: one header and one data message here.
    n = len(published.payload)
    assert published.epoch == core.epoch
    header = pb.PullHeader(found=True, fragment=0, version=1, codec="fp32", checksum=published.checksum,
                           total_size=n, epoch=core.epoch)
    assert t.bytes_received - received1 == (pb.PullChunk(header=header).ByteSize() + frame +
                                            pb.PullChunk(data=published.payload, offset=0).ByteSize() + frame)
    assert t.bytes_sent - sent1 == pb.PullRequest(learner_id=0, fingerprint=FP, fragment=0, min_version=1,
                                                  timeout_s=0.0).ByteSize() + frame


@pytest.mark.parametrize("data_plane", [False, True])
def test_delta_downlink_over_the_wire(monkeypatch, data_plane):
  # int4 downlink: a learner that says it holds version 0 gets the int4 delta from R_0, with kind,
  # base_version and the syncer's epoch in the header; one that holds nothing gets the full fp32 reference.
  # Past version 0, the delta needs the epoch of the learner's reference to come back as the core's.
  r0 = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
  core = helpers.make_core((1000,), downlink="int4", initial=[r0])
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  try:
    with client(handle, data_plane=data_plane) as t:
      t.join(0, FP)
      assert (t.data_port != 0) == data_plane
      t.push(make_push(core))
      sent0 = t.bytes_sent
      delta = t.pull(0, 1, timeout_s=5.0, have_version=0)
      request = pb.PullRequest(learner_id=0, fingerprint=FP, fragment=0, min_version=1, timeout_s=5.0,
                               have_version=0, have_epoch=0).ByteSize()
      # gRPC: the message and its 5-byte frame; the data plane: op and length, then the message (on the
      # push's connection, which proved the token with its first request).
      framing = 1 + 4 if data_plane else 5
      assert t.bytes_sent - sent0 == request + framing
      assert (delta.kind, delta.base_version, delta.version, delta.codec) == ("delta", 0, 1, "int4")
      assert delta.epoch == core.epoch
      assert len(delta.payload) == codec_lib.encoded_size(1000, "int4", 64)
      version, ref = core.reference(0)
      assert version == 1
      np.testing.assert_array_equal(r0 + codec_lib.decode(delta.payload, "int4", 1000, 64), ref)
      full = t.pull(0, 1, have_version=-1)
      assert (full.kind, full.base_version, full.codec, full.epoch) == ("full", -1, "fp32", core.epoch)
      np.testing.assert_array_equal(codec_lib.decode(full.payload, "fp32", 1000), ref)
      assert t.pull(0, 1, have_version=1).kind == "full"  # nothing newer than what it holds: full
      # have_epoch travels: from version 1 on, only a learner naming the core's epoch gets the delta.
      t.push(make_push(core, base_version=1))
      for have_epoch, kind in ((core.epoch ^ 1, "full"), (0, "full"), (core.epoch, "delta")):
        got = t.pull(0, 2, timeout_s=5.0, have_version=1, have_epoch=have_epoch)
        assert (got.kind, got.version, got.epoch) == (kind, 2, core.epoch)
      old_epoch = core.epoch
      # A restart (same versions here) is a new epoch; the largest one round-trips both ways.
      monkeypatch.setattr(core_lib, "new_epoch", lambda: 2**63 - 1)
      core.load_state_dict(core.state_dict())
      assert core.epoch == 2**63 - 1
      got = t.pull(0, 2, timeout_s=5.0, have_version=1, have_epoch=old_epoch)
      assert (got.kind, got.epoch) == ("full", 2**63 - 1)
      got = t.pull(0, 2, timeout_s=5.0, have_version=1, have_epoch=2**63 - 1)
      assert (got.kind, got.epoch) == ("delta", 2**63 - 1)
    counters = core.status()["counters"]
    assert counters["pulls_delta"] == 3 and counters["pulls_full"] == 5
  finally:
    handle.stop(grace=0)


# --- bad input over the wire ----------------------------------------------------------------------------


def _stub(handle, token=TOKEN):
  channel = grpc.insecure_channel(f"127.0.0.1:{handle.port}")
  metadata = () if token is None else (("authorization", f"Bearer {token}"),)
  return channel, pb_grpc.SyncerStub(channel), metadata


def _header(push, **overrides):
  fields = dict(learner_id=push.learner_id, fingerprint=push.fingerprint, fragment=push.fragment,
                base_version=push.base_version, steps=push.steps, tokens=push.tokens, codec=push.codec,
                checksum=push.checksum, total_size=len(push.payload))
  fields.update(overrides)
  return pb.PushChunk(header=pb.PushHeader(**fields))


def _chunks(payload, size=1024, start=0):
  return [pb.PushChunk(data=payload[o:o + size], offset=start + o) for o in range(0, len(payload), size)]


def _comparable(state, *, counters=True):
  """A state dict as nested python values; without the rejection counters if counters=False."""
  state = dict(state)
  if not counters:
    c = dict(state["counters"])
    c.pop("rejected"), c.pop("contributions_rejected")
    state["counters"] = c
  return repr({k: (v if k not in ("fragments", "opt_states") else
                   [np.asarray(x).tobytes() for x in jax.tree.leaves(v)])
               for k, v in state.items()})


def _bad_calls(core):
  """(name, call(stub, metadata), status code, text in the details, reaches the core)."""
  good = make_push(core)
  garbage = bytes(np.random.default_rng(1).integers(0, 256, len(good.payload), dtype=np.uint8))
  nan = make_push(core)
  nan_payload = codec_lib.encode(np.full(SIZES[0], np.nan, np.float32), "fp32", 64)
  wrong_shape = codec_lib.encode(np.zeros(SIZES[0] - 7, np.float32), "fp32", 64)
  other_run = make_push(core, fingerprint="another-run")
  half = len(good.payload) // 2
  del nan
  return [
      ("checksum", lambda s, m: s.Push(iter([_header(good, checksum=good.checksum)] + _chunks(garbage)),
                                       metadata=m), grpc.StatusCode.INVALID_ARGUMENT, "checksum", True),
      ("truncated", lambda s, m: s.Push(iter([_header(good)] + _chunks(good.payload[:half])), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "truncated", False),
      ("out_of_sequence", lambda s, m: s.Push(iter([_header(good)] + _chunks(good.payload)[::-1]),
                                              metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "out of sequence", False),
      ("oversize", lambda s, m: s.Push(iter([_header(good)] + _chunks(good.payload + b"xx")), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "exceeds its declared size", False),
      ("no_header", lambda s, m: s.Push(iter(_chunks(good.payload)), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "must start with a header", False),
      ("huge_declared", lambda s, m: s.Push(iter([_header(good, total_size=1 << 40)]), metadata=m),
       grpc.StatusCode.RESOURCE_EXHAUSTED, "exceeds the limit", False),
      ("wrong_shape", lambda s, m: s.Push(iter([_header(good, total_size=len(wrong_shape),
                                                        checksum=codec_lib.checksum(wrong_shape))]
                                               + _chunks(wrong_shape)), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "shape", True),
      ("nan", lambda s, m: s.Push(iter([_header(good, checksum=codec_lib.checksum(nan_payload))]
                                       + _chunks(nan_payload)), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "nonfinite", True),
      ("unknown_fragment", lambda s, m: s.Push(iter([_header(good, fragment=7)] + _chunks(good.payload)),
                                               metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "unknown_fragment", True),
      ("pull_unknown_fragment", lambda s, m: list(s.Pull(pb.PullRequest(learner_id=0, fingerprint=FP,
                                                                        fragment=9), metadata=m)),
       grpc.StatusCode.INVALID_ARGUMENT, "unknown_fragment", False),
      ("push_other_run", lambda s, m: s.Push(iter([_header(other_run)] + _chunks(other_run.payload)),
                                             metadata=m),
       grpc.StatusCode.PERMISSION_DENIED, "fingerprint", True),
      ("join_other_run", lambda s, m: s.Join(pb.JoinRequest(learner_id=5, fingerprint="another-run"),
                                             metadata=m),
       grpc.StatusCode.PERMISSION_DENIED, "fingerprint", True),
      ("not_joined", lambda s, m: s.Push(iter([_header(good, learner_id=3)] + _chunks(good.payload)),
                                         metadata=m),
       grpc.StatusCode.FAILED_PRECONDITION, "unknown_learner", True),
      ("heartbeat_nan", lambda s, m: s.Heartbeat(pb.HeartbeatRequest(learner_id=0, fingerprint=FP,
                                                                     step_time_s=float("nan")), metadata=m),
       grpc.StatusCode.INVALID_ARGUMENT, "finite", False),
  ]


def test_bad_calls_get_clear_errors_and_change_nothing(syncer):
  core, handle = syncer
  core.join(0, FP)
  channel, stub, metadata = _stub(handle)
  for name, call, code, text, reaches_core in _bad_calls(core):
    before = core.state_dict()
    with pytest.raises(grpc.RpcError) as info:
      call(stub, metadata)
    assert info.value.code() == code, (name, info.value.details())
    assert text in info.value.details(), (name, info.value.details())
    after = core.state_dict()
    # The shell's own refusals never reach the core; the core's count the rejection and nothing else.
    assert _comparable(after, counters=not reaches_core) == _comparable(before, counters=not reaches_core), name
    if not reaches_core:
      assert _comparable(after) == _comparable(before), name
  # The server is still up and a good push still goes through.
  assert core.counters["rounds"] == 0
  assert stub.Push(iter([_header(make_push(core))] + _chunks(make_push(core).payload)),
                   metadata=metadata).round == 0
  assert core.status()["versions"] == [1, 0]
  channel.close()


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_token_is_required_on_every_call(syncer, token):
  core, handle = syncer
  channel, stub, metadata = _stub(handle, token)
  before = _comparable(core.state_dict())
  calls = [
      lambda: stub.Status(pb.StatusRequest(), metadata=metadata),
      lambda: stub.Join(pb.JoinRequest(learner_id=0, fingerprint=FP), metadata=metadata),
      lambda: stub.Push(iter([_header(make_push(core))] + _chunks(make_push(core).payload)), metadata=metadata),
      lambda: list(stub.Pull(pb.PullRequest(fragment=0), metadata=metadata)),
  ]
  for call in calls:
    with pytest.raises(grpc.RpcError) as info:
      call()
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert ("missing run token" if token is None else "invalid run token") in info.value.details()
  assert _comparable(core.state_dict()) == before
  assert core.status()["members"] == {}
  channel.close()
  with client(handle) as t:  # still serving
    assert t.join(0, FP).versions == {0: 0, 1: 0}


def test_client_translates_refusals(syncer):
  core, handle = syncer
  with client(handle) as t:
    with pytest.raises(Rejected) as info:
      t.join(0, "another-run")
    assert info.value.reason == "fingerprint"
    t.join(0, FP)
    with pytest.raises(Rejected) as info:
      t.push(make_push(core, checksum=123))
    assert info.value.reason == "checksum" and "CRC-32" in str(info.value)
  with grpc_transport.GrpcTransport(f"127.0.0.1:{handle.port}", "bad", 0) as t:
    with pytest.raises(errors.AuthError):
      t.status()


def test_rate_limit_is_per_caller_and_the_client_backs_off():
  core = make_core()
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN,
                         limits=limits_lib.Limits.defaults(rate_per_s=2.0, rate_burst=3))
  try:
    with client(handle, unreachable_deadline_s=0.2, backoff_s=0.05) as t:
      t.join(0, FP)
      t.heartbeat(0, 0.1)
      t.heartbeat(0, 0.1)
      # Over the rate, within a deadline too short for the bucket to refill: given up, saying why.
      with pytest.raises(errors.SyncerUnreachable, match="RESOURCE_EXHAUSTED.*calls/s"):
        t.heartbeat(0, 0.1)
      assert t.retries >= 1
    with client(handle, unreachable_deadline_s=30.0, backoff_s=0.05) as t:
      for _ in range(6):  # past the burst: the client backs off until the bucket refills
        t.heartbeat(0, 0.1)
      assert t.retries >= 1
    with client(handle, learner_id=1) as t:  # per learner: another one is not throttled
      t.join(1, FP)
    assert handle.gate.counters()["refused_resource_exhausted"] >= 2
  finally:
    handle.stop(grace=0)


def test_refuses_non_loopback_bind_without_allow_remote():
  with pytest.raises(ValueError, match="not a loopback"):
    service.serve(make_core(), "0.0.0.0:0", token=TOKEN)
  assert auth.is_loopback("127.0.0.1:5") and auth.is_loopback("[::1]:5")
  assert auth.is_loopback("localhost:5") and not auth.is_loopback("10.1.2.3:5")


def test_retries_until_the_syncer_comes_up():
  with socket.socket() as s:  # a free port, then nobody listens on it
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  t = grpc_transport.GrpcTransport(f"127.0.0.1:{port}", TOKEN, 0, unreachable_deadline_s=0.6, backoff_s=0.05)
  start = time.monotonic()
  with pytest.raises(errors.SyncerUnreachable, match="unreachable"):
    t.status()
  assert time.monotonic() - start < 5.0 and t.retries >= 2
  t.close()
  core = make_core()
  handles = []
  threading.Timer(0.5, lambda: handles.append(service.serve(core, f"127.0.0.1:{port}", token=TOKEN))).start()
  with grpc_transport.GrpcTransport(f"127.0.0.1:{port}", TOKEN, 0, unreachable_deadline_s=20.0,
                                    backoff_s=0.05, max_backoff_s=0.2) as t:
    assert t.join(0, FP).versions == {0: 0, 1: 0}
    assert t.retries >= 1
  handles[0].stop(grace=0)


def test_64mb_fragment_passes_default_limits():
  n = 16 * 1024 * 1024  # 64 MB of float32
  core = make_core(sizes=(n,))
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)  # default 4 MiB message limits
  try:
    with client(handle) as t:
      t.join(0, FP)
      push = helpers.make_push(0, np.full(n, 1e-3, np.float32), core=core, steps=1, tokens=1)
      assert len(push.payload) == 64 << 20
      t.push(push)
      published = t.pull(0, 1, timeout_s=30.0)
      assert published.version == 1 and len(published.payload) == 64 << 20
      assert published.checksum == codec_lib.checksum(published.payload)
      assert t.bytes_sent > 64 << 20 and t.bytes_received > 64 << 20
  finally:
    handle.stop(grace=0)


# --- TLS ----------------------------------------------------------------------------------------------------


def _openssl(*args, cwd):
  subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
  if shutil.which("openssl") is None:
    pytest.skip("openssl not installed")
  d = tmp_path_factory.mktemp("certs")
  _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
           "-subj", "/CN=test-ca", cwd=d)
  (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
  for name in ("server", "client"):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
  return d


def test_mutual_tls(certs):
  core = make_core()
  tls = auth.TlsConfig(cert=str(certs / "server.pem"), key=str(certs / "server.key"),
                             client_ca=str(certs / "ca.pem"))
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN, tls=tls)
  target = f"localhost:{handle.port}"
  try:
    with grpc_transport.GrpcTransport(target, TOKEN, 0, tls_ca=str(certs / "ca.pem"),
                                      tls_cert=str(certs / "client.pem"),
                                      tls_key=str(certs / "client.key")) as t:
      assert t.join(0, FP).versions == {0: 0, 1: 0}
      # Payloads take the data plane, under TLS with the same certificates (not the gRPC fallback).
      assert t.data_port == handle.data_plane.port
      t.push(make_push(core))
      assert t.pull(0, 1, timeout_s=5.0).payload == core.pull(0, 1).payload
      assert handle.gate.counters()["data_pushes"] == 1 and handle.gate.counters()["data_pulls"] == 1
    # A plaintext connection to the TLS data port gets no hello, and the core sees nothing.
    with socket.create_connection(("127.0.0.1", handle.data_plane.port), timeout=5) as raw:
      raw.sendall(b"\x00" * 64)
      try:
        assert not raw.recv(64).startswith(b"DLCD")
      except (TimeoutError, ConnectionError):
        pass
    assert core.status()["versions"] == [1, 0]
    # Without a client certificate the handshake fails (reported as UNAVAILABLE: retried, then given up).
    with grpc_transport.GrpcTransport(target, TOKEN, 0, tls_ca=str(certs / "ca.pem"),
                                      unreachable_deadline_s=0.3, backoff_s=0.1) as t:
      with pytest.raises(errors.SyncerUnreachable):
        t.status()
    # Plaintext against a TLS server fails too.
    with grpc_transport.GrpcTransport(target, TOKEN, 0, unreachable_deadline_s=0.3, backoff_s=0.1) as t:
      with pytest.raises(errors.SyncerUnreachable):
        t.status()
  finally:
    handle.stop(grace=0)

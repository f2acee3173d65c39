"""Persistent data-plane connections (issue 24) over real loopback sockets: a learner's transfers reuse its
connections (no new one in steady state), idle ones are closed by the syncer and count against the
per-address limit, a reused connection that broke is replaced at once, and stop closes idle connections."""

import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

import helpers
from configs import tiny_cpu
from diloco_jax import config as config_lib
from diloco_jax.protocol import convert, wire
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.syncer.server import dataplane
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.transports import dataplane_client
from diloco_jax.transports import grpc_client as grpc_transport
from diloco_jax.transports import wan as wan_lib

TOKEN = "persistent-data-plane-token"
FP = helpers.FP


def client(handle, **kw):
  kw.setdefault("unreachable_deadline_s", 5.0)
  return grpc_transport.GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, 0, **kw)


def push_of(core, fragment, base_version, seed=0):
  n = core.settings.sizes[fragment]
  return helpers.make_push(0, helpers.small_delta(n, 0.001, seed), core=core, fragment=fragment,
                           base_version=base_version)


@pytest.fixture
def own_plane():
  """A service whose data plane has the given limits: (core, handle, plane)."""
  made = []

  def make(size=3000, **limits):
    core = helpers.make_core((size,), codec="int4")
    handle = service.serve(core, "127.0.0.1:0", token=TOKEN, data_plane=False)
    plane = dataplane.DataPlaneServer(handle.gate, TOKEN, limits=dataplane.DataPlaneLimits(**limits))
    handle.gate.data_port = plane.port  # what Join tells learners
    made.append((handle, plane))
    return core, handle, plane

  yield make
  for handle, plane in made:
    plane.stop()
    handle.stop(grace=0)


def test_100_syncs_open_no_new_connection_in_steady_state():
  # Each sync: a long-poll pull of the next version in flight while the push goes (two transfers at once,
  # as a learner's comms workers overlap them), over a real service and its data plane.
  core = helpers.make_core((5000, 300), codec="int4", downlink="fp32")
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  try:
    with client(handle) as t:
      t.join(0, FP)
      counters = handle.gate.counters
      steady = None
      for i in range(100):
        fragment = i % 2
        version = core.status()["versions"][fragment]
        pulled = []
        waiter = threading.Thread(target=lambda f=fragment, v=version, out=pulled: out.append(t.pull(f, v + 1, 10.0)))
        waiter.start()
        helpers.wait_for(lambda: handle.data_plane.pull_slots.in_use == 1, "the long-poll", timeout=10, poll=0.001)
        assert t.push(push_of(core, fragment, version, seed=i)).version == version + 1
        waiter.join(10)
        assert pulled and pulled[0].version == version + 1
        if i == 3:  # both directions have a connection by now
          steady = (counters()["data_connections"], t.data_connections)
      assert steady[0] == steady[1] <= 2
      assert (counters()["data_connections"], t.data_connections) == steady
      assert counters()["data_pushes"] == 100 and counters()["data_pulls"] == 100
      assert counters()["pushes"] == 100 and counters().get("data_dropped", 0) == 0
  finally:
    handle.stop(grace=0)


@pytest.mark.parametrize("shut_delay_s", [0.0, 0.3])
def test_an_idle_connection_is_closed_by_the_syncer_and_the_client_reconnects(own_plane, monkeypatch, shut_delay_s):
  # With a delay in the shutdown (a busy machine: the reaper thread descheduled there), a close counted before
  # the socket was shut let the next push through on the old connection (a clean-clone CI run).
  shut = dataplane._shut
  monkeypatch.setattr(dataplane, "_shut", lambda conn: (time.sleep(shut_delay_s), shut(conn)))
  core, handle, plane = own_plane(idle_timeout_s=0.3)
  with client(handle) as t:
    t.join(0, FP)
    t.push(push_of(core, 0, 0))
    helpers.wait_for(lambda: handle.gate.counters().get("data_idle_closed", 0) == 1, "the idle close", timeout=5,
                     poll=0.02)
    assert t.push(push_of(core, 0, 1, seed=1)).version == 2  # a fresh connection, still the data plane
    assert t.data_connections == 2 and t.data_port == plane.port
  assert handle.gate.counters()["data_pushes"] == 2


def test_a_reused_connection_that_broke_is_replaced_at_once(own_plane, monkeypatch):
  # The race a stale check cannot close: the syncer ends an idle connection just as the client reuses it.
  core, handle, plane = own_plane(idle_timeout_s=0.3)
  monkeypatch.setattr(dataplane_client._Connection, "stale", lambda self: False)
  with client(handle) as t:
    t.join(0, FP)
    t.push(push_of(core, 0, 0))
    helpers.wait_for(lambda: handle.gate.counters().get("data_idle_closed", 0) == 1, "the idle close", timeout=5,
                     poll=0.02)
    assert t.push(push_of(core, 0, 1, seed=1)).version == 2
    assert t.data_connections == 2 and t.data_port == plane.port and t.retries == 0
  counters = handle.gate.counters()
  assert counters["data_pushes"] == 2 and counters["pushes"] == 2  # both over the data plane, merged once each


def test_a_slow_emulated_link_trickles_a_push_past_the_syncers_read_timeout(own_plane):
  # 11 KB at 8 KB/s takes 1.4 s, longer than the syncer waits for a byte (0.6 s): sent whole after its
  # pacing, the push was cut and fell back to gRPC; paced in pieces of 50 ms of the link, it arrives.
  core, handle, plane = own_plane(size=20_000, io_timeout_s=0.6)
  link = wan_lib.WanLink(wan_lib.WanSpec(up_bytes_per_s=8000, down_bytes_per_s=8000))
  with client(handle, wan=link) as t:
    t.join(0, FP)
    assert t.push(push_of(core, 0, 0)).version == 1 and t.data_port == plane.port
  counters = handle.gate.counters()
  assert counters["data_pushes"] == 1 and counters.get("data_dropped", 0) == 0


def test_idle_connections_count_against_the_per_address_limit(own_plane):
  core, handle, plane = own_plane(per_address=2)
  clients = [client(handle) for _ in range(2)]
  try:
    for t in clients:  # each keeps one idle connection
      t.join(0, FP)
      assert t.pull(0, 0, 1.0).version == 0 and t.data_connections == 1
    extra = socket.create_connection(("127.0.0.1", plane.port), timeout=5)
    assert extra.recv(64) == b""  # closed at once: the address's two connections are held
    extra.close()
    assert handle.gate.counters()["data_refused_address"] == 1
  finally:
    for t in clients:
      t.close()


def test_stop_closes_idle_connections_at_once(own_plane):
  core, handle, plane = own_plane()
  with client(handle) as t:
    t.join(0, FP)
    assert t.pull(0, 0, 1.0).version == 0
    (idle,) = t._data._idle  # the connection it keeps for its next transfer
    assert plane.open_connections == 1
    start = time.monotonic()
    plane.stop()
    assert select.select([idle.sock], [], [], 5.0)[0] and idle.sock.recv(64) == b""  # closed by the syncer
    assert time.monotonic() - start < 6.0
    helpers.wait_for(lambda: plane.open_connections == 0, "the connection's thread to end", timeout=5, poll=0.02)


def test_after_the_first_transfer_a_request_carries_no_token_proof(own_plane):
  # The framing (protocol/wire.py): the proof once per connection, then bare requests; a refusal ends it.
  core, handle, plane = own_plane()
  core.join(0, FP)
  request = convert.pull_request(0, FP, 0, 0, 0.0, -1, 0).SerializeToString()
  with socket.create_connection(("127.0.0.1", plane.port), timeout=5) as sock:
    nonce = wire.parse_hello(wire.recv_exact(sock, wire.HELLO_BYTES, "hello"))
    for first in (True, False, False):
      sock.sendall(wire.request(TOKEN, nonce, wire.OP_PULL, request) if first else
                   wire.next_request(wire.OP_PULL, request))
      status, body = wire.recv_frame(sock, "reply")
      assert status == wire.OK
      h = pb.PullHeader.FromString(body)
      assert h.found and wire.recv_exact(sock, h.total_size, "payload")
    sock.sendall(b"X" + struct.pack("<I", 0))
    status, body = wire.recv_frame(sock, "reply")
    assert status == wire.REFUSED and wire.parse_refusal(body)[0] == "protocol"
    assert sock.recv(64) == b""  # the refusal ended the connection
  assert handle.gate.counters()["data_pulls"] == 3 and handle.gate.counters()["data_connections"] == 1


# A real syncer process (jax import, model init): ~5 s here.
def test_a_syncer_process_stops_promptly_on_sigterm_with_idle_connections_open(tmp_path):
  token_file = tmp_path / "token"
  token_file.write_text(TOKEN + "\n")
  token_file.chmod(0o600)
  workdir = tmp_path / "syncer"
  cmd = [sys.executable, "-m", "diloco_jax", "syncer", f"--config={helpers.REPO}/configs/tiny_cpu.py",
         f"--workdir={workdir}", "--bind=127.0.0.1:0", f"--token-file={token_file}", "--run-id=sigterm-idle"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("DILOCO_TOKEN", None)
  fp = config_lib.fingerprint(tiny_cpu.get_config(), "sigterm-idle")
  proc = subprocess.Popen(cmd, cwd=helpers.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  clients = []
  try:
    port = int(helpers.wait_for(lambda: proc.poll() is None and (workdir / "syncer.port").exists()
                                and (workdir / "syncer.port").read_text(), "the syncer's port", timeout=120))
    for learner in range(2):  # two learners, each with an idle data-plane connection after its pull
      t = grpc_transport.GrpcTransport(f"127.0.0.1:{port}", TOKEN, learner, unreachable_deadline_s=2.0)
      clients.append(t)
      t.join(learner, fp)
      assert t.pull(0, 0, 1.0).version == 0 and t.data_connections == 1
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and time.monotonic() - start < 10.0, (time.monotonic() - start, out)
    assert "final checkpoint" in out, out
  finally:
    for t in clients:
      t.close()
    if proc.poll() is None:
      proc.kill()

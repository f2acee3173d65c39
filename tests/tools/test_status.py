"""The `status` command against a live gRPC syncer (a real server on loopback, the command a real
subprocess), the learner's step as heartbeats carry it, and its bound on the wire."""

import json
import os
import signal
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

import helpers
from diloco_jax.learner.comms import Comms
from diloco_jax.protocol.messages import OBSERVER_ID
from diloco_jax.protocol.proto import diloco_pb2 as pb
from diloco_jax.protocol.proto import diloco_pb2_grpc as pb_grpc
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.protocol.run_token import TOKEN_ENV
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.transports.grpc_client import GrpcTransport
from diloco_jax.transports.inprocess import InProcessTransport

FP = helpers.FP
TOKEN = "status-test-token-0123456789"


def test_learner_heartbeats_carry_its_step_and_skip_the_compiling_step():
  core = helpers.make_core((8,), k=1)
  comms = Comms(InProcessTransport(core), 0, FP, codec="fp32", downlink_codec="fp32", block=64, sizes=(8,),
                max_in_flight=1, heartbeat_s=0.05)
  try:
    comms.join()
    comms.report_step_time(30.0, step=1)  # the first step compiles: not a step time
    comms.report_step_time(0.2, step=2)
    comms.report_step_time(0.4, step=3)
    comms.report_step_time(0.3, step=4)
    assert comms.step_time_s == pytest.approx(0.3)  # the mean of the steps after the first (no whole group yet)
    helpers.wait_for(lambda: core.status()["members"]["0"]["step"] == 4, "a heartbeat with step 4", timeout=10)
  finally:
    comms.close(leave=False)


@pytest.fixture
def served():
  core = helpers.make_core((1000, 300), k=2, max_grace_s=30.0, gamma=0.5, tau=1000, lease_s=60.0, num_learners=3)
  handle = service.serve(core, "127.0.0.1:0", token=TOKEN)
  yield core, handle
  handle.stop(grace=0)


def test_the_step_on_the_wire_is_bounded(served):
  core, handle = served
  with GrpcTransport(f"127.0.0.1:{handle.port}", TOKEN, 0, unreachable_deadline_s=2.0) as t:
    t.join(0, FP)
    t.heartbeat(0, 0.1, step=41)
    assert core.status()["members"]["0"]["step"] == 41
    with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel, pytest.raises(grpc.RpcError) as e:
      pb_grpc.SyncerStub(channel).Heartbeat(
          pb.HeartbeatRequest(learner_id=0, fingerprint=FP, step_time_s=0.1, step=-5),
          metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "step" in e.value.details()
    assert core.status()["members"]["0"]["step"] == 41  # unchanged


def _status_command(port: int, *args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
  env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
  env[TOKEN_ENV] = token
  return subprocess.run([sys.executable, "-m", "diloco_jax", "status", "--syncer", f"127.0.0.1:{port}",
                         "--timeout-s", "5", *args], cwd=helpers.REPO, env=env, capture_output=True, text=True,
                        timeout=120)


def test_status_command_against_a_live_syncer(served):
  core, handle = served
  target = f"127.0.0.1:{handle.port}"
  with GrpcTransport(target, TOKEN, 0, unreachable_deadline_s=2.0) as l0, \
       GrpcTransport(target, TOKEN, 1, unreachable_deadline_s=2.0) as l1:
    l0.join(0, FP)
    l1.join(1, FP)
    l0.heartbeat(0, 0.125, step=17)
    l1.heartbeat(1, 0.5, step=9)
    n0, n1 = core.settings.sizes
    # Fragment 1 merges (both learners), fragment 0 has learner 1's contribution waiting in its round.
    l0.push(helpers.make_push(0, np.full(n1, 0.01), core=core, fragment=1, steps=18))
    l1.push(helpers.make_push(1, np.full(n1, 0.01), core=core, fragment=1, steps=9))
    l1.push(helpers.make_push(1, np.full(n0, 0.01), core=core, fragment=0, steps=9))
    with pytest.raises(Rejected):
      l0.push(helpers.make_push(0, np.full(n0, np.nan), core=core, fragment=0))  # refused: nonfinite
    # An observer (the status command itself, or the evaluator) pulls without joining: no member.
    with GrpcTransport(target, TOKEN, OBSERVER_ID, fingerprint=FP, unreachable_deadline_s=2.0) as observer:
      assert observer.pull(0, 0).version == 0
      with pytest.raises(Rejected) as e:  # and it can never become one
        observer.join(OBSERVER_ID, FP)
      assert e.value.reason == "learner_id"
    proc = _status_command(handle.port)
  assert proc.returncode == 0, proc.stderr
  lines = proc.stdout.splitlines()
  assert lines[0].startswith(f"syncer {target}  fingerprint {FP}") and "live 2/3" in lines[0], lines[0]
  assert "goodput so far" in lines[0]
  rows = {tuple(line.split()[:3]) for line in lines}
  assert ("0", "yes", "17") in rows and ("1", "yes", "9") in rows
  learner0 = next(line for line in lines if line.startswith("0 ") and "ago" in line)
  cells = learner0.split()  # 0 yes 17 (Xms ago) 125ms Yms ago 9 Z: the step is from a heartbeat Xms ago
  assert cells[3].startswith("(") and cells[4] == "ago)"
  assert cells[5] == "125ms" and cells[8] == "9"  # step time; steps merged (18 over P = 2)
  fragments = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"]) and "ago" not in line]
  assert fragments[0][:3] == ["0", "0", "1"]  # fragment 0: version 0, learner 1 in its open round
  assert fragments[1][:3] == ["1", "1", "-"]  # fragment 1: version 1, no open round
  text = proc.stdout
  assert "rounds 1" in text and "contributors/round 2.00" in text
  assert "contributions rejected 1, requests refused by reason (learner_id 1, nonfinite 1)" in text
  assert str(OBSERVER_ID) not in {line.split()[0] for line in lines if line.split()}
  assert core.status()["live"] == [0, 1]  # asking changed nothing

  raw = _status_command(handle.port, "--json")
  assert raw.returncode == 0 and json.loads(raw.stdout)["members"]["0"]["step"] == 17


def test_status_command_with_a_wrong_token_says_so(served):
  _, handle = served
  proc = _status_command(handle.port, token="not-the-token")
  assert proc.returncode == 1 and "token" in proc.stderr and proc.stdout == ""
  line = proc.stderr.strip()
  assert line.startswith("status: syncer refused the run token") and "status: status:" not in line, line


def test_status_watch_redraws_until_interrupted(served):
  _, handle = served
  env = {**os.environ, TOKEN_ENV: TOKEN}
  proc = subprocess.Popen([sys.executable, "-m", "diloco_jax", "status", "--syncer", f"127.0.0.1:{handle.port}",
                           "--watch", "--interval", "0.2"], cwd=helpers.REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          # As from a terminal: a suite started as a background job of a script inherits
                          # SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  lines: list[str] = []
  errors: list[str] = []  # read as it comes: a full stderr pipe would block the command, not the test
  for stream, into in ((proc.stdout, lines), (proc.stderr, errors)):
    threading.Thread(target=into.extend, args=(stream,), daemon=True).start()
  try:
    helpers.wait_for(lambda: sum(line.startswith("fragment  version") for line in lines) >= 3, "three redraws",
                     timeout=120, poll=0.05)
    proc.send_signal(signal.SIGINT)
    try:
      assert proc.wait(30) == 0, "".join(errors)[-3000:]
    except subprocess.TimeoutExpired:
      pytest.fail(f"status --watch still running 30 s after SIGINT; stderr: {''.join(errors)[-3000:]}")
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()

"""Learners spanning several processes: jax.distributed on loopback with fake CPU devices, a real gRPC
syncer, real kills.

A learner of 2 processes x 2 devices trains and syncs, and ends with the parameters of a one-process
learner on 4 devices with the same seed and data; killing one process of a learner takes that learner out
(the survivor exits with a clear message instead of hanging in a collective), the syncer drops it, the
other learner goes on, and the restarted processes resume from their checkpoint and rejoin.
"""

import json
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from absl import flags

import helpers
from diloco_jax import cli, command_flags
from diloco_jax.compute import checkpoint as checkpoint_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.compute import multihost
from diloco_jax.learner import loop as loop_lib
from diloco_jax.runs import children as run_children
from diloco_jax.syncer import build
from diloco_jax.syncer.ticker import Ticker
from diloco_jax.tools.chaos import history as chaos_history
from diloco_jax.transports.inprocess import InProcessTransport

REPO = helpers.REPO
TIMEOUT_S = helpers.PROCESS_TIMEOUT_S
wait_for = helpers.wait_for


def _worker_results(tmp_path) -> list[dict]:
  port = helpers.free_port()
  procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "multihost_worker.py"), str(p), str(port),
                             str(tmp_path)], cwd=REPO, stdout=open(tmp_path / f"worker{p}.log", "wb"),
                            stderr=subprocess.STDOUT, env=run_children.child_env(2))
           for p in range(2)]
  try:
    for p, proc in enumerate(procs):
      assert proc.wait(TIMEOUT_S) == 0, (tmp_path / f"worker{p}.log").read_text()[-3000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return [json.loads((tmp_path / f"p{p}.json").read_text()) for p in range(2)]


def test_broadcast_channel_and_watch_across_two_processes(tmp_path):
  p0, p1 = _worker_results(tmp_path)
  for r in (p0, p1):
    assert r["process_count"] == 2 and r["local_devices"] == 2
    # The vector process 0 sent arrives bit for bit on every process, replicated on the learner's mesh,
    # and each process's local copy of it is the whole vector.
    assert r["broadcast_bits_equal"] and r["broadcast_replicated"] and r["local_replica_shape"] == [1008]
    assert r["messages_left"] == []  # the last reader deleted every message
  assert p0["broadcast_collectives"] == ["all-reduce"]  # one all-reduce, not a gather of every device's row
  assert p0["rows"] == [0, 4] and p1["rows"] == [4, 8]  # each process feeds its half of a batch of 8
  assert [m["seq"] for m in p1["received"]] == [0, 1, 2]
  assert p1["received"][2]["adopt"] == [[0, 3, "full", -1, 1, False]]
  # Process 0 stopped beating: process 1's wait for a message that never comes ended through the watch
  # (3 s timeout), not never.
  assert p1["receive_after_loss"].startswith("PeerLost: process 0 silent")
  assert p1["lost"] and 2.5 < p1["loss_detected_after_s"] < 30


def _overrides(**extra):
  return helpers.tiny_overrides(**extra)


# The data-parallel case in `make test-slow` (make test's budget binds since the emulated-cloud run joined it);
# the FSDP case, which shards parameters across the processes, stays.
@pytest.mark.parametrize("mesh", [pytest.param({}, marks=pytest.mark.slow), {"mesh.data": 1, "mesh.fsdp": 4}],
                         ids=["data_parallel", "fsdp_over_processes"])
def test_two_process_learner_matches_one_process_learner(tmp_path, mesh):
  # One learner (K = 1) with tau = 0 adopts each merge at its snapshot's step, so its whole trajectory,
  # syncs included, is deterministic; fp32 codecs keep rounding differences from being quantized apart.
  # With fsdp over both processes, each outer gradient reaches process 0 and each merged fragment every
  # device chunk by chunk, no device holding a whole fragment (`multihost.Broadcaster.pieces`, `.gather`).
  argv = _overrides(steps=12, **{"learners.num": 1, "learners.devices": 4, "outer.tau": 0,
                                 "outer.codec": "fp32", "outer.downlink_codec": "fp32",
                                 "learners.peer_timeout_s": 30.0, **mesh})
  run = helpers.ProcessRun(tmp_path, argv)
  try:
    syncer = run.syncer()
    run.group_learner(0, hosts=2, devices_per_host=2)
    # Meanwhile, the reference: the same learner on 4 of this process's devices, with its own core.
    config = cli.parse(["test", *argv]).config
    core, fingerprint = build.build_core(config)
    with Ticker(core):
      reference = loop_lib.Learner(config, 0, jax.devices()[:4], InProcessTransport(core), fingerprint, None)
      ref_summary = loop_lib.run_learner(reference)
      reference.close()
    run.wait_ok("learner_0_p0")
    run.wait_ok("learner_0_p1")
    status = run.status()
    syncer.send_signal(signal.SIGTERM)
    assert syncer.wait(60) == 0, run.log("syncer")
  finally:
    run.kill_all()
  summary = run.summary(0)
  assert summary["steps"] == 12 and summary["completed"] and summary["processes"] == 2
  assert summary["syncs"] == ref_summary["syncs"] >= 4 and summary["adopted"] == summary["syncs"]
  assert summary["rejected_pushes"] == [] and summary["pushes"] == summary["syncs"]
  assert summary["broadcasts"] == summary["adopted"] and summary["decisions"] >= summary["syncs"]
  assert sum(status["versions"]) == sum(core.status()["versions"]) == summary["syncs"]
  assert "done at step 12" in run.log("learner_0_p1")
  assert not (tmp_path / "learner_0" / "metrics.jsonl").read_text().count('"learner": 1')
  # Both processes wrote the final checkpoint; it restores into the one-process learner's shardings.
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          reference.trainer.state)
  ckpt = checkpoint_lib.TrainCheckpointer(tmp_path / "learner_0" / "checkpoints")
  state, data_state, meta = ckpt.restore(abstract)
  ckpt.close()
  assert meta["step"] == 12 and int(state.step) == 12
  assert data_state == reference.trainer.data.get_state()  # every process read 12 batches of its part
  got = jax.tree.leaves(jax.device_get(state.params))
  want = jax.tree.leaves(jax.device_get(reference.trainer.state.params))
  initial = jax.tree.leaves(model_lib.init_params_host(config))
  moved = max(float(np.max(np.abs(w - i))) for w, i in zip(want, initial))
  assert moved > 1e-3  # the comparison is not between two untrained models
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~55 s: make test's budget binds since the emulated-cloud run (a preemption healed) joined it
def test_killed_process_takes_its_learner_out_and_restart_rejoins(tmp_path):
  steps = 16
  run = helpers.ProcessRun(tmp_path, _overrides(steps=steps, **{"learners.devices": 2,
                                                                "learners.peer_timeout_s": 10.0}))
  try:
    run.syncer()
    run.group_learner(0, hosts=2)  # learner 0: 2 processes x 1 device
    # Learner 1: one process of 2 devices that trains until it is told to stop (SIGTERM), so that it is
    # still training while learner 0 is out (train.steps is not part of the run's fingerprint).
    run.learner(1, devices=2, extra=["--config.train.steps=100000"])
    # The kill must come after a checkpoint both processes finished writing (saves are asynchronous: a
    # kill during one leaves only the previous checkpoint, and the restart would start from scratch).
    committed = lambda: [d for d in (tmp_path / "learner_0" / "checkpoints").glob("[0-9]*")
                         if d.name.isdigit() and (d / "_CHECKPOINT_METADATA").exists()]
    wait_for(lambda: run.step(0) >= 6 and committed(), "learner 0 past a committed checkpoint (step 5)")
    run.procs["learner_0_p1"].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    # Process 0 notices within the peer timeout, leaves the syncer, and exits with its own status.
    try:
      rc = run.procs["learner_0_p0"].wait(10.0 + 60.0)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process 0 still running after its peer was killed:\n{run.log('learner_0_p0')}")
    assert rc == multihost.EXIT_PEER_LOST, run.log("learner_0_p0")
    assert "process 1 silent" in run.log("learner_0_p0") and "this learner is out" in run.log("learner_0_p0")
    assert time.monotonic() - killed_at > 8.0  # it waited for the verdict, not for the first error
    status = run.status()
    # It left the quorum on its way out (a member that left is pruned a lease later).
    assert 0 not in status["live"] and status["members"].get("0", {"left": True})["left"]
    assert status["counters"]["leaves"] >= 1 and status["members"]["1"]["live"]
    # The run goes on without it: learner 1 alone makes quorum (K = 1) and its rounds commit.
    out_at, step1 = sum(run.status()["versions"]), run.step(1)
    wait_for(lambda: sum(run.status()["versions"]) >= out_at + 2, "versions to advance while learner 0 is out")
    assert run.step(1) > step1 and run.procs["learner_1"].poll() is None
    run.procs["learner_1"].send_signal(signal.SIGTERM)  # it made its point; the restart runs alone
    run.wait_ok("learner_1")
    merged_before = run.status()["counters"]["contributions_merged"]
    run.group_learner(0, hosts=2)  # same workdir: both processes resume from the checkpoint and rejoin
    run.wait_ok("learner_0_p0")
    run.wait_ok("learner_0_p1")
    status = run.status()
  finally:
    run.kill_all()
  s0 = run.summary(0)
  assert s0["restored"] and 5 <= s0["start_step"] < steps and s0["steps"] == steps and s0["processes"] == 2
  assert s0["pushes"] >= 2 and s0["rejected_pushes"] == [] and s0["adopted"] >= s0["pushes"]
  assert status["counters"]["contributions_merged"] >= merged_before + s0["pushes"]
  # It finished and left again (shown as left, or already pruned a lease later).
  assert status["counters"]["joins"] >= 3 and status["counters"]["leaves"] >= 2
  assert status["members"].get("0", {"left": True})["left"]
  assert run.summary(1)["stopped_by_signal"]


@pytest.mark.slow  # ~47 s: make test's budget binds since the emulated-cloud run joined it
def test_multi_process_learner_recovers_from_a_syncer_restart(tmp_path):
  """Shipped fault-tolerance settings (quorum all live learners): a learner of 2 processes; the syncer is
  killed (-9) and restarted on its port and workdir. Process 0 decides the recovery and process 1 applies
  the same decision (a mismatch would hang their collectives): both finish, versions never go backwards,
  and every token is merged exactly once (the work the crash lost, its own pushes and the lost merges it
  had adopted, was pushed again as new pushes: neither dropped as a duplicate nor merged twice)."""
  # Inner steps paced to 0.1 s (`emulation.min_step_s`), so that the learner is not done before the kill.
  steps = 200
  run = helpers.ProcessRun(tmp_path, helpers.shipped_overrides(
      steps=steps, learners=1, **{"learners.devices": 2, "learners.peer_timeout_s": 30.0,
                                  "emulation.min_step_s": 0.1}))
  port = helpers.free_port()
  try:
    run.syncer(f"127.0.0.1:{port}")
    run.group_learner(0, hosts=2)  # 2 processes x 1 device
    wait_for(lambda: sum(run.status()["versions"]) >= 4 and run.step(0) >= 10, "a few rounds")
    assert all(proc.poll() is None for proc in run.procs.values())
    run.procs["syncer"].send_signal(signal.SIGKILL)
    assert run.procs["syncer"].wait(60) == -signal.SIGKILL
    time.sleep(1.0)  # the learner trains on, its calls retry
    run.syncer(f"127.0.0.1:{port}")
    run.wait_ok("learner_0_p0")
    run.wait_ok("learner_0_p1")
    status = run.status()
  finally:
    run.kill_all()
  s0 = run.summary(0)
  assert s0["completed"] and s0["processes"] == 2 and s0["rejected_pushes"] == [], s0
  assert s0["recoveries"] >= 1 and status["counters"]["restarts"] == 1, s0
  decisions = [[line[line.index("syncer restarted (epoch"):] for line in run.log(f"learner_0_p{p}").splitlines()
                if "syncer restarted (epoch" in line] for p in range(2)]
  assert decisions[0] and decisions[0] == decisions[1], decisions  # the same decision, applied by both
  assert f"done at step {steps}" in run.log("learner_0_p1")
  seen = chaos_history.learner_versions(tmp_path / "learner_0")
  assert seen and chaos_history.monotone(seen), seen
  assert chaos_history.monotone(v for _, v in chaos_history.commits(tmp_path / "syncer"))
  assert status["counters"]["tokens_merged_by_fragment"] == [s0["tokens"]] * len(status["versions"]), status


@pytest.mark.slow
def test_multi_process_learner_back_from_a_stop_catches_up_on_every_process(tmp_path):
  """Shipped settings: a learner of 2 processes is SIGSTOPped (both processes) for 15 s while a second
  learner trains on. Back, process 0 judges the absence and both processes sync every fragment at the same
  step (a mismatch would hang their collectives): both finish, nothing refused."""
  steps = 1000  # learner 1 trains on through the stop
  run = helpers.ProcessRun(tmp_path, helpers.shipped_overrides(
      steps=steps, learners=2, **{"learners.devices": 2, "learners.peer_timeout_s": 30.0,
                                  "emulation.min_step_s": 0.05}))
  try:
    run.syncer()
    group = run.group_learner(0, hosts=2)
    run.learner(1, devices=2)
    wait_for(lambda: run.step(0) >= 40 and run.step(1) >= 40, "both learners training")
    for proc in group:
      proc.send_signal(signal.SIGSTOP)
    time.sleep(15.0)  # learner 1 trains on: 30 periods at its paced 0.05 s a step
    for proc in group:
      proc.send_signal(signal.SIGCONT)
    for name in ("learner_0_p0", "learner_0_p1", "learner_1"):
      run.wait_ok(name)
  finally:
    for proc in run.procs.values():
      if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
    run.kill_all()
  s0 = run.summary(0)
  assert s0["completed"] and s0["catch_ups"] >= 1 and s0["rejected_pushes"] == [], s0
  caught = [[line[line.index("back after an absence"):] for line in run.log(f"learner_0_p{p}").splitlines()
             if "back after an absence" in line] for p in range(2)]
  assert caught[0] and caught[0] == caught[1], caught  # the same catch-up, at the same step, on both
  assert f"done at step {steps}" in run.log("learner_0_p1")


@pytest.mark.slow
def test_killed_coordinator_ends_the_other_processes(tmp_path):
  # Process 0 hosts jax's coordination service: when it dies, jax's runtime ends the others at once.
  run = helpers.ProcessRun(tmp_path, _overrides(steps=200, **{"learners.devices": 2,
                                                              "learners.peer_timeout_s": 15.0}))
  try:
    run.syncer()
    run.group_learner(0, hosts=2)
    wait_for(lambda: run.step(0) >= 3, "learner 0 to train")
    run.procs["learner_0_p0"].send_signal(signal.SIGKILL)
    try:
      rc = run.procs["learner_0_p1"].wait(60.0)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process 1 still running after process 0 was killed:\n{run.log('learner_0_p1')}")
    assert rc == -signal.SIGABRT, run.log("learner_0_p1")  # jax's runtime: the coordination service is gone
    assert "JAX distributed service detected fatal errors" in run.log("learner_0_p1")
    # The syncer drops the learner when its lease lapses (process 0 could not leave).
    wait_for(lambda: not run.status()["members"]["0"]["live"], "the syncer to drop learner 0", timeout=60)
  finally:
    run.kill_all()


@pytest.mark.slow
def test_signal_to_one_process_stops_the_whole_learner(tmp_path):
  # SIGTERM reaches process 1 only: process 0 hears of it at the next step's decision (every step carries the
  # stop flag: not only every train.log_every steps, which took ~88 s on b12 against a 30 s shutdown grace)
  # and the learner stops at the same step everywhere, flushes, checkpoints and exits 0.
  run = helpers.ProcessRun(tmp_path, _overrides(steps=2000, **{"learners.devices": 2, "train.log_every": 50}))
  try:
    run.syncer()
    run.group_learner(0, hosts=2)
    wait_for(lambda: run.step(0) >= 50, "learner 0 to train")
    run.procs["learner_0_p1"].send_signal(signal.SIGTERM)
    run.wait_ok("learner_0_p0")
    run.wait_ok("learner_0_p1")
  finally:
    run.kill_all()
  s0 = run.summary(0)
  assert s0["stopped_by_signal"] and not s0["completed"] and 50 <= s0["steps"] < 2000
  assert s0["steps"] < 90  # well before the next log_every boundary (100), where the old check stopped it
  assert f"done at step {s0['steps']}" in run.log("learner_0_p1")


@pytest.mark.slow
def test_launcher_with_hosts_per_learner(tmp_path):
  workdir = tmp_path / "run"
  argv = [sys.executable, "-m", "diloco_jax", "local", *_overrides(steps=12, **{"learners.devices": 2}),
          "--learners", "2", "--hosts-per-learner", "2", "--workdir", str(workdir)]
  proc = subprocess.run(argv, cwd=REPO, env=run_children.child_env(1), capture_output=True, text=True,
                        timeout=TIMEOUT_S + 120)
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert [s["learner"] for s in summary["learners"]] == [0, 1]
  assert all(s["steps"] == 12 and s["processes"] == 2 for s in summary["learners"])
  # The global model's evaluator runs beside them, as in every `local` run (test_processes.py).
  processes = {f"learner {i} process {p}": 0 for i in range(2) for p in range(2)}
  assert summary["exit_codes"] == processes | {"evaluator": 0, "syncer": 0}
  assert summary["final_eval_loss"] is not None and sum(summary["versions"]) >= 4
  assert {p.name for p in (workdir / "logs").iterdir()} == {
      "syncer.log", "evaluator.log", "learner_0_p0.log", "learner_0_p1.log", "learner_1_p0.log", "learner_1_p1.log"}


# ---- without processes ------------------------------------------------------------------------------------


def _spec(*args):
  fv = flags.FlagValues()
  command_flags.distributed(fv)
  fv(["prog", *args])
  return multihost.spec_from_flags(fv)


def test_distributed_flags():
  assert not _spec().enabled
  assert _spec("--distributed").auto and _spec("--distributed").enabled
  spec = _spec("--coordinator", "10.0.0.2:1234", "--num-processes", "4", "--process-id", "3")
  assert spec.enabled and not spec.auto and (spec.num_processes, spec.process_id) == (4, 3)
  with pytest.raises(ValueError, match="--coordinator"):
    _spec("--num-processes", "2", "--process-id", "0")
  with pytest.raises(ValueError, match="--process-id"):
    _spec("--coordinator", "h:1", "--num-processes", "2", "--process-id", "2")
  with pytest.raises(ValueError, match="--num-processes"):
    _spec("--num-processes", "0")


def test_distributed_flags_from_environment(monkeypatch):
  monkeypatch.setenv("DILOCO_COORDINATOR", "127.0.0.1:999")
  monkeypatch.setenv("DILOCO_NUM_PROCESSES", "2")
  monkeypatch.setenv("DILOCO_PROCESS_ID", "1")
  spec = _spec()
  assert spec.enabled and (spec.coordinator, spec.num_processes, spec.process_id) == ("127.0.0.1:999", 2, 1)


def test_checkpoint_paths_keep_urls():
  assert str(checkpoint_lib.join("gs://bucket/run", "checkpoints")) == "gs://bucket/run/checkpoints"
  local = checkpoint_lib.as_path("runs/x")
  assert local.is_absolute() and str(local).endswith("runs/x")

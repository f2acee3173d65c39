"""Syncer checkpoints under real processes: a saver killed mid-save, (slow) a syncer process stopped by
SIGTERM and resumed."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import helpers
from configs import tiny_cpu
from diloco_jax import config as config_lib
from diloco_jax.syncer import build, checkpoint
from diloco_jax.transports.grpc_client import GrpcTransport

REPO = helpers.REPO


def test_crash_mid_save_keeps_the_last_good_step(tmp_path):
  directory = tmp_path / "ck"
  proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(directory)], stdout=subprocess.PIPE, text=True,
                          cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.stdout.readline().strip() == "saved"
  deadline = time.monotonic() + 60
  # Kill it as soon as step 2 is being written (a temporary directory next to step 1).
  while time.monotonic() < deadline and not any("tmp" in p.name for p in directory.iterdir()):
    time.sleep(0.005)
  proc.kill()
  proc.wait()
  partial = [p.name for p in directory.iterdir() if "tmp" in p.name]
  ckpt = checkpoint.SyncerCheckpointer(directory)
  assert ckpt.latest_step() == 1, (partial, os.listdir(directory))
  state, info = ckpt.restore()
  assert state["versions"] == [1] and info["rounds"] == 1
  np.testing.assert_array_equal(state["fragments"][0], np.ones(10, np.float32))


@pytest.mark.slow  # two syncer processes start (jax import, model init): ~45 s on 2 cores
def test_syncer_process_checkpoints_on_sigterm_and_resumes(tmp_path):
  token_file = tmp_path / "token"
  token_file.write_text("s3cret-token\n")
  token_file.chmod(0o600)
  workdir = tmp_path / "syncer"
  cmd = [sys.executable, "-m", "diloco_jax", "syncer", f"--config={REPO}/configs/tiny_cpu.py",
         f"--workdir={workdir}", "--bind=127.0.0.1:0", f"--token-file={token_file}",
         "--config.outer.max_grace_s=0", "--config.outer.min_quorum=1", "--run-id=ckpt-test"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  env.pop("DILOCO_TOKEN", None)

  config = tiny_cpu.get_config()
  config.outer.max_grace_s = 0.0
  fp = config_lib.fingerprint(config, "ckpt-test")
  core, _ = build.build_core(config, "ckpt-test")
  good = helpers.make_push(0, np.full(core.settings.sizes[0], 1e-3, np.float32), core=core, tokens=640)

  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    port = _wait_for(workdir / "syncer.port", proc)
    with GrpcTransport(f"127.0.0.1:{port}", "s3cret-token", 0) as t:
      assert t.join(0, fp).versions == {0: 0, 1: 0}
      t.push(good)
      published = t.pull(0, 1, timeout_s=10.0)
      assert published.version == 1
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "final checkpoint step 1" in out, out
  finally:
    if proc.poll() is None:
      proc.kill()

  (workdir / "syncer.port").unlink()
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    port = _wait_for(workdir / "syncer.port", proc)
    with GrpcTransport(f"127.0.0.1:{port}", "s3cret-token", 1) as t:
      assert t.join(1, fp).versions == {0: 1, 1: 0}
      assert t.pull(0, 1).payload == published.payload
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "resumed from checkpoint step 1" in out, out
  finally:
    if proc.poll() is None:
      proc.kill()


_SAVER = textwrap.dedent("""
    import sys, numpy as np
    from diloco_jax.syncer import checkpoint
    ckpt = checkpoint.SyncerCheckpointer(sys.argv[1], async_save=False)
    ckpt.save({"fragments": [np.full(10, 1.0, np.float32)], "versions": [1]}, rounds=1)
    print("saved", flush=True)
    big = [np.random.default_rng(i).standard_normal(8 << 20).astype(np.float32) for i in range(12)]
    ckpt.save({"fragments": big, "versions": [2]}, rounds=2)  # killed somewhere in here
    print("second save finished", flush=True)
""")


def _wait_for(path, proc, timeout=120.0):
  deadline = time.monotonic() + timeout
  while not path.exists():
    if proc.poll() is not None:
      raise AssertionError(f"syncer exited with {proc.returncode}: {proc.stdout.read()}")
    if time.monotonic() > deadline:
      raise AssertionError(f"{path} did not appear")
    time.sleep(0.1)
  return int(path.read_text())

"""No XLA_FLAGS by hand: on a CPU-only machine `train` (like `baseline` and `bench`) gives itself the fake
CPU devices its config needs and says so; an explicit device count in XLA_FLAGS still wins. Each case runs
in a fresh interpreter, the only place a device count can still be chosen."""

import os
import subprocess
import sys

import pytest

import helpers
from diloco_jax import cli

pytestmark = pytest.mark.process  # each test runs `train` in a child process

SMALL = ["--config", "configs/tiny_cpu.py", "--config.learners.num=2", "--config.learners.devices=1",
         "--config.train.steps=4", "--config.train.warmup_steps=1", "--config.train.log_every=2",
         "--config.outer.sync_every=2", "--config.model.d_model=32", "--config.model.mlp_dim=64",
         "--config.model.head_dim=8", "--config.data.max_bytes=60000", "--config.data.eval_batches=1"]


def _env(xla_flags: str | None) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  return env


def _train(tmp_path, xla_flags: str | None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "diloco_jax", "train", *SMALL, "--workdir", str(tmp_path / "run")],
                        cwd=helpers.REPO, env=_env(xla_flags), capture_output=True, text=True,
                        timeout=helpers.PROCESS_TIMEOUT_S)


def test_train_gives_itself_the_fake_devices_it_needs(tmp_path):
  proc = _train(tmp_path, None)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # 2 learners x 1 device, and 1 for the global model's evaluator; said in one line.
  lines = [line for line in proc.stderr.splitlines() if "fake CPU devices" in line]
  assert len(lines) == 1 and lines[0].startswith("train: no accelerator: running on 3 fake CPU devices"), lines
  assert (tmp_path / "run" / "summary.json").exists()


def test_an_explicit_device_count_wins(tmp_path):
  proc = _train(tmp_path, f"{cli.DEVICE_COUNT_FLAG}=1")
  assert proc.returncode == 2
  assert "config.learners.devices: asks for 2 devices but only 1 exist" in proc.stderr
  assert "fake CPU devices" not in proc.stderr

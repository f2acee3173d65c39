"""(slow) The sizing estimate against a real syncer process's peak memory."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

import helpers
from diloco_jax.tools.sim import sizing

REPO = helpers.REPO
MiB = 2**20
_config = helpers.sizing_config


@pytest.mark.slow
@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("downlink", ["fp32", "int8"])
def test_estimate_bounds_a_real_syncer_start_and_final_checkpoint(tmp_path, downlink):
  """A real syncer process (~57M parameters) starts, serves, and writes its final checkpoint at SIGTERM; its
  peak RSS must stay under the estimate without open rounds (none exist here) and reach at least 70% of it
  (the estimate's checkpoint and start terms are measured, not guessed)."""
  overrides = ["--config.model.d_model=768", "--config.model.num_layers=8", "--config.model.mlp_dim=3072",
               "--config.model.num_heads=12", "--config.model.num_kv_heads=12", "--config.model.head_dim=64",
               "--config.outer.num_fragments=4", "--config.outer.sync_every=100",
               f"--config.outer.downlink_codec={downlink}"]
  c = _config(d_model=768, num_layers=8, mlp_dim=3072, num_heads=12, num_kv_heads=12, head_dim=64)
  c.outer.num_fragments, c.outer.sync_every, c.outer.downlink_codec = 4, 100, downlink
  parts = sizing.syncer_memory(sizing.fragment_sizes(c), 1, codec=c.outer.codec, downlink_codec=downlink,
                               block=c.outer.codec_block, max_in_flight=c.outer.max_in_flight)
  no_rounds = parts["total"] - parts["open_rounds"] - parts["pushes_receiving"] - parts["merge_transient"]
  token = tmp_path / "token"
  token.write_text("t" * 64)
  token.chmod(0o600)
  workdir = tmp_path / "syncer"
  proc = subprocess.Popen([sys.executable, "-m", "diloco_jax", "syncer", "--config", "configs/tiny_cpu.py",
                           *overrides, "--workdir", str(workdir), "--bind", "127.0.0.1:0", "--token-file", str(token),
                           "--run-id", "sizing"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  try:
    deadline = time.monotonic() + 180
    while not (workdir / "syncer.port").exists():
      assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
      assert time.monotonic() < deadline, "the syncer did not serve within 180 s"
      time.sleep(0.2)
    peak = _vm_kib(proc.pid, "VmHWM")
    proc.terminate()
    while proc.poll() is None:
      peak = max(peak, _vm_kib(proc.pid, "VmHWM") or 0)
      time.sleep(0.02)
  finally:
    if proc.poll() is None:
      proc.kill()
    proc.wait()
  assert proc.returncode == 0
  peak_bytes = peak * 1024
  assert 0.7 * no_rounds <= peak_bytes <= no_rounds, (peak_bytes / MiB, no_rounds / MiB)


def _vm_kib(pid: int, field: str) -> int | None:
  try:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
      if line.startswith(field):
        return int(line.split()[1])
  except (FileNotFoundError, ProcessLookupError):
    return None
  return None

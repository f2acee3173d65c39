"""launch/tpu on the emulated cloud (tests/emucloud.py): the scripts run the whole life of a run for real, on
local hosts, with gs:// through a local GCS server: the data step (tokenizer and tokenize to gs://), create
(the code shipped to every host and checked there), start (a syncer of 2 shards; learner 0 on the 2 hosts of
a v5p-16 with jax.distributed, learner 1 on a v5p-8), status, a preemption of learner 1's slice healed (it
resumes from its gs:// checkpoint), stop (learners checkpoint, the syncer exports; logs, metrics and
checkpoints reach the bucket) and delete; then `eval` of the exported model read from the bucket.
"""

from __future__ import annotations

import json
import logging
import pathlib
import subprocess
import sys
import sysconfig
import time

import emucloud
import pytest
from etils import epath

import helpers

REPO = helpers.REPO
logging.getLogger("gcsfs").setLevel(logging.ERROR)  # "no default credentials": the emulator needs none
RUN = "emu"
BUCKET = "gs://emu-bucket/runs"
DATA = "gs://emu-bucket/data"


def _overrides() -> str:
  fields = {
      "train.steps": 100_000, "train.warmup_steps": 2, "train.log_every": 2, "train.eval_every": 100_000,
      "train.checkpoint_every": 6, "outer.sync_every": 4, "outer.lease_s": 5.0, "outer.min_quorum": 1,
      "outer.max_grace_s": 0.2, "model.d_model": 32, "model.mlp_dim": 64, "model.head_dim": 8,
      "model.vocab_size": 512, "data.format": "array_record", "data.tokenizer": f"{DATA}/tokenizer.model",
      "data.train_files": f"{DATA}/tokens/train-*.array_record",
      "data.eval_files": f"{DATA}/tokens/eval-*.array_record", "data.eval_batches": 1,
      "syncer.checkpoint_every_rounds": 2, "comms.max_backoff_s": 0.5, "comms.unreachable_deadline_s": 120.0,
  }
  return " ".join(f"--config.{k}={v}" for k, v in fields.items())


@pytest.fixture
def cloud(tmp_path):
  cloud = emucloud.EmulatedCloud(
      tmp_path, RUN=RUN, LEARNERS="v5p-16,v5p-8", BUCKET=BUCKET, CONFIG="configs/tiny_cpu.py",
      OVERRIDES=_overrides(), PORT=str(emucloud.free_port()), COORDINATOR_PORT=str(emucloud.free_port()),
      SYNCER_MACHINE="n2-highmem-8", HOST_PYTHON=sys.executable, SYNC_EVERY_S="3", HOST_START_CHECK_S="240",
      SUPERVISE_BACKOFF_S="1", STOP_TIMEOUT_S="120", DILOCO_JAX_CACHE=str(tmp_path / "xla-cache"), SYNCER_SHARDS="2",
      DILOCO_DATA_CACHE="")
  cloud.start_gcs("emu-bucket")
  yield cloud
  cloud.close()


def _ok(result: subprocess.CompletedProcess, what: str) -> str:
  assert result.returncode == 0, f"{what}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
  return result.stdout


def _python(cloud, *args: str, timeout: float = 180) -> str:
  result = subprocess.run([sys.executable, "-m", "diloco_jax", *args], cwd=REPO, env=cloud.env, capture_output=True,
                          text=True, timeout=timeout)
  return _ok(result, " ".join(args[:1]))


def _prepare_data(cloud, tmp_path) -> None:
  """The data step of docs/tpu.md: a tokenizer and token shards on gs://, made here."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  stdlib = sorted(p for p in (pathlib.Path(sysconfig.get_paths()["stdlib"])).glob("*.py"))
  for path in stdlib[:40]:
    (corpus / path.name).write_bytes(path.read_bytes())
  _python(cloud, "tokenizer", "--data", str(corpus), "--vocab", "512", "--out", f"{DATA}/tokenizer.model")
  _python(cloud, "tokenize", "--tokenizer", f"{DATA}/tokenizer.model", "--data", str(corpus), "--out",
          f"{DATA}/tokens", "--shards", "2", "--eval-fraction", "0.1")


def _wait_for_checkpoint(learner: int, above: int, timeout: float = 180, committed: bool = True) -> int:
  ckpt = epath.Path(f"{BUCKET}/{RUN}/learner_{learner}/checkpoints")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    # A checkpoint counts once orbax committed it (on GCS: its commit_success.txt).
    steps = [int(p.name) for p in ckpt.iterdir()
             if p.name.isdigit() and (not committed or (p / "commit_success.txt").exists())] \
        if ckpt.exists() else []
    if steps and max(steps) > above:
      return max(steps)
    time.sleep(1)
  raise AssertionError(f"learner {learner}: no checkpoint above step {above} in {ckpt} after {timeout}s")


# In `make test`'s process tier (issue 25: the launch must be proved where it can run here), and in
# `make test-cloud` with the scripts' own tests.
def test_a_run_on_the_emulated_cloud_from_data_to_a_saved_model(cloud, tmp_path, monkeypatch):
  t0 = time.monotonic()
  for name, value in cloud.host_env.items():
    monkeypatch.setenv(name, value)  # this process reads the bucket too
  _prepare_data(cloud, tmp_path)

  marks = {"data": time.monotonic() - t0}
  out = _ok(cloud.run("create.sh"), "create.sh")
  marks["create"] = time.monotonic() - t0
  assert "every slice is ACTIVE" in out
  # The shipped code, checked on every host: it is what runs there (not this checkout's install).
  for node, workers in ((f"{RUN}-l0", 2), (f"{RUN}-l1", 1)):
    for w in range(workers):
      assert "ready: python" in (cloud.root / "logs").joinpath(RUN).glob("create-*").__next__() \
          .joinpath(f"deploy.{node}", f"{w}.log").read_text()
  assert cloud.home(f"{RUN}-syncer").joinpath("diloco", RUN, "code", "launch", "tpu", "host.sh").is_file()

  out = _ok(cloud.run("start.sh", "--no-deploy"), "start.sh")
  assert "run emu started" in out
  marks["start"] = time.monotonic() - t0
  # Learner 0 spans two hosts: jax.distributed with the coordinator on its worker 0, process ids 1 and 0.
  log1 = cloud.home(f"{RUN}-l0", 1).joinpath("diloco", RUN, "logs", "learner.log").read_text()
  assert "learner 0 process 1: started" in log1
  log0 = cloud.home(f"{RUN}-l0", 0).joinpath("diloco", RUN, "logs", "learner.log").read_text()
  assert "over 2 processes" in log0
  # Checkpoints on gs://, metrics in the local workdir.
  _wait_for_checkpoint(0, 0, committed=False)  # written from both processes of learner 0
  assert cloud.home(f"{RUN}-l0").joinpath("diloco", RUN, "learner", "metrics.jsonl").is_file()
  assert not (REPO / "gs:").exists()

  out = _ok(cloud.run("status.sh"), "status.sh")
  assert out.count("learner: running") == 3 and "CRASH LOOP" not in out
  assert "syncer: running" in out and "syncer1: running" in out  # both shards of the syncer

  # A spot preemption of learner 1's slice: its processes die, the slice is SUSPENDED; heal brings it back.
  step1 = _wait_for_checkpoint(1, 0)
  cloud.preempt(f"{RUN}-l1")
  result = cloud.run("status.sh")
  assert result.returncode != 0 and f"{RUN}-l1 (v5p-8, us-east5-a, spot): SUSPENDED" in result.stdout
  marks["preempted"] = time.monotonic() - t0
  out = _ok(cloud.run("heal.sh"), "heal.sh")
  marks["healed"] = time.monotonic() - t0
  assert f"slice {RUN}-l1 is SUSPENDED" in out
  log = cloud.home(f"{RUN}-l1").joinpath("diloco", RUN, "logs", "learner.log").read_text()
  ckpt = epath.Path(f"{BUCKET}/{RUN}/learner_1/checkpoints")
  listing = {p.name: sorted(q.name for q in p.iterdir()) for p in ckpt.iterdir()} if ckpt.exists() else None
  assert "resumed at step" in log, f"{log[-1500:]}\n{listing}\n{out[-3000:]}"
  assert int(log.split("resumed at step ")[1].split()[0].rstrip(",")) >= step1

  out = _ok(cloud.run("stop.sh"), "stop.sh")
  marks["stopped"] = time.monotonic() - t0
  assert f"saved params-only export: {BUCKET}/{RUN}/export" in out
  assert f"saved syncer checkpoints: {BUCKET}/{RUN}/syncer" in out
  assert f"saved syncer checkpoints: {BUCKET}/{RUN}/syncer1" in out
  # The learners' logs and metrics reached the bucket (every worker's), and so did the syncer's logs.
  for learner, workers in ((0, 2), (1, 1)):
    for w in range(workers):
      base = epath.Path(f"{BUCKET}/{RUN}/learner_{learner}/learner_logs/worker{w}")
      assert (base / "logs" / "learner.log").exists(), base
  assert epath.Path(f"{BUCKET}/{RUN}/learner_0/learner_logs/worker0/learner/metrics.jsonl").exists()
  assert epath.Path(f"{BUCKET}/{RUN}/syncer_logs/syncer.log").exists()
  assert epath.Path(f"{BUCKET}/{RUN}/syncer/syncer_checkpoints").exists()

  # The exported model, read from the bucket, scores what the global model of the syncer's final checkpoint
  # (on its VM) scores: the export is that model.
  local = tmp_path / "from-checkpoint"
  config = ["--config", str(REPO / "configs" / "tiny_cpu.py"), *_overrides().split(), "--config.learners.num=2"]
  shards = [str(cloud.home(f"{RUN}-syncer") / "diloco" / RUN / name) for name in ("syncer", "syncer1")]
  _python(cloud, "export", "--syncer-workdir", ",".join(shards),
          "--run-id", RUN, "--out", str(local), *config)
  scores = [json.loads(_python(cloud, "eval", "--model", model, "--json").strip().splitlines()[-1])
            for model in (f"{BUCKET}/{RUN}/export", str(local))]
  assert scores[0]["nats_per_token"] == scores[1]["nats_per_token"] and scores[0]["tokens"] == scores[1]["tokens"] > 0

  _ok(cloud.run("stop.sh", "--delete"), "stop.sh --delete")
  assert cloud.state()["qr"] == {} and cloud.state()["instances"] == {} and cloud.state()["firewalls"] == []
  marks["deleted"] = time.monotonic() - t0
  print("emulated cloud, seconds from the start: " + ", ".join(f"{k} {v:.0f}" for k, v in marks.items()))

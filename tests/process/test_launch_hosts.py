"""launch/tpu's hosts' side run here for real: supervise.sh restarts, stops and signals a command; host.sh
starts and stops a supervised learner and the syncer, with fake learner and syncer programs. (The scripts
against a fake `gcloud`: tests/launch/test_tpu.py.)"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import stat
import subprocess
import time

import helpers

TPU = helpers.REPO / "launch" / "tpu"
RUN = "t1"  # the run name the fake host is laid out for


def _wait_for(predicate, timeout=20.0):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.05)
  return False


def _program(path: pathlib.Path, body: str) -> pathlib.Path:
  path.write_text("#!/usr/bin/env bash\n" + body)
  path.chmod(0o755)
  return path


def test_supervisor_restarts_a_crashing_command_until_it_finishes(tmp_path):
  flaky = _program(tmp_path / "flaky", f"""
n=$(( $(cat {tmp_path}/count 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/count
((n < 3)) && kill -KILL $$   # two crashes, the second by a signal
echo "run $n finished"
""")
  result = subprocess.run([str(TPU / "supervise.sh"), "--", str(flaky)], capture_output=True, text=True,
                          env={**os.environ, "SUPERVISE_BACKOFF_S": "0.05"}, timeout=30)
  assert result.returncode == 0, result.stdout + result.stderr
  assert (tmp_path / "count").read_text().strip() == "3"
  assert result.stdout.count("start:") == 3 and "restart 2 in 0.1s" in result.stdout
  assert "run 3 finished" in result.stdout and "exited 0: done" in result.stdout


def test_supervisor_does_not_restart_bad_flags_and_honours_max_restarts(tmp_path):
  bad = _program(tmp_path / "bad", "exit 2\n")
  result = subprocess.run([str(TPU / "supervise.sh"), "--", str(bad)], capture_output=True, text=True, timeout=30)
  assert result.returncode == 2 and result.stdout.count("start:") == 1
  crash = _program(tmp_path / "crash", "exit 5\n")
  result = subprocess.run([str(TPU / "supervise.sh"), "--max-restarts", "2", "--", str(crash)], capture_output=True,
                          text=True, env={**os.environ, "SUPERVISE_BACKOFF_S": "0.01"}, timeout=30)
  assert result.returncode == 5 and result.stdout.count("start:") == 3


def test_supervisor_passes_sigterm_on_and_waits_for_a_clean_exit(tmp_path):
  learner = _program(tmp_path / "learner", f"""
trap 'sleep 0.5; echo flushed > {tmp_path}/flushed; exit 0' TERM
echo up > {tmp_path}/up
while true; do sleep 0.1; done
""")
  proc = subprocess.Popen([str(TPU / "supervise.sh"), "--", str(learner)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  assert _wait_for((tmp_path / "up").exists)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=30)
  assert proc.returncode == 0, out
  assert (tmp_path / "flushed").read_text().strip() == "flushed"  # the child finished its shutdown first
  assert out.count("start:") == 1 and "stopped by a signal" in out


def _fake_host(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
  """A host's ~/diloco/t1 with code/ (the real launch/tpu scripts) and a venv whose python records its
  arguments and behaves like the syncer (writes the port file) or a learner (flushes on SIGTERM)."""
  home = tmp_path / "home"
  d = home / "diloco" / RUN
  (d / "code" / "launch").mkdir(parents=True)
  shutil.copytree(TPU, d / "code" / "launch" / "tpu")
  (d / "venv" / "bin").mkdir(parents=True)
  _program(d / "venv" / "bin" / "python", f"""
echo "$@" > {tmp_path}/args.$3
trap 'echo stopping; sleep 0.3; exit 0' TERM
if [[ $3 == syncer ]]; then
  while [[ $# -gt 1 && $1 != --workdir ]]; do shift; done
  mkdir -p "$2"; echo 50051 > "$2/syncer.port"
fi
while true; do sleep 0.1; done
""")
  (d / "token").write_text("secret\n")
  shutil.copy(TPU / "host.sh", d / "host.sh")
  return d, {**os.environ, "HOME": str(home), "HOST_START_CHECK_S": "1"}


def _host(d: pathlib.Path, env: dict, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(d / "host.sh"), RUN, *args], capture_output=True, text=True, env=env,
                        timeout=60)


def test_host_starts_and_stops_a_supervised_learner(tmp_path):
  d, env = _fake_host(tmp_path)
  started = _host(d, env, "start-learner", "-", "1", "--", "--config", "configs/tiny_cpu.py", "--learner-id", "1")
  assert started.returncode == 0, started.stdout + started.stderr
  assert (tmp_path / "args.learner").read_text().split() == ["-m", "diloco_jax", "learner", "--config",
                                                             "configs/tiny_cpu.py", "--learner-id", "1"]
  assert stat.S_IMODE((d / "token").stat().st_mode) == 0o600
  again = _host(d, env, "start-learner", "-", "1", "--", "--learner-id", "1")
  assert again.returncode == 0 and "already runs here" in again.stdout
  supervisor = int((d / "learner.pid").read_text())
  stopped = _host(d, env, "stop", "learner", "20")
  assert stopped.returncode == 0 and "learner stopped" in stopped.stdout, stopped.stdout + stopped.stderr
  assert not _pid_alive(supervisor)
  log = (d / "logs" / "learner.log").read_text()
  assert "stopping" in log and "stopped by a signal; the command exited 0" in log
  assert _host(d, env, "stop", "learner", "5").stdout.strip() == "learner: not running"


def test_host_starts_the_syncer_once_and_waits_until_it_serves(tmp_path):
  d, env = _fake_host(tmp_path)
  started = _host(d, env, "start-syncer", "30", "--", "--workdir", "../syncer", "--token-file", "../token")
  assert started.returncode == 0 and "syncer serving on port 50051" in started.stdout, started.stderr
  again = _host(d, env, "start-syncer", "30", "--", "--workdir", "../syncer")
  assert again.stdout.startswith("the syncer already runs")
  refused = _host(d, env, "export", "gs://b/x")
  assert refused.returncode != 0 and "stop it first" in refused.stderr
  assert _host(d, env, "stop", "syncer", "20").returncode == 0


def test_host_reports_a_syncer_that_dies_at_start(tmp_path):
  d, env = _fake_host(tmp_path)
  _program(d / "venv" / "bin" / "python", "echo 'error: config.model.d_model: must be >= 1'; exit 2\n")
  result = _host(d, env, "start-syncer", "30", "--", "--workdir", "../syncer")
  assert result.returncode != 0 and "exited during start" in result.stderr
  assert "config.model.d_model" in result.stderr
  # A crash (not bad flags) would be restarted by the supervisor: at start it is a failure, and nothing stays up.
  _program(d / "venv" / "bin" / "python", "echo 'Traceback: boom'; exit 1\n")
  result = _host(d, env, "start-syncer", "30", "--", "--workdir", "../syncer")
  assert result.returncode != 0 and "crashed during start" in result.stderr and "boom" in result.stderr
  assert not _pid_alive(int((d / "syncer.pid").read_text()))


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True

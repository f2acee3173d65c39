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
[[ $3 != learner ]] || echo "learner 1: fake learner up"
if [[ $3 == syncer ]]; then
  while [[ $# -gt 1 && $1 != --workdir ]]; do shift; done
  mkdir -p "$2"; echo 50051 > "$2/syncer.port"
fi
while true; do sleep 0.1; done
""")
  (d / "token").write_text("secret\n")
  shutil.copy(TPU / "host.sh", d / "host.sh")
  return d, {**os.environ, "HOME": str(home), "HOST_START_CHECK_S": "20", "DILOCO_NO_SYSTEMD": "1",
             "LIBTPU_LOCKFILE": str(tmp_path / "libtpu_lockfile"), "ACCEL_DEVICES": str(tmp_path / "accel0"),
             "SUPERVISE_BACKOFF_S": "0.1"}


def _host(d: pathlib.Path, env: dict, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run(["bash", str(d / "host.sh"), RUN, *args], capture_output=True, text=True, env=env,
                        timeout=60)


def test_host_starts_and_stops_a_supervised_learner(tmp_path):
  d, env = _fake_host(tmp_path)
  started = _host(d, env, "start-learner", "-", "1", "-", "--", "--config", "configs/tiny_cpu.py", "--learner-id",
                  "1")
  assert started.returncode == 0, started.stdout + started.stderr
  assert (tmp_path / "args.learner").read_text().split() == ["-m", "diloco_jax", "learner", "--config",
                                                             "configs/tiny_cpu.py", "--learner-id", "1"]
  assert stat.S_IMODE((d / "token").stat().st_mode) == 0o600
  again = _host(d, env, "start-learner", "-", "1", "-", "--", "--learner-id", "1")
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
  started = _host(d, env, "start-syncer", "syncer", "30", "--", "--workdir", "../syncer", "--token-file", "../token")
  assert started.returncode == 0 and "syncer serving on port 50051" in started.stdout, started.stderr
  again = _host(d, env, "start-syncer", "syncer", "30", "--", "--workdir", "../syncer")
  assert again.stdout.startswith("syncer already runs")
  refused = _host(d, env, "export", "syncer", "gs://b/x")
  assert refused.returncode != 0 and "stop it first" in refused.stderr
  assert _host(d, env, "stop", "syncer", "20").returncode == 0


def test_host_reports_a_syncer_that_dies_at_start(tmp_path):
  d, env = _fake_host(tmp_path)
  _program(d / "venv" / "bin" / "python", "echo 'error: config.model.d_model: must be >= 1'; exit 2\n")
  result = _host(d, env, "start-syncer", "syncer", "30", "--", "--workdir", "../syncer")
  assert result.returncode != 0 and "exited during start" in result.stderr
  assert "config.model.d_model" in result.stderr
  # A crash (not bad flags) would be restarted by the supervisor: at start it is a failure, and nothing stays up.
  _program(d / "venv" / "bin" / "python", "echo 'Traceback: boom'; exit 1\n")
  result = _host(d, env, "start-syncer", "syncer", "30", "--", "--workdir", "../syncer")
  assert result.returncode != 0 and "crashed during start" in result.stderr and "boom" in result.stderr
  assert not _pid_alive(int((d / "syncer.pid").read_text()))


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  return True


def test_host_reports_a_crash_at_start_and_a_crash_loop_with_the_last_error(tmp_path):
  d, env = _fake_host(tmp_path)
  _program(d / "venv" / "bin" / "python", "echo 'Traceback (most recent call last):'; "
           "echo 'ImportError: Please install gcsfs'; exit 1\n")
  result = _host(d, env, "start-learner", "-", "1", "-", "--", "--learner-id", "1")
  assert result.returncode != 0
  assert "crashed during start (last error: ImportError: Please install gcsfs)" in result.stderr
  assert not _pid_alive(int((d / "learner.pid").read_text()))
  # A learner that starts, then crashes and is restarted by its supervisor: status says so, with the error.
  _program(d / "venv" / "bin" / "python", f"""
n=$(( $(cat {tmp_path}/n 2>/dev/null || echo 0) + 1 )); echo $n > {tmp_path}/n
echo "learner 1: up"
((n > 1)) || {{ echo 'ValueError: boom'; exit 1; }}
trap 'exit 0' TERM
while true; do sleep 0.1; done
""")
  (d / "logs" / "learner.log").write_text("")
  assert _host(d, env, "start-learner", "-", "1", "-", "--", "--learner-id", "1").returncode == 0
  assert _wait_for(lambda: (tmp_path / "n").exists() and (tmp_path / "n").read_text().strip() == "2")
  status = _host(d, env, "status", "learner")
  assert "learner: running" in status.stdout
  assert "CRASH LOOP? restarted 1 time(s), last exit 1; last error: ValueError: boom" in status.stdout
  assert _host(d, env, "stop", "learner", "20").returncode == 0


def test_host_ends_a_stale_tpu_holder_and_removes_the_libtpu_lock_before_a_start(tmp_path):
  d, env = _fake_host(tmp_path)
  accel = tmp_path / "accel0"
  accel.write_text("")
  (tmp_path / "libtpu_lockfile").write_text("")
  stale = subprocess.Popen(["bash", "-c", f"exec 3<{accel}; exec sleep 60"])
  try:
    assert _wait_for(lambda: any(os.path.realpath(f"/proc/{stale.pid}/fd/{fd}") == str(accel)
                                 for fd in os.listdir(f"/proc/{stale.pid}/fd")))
    started = _host(d, env, "start-learner", "-", "1", "-", "--", "--learner-id", "1")
    assert started.returncode == 0, started.stdout + started.stderr
    assert f"ending stale TPU holder(s): pid {stale.pid}" in started.stdout
    assert stale.wait(10) == -signal.SIGKILL
    assert not (tmp_path / "libtpu_lockfile").exists()
  finally:
    if stale.poll() is None:
      stale.kill()
    _host(d, env, "stop", "learner", "20")


def test_host_export_passes_the_config_and_every_shard(tmp_path):
  d, env = _fake_host(tmp_path)
  _program(d / "venv" / "bin" / "python", f'echo "$@" > {tmp_path}/args.export\n')
  result = _host(d, env, "export", "syncer,syncer1", "gs://b/x/export", "--", "--config", "configs/b12.py",
                 "--run-id", RUN)
  assert result.returncode == 0, result.stderr
  assert (tmp_path / "args.export").read_text().split() == [
      "-m", "diloco_jax", "export", "--syncer-workdir", f"{d}/syncer,{d}/syncer1", "--out", "gs://b/x/export",
      "--config", "configs/b12.py", "--run-id", RUN]


def test_host_writes_a_systemd_user_unit_that_verifies(tmp_path):
  """The unit that keeps the supervisor across a reboot where there is a user manager (none here: the
  start falls back to setsid, and the unit's file is still written next to the pid file)."""
  d, env = _fake_host(tmp_path)
  assert _host(d, env, "start-learner", "-", "1", "-", "--", "--learner-id", "1").returncode == 0
  try:
    unit = d / f"diloco-{RUN}-learner.service"
    text = unit.read_text()
    assert f"ExecStart=/bin/bash {d}/learner.cmd" in text and "WantedBy=default.target" in text
    assert "KillMode=mixed" in text and "Restart=on-abnormal" in text
    cmd = (d / "learner.cmd").read_text()
    assert "supervise.sh" in cmd and "--learner-id 1" in cmd and f"{d}/logs/learner.log" in cmd
    analyze = shutil.which("systemd-analyze")
    if analyze:
      result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60)
      assert result.returncode == 0, result.stdout + result.stderr
  finally:
    _host(d, env, "stop", "learner", "20")

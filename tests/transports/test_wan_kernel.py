"""The WAN emulation's bandwidth against the kernel's (issue 24): a real syncer in one network namespace and
data-plane clients in another, joined by two veth pairs, one shaped by a `tbf` qdisc each way, one not.
One client pushes and pulls (1 KB .. 64 MB) over the shaped pair, another over the plain pair with the
emulation at the same rate and burst, taking turns (so the machine's load drifts alike for both); each
transfer's time (the least of its repeats) must agree within 20%. Needs root, `ip netns` and `tc` with
tbf (netem is not available: latency is not compared here; test_wan.py checks what it charges)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import helpers

RATE = 32e6  # bytes/s each way: 64 MB in 2 s
BURST_S = 0.002  # the emulation's bucket, and tbf's burst
SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)  # payload bytes (fp32: a quarter as many params)
TOLERANCE = 0.20

_SERVER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[1])
    import helpers
    from diloco_jax.syncer.server import grpc_service as service
    from diloco_jax.syncer.server import limits as limits_lib
    sizes = [int(s) // 4 for s in sys.argv[3].split(",")]
    core = helpers.make_core(sizes, codec="fp32", downlink="fp32", initial="linspace", lease_s=3600.0)
    handle = service.serve(core, sys.argv[2] + ":0", token="kernel-wan-token", allow_remote=True,
                           limits=limits_lib.Limits.defaults(rate_per_s=0.0))
    print(handle.port, flush=True)
    sys.stdin.read()  # until the test closes our stdin
    handle.stop(grace=0)
""")

_CLIENT = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    import helpers
    from diloco_jax.transports import wan as wan_lib
    from diloco_jax.transports.grpc_client import GrpcTransport
    shaped, plain, rate, burst_s = sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
    sizes = sys.argv[6].split(",")
    wan = wan_lib.WanSpec(up_bytes_per_s=rate, down_bytes_per_s=rate, burst_s=burst_s)
    links = {"kernel": GrpcTransport(shaped, "kernel-wan-token", 0, unreachable_deadline_s=30.0),
             "emulated": GrpcTransport(plain, "kernel-wan-token", 1, wan=wan, unreachable_deadline_s=30.0)}
    for learner, t in enumerate(links.values()):
      versions = t.join(learner, helpers.FP).versions
      t.pull(0, 0)  # the connection is up before anything is timed
    times = {name: {} for name in links}
    for p, size in enumerate(int(s) for s in sizes):
      took = {(name, op): [] for name in links for op in ("pull", "push")}
      for _ in range(3 if size > (16 << 20) else 7 if size > (64 << 10) else 40):
        for learner, (name, t) in enumerate(links.items()):
          start = time.perf_counter()
          t.pull(p, 0, have_version=-1)
          took[name, "pull"].append(time.perf_counter() - start)
          push = helpers.make_push(learner, np.full(size // 4, 1e-5, np.float32), fragment=p,
                                   base_version=versions[p])
          start = time.perf_counter()
          versions[p] = t.push(push).version
          took[name, "push"].append(time.perf_counter() - start)
      for (name, op), values in took.items():
        times[name].setdefault(size, {})[op] = min(values)  # the least disturbed by a shared machine
    for t in links.values():
      assert t.data_port and t.data_connections == 1, "not all over one data-plane connection"
      t.close()
    print(json.dumps(times))
""")


def _run(*cmd):
  subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


def _unavailable() -> str | None:
  if os.geteuid() != 0:
    return "needs root (network namespaces and tc)"
  if not (shutil.which("ip") and shutil.which("tc")):
    return "needs iproute2 (ip, tc)"
  probe = f"dlprobe{os.getpid()}"
  try:
    _run("ip", "netns", "add", probe)
  except (subprocess.SubprocessError, OSError) as e:
    return f"network namespaces unavailable: {e}"
  try:
    _run("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
    _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit",
         "burst", "10kb", "latency", "100ms")
  except (subprocess.SubprocessError, OSError) as e:
    return f"veth or tbf unavailable: {e}"
  finally:
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
  return None


@pytest.fixture
def namespaces():
  """Two namespaces (syncer, learner) joined by two veth pairs, the first shaped by tbf each way:
  {"ns": (syncer's, learner's), "shaped": syncer's address on it, "plain": on the other}."""
  why = _unavailable()
  if why:
    pytest.skip(why)
  pid = os.getpid()
  ns = (f"dlsyn{pid}", f"dllrn{pid}")
  try:
    for name in ns:
      _run("ip", "netns", "add", name)
      _run("ip", "-n", name, "link", "set", "lo", "up")
    for k in range(2):
      dev = (f"v{k}s{pid}"[:15], f"v{k}l{pid}"[:15])
      _run("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
      for name, d, host in zip(ns, dev, (1, 2), strict=True):
        _run("ip", "link", "set", d, "netns", name)
        _run("ip", "-n", name, "addr", "add", f"10.231.{k}.{host}/24", "dev", d)
        _run("ip", "-n", name, "link", "set", d, "up")
        if k == 0:
          _run("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", d, "root", "tbf", "rate",
               f"{int(RATE * 8)}bit", "burst", str(int(RATE * BURST_S)), "latency", "2s")
    yield {"ns": ns, "shaped": "10.231.0.1", "plain": "10.231.1.1"}
  finally:
    for name in ns:
      subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@pytest.mark.slow  # ~60 s: 64 MB each way at 32 MB/s, 3 times, on both links
def test_the_emulated_link_times_transfers_as_a_kernel_shaped_one(namespaces):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  tests_dir = str(helpers.REPO / "tests")
  server = subprocess.Popen(
      ["ip", "netns", "exec", namespaces["ns"][0], "nice", sys.executable, "-c", _SERVER, tests_dir, "0.0.0.0",
       ",".join(map(str, SIZES))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=helpers.REPO, env=env)
  try:
    port = int(server.stdout.readline())
    out = subprocess.run(
        ["ip", "netns", "exec", namespaces["ns"][1], "nice", sys.executable, "-c", _CLIENT, tests_dir,
         f"{namespaces['shaped']}:{port}", f"{namespaces['plain']}:{port}", str(RATE), str(BURST_S),
         ",".join(map(str, SIZES))], capture_output=True, text=True, timeout=300, cwd=helpers.REPO, env=env)
  finally:
    server.stdin.close()
    server.wait(30)
  assert out.returncode == 0, out.stderr[-3000:]
  times = json.loads(out.stdout.strip().splitlines()[-1])
  kernel, emulated = times["kernel"], times["emulated"]
  table = {size: {op: (kernel[str(size)][op], emulated[str(size)][op]) for op in ("pull", "push")} for size in SIZES}
  print(json.dumps(table, indent=1))
  for size in SIZES:
    for op in ("pull", "push"):
      real, emu = table[size][op]
      assert abs(emu - real) <= TOLERANCE * real, (size, op, real, emu, table)

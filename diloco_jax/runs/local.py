"""A syncer and N learner processes on this machine: `python -m diloco_jax local`.

    python -m diloco_jax local --config configs/tiny_cpu.py --learners 2 --workdir runs/local \\
        [--config.train.steps=200 ...]

Each learner is its own process with its own fake CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=<its learner's devices>` in its environment), talking to the syncer
process over gRPC on loopback, exactly as on separate hosts. The launcher:

1. writes a fresh random run token to `WORKDIR/token` (mode 600) and hands it to every child by file;
2. starts the syncer (`--bind 127.0.0.1:0`) and waits for `WORKDIR/syncer/syncer.port`;
3. with `--eval` (the default), starts the global model's evaluator (`python -m diloco_jax evaluator`, an
   observer that never joins) in `WORKDIR/global`, on its own fake devices (as many as learner 0's);
4. starts learner i in `WORKDIR/learner_<i>`; every child logs to `WORKDIR/logs/<name>.log`;
5. shows overall progress (steps read from each learner's `metrics.jsonl`, the newest global eval loss from
   `WORKDIR/global/metrics.jsonl`) and waits for the learners;
6. asks the syncer for its status, stops the evaluator (its last eval) and then the syncer with SIGTERM (it
   writes a final checkpoint), evaluates the global model from that checkpoint (`--eval`), exports it to
   `WORKDIR/model` (`--export`; see `python -m diloco_jax eval/sample --model`), writes
   `WORKDIR/summary.json` and the plots (`WORKDIR/plots/`), and prints where TensorBoard finds the logs.

The resolved config goes to `WORKDIR/config.json` (and every child's workdir), its fingerprint beside it.

With `--syncer-shards S`, the syncer is S processes on consecutive free loopback ports, shard i in
`WORKDIR/syncer/shard_<i>` owning its fragments (`placement.assign_shards`; docs/architecture.md, "Sharded
syncer"); learners and the evaluator get every shard's address, the summary reads every shard's status,
and the final eval and export assemble the global model from every shard's checkpoint.

With `--hosts-per-learner H`, each learner is H processes of 1/H of its fake CPU devices each,
one learner spanning them through `jax.distributed` (a coordinator on a free loopback port, process 0
talking to the syncer), as a learner spanning H hosts of a TPU slice; their logs are
`WORKDIR/logs/learner_<i>_p<p>.log`.

Rerunning on the same workdir resumes: the syncer from its checkpoint, each learner from its own.
Ctrl-C (or SIGTERM) stops everything cleanly: learners first (they flush and checkpoint), then the syncer;
a child still alive after `--stop-timeout-s` is killed; the launcher exits 128 + the signal number. A child
that fails stops the run: the launcher names it, prints its log tail, and exits 1. Children run in their
own sessions (a terminal's Ctrl-C reaches only the launcher, which orders the shutdown) and get SIGTERM if
the launcher dies (Linux parent-death signal).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
import re
import secrets
import signal
import socket
import subprocess
import sys
import time

# jax only serves the final eval, on devices this launcher sets up in `launch` before the backend starts.
import jax
from absl import flags

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.runs import export as export_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.outer import merge as outer_lib
from diloco_jax.runs import plots as plot_lib
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol import run_token
from diloco_jax.evaluator import loop as eval_loop
from diloco_jax.transports import sharded
from diloco_jax.transports.grpc_client import GrpcTransport

EXIT_FAILED = 1
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "run directory (token, logs, syncer/, learner_<i>/, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_integer("learners", 0, "learner processes (default config.learners.num; sets it)",
                       flag_values=fv)
  flags.DEFINE_string("run-id", "local", "run id (enters the fingerprint; keep it to resume a workdir)",
                      flag_values=fv)
  flags.DEFINE_bool("eval", True, "run the global model's evaluator, and evaluate the syncer's final global "
                    "model (loads its checkpoint)", flag_values=fv)
  flags.DEFINE_bool("export", True, "with --eval, export that model to WORKDIR/model", flag_values=fv)
  flags.DEFINE_float("stop-timeout-s", 60.0, "grace for a child after SIGTERM before SIGKILL",
                     flag_values=fv)
  flags.DEFINE_float("start-timeout-s", 300.0, "how long to wait for the syncer's port file", flag_values=fv)
  flags.DEFINE_integer("hosts-per-learner", 1, "processes per learner (jax.distributed on loopback), each "
                       "with 1/H of the learner's fake CPU devices", flag_values=fv)
  flags.DEFINE_integer("syncer-shards", 1, "syncer processes, each owning some fragments (at most "
                       "outer.num_fragments)", flag_values=fv, lower_bound=1)


def config_args(argv: list[str]) -> list[str]:
  """The `--config FILE` and `--config.x=y` arguments of `argv`, to hand to every child unchanged."""
  out, i = [], 1
  while i < len(argv):
    a = argv[i]
    if a == "--config" or (a.startswith("--config.") and "=" not in a):
      out.append(a)
      if i + 1 < len(argv) and not argv[i + 1].startswith("-"):
        out.append(argv[i + 1])
        i += 1
    elif a.startswith("--config=") or a.startswith("--config."):
      out.append(a)
    i += 1
  return out


def child_env(num_devices: int) -> dict[str, str]:
  """This environment with exactly `num_devices` fake CPU devices (set before the child imports jax)."""
  env = dict(os.environ)
  xla = re.sub(rf"{_DEVICE_FLAG}=\S+", "", env.get("XLA_FLAGS", "")).strip()
  env["XLA_FLAGS"] = f"{xla} {_DEVICE_FLAG}={num_devices}".strip()
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["PYTHONUNBUFFERED"] = "1"
  return env


def _die_with_parent() -> None:
  """In the child, before exec: SIGTERM when the launcher dies (Linux), so no child outlives it."""
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


class Child:
  """One child process with its log file."""

  def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: pathlib.Path):
    self.name, self.log_path = name, log_path
    self._log = open(log_path, "ab")
    self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True,
                                 preexec_fn=_die_with_parent if sys.platform == "linux" else None)

  @property
  def pid(self) -> int:
    return self.proc.pid

  def poll(self) -> int | None:
    return self.proc.poll()

  def terminate(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGTERM)

  def wait(self, timeout: float) -> int | None:
    """Waits up to `timeout`; SIGKILLs the child if it is still alive then. Returns its exit code."""
    try:
      return self.proc.wait(timeout)
    except subprocess.TimeoutExpired:
      print(f"local: {self.name} (pid {self.pid}) did not stop in {timeout:.0f}s: killing it", file=sys.stderr)
      self.proc.kill()
      return self.proc.wait()

  def tail(self, lines: int = 25) -> str:
    self._log.flush()
    try:
      text = self.log_path.read_bytes()[-16384:].decode(errors="replace")
    except OSError:
      return ""
    # tqdm redraws with carriage returns: keep the last state of each line.
    return "\n".join(line.split("\r")[-1] for line in text.splitlines()[-lines:])

  def close(self) -> None:
    self._log.close()


def _last_record(path: pathlib.Path) -> dict | None:
  """The last complete JSON line of a metrics file (reads only its end)."""
  try:
    with open(path, "rb") as f:
      f.seek(0, os.SEEK_END)
      f.seek(max(0, f.tell() - 8192))
      lines = f.read().splitlines()
  except OSError:
    return None
  for line in reversed(lines):
    try:
      return json.loads(line)
    except ValueError:
      continue  # a line being written, or cut by the seek
  return None


def learner_progress(workdir: pathlib.Path) -> dict:
  """{"step": s, "versions": [...]} from a learner's summary, else its latest metrics record."""
  summary = workdir / "summary.json"
  if summary.exists():
    try:
      return {"step": json.loads(summary.read_text())["steps"], "versions": None}
    except (OSError, ValueError, KeyError):
      pass
  record = _last_record(workdir / "metrics.jsonl") or {}
  return {"step": int(record.get("step", 0)), "versions": record.get("versions")}


def free_port() -> int:
  """A TCP port free on loopback now (for a learner's jax.distributed coordinator)."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def free_ports(n: int) -> int:
  """The first of `n` consecutive TCP ports free on loopback now (for the shards of a syncer)."""
  for _ in range(100):
    base = free_port()
    socks = []
    try:
      for port in range(base, base + n):
        sock = socket.socket()
        socks.append(sock)
        sock.bind(("127.0.0.1", port))
      return base
    except OSError:
      continue  # one of them is taken: try another base
    finally:
      for sock in socks:
        sock.close()
  raise RuntimeError(f"found no {n} consecutive free ports on loopback")


def write_token(path: pathlib.Path) -> None:
  """A fresh random run token, readable by this user only (created with mode 600, never widened)."""
  path.unlink(missing_ok=True)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32) + "\n")


def evaluate_global(config, syncer_dirs: list[pathlib.Path], run_id: str, export_dir: pathlib.Path | None = None
                    ) -> float | None:
  """Eval loss of the global model in the syncer's latest checkpoint (every shard's), on this process's CPU
  devices; with `export_dir`, that model is exported there too (`export.py`). None when the syncer left no
  checkpoint."""
  found = export_lib.syncer_params(config, syncer_dirs, run_id)
  if found is None:
    return None
  params, info = found
  loss = eval_loop.GlobalEval(config, jax.devices()[:config_lib.resolve(config).learners.device_counts[0]]).loss(params)
  if export_dir is not None:
    export_lib.export(export_dir, config, params, source="local", run_id=run_id,
                      syncer_checkpoint_step=info["step"], rounds=info["rounds"], versions=info["versions"],
                      final_eval_loss=loss)
  return loss


class Launcher:
  """Starts, watches and stops the children of one local run."""

  def __init__(self, config, config_argv: list[str], workdir: pathlib.Path, run_id: str, *,
               stop_timeout_s: float, start_timeout_s: float, hosts_per_learner: int = 1, syncer_shards: int = 1):
    self.config, self.config_argv, self.workdir, self.run_id = config_lib.resolve(config), config_argv, workdir, run_id
    self.hosts_per_learner, self.syncer_shards = hosts_per_learner, syncer_shards
    self.stop_timeout_s, self.start_timeout_s = stop_timeout_s, start_timeout_s
    self.syncers: list[Child] = []  # one per shard
    self.evaluator: Child | None = None  # an observer: its failure is reported, never fatal
    self._evaluator_reported = False
    self.learners: list[Child] = []
    self.signals: list[int] = []
    self.ports: list[int] = [0] * syncer_shards  # the shards', in shard order (0: not serving yet)

  def _command(self, command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_jax", command, *self.config_argv, "--run-id", self.run_id, *args]

  def on_signal(self, signum, frame) -> None:
    del frame
    self.signals.append(signum)

  def syncer_dirs(self) -> list[pathlib.Path]:
    """The syncer's workdir: one, or one per shard."""
    if self.syncer_shards == 1:
      return [self.workdir / "syncer"]
    return [self.workdir / "syncer" / f"shard_{i}" for i in range(self.syncer_shards)]

  @property
  def target(self) -> str:
    """The syncer's address for `--syncer`: every shard's, in shard order."""
    return ",".join(f"127.0.0.1:{port}" for port in self.ports)

  @property
  def port(self) -> int:
    """The syncer's port (shard 0's, when sharded)."""
    return self.ports[0]

  @property
  def syncer(self) -> Child | None:
    """The syncer's process (shard 0's, when sharded)."""
    return self.syncers[0] if self.syncers else None

  def start_syncers(self) -> None:
    """Starts the syncer (every shard: on consecutive free ports) and waits until every shard serves."""
    s = self.syncer_shards
    base = free_ports(s) if s > 1 else 0  # one syncer: any free port, read back from its port file
    for i in range(s):
      self.start_syncer(base + i if s > 1 else 0, wait=False, shard=i)
    deadline = time.monotonic() + self.start_timeout_s
    while not self.signals and not all([self.syncer_serving(i) for i in range(s)]):
      if time.monotonic() > deadline:
        raise RuntimeError(f"the syncer wrote no port file in {self.start_timeout_s:.0f}s; see "
                           f"{', '.join(str(c.log_path) for c in self.syncers)}")
      time.sleep(0.2)

  def start_syncer(self, port: int = 0, wait: bool = True, shard: int = 0) -> None:
    """Start syncer shard `shard` (the syncer, unsharded) on `port` (0: any free port; a restart passes the
    port it had) and, with `wait`, wait until it serves (else poll `syncer_serving`)."""
    s = self.syncer_shards
    sdir = self.syncer_dirs()[shard]
    sdir.mkdir(parents=True, exist_ok=True)
    (sdir / "syncer.port").unlink(missing_ok=True)  # a stale one from an earlier run would point at a dead port
    flags_ = ["--shard", str(shard), "--shards", str(s)] if s > 1 else []
    child = Child("syncer" if s == 1 else f"syncer shard {shard}",
                  self._command("syncer", "--workdir", str(sdir), "--bind", f"127.0.0.1:{port}",
                                "--token-file", str(self.workdir / "token"), *flags_),
                  child_env(1), self.workdir / "logs" / ("syncer.log" if s == 1 else f"syncer_{shard}.log"))
    if shard < len(self.syncers):
      self.syncers[shard] = child
    else:
      self.syncers.append(child)
    deadline = time.monotonic() + self.start_timeout_s
    while wait and not self.signals and not self.syncer_serving(shard):
      if time.monotonic() > deadline:
        raise RuntimeError(f"the syncer wrote no port file in {self.start_timeout_s:.0f}s; see {child.log_path}")
      time.sleep(0.2)

  def syncer_serving(self, shard: int = 0) -> bool:
    """Whether syncer shard `shard` wrote its port file (it serves; `ports` has its port). Raises
    ChildFailed if it died."""
    port_file = self.syncer_dirs()[shard] / "syncer.port"
    text = port_file.read_text().strip() if port_file.exists() else ""
    if text.isdigit():
      self.ports[shard] = int(text)
      return True
    if self.syncers[shard].poll() is not None:
      raise ChildFailed(self.syncers[shard])
    return False

  def start_learners(self) -> None:
    for i in range(self.config.learners.num):
      self.start_learner(i)

  def start_learner(self, i: int, add: bool = True) -> list[Child]:
    """Starts (or restarts: same id, same workdir, so it resumes from its checkpoint) learner i: one
    process, or `hosts_per_learner` processes joined by jax.distributed; `add`: append them to `learners`
    (a restart replaces the old ones itself)."""
    h = self.hosts_per_learner
    devices = self.config.learners.device_counts[i]
    ldir = self.workdir / f"learner_{i}"
    argv = self._command("learner", "--syncer", self.target, "--learner-id", str(i),
                         "--workdir", str(ldir), "--token-file", str(self.workdir / "token"))
    if h == 1:
      children = [Child(f"learner {i}", argv, child_env(devices),
                        self.workdir / "logs" / f"learner_{i}.log")]
    else:
      coordinator = f"127.0.0.1:{free_port()}"
      children = [Child(f"learner {i} process {p}",
                        argv + ["--coordinator", coordinator, "--num-processes", str(h), "--process-id", str(p)],
                        child_env(devices // h), self.workdir / "logs" / f"learner_{i}_p{p}.log")
                  for p in range(h)]
    if add:
      self.learners.extend(children)
    return children

  def start_evaluator(self) -> None:
    self.evaluator = Child(
        "evaluator",
        self._command("evaluator", "--syncer", self.target, "--workdir", str(self.workdir / "global"),
                      "--token-file", str(self.workdir / "token")),
        child_env(self.config.learners.device_counts[0]), self.workdir / "logs" / "evaluator.log")

  def latest_global_eval(self) -> float | None:
    """The newest eval loss of the global model (the evaluator's records), if any."""
    record = _last_record(self.workdir / "global" / "metrics.jsonl") or {}
    return record.get("eval_loss")

  def _check_evaluator(self) -> None:
    if self.evaluator is not None and self.evaluator.poll() not in (None, 0) and not self._evaluator_reported:
      self._evaluator_reported = True
      print(f"\nlocal: the evaluator exited with status {self.evaluator.poll()} (training goes on without the "
            f"global model's curve); last lines of {self.evaluator.log_path}:\n{self.evaluator.tail(10)}",
            file=sys.stderr)

  def watch(self, quiet: bool = False) -> None:
    """Until every learner exits 0 (returns), a child fails (raises ChildFailed), or a signal (returns)."""
    steps = self.config.train.steps
    dirs = [self.workdir / f"learner_{i}" for i in range(self.config.learners.num)]
    bar = None if quiet else metrics_lib.progress(steps * len(dirs), desc="local")
    max_version = 0
    try:
      while not self.signals:
        for child in [*self.syncers, *self.learners]:
          rc = child.poll()
          if rc is not None and (rc != 0 or child in self.syncers):
            raise ChildFailed(child)
        self._check_evaluator()
        progress = [learner_progress(d) for d in dirs]
        if bar is not None:
          versions = [v for p in progress if p["versions"] for v in p["versions"]]
          max_version = max(versions + [max_version])
          eval_loss = self.latest_global_eval()
          bar.set_postfix(alive=sum(c.poll() is None for c in self.learners), max_version=max_version,
                          **({"global_eval": f"{eval_loss:.3f}"} if eval_loss is not None else {}),
                          refresh=False)
          # update() draws at tqdm's interval (10 s when stderr is a log file, not a terminal).
          bar.update(sum(min(p["step"], steps) for p in progress) - bar.n)
        if all(c.poll() == 0 for c in self.learners):
          return
        time.sleep(1.0)
    finally:
      if bar is not None:
        bar.close()

  def syncer_status(self) -> dict | None:
    try:
      token = run_token.read_token(str(self.workdir / "token"))
      with sharded.connect(self.target.split(","), lambda target: GrpcTransport(
          target, token, protocol.OBSERVER_ID, unreachable_deadline_s=10.0)) as t:
        return t.status()
    except Exception as e:  # noqa: BLE001 - the summary is still worth writing without it
      print(f"local: could not read the syncer's status: {e}", file=sys.stderr)
      return None

  def stop_all(self) -> dict[str, int | None]:
    """Learners first (they flush to the syncer and checkpoint), then the evaluator (a last eval of the
    global model, which the syncer still serves), then the syncer (final checkpoint)."""
    codes = {}
    for child in self.learners:
      child.terminate()
    for child in self.learners:
      codes[child.name] = child.wait(self.stop_timeout_s)
    if self.evaluator is not None:
      self.evaluator.terminate()
      codes["evaluator"] = self.evaluator.wait(self.stop_timeout_s)
    for child in self.syncers:
      child.terminate()
    for child in self.syncers:
      codes[child.name] = child.wait(self.stop_timeout_s)
    for child in [*self.learners, *([self.evaluator] if self.evaluator is not None else []), *self.syncers]:
      child.close()
    return codes


class ChildFailed(RuntimeError):

  def __init__(self, child: Child):
    super().__init__(f"{child.name} (pid {child.pid}) exited with status {child.poll()}")
    self.child = child


def merged_summary(workdir: pathlib.Path, num: int, status: dict | None, wall_s: float, run_id: str,
                   num_fragments: int = 1) -> dict:
  learners = []
  for i in range(num):
    path = workdir / f"learner_{i}" / "summary.json"
    learners.append(json.loads(path.read_text()) if path.exists() else {"learner": i, "missing": True})
  done = [s for s in learners if not s.get("missing")]
  tokens = sum(s["tokens"] for s in done)
  summary = {
      "mode": "local", "run_id": run_id, "wall_s": wall_s, "learners": learners, "tokens": tokens,
      "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
      "bytes_sent": sum(s["bytes_sent"] for s in done),
      "bytes_received": sum(s["bytes_received"] for s in done),
      "payload_bytes_sent": sum(s["payload_bytes_sent"] for s in done),
      "payload_bytes_received": sum(s["payload_bytes_received"] for s in done),
      "comm_bytes": sum(s["bytes_sent"] + s["bytes_received"] for s in done) / max(len(done), 1),
      "syncer": status,
  }
  if status:
    counters = status["counters"]
    summary.update(versions=status["versions"], outer_rounds=counters["rounds"],
                   contributions_merged=counters["contributions_merged"],
                   contributions_rejected=counters["contributions_rejected"],
                   tokens_merged=outer_lib.tokens_merged(counters["tokens_merged"],
                                                         num_fragments))
  return summary


def launch(argv) -> int:
  """`python -m diloco_jax local --config CFG --learners N --workdir DIR`; see the module docstring."""
  fv = cli.parse(argv, _define_flags, doc=__doc__)
  config = fv.config
  config_argv = config_args(argv)
  if fv.learners:
    config.learners.num = fv.learners
    config_argv.append(f"--config.learners.num={fv.learners}")
  counts = list(config_lib.resolve(config).learners.device_counts)  # sized before validating (resolve never raises)
  config = cli.validated(config, sum(counts), learners=True)  # the run's RunSpec from here on
  hosts = fv["hosts-per-learner"].value
  shards = fv["syncer-shards"].value
  if shards > config.outer.num_fragments:
    raise cli.UsageError(f"--syncer-shards ({shards}) must be at most outer.num_fragments "
                         f"({config.outer.num_fragments}): a shard owns whole fragments")
  if hosts < 1 or any(n % hosts for n in counts):
    raise cli.UsageError(f"--hosts-per-learner ({hosts}) must be >= 1 and divide every learner's devices "
                         f"({counts if len(set(counts)) > 1 else counts[0]})")
  # The launcher's own jax (the final eval) gets learner 0's CPU devices; set before first use.
  os.environ.update({k: v for k, v in child_env(counts[0]).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  workdir = pathlib.Path(fv.workdir).resolve()
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  write_token(workdir / "token")
  run_id = fv["run-id"].value
  config_lib.save_resolved(config, workdir, run_id)
  launcher = Launcher(config, config_argv, workdir, run_id, stop_timeout_s=fv["stop-timeout-s"].value,
                      start_timeout_s=fv["start-timeout-s"].value, hosts_per_learner=hosts, syncer_shards=shards)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, launcher.on_signal)
  t0 = time.perf_counter()
  status, failed = None, None
  per = f"{counts if len(set(counts)) > 1 else counts[0]}"
  shape = f"{hosts} processes x {per} / {hosts}" if hosts > 1 else per
  print(f"local: {config.learners.num} learners x {shape} CPU devices, run id {run_id!r}, "
        f"logs in {workdir / 'logs'}", file=sys.stderr, flush=True)
  try:
    launcher.start_syncers()
    if not launcher.signals:
      pids = ", ".join(str(c.pid) for c in launcher.syncers)
      print(f"local: syncer on {launcher.target} (pid {pids})", file=sys.stderr, flush=True)
      if fv.eval:
        launcher.start_evaluator()
      launcher.start_learners()
      launcher.watch()
    if not launcher.signals:
      status = launcher.syncer_status()
  except ChildFailed as e:
    failed = e
  finally:
    codes = launcher.stop_all()
  if failed is not None:
    print(f"local: {failed}; last lines of {failed.child.log_path}:\n{failed.child.tail()}", file=sys.stderr)
    return EXIT_FAILED
  if launcher.signals:
    print(f"local: stopped by signal {launcher.signals[0]}; children exited {codes}", file=sys.stderr)
    return 128 + launcher.signals[0]
  summary = merged_summary(workdir, config.learners.num, status, time.perf_counter() - t0, run_id,
                           config.outer.num_fragments)
  summary["exit_codes"] = codes
  evaluator_summary = workdir / "global" / "summary.json"
  if launcher.evaluator is not None and evaluator_summary.exists():
    summary["global_eval"] = json.loads(evaluator_summary.read_text())
  if fv.eval:
    export_dir = workdir / "model" if fv.export else None
    summary["final_eval_loss"] = evaluate_global(config, launcher.syncer_dirs(), run_id, export_dir)
    if export_dir is not None and summary["final_eval_loss"] is not None:
      summary["model"] = str(export_dir)
  metrics_lib.write_summary(workdir, summary)
  loss = summary.get("final_eval_loss")
  print(f"local done: {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s, versions {summary.get('versions')}, "
        + (f"global eval loss {loss:.4f}, " if loss is not None else "")
        + f"{summary['comm_bytes'] / 2**20:.2f} MiB per learner on the wire; summary in {workdir}/summary.json"
        + (f", model in {summary['model']}" if "model" in summary else ""),
        file=sys.stderr)
  print(plot_lib.outputs(workdir, "local"), file=sys.stderr)
  return 0

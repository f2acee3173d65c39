"""A syncer and N learner processes on this machine: `python -m diloco_jax local`.

    python -m diloco_jax local --config configs/tiny_cpu.py --learners 2 --workdir runs/local \\
        [--config.train.steps=200 ...]

Each learner is its own process with its own fake CPU devices (`XLA_FLAGS=
--xla_force_host_platform_device_count=<its learner's devices>` in its environment), talking to the syncer
process over gRPC on loopback, exactly as on separate hosts. The launcher:

1. writes a fresh random run token to `WORKDIR/token` (mode 600) and hands it to every child by file;
2. starts the syncer (`--bind 127.0.0.1:0`) and waits for `WORKDIR/syncer/syncer.port`;
3. starts learner i in `WORKDIR/learner_<i>`; every child logs to `WORKDIR/logs/<name>.log`;
4. shows overall progress (steps read from each learner's `metrics.jsonl`) and waits for the learners;
5. asks the syncer for its status, stops it with SIGTERM (it writes a final checkpoint), evaluates the
   global model from that checkpoint (`--eval`), and writes `WORKDIR/summary.json`.

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
import subprocess
import sys
import time

# jax only serves the final eval, on devices this launcher sets up in `main` before the backend starts.
import jax
import numpy as np
from absl import flags

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax import outer as outer_lib
from diloco_jax import protocol
from diloco_jax import trainer as trainer_lib
from diloco_jax.syncer import build
from diloco_jax.syncer import checkpoint as syncer_checkpoint
from diloco_jax.transports.grpc import GrpcTransport

EXIT_FAILED = 1
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "run directory (token, logs, syncer/, learner_<i>/, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_integer("learners", 0, "learner processes (default config.learners.num; sets it)",
                       flag_values=fv)
  flags.DEFINE_string("run-id", "local", "run id (enters the fingerprint; keep it to resume a workdir)",
                      flag_values=fv)
  flags.DEFINE_bool("eval", True, "evaluate the syncer's final global model (loads its checkpoint)",
                    flag_values=fv)
  flags.DEFINE_float("stop-timeout-s", 60.0, "grace for a child after SIGTERM before SIGKILL",
                     flag_values=fv)
  flags.DEFINE_float("start-timeout-s", 300.0, "how long to wait for the syncer's port file", flag_values=fv)


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


def write_token(path: pathlib.Path) -> None:
  """A fresh random run token, readable by this user only (created with mode 600, never widened)."""
  path.unlink(missing_ok=True)
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, "w") as f:
    f.write(secrets.token_hex(32) + "\n")


def evaluate_global(config, syncer_dir: pathlib.Path, run_id: str) -> float | None:
  """Eval loss of the global model in the syncer's latest checkpoint, on this process's CPU devices."""
  core, _ = build.build_core(config, run_id)
  ckpt = syncer_checkpoint.SyncerCheckpointer(syncer_dir / "syncer_checkpoints", keep=1 << 20,
                                              async_save=False)
  try:
    if syncer_checkpoint.restore_core(ckpt, core) is None:
      return None
  finally:
    ckpt.close()
  devices = jax.devices()[:config_lib.learner_devices(config, 0)]
  trainer = trainer_lib.MeshTrainer(config, devices, None, batch_size=config_lib.learner_batch(config, 0))
  plan = build.fragment_plan(config, trainer.state.params)
  params = build.global_params(core, plan, jax.tree.map(np.asarray, trainer.state.params))
  return trainer.evaluate(jax.device_put(params, trainer.shardings.params))


class Launcher:
  """Starts, watches and stops the children of one local run."""

  def __init__(self, config, config_argv: list[str], workdir: pathlib.Path, run_id: str, *,
               stop_timeout_s: float, start_timeout_s: float):
    self.config, self.config_argv, self.workdir, self.run_id = config, config_argv, workdir, run_id
    self.stop_timeout_s, self.start_timeout_s = stop_timeout_s, start_timeout_s
    self.syncer: Child | None = None
    self.learners: list[Child] = []
    self.signals: list[int] = []
    self.port: int | None = None

  def _command(self, command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_jax", command, *self.config_argv, "--run-id", self.run_id, *args]

  def on_signal(self, signum, frame) -> None:
    del frame
    self.signals.append(signum)

  def start_syncer(self) -> None:
    sdir = self.workdir / "syncer"
    sdir.mkdir(parents=True, exist_ok=True)
    port_file = sdir / "syncer.port"
    port_file.unlink(missing_ok=True)  # a stale one from an earlier run would point at a dead port
    self.syncer = Child("syncer", self._command("syncer", "--workdir", str(sdir), "--bind", "127.0.0.1:0",
                                                "--token-file", str(self.workdir / "token")),
                        child_env(1), self.workdir / "logs" / "syncer.log")
    deadline = time.monotonic() + self.start_timeout_s
    while not self.signals:
      text = port_file.read_text().strip() if port_file.exists() else ""
      if text.isdigit():
        self.port = int(text)
        return
      if self.syncer.poll() is not None:
        raise ChildFailed(self.syncer)
      if time.monotonic() > deadline:
        raise RuntimeError(f"the syncer wrote no port file in {self.start_timeout_s:.0f}s; see "
                           f"{self.syncer.log_path}")
      time.sleep(0.2)

  def start_learners(self) -> None:
    for i in range(self.config.learners.num):
      ldir = self.workdir / f"learner_{i}"
      self.learners.append(Child(
          f"learner {i}",
          self._command("learner", "--syncer", f"127.0.0.1:{self.port}", "--learner-id", str(i),
                        "--workdir", str(ldir), "--token-file", str(self.workdir / "token")),
          child_env(config_lib.learner_devices(self.config, i)), self.workdir / "logs" / f"learner_{i}.log"))

  def watch(self, quiet: bool = False) -> None:
    """Until every learner exits 0 (returns), a child fails (raises ChildFailed), or a signal (returns)."""
    steps = self.config.train.steps
    dirs = [self.workdir / f"learner_{i}" for i in range(len(self.learners))]
    bar = None if quiet else metrics_lib.progress(steps * len(dirs), desc="local")
    max_version = 0
    try:
      while not self.signals:
        for child in [self.syncer, *self.learners]:
          rc = child.poll()
          if rc is not None and (rc != 0 or child is self.syncer):
            raise ChildFailed(child)
        progress = [learner_progress(d) for d in dirs]
        if bar is not None:
          versions = [v for p in progress if p["versions"] for v in p["versions"]]
          max_version = max(versions + [max_version])
          bar.set_postfix(alive=sum(c.poll() is None for c in self.learners), max_version=max_version,
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
      token = protocol.read_token(str(self.workdir / "token"))
      with GrpcTransport(f"127.0.0.1:{self.port}", token, -1, unreachable_deadline_s=10.0) as t:
        return t.status()
    except Exception as e:  # noqa: BLE001 - the summary is still worth writing without it
      print(f"local: could not read the syncer's status: {e}", file=sys.stderr)
      return None

  def stop_all(self) -> dict[str, int | None]:
    """Learners first (they flush to the syncer and checkpoint), then the syncer (final checkpoint)."""
    codes = {}
    for child in self.learners:
      child.terminate()
    for child in self.learners:
      codes[child.name] = child.wait(self.stop_timeout_s)
    if self.syncer is not None:
      self.syncer.terminate()
      codes["syncer"] = self.syncer.wait(self.stop_timeout_s)
    for child in [*self.learners, *([self.syncer] if self.syncer else [])]:
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


def main(argv) -> int:
  """`python -m diloco_jax local --config CFG --learners N --workdir DIR`; see the module docstring."""
  fv = cli.parse(argv, _define_flags, doc=__doc__)
  config = fv.config
  config_argv = config_args(argv)
  if fv.learners:
    config.learners.num = fv.learners
    config_argv.append(f"--config.learners.num={fv.learners}")
  counts = [config_lib.learner_devices(config, i) for i in range(config.learners.num)]
  cli.validated(config, sum(counts), learners=True)
  # The launcher's own jax (the final eval) gets learner 0's CPU devices; set before first use.
  os.environ.update({k: v for k, v in child_env(counts[0]).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  workdir = pathlib.Path(fv.workdir).resolve()
  (workdir / "logs").mkdir(parents=True, exist_ok=True)
  write_token(workdir / "token")
  run_id = fv["run-id"].value
  launcher = Launcher(config, config_argv, workdir, run_id, stop_timeout_s=fv["stop-timeout-s"].value,
                      start_timeout_s=fv["start-timeout-s"].value)
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, launcher.on_signal)
  t0 = time.perf_counter()
  status, failed = None, None
  print(f"local: {config.learners.num} learners x {counts if len(set(counts)) > 1 else counts[0]} CPU devices, "
        f"run id {run_id!r}, "
        f"logs in {workdir / 'logs'}", file=sys.stderr, flush=True)
  try:
    launcher.start_syncer()
    if not launcher.signals:
      print(f"local: syncer on 127.0.0.1:{launcher.port} (pid {launcher.syncer.pid})", file=sys.stderr,
            flush=True)
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
  if fv.eval:
    summary["final_eval_loss"] = evaluate_global(config, workdir / "syncer", run_id)
  metrics_lib.write_summary(workdir, summary)
  loss = summary.get("final_eval_loss")
  print(f"local done: {summary['tokens']:,} tokens in {summary['wall_s']:.1f}s, versions {summary.get('versions')}, "
        + (f"global eval loss {loss:.4f}, " if loss is not None else "")
        + f"{summary['comm_bytes'] / 2**20:.2f} MiB per learner on the wire; summary in {workdir}/summary.json",
        file=sys.stderr)
  return 0

"""The launcher of a local run: starts the syncer (or its shards), the evaluator and the learners in order,
watches them, and stops them in order (`Launcher`); `learner_progress` reads a learner's progress from its
metrics (`runs/local.py`, the `local` command; `tools/chaos`)."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.protocol import messages as protocol
from diloco_jax.protocol import run_token
from diloco_jax.runs.children import Child, ChildFailed, child_env, free_port, free_ports
from diloco_jax.transports import sharded
from diloco_jax.transports.grpc_client import GrpcTransport


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


class Launcher:
  """Starts, watches and stops the children of one local run."""

  def __init__(self, config, config_argv: list[str], workdir: pathlib.Path, run_id: str, *,
               stop_timeout_s: float, start_timeout_s: float, hosts_per_learner: int = 1, syncer_shards: int = 1,
               signals: list[int] | None = None):
    self.config, self.config_argv, self.workdir, self.run_id = config_lib.resolve(config), config_argv, workdir, run_id
    self.hosts_per_learner, self.syncer_shards = hosts_per_learner, syncer_shards
    self.stop_timeout_s, self.start_timeout_s = stop_timeout_s, start_timeout_s
    self.syncers: list[Child] = []  # one per shard
    self.evaluator: Child | None = None  # an observer: its failure is reported, never fatal
    self._evaluator_reported = False
    self.learners: list[Child] = []
    # The stop signals received so far (`cli.StopSignals.received`): starting and watching end at the first.
    self.signals: list[int] = [] if signals is None else signals
    self.ports: list[int] = [0] * syncer_shards  # the shards', in shard order (0: not serving yet)

  def _command(self, command: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "diloco_jax", command, *self.config_argv, "--run-id", self.run_id, *args]

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
          # update() draws at most once a second (a line every 10 s when stderr is not a terminal).
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

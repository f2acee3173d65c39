"""`python -m diloco_jax bench multihost --config configs/tiny_cpu.py [--devices 4 --processes 2 --json]`

What it costs a learner to span several processes. The same learner (one learner, a quorum of one, its
syncer core in process 0 behind the in-process transport, so no network is in the figure) on the same
number of fake CPU devices, run twice, one after the other:

  1 x D         all D devices in one process: the single-process learner;
  N x D/N       the devices split over `--processes` processes joined by jax.distributed on loopback, its
                decisions sent two ways, alternating chunk by chunk: the shipped host channel
                (`multihost.HostChannel`) and a collective (`CollectiveChannel`).

Reported, as medians over chunks (`_worker`): the bare and learner step times, the decisions per step
and their host time on each process, and the broadcasts of merged fragments. The bare step of 1 x D
against N x D/N is the price of the inner step's own cross-process collectives (gloo over loopback here,
ICI on a TPU slice), which no protocol removes.
"""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.compute import multihost
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner import group as group_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.runs import children as run_children
from diloco_jax.syncer import build
from diloco_jax.syncer.ticker import Ticker
from diloco_jax.tools.bench import bench_flags
from diloco_jax.transports.inprocess import InProcessTransport


class CollectiveChannel:
  """Decisions as a collective: the alternative the host channel is measured against. Every decision is
  a `SIZE`-byte `broadcast_one_to_all` over all devices whose result each host reads back, so it waits for
  every step already dispatched (the host channel, a message through the coordination service's
  key-value store host to host, never waits for the devices)."""

  SIZE = 4096

  def __init__(self, process_id: int, num_processes: int):
    self.process_id, self.num_processes = process_id, num_processes

  @property
  def leader(self) -> bool:
    return self.process_id == 0

  def _broadcast(self, message: dict | None) -> dict:
    buf = np.zeros(self.SIZE, np.uint8)
    if message is not None:
      data = json.dumps(message).encode()
      buf[:len(data)] = np.frombuffer(data, np.uint8)
    out = multihost_utils.broadcast_one_to_all(buf, is_source=self.leader)
    return json.loads(bytes(np.asarray(out)).rstrip(b"\0"))

  def publish(self, seq: int, message: dict) -> None:
    del seq
    self._broadcast(message)

  def receive(self, seq: int) -> dict:
    del seq
    return self._broadcast(None)

  def request_stop(self) -> None:
    pass

  def stop_requested(self) -> bool:
    return False


def _chunk(step_fn, trainer, steps: int) -> float:
  """Seconds per step over `steps` calls, waiting for the devices at the end."""
  t0 = time.perf_counter()
  for _ in range(steps):
    step_fn()
  jax.block_until_ready(trainer.state.params)
  return (time.perf_counter() - t0) / steps


def _group_counters(learner) -> tuple:
  group = learner.strategy
  if not isinstance(group, group_lib.ProcessGroup):
    return (0, 0.0, 0, 0.0)
  return (group.decisions, group.decision_s, group.broadcasts, group.broadcast_s)


def _worker(fv, config) -> int:
  """One process of a configuration: compile everything in a warm-up, then alternate chunks of bare inner
  steps (no outer loop) and of learner steps (outer loop on; one chunk per decision channel); write the
  medians: step times, the outer loop's share (learner - bare), decisions per step and their host time on
  process 0 (which only publishes) and the others (which also wait for process 0's host to reach the same
  step boundary), and the broadcasts of merged fragments."""
  if fv["num-processes"].value > 1:
    multihost.initialize(multihost.DistributedSpec(fv.coordinator, fv["num-processes"].value,
                                                   fv["process-id"].value), peer_timeout_s=120.0)
  devices = jax.devices()
  leader = jax.process_index() == 0
  ticker, transport = None, None
  fingerprint = config_lib.fingerprint(config, "bench-multihost")
  if leader:
    core, fingerprint = build.build_core(config, "bench-multihost")
    ticker, transport = Ticker(core), InProcessTransport(core)
  channels = {"one process": None}
  if jax.process_count() > 1:
    channels = {"host channel": multihost.HostChannel(jax.process_index(), jax.process_count()),
                "collective": CollectiveChannel(jax.process_index(), jax.process_count())}
    learner = loop_lib.Learner(config, 0, devices, transport, fingerprint, None,
                               strategy=group_lib.ProcessGroup(channels["host channel"]))
  else:
    learner = loop_lib.Learner(config, 0, devices, transport, fingerprint, None)
  bare = trainer_lib.MeshTrainer(config, devices, None, batch_size=config.data.global_batch)
  h = config.outer.sync_every
  steps = fv.steps or 2 * h
  learner.join()
  _chunk(bare.train_step, bare, 3)  # warm up: compile the steps, outer-gradient and adoption functions
  for channel in channels.values():
    learner.strategy.channel = channel
    _chunk(learner.train_step, learner.trainer, h + 2)
  bare_s = []
  learner_s = {name: [] for name in channels}
  per_step = {name: [] for name in channels}
  for _ in range(fv.chunks):  # the sides alternate, so that a drift of the machine's speed hits all alike
    bare_s.append(_chunk(bare.train_step, bare, steps))
    for name, channel in channels.items():
      learner.strategy.channel = channel
      before = _group_counters(learner)
      learner_s[name].append(_chunk(learner.train_step, learner.trainer, steps))
      per_step[name].append([(b - a) / steps for a, b in zip(before, _group_counters(learner))])
  learner.flush()
  learner.close()
  if ticker is not None:
    ticker.stop()
  result = {"process": jax.process_index(), "processes": jax.process_count(), "devices": len(devices),
            "bare_step_s": statistics.median(bare_s), "chunks_bare_s": bare_s, "syncs": learner.stats.syncs,
            "sides": {}}
  for name in channels:
    decisions, decision_s, broadcasts, broadcast_s = (statistics.median(col) for col in zip(*per_step[name]))
    result["sides"][name] = {
        "learner_step_s": statistics.median(learner_s[name]), "chunks_learner_s": learner_s[name],
        "decisions_per_step": decisions, "decision_s_per_step": decision_s,
        "broadcasts_per_step": broadcasts, "broadcast_s_per_step": broadcast_s}
  pathlib.Path(fv["worker-out"].value).write_text(json.dumps(result))
  return 0


def _run_configuration(argv_config: list[str], out_dir: pathlib.Path, name: str, processes: int,
                       devices: int, extra: list[str]) -> list[dict]:
  port = run_children.free_port()
  procs = []
  for p in range(processes):
    out = out_dir / f"{name}_p{p}.json"
    argv = [sys.executable, "-m", "diloco_jax", "bench", "multihost", *argv_config, *extra, "--worker-out", str(out),
            "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
            "--process-id", str(p)]
    log = open(out_dir / f"{name}_p{p}.log", "wb")
    procs.append((subprocess.Popen(argv, env=run_children.child_env(devices // processes), stdout=log,
                                   stderr=subprocess.STDOUT), out, log))
  results = []
  for proc, out, log in procs:
    rc = proc.wait()
    log.close()
    if rc != 0:
      for other, _, _ in procs:
        if other.poll() is None:
          other.kill()
      raise RuntimeError(f"bench multihost: {name} process exited {rc}; see {log.name}:\n"
                         + pathlib.Path(log.name).read_text(errors="replace")[-3000:])
    results.append(json.loads(out.read_text()))
  return results


def bench_multihost(argv) -> int:
  fv = cli.parse(argv, bench_flags.multihost, doc=__doc__)
  config = fv.config
  config.learners.num = 1
  config.learners.devices = fv.devices
  config.outer.min_quorum = 1
  cli.validated(config, fv.devices, learners=True)
  if fv["worker-out"].value:
    return _worker(fv, config)
  n = fv.processes
  if n < 2 or fv.devices % n:
    raise cli.UsageError(f"--processes ({n}) must be >= 2 and divide --devices ({fv.devices})")
  extra = ["--config.learners.num=1", f"--config.learners.devices={fv.devices}", "--config.outer.min_quorum=1",
           f"--devices={fv.devices}", f"--chunks={fv.chunks}", f"--steps={fv.steps}"]
  h = config.outer.sync_every
  print(f"bench multihost: {fv.devices} devices, batch {config.data.global_batch}, H={h}, "
        f"P={config.outer.num_fragments}, tau={config.outer.tau}, {fv.chunks} x {fv.steps or 2 * h} steps a side",
        file=sys.stderr)
  table = {}
  with tempfile.TemporaryDirectory(prefix="bench_multihost_") as tmp:
    for processes in (1, n):
      print(f"  running {processes} process(es) ...", file=sys.stderr, flush=True)
      results = _run_configuration(run_children.config_args(argv), pathlib.Path(tmp), f"p{processes}", processes,
                                   fv.devices, extra)
      for side in results[0]["sides"]:
        label = f"1 x {fv.devices}" if processes == 1 else f"{processes} x {fv.devices // processes}, {side}"
        table[label] = [
            {**{k: v for k, v in r.items() if k != "sides"}, **r["sides"][side]} for r in results]
  if fv.json:
    print(json.dumps(table, indent=2))
    return 0
  ms = lambda s: f"{1000 * s:8.1f}"
  print(f"{'':28}" + "".join(f"{name:>26}" for name in table))
  rows = [("bare inner step, ms", lambda r: ms(r[0]["bare_step_s"])),
          ("learner step, ms", lambda r: ms(r[0]["learner_step_s"])),
          ("outer loop, ms/step", lambda r: ms(r[0]["learner_step_s"] - r[0]["bare_step_s"])),
          ("decisions per step", lambda r: f"{r[0]['decisions_per_step']:8.2f}"),
          ("decisions, ms/step, proc 0", lambda r: ms(r[0]["decision_s_per_step"])),
          ("decisions, ms/step, others", lambda r: ms(max(x["decision_s_per_step"] for x in r[1:])) if len(r) > 1
           else f"{'-':>8}"),
          ("broadcasts per step", lambda r: f"{r[0]['broadcasts_per_step']:8.2f}"),
          ("broadcast, ms each (host)", lambda r: ms(r[0]["broadcast_s_per_step"] / r[0]["broadcasts_per_step"])
           if r[0]["broadcasts_per_step"] else f"{'-':>8}")]
  for label, cell in rows:
    print(f"{label:28}" + "".join(f"{cell(r):>26}" for r in table.values()))
  return 0

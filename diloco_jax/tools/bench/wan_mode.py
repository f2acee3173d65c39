"""One mode of `bench wan` (`wan.py` says what it measures; `run_mode`, how): a gRPC syncer and one learner
behind an emulated link in this process, warmed up, then timed; and the bare inner step it is compared with.

Imported by `wan.py`, which sets the fake CPU device count before jax starts.
"""

from __future__ import annotations

import dataclasses
import secrets
import statistics
import time

import jax

from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.syncer import build
from diloco_jax.syncer.server import grpc_service as service
from diloco_jax.syncer.server import limits as limits_lib
from diloco_jax.syncer.ticker import Ticker
from diloco_jax.transports import wan as wan_lib
from diloco_jax.transports.grpc_client import GrpcTransport


@dataclasses.dataclass(frozen=True)
class Mode:
  """One sync schedule. None fields keep the config's value."""

  name: str
  num_fragments: int | None
  tau: int
  max_in_flight: int
  codec: str
  downlink_codec: str


def _mode_config(config, mode: Mode):
  c = config.copy_and_resolve_references()
  c.learners.num = 1
  c.outer.min_quorum = 1
  if mode.num_fragments is not None:
    c.outer.num_fragments = mode.num_fragments
  c.outer.tau = mode.tau
  c.outer.max_in_flight = mode.max_in_flight
  c.outer.codec = mode.codec
  c.outer.downlink_codec = mode.downlink_codec
  # The syncer's per-learner call-rate limit is a guard against misbehaving clients; at tiny step times
  # the staggered schedule makes more calls per second than its default, so lift it here.
  c.syncer.rate_limit_per_s = 0.0
  return c


class BareSteps:
  """The bare inner step of the learner's model on the same devices, without an outer loop."""

  def __init__(self, config, devices):
    self.trainer = trainer_lib.MeshTrainer(config, devices, None, batch_size=config.data.global_batch,
                                           num_shards=1)
    for _ in range(3):  # compile
      self.trainer.train_step()
    jax.block_until_ready(self.trainer.state.params)

  def step_time(self, steps: int, repeats: int = 3) -> float:
    """Median seconds per step over `repeats` runs of `steps` steps."""
    return bare_step_time(self.trainer, steps, repeats)

  def close(self):
    self.trainer.close()


def bare_step_time(trainer, steps: int, repeats: int = 3) -> float:
  """Median seconds per inner step of a warm `MeshTrainer` over `repeats` runs of `steps` steps."""
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      trainer.train_step()
    jax.block_until_ready(trainer.state.params)
    times.append((time.perf_counter() - t0) / steps)
  return statistics.median(times)


def run_mode(config, mode: Mode, devices, spec: wan_lib.WanSpec, steps: int, bare: BareSteps | None = None,
             sync_steps: bool = True, log=lambda msg: None) -> dict:
  """One mode: a gRPC syncer and one learner behind an emulated link; returns its row.

  A real gRPC syncer (`syncer.server.serve` around `build_core`, loopback, token auth) and one learner
  (`learners.num = 1`, so a quorum of one) on its device slice, talking to it through
  `GrpcTransport(wan=WanLink(...))`: the bandwidth cap (a token bucket per direction) and the one-way
  latency are applied in the client, on every gRPC message. The mode warms up (compile every step,
  outer-gradient and adoption function; two sync periods and a flush), then times `steps` inner steps from
  a quiet state to `block_until_ready` of the parameters.

  `bare`: measures the bare step (no outer loop, same devices) right before the timed steps (the
  machine's speed drifts when it is shared); the row's `vs_bare`, steps x (bare step time) / wall, also
  counts any slowdown of the steps themselves (the comms threads, the gRPC service and the syncer core
  share the CPU and the GIL), and any drift of the machine's speed between the two measurements when it
  is shared. `sync_steps` and the other figures: `_timed_steps`.
  """
  c = _mode_config(config, mode)
  h = c.outer.sync_every
  token = secrets.token_hex(16)
  core, fingerprint = build.build_core(c, f"bench-wan-{mode.name}")
  ticker = Ticker(core)
  handle = service.serve(core, "127.0.0.1:0", token=token, limits=limits_lib.Limits.from_config(c),
                         fingerprint=fingerprint)
  link = wan_lib.WanLink(spec)
  transport = GrpcTransport(
      f"127.0.0.1:{handle.port}", token, 0, fingerprint=fingerprint, wan=link,
      chunk_bytes=int(c.comms.chunk_kb) * 1024, max_message_bytes=int(c.syncer.max_message_mb) << 20)
  learner = None
  try:
    learner = loop_lib.Learner(c, 0, devices, transport, fingerprint, None)
    learner.join()
    bare_s = _warm_up(learner, mode, h, steps, bare, log)
    timed = _timed_steps(learner, transport, link, steps, sync_steps)
  finally:
    if learner is not None:
      learner.close(leave=True)
    transport.close()
    handle.stop(grace=0)
    ticker.stop()
  sizes = [learner.plan.size(p) for p in range(learner.plan.num_fragments)]
  wall, compute = timed["wall_s"], timed["compute_s"]
  return {
      "mode": mode.name, "fragments": len(sizes), "fragment_params": sizes, "tau": mode.tau,
      "max_in_flight": mode.max_in_flight, "codec": mode.codec, "downlink_codec": mode.downlink_codec,
      "link_mb_s": spec.up_bytes_per_s / 1e6, "latency_ms": spec.latency_s * 1e3, "sync_steps": sync_steps,
      "steps": steps, "syncs": timed["syncs"], "pending_at_end": timed["pending"], "wall_s": wall,
      "blocked_s": timed["blocked_s"], "compute_s": compute, "compute_utilization": compute / wall,
      "step_s": compute / steps, "bare_step_s": bare_s, "vs_bare": steps * bare_s / wall,
      "bytes_sent": timed["sent"], "bytes_received": timed["received"],
      "link_delay_s": link.delay_s - timed["delay0"], "process_cpu_s": timed["cpu"],
  }


def _warm_up(learner, mode: Mode, h: int, steps: int, bare: BareSteps | None, log) -> float:
  """Two sync periods (every fragment synced and adopted twice: compiles everything), then a flush, so
  the timed steps start with nothing in flight and on the schedule's phase 0; returns the bare step time
  measured right after (nan without `bare`)."""
  t_warm = time.perf_counter()
  while learner.trainer.step < 2 * h:
    learner.train_step()
  learner.flush()
  jax.block_until_ready(learner.trainer.state.params)
  bare_s = bare.step_time(h) if bare is not None else float("nan")
  log(f"  {mode.name}: P={learner.plan.num_fragments} tau={mode.tau} max_in_flight={mode.max_in_flight} "
      f"{mode.codec}/{mode.downlink_codec}: warm in {time.perf_counter() - t_warm:.1f}s; bare step "
      f"{1e3 * bare_s:.1f} ms; timing {steps} steps")
  return bare_s


def _timed_steps(learner, transport, link, steps: int, sync_steps: bool) -> dict:
  """`steps` timed inner steps of a warm learner: syncs, wall, CPU, blocked and compute time, bytes.

  `sync_steps`: each timed step waits for the device. jax dispatches steps asynchronously, so a loop that
  does not wait runs ahead of the device and the learner's `blocked_s` then also holds the device catching
  up with the queued steps (the comms thread's host copy of a snapshot waits for them), which is inner-step
  time. The figures (util = compute / wall in the row):
    compute   the time of the timed steps outside the learner's blocked waits (`stats.blocked_s`: waiting
              on the outer loop), so util = 1 - blocked / wall. Without `sync_steps` it is the learner's
              own `stats.compute_s` (biased low, see above).
    cpu       this process's CPU time (all threads: XLA, comms, gRPC, syncer) during the timed steps.
    bytes     every gRPC message this learner sent / received for the syncs of the timed steps (payload
              and framing; `GrpcTransport`'s counters), read once those syncs came back.
  """
  params = lambda: learner.trainer.state.params
  s = learner.stats
  syncs0, blocked0, compute0 = s.syncs, s.blocked_s, s.compute_s
  sent0, received0, delay0 = transport.bytes_sent, transport.bytes_received, link.delay_s
  step_times = []
  cpu0, t0 = time.process_time(), time.perf_counter()
  for _ in range(steps):
    t_step, blocked_before = time.perf_counter(), s.blocked_s
    learner.train_step()
    if sync_steps:
      jax.block_until_ready(params())
      step_times.append(time.perf_counter() - t_step - (s.blocked_s - blocked_before))
  jax.block_until_ready(params())
  wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
  syncs, blocked = s.syncs - syncs0, s.blocked_s - blocked0
  # With sync_steps the device wait after each step is inner-step time the learner's own counter does
  # not see (it stops its clock when the step is dispatched); either way blocked_s is the outer wait.
  compute = sum(step_times) if sync_steps else s.compute_s - compute0
  pending = len(learner.in_flight)
  # Let the syncs made in the timed steps come back (not timed) so their bytes count in full.
  for item in list(learner.in_flight):
    item.future.result()
  sent, received = transport.bytes_sent - sent0, transport.bytes_received - received0
  learner.flush()
  return {"syncs": syncs, "pending": pending, "wall_s": wall, "cpu": cpu, "blocked_s": blocked,
          "compute_s": compute, "sent": sent, "received": received, "delay0": delay0}

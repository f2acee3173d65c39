"""`python -m diloco_jax bench wan --config configs/tiny_cpu.py [--gbps X --latency-ms L --steps N --json]`

A learner's compute utilization on an emulated slow link (inner-step time / wall
time), with and without overlap. Each mode runs in this process: a real gRPC syncer (`syncer.server.serve`
around `build_core`, loopback, token auth) and one learner (`learners.num = 1`, so a quorum of one) on its
device slice, talking to it through `GrpcTransport(wan=WanLink(...))`: the bandwidth cap (a token bucket
per direction) and the one-way latency are applied in the client, on every gRPC message.

Modes (same model, H, steps and link; only the sync schedule and codecs differ):

  all-at-once   P = 1 (the whole model syncs every H steps), tau = 0 (the learner waits for each merge),
                fp32 up and down: synchronous DiLoCo.
  streaming     the config's P fragments staggered over H, tau >= 1 (adopt later, never wait),
                max_in_flight >= 2, fp32 up and down: only the overlap and the staggering differ.
  stream+int4   as streaming, int4 both ways (`--int4`, on by default).

The link: `--gbps` per direction, or by default derived from the measured bare step time t and the
model's fp32 bytes B so that the link moves B in `--link-periods` x H step-times (default 0.5): the
all-at-once sync then needs about H x t of transfer per H steps (up, then down), i.e. a stall near 50%.

Per mode: warm up (compile every step, outer-gradient and adoption function; two sync periods and a
flush), then time `--steps` inner steps (default 8 H, a multiple of H so every mode makes the same number
of syncs) from a quiet state to `block_until_ready` of the parameters. Each timed step waits for the
device (`--sync-steps`, default): jax dispatches steps asynchronously, so a loop that does not wait runs
ahead of the device and the learner's `blocked_s` then also holds the device catching up with the queued
steps (the comms thread's host copy of a snapshot waits for them), which is inner-step time. Reported:

  util      inner-step time / wall: the time of the timed steps outside the learner's blocked waits
            (`stats.blocked_s`: waiting on the outer loop), over the wall time; = 1 - blocked / wall.
            With --nosync-steps it is the learner's own `stats.compute_s / wall` (biased low, see above).
  vs bare   steps x (bare step time) / wall, the bare step (no outer loop, same devices) measured just
            before the mode's timed steps: it also counts any slowdown of the steps themselves (the
            comms threads, the gRPC service and the syncer core share the CPU and the GIL), and any
            drift of the machine's speed between the two measurements when it is shared.

`cpu s` is this process's CPU time (all threads: XLA, comms, gRPC, syncer) during the timed steps.
Bytes are every gRPC message this learner sent / received for the syncs of the timed steps (payload and
framing; `GrpcTransport`'s counters), read once those syncs came back.

The issue's goal: with overlap, util >= 0.95 on a link where all-at-once stalls the learner >= 30% of its
time (util <= 0.70).

`--paper-link`: the paper's setting instead. The link carries 1/236 of what data-parallel training of the
same model needs (Decoupled DiLoCo: 198 Gbps for data-parallel against 0.84 Gbps), where data-parallel's
need is a ring all-reduce of the fp32 gradient every bare step among `learners.num` workers, 2 (n - 1) / n
x 4 bytes per parameter per step, each way. One mode runs on it, `paper`: P = H (one fragment due every
step), int4 both ways, tau >= 1, the in-flight limit the schedule needs. The goal there: util >= 0.95.
It prints the smallest H whose int4 traffic fits the link (its payload bytes per step at most the link's
bytes per step); below that no overlap can keep the learner busy.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import statistics
import sys
import time

# Fake CPU devices must be set before jax creates its backend (the Makefile sets 8; so do we if unset).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
from absl import flags  # noqa: E402

from diloco_jax import cli  # noqa: E402
from diloco_jax.outer import codec as codec_lib  # noqa: E402
from diloco_jax.outer import schedule  # noqa: E402
from diloco_jax.compute import model as model_lib  # noqa: E402
from diloco_jax.compute import trainer as trainer_lib  # noqa: E402
from diloco_jax.learner import loop as loop_lib  # noqa: E402
from diloco_jax.syncer import build  # noqa: E402
from diloco_jax.syncer.server import grpc_service as service  # noqa: E402
from diloco_jax.syncer.server import limits as limits_lib  # noqa: E402
from diloco_jax.syncer.ticker import Ticker  # noqa: E402
from diloco_jax.transports import wan as wan_lib  # noqa: E402
from diloco_jax.transports.grpc_client import GrpcTransport  # noqa: E402

GOAL_UTIL = 0.95
GOAL_STALL = 0.30


@dataclasses.dataclass(frozen=True)
class Mode:
  """One sync schedule. None fields keep the config's value."""

  name: str
  num_fragments: int | None
  tau: int
  max_in_flight: int
  codec: str
  downlink_codec: str


def modes(config, int4: bool = True) -> list[Mode]:
  """all-at-once, streaming + overlap, and optionally streaming + overlap with int4 both ways."""
  o = config.outer
  tau = max(int(o.tau), 1)
  in_flight = max(schedule.in_flight_limit(int(o.max_in_flight), o.num_fragments, o.sync_every, tau), 2)
  out = [Mode("all-at-once", 1, 0, 1, "fp32", "fp32"),
         Mode("streaming", None, tau, in_flight, "fp32", "fp32")]
  if int4:
    out.append(Mode("stream+int4", None, tau, in_flight, "int4", "int4"))
  return out


def _flags(fv):
  flags.DEFINE_float("gbps", 0.0, "Link bandwidth per direction in Gbit/s (0: derive it from the step "
                     "time, see --link-periods).", flag_values=fv)
  flags.DEFINE_float("latency-ms", 10.0, "One-way link latency in ms.", flag_values=fv)
  flags.DEFINE_float("link-periods", 0.5, "Auto bandwidth: the link moves the full fp32 model in this "
                     "many sync periods (H step-times).", flag_values=fv)
  flags.DEFINE_integer("steps", 0, "Timed inner steps per mode (default 8 H; rounded up to a multiple "
                       "of H).", flag_values=fv)
  flags.DEFINE_bool("int4", True, "Also run streaming + overlap with int4 both ways.", flag_values=fv)
  flags.DEFINE_bool("sync-steps", True, "Wait for each timed inner step to finish on the device (see the "
                    "module docstring); --nosync-steps times the loop as run_learner runs it.", flag_values=fv)
  flags.DEFINE_bool("paper-link", False, "Size the link at 1/236 of data-parallel's need and run the paper's "
                    "schedule on it (P = H, int4; see the module docstring).", flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)


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

  `bare`: measures the bare step time right before the timed steps (the machine's speed drifts when
  it is shared). `sync_steps`: wait for each inner step on the device (see the module docstring).
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
    params = lambda: learner.trainer.state.params
    # Warm-up: two sync periods (every fragment synced and adopted twice: compiles everything), then a
    # flush, so the timed steps start with nothing in flight and on the schedule's phase 0.
    t_warm = time.perf_counter()
    while learner.trainer.step < 2 * h:
      learner.train_step()
    learner.flush()
    jax.block_until_ready(params())
    bare_s = bare.step_time(h) if bare is not None else float("nan")
    log(f"  {mode.name}: P={learner.plan.num_fragments} tau={mode.tau} max_in_flight={mode.max_in_flight} "
        f"{mode.codec}/{mode.downlink_codec}: warm in {time.perf_counter() - t_warm:.1f}s; bare step "
        f"{1e3 * bare_s:.1f} ms; timing {steps} steps")

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
  finally:
    if learner is not None:
      learner.close(leave=True)
    transport.close()
    handle.stop(grace=0)
    ticker.stop()
  sizes = [learner.plan.size(p) for p in range(learner.plan.num_fragments)]
  return {
      "mode": mode.name, "fragments": len(sizes), "fragment_params": sizes, "tau": mode.tau,
      "max_in_flight": mode.max_in_flight, "codec": mode.codec, "downlink_codec": mode.downlink_codec,
      "link_mb_s": spec.up_bytes_per_s / 1e6, "latency_ms": spec.latency_s * 1e3, "sync_steps": sync_steps,
      "steps": steps, "syncs": syncs, "pending_at_end": pending, "wall_s": wall, "blocked_s": blocked,
      "compute_s": compute, "compute_utilization": compute / wall, "step_s": compute / steps,
      "bare_step_s": bare_s, "vs_bare": steps * bare_s / wall,
      "bytes_sent": sent, "bytes_received": received, "link_delay_s": link.delay_s - delay0,
      "process_cpu_s": cpu,
  }


def format_table(rows) -> str:
  head = (f"{'mode':<13}{'P':>3}{'tau':>4}{'codec':>11}{'link MB/s':>10}{'lat ms':>7}{'steps':>6}{'syncs':>6}"
          f"{'wall s':>8}{'blocked s':>10}{'util':>7}{'vs bare':>8}{'step ms':>8}{'cpu s':>7}{'sent MB':>9}"
          f"{'recv MB':>9}")
  lines = [head, "-" * len(head)]
  for r in rows:
    lines.append(
        f"{r['mode']:<13}{r['fragments']:>3}{r['tau']:>4}{r['codec'] + '/' + r['downlink_codec']:>11}"
        f"{r['link_mb_s']:>10.3f}{r['latency_ms']:>7.1f}{r['steps']:>6}{r['syncs']:>6}{r['wall_s']:>8.2f}"
        f"{r['blocked_s']:>10.2f}{r['compute_utilization']:>7.3f}{r['vs_bare']:>8.3f}{1e3 * r['step_s']:>8.1f}"
        f"{r['process_cpu_s']:>7.1f}{r['bytes_sent'] / 1e6:>9.3f}{r['bytes_received'] / 1e6:>9.3f}")
  return "\n".join(lines)


def verdict(rows) -> dict:
  """The issue's goal: overlap util >= 0.95 where all-at-once stalls >= 30% of the time."""
  by = {r["mode"]: r for r in rows}
  stall = 1.0 - by["all-at-once"]["compute_utilization"]
  util = by["streaming"]["compute_utilization"]
  return {"all_at_once_stall": stall, "streaming_utilization": util,
          "link_slow_enough": stall >= GOAL_STALL, "overlap_met": util >= GOAL_UTIL,
          "met": stall >= GOAL_STALL and util >= GOAL_UTIL}


PAPER_REDUCTION = 236  # Decoupled DiLoCo: 198 Gbps for data-parallel, 0.84 Gbps with 8 learners


def paper_mode(config) -> Mode:
  """P = H, int4 both ways, tau >= 1, the in-flight limit of the schedule (or the config's, if set)."""
  o = config.outer
  tau = max(int(o.tau), 1)
  h = int(o.sync_every)
  return Mode("paper", h, tau, schedule.in_flight_limit(int(o.max_in_flight), h, h, tau), "int4", "int4")


def paper_link(params: int, workers: int, bare_step_s: float) -> float:
  """Bytes per second each way: data-parallel's ring all-reduce of the fp32 gradient among `workers`,
  every bare step, divided by the paper's reduction."""
  n = max(int(workers), 2)
  return 2 * (n - 1) / n * 4 * params / bare_step_s / PAPER_REDUCTION


def min_sync_every(params: int, sizes_bytes_per_param: float, link_bytes_per_step: float) -> int:
  """The smallest H for which a fragment's payload per step (params / H x bytes per param) fits the
  link's bytes per step."""
  return max(1, int(-(-params * sizes_bytes_per_param // link_bytes_per_step)))


def run_paper(config, *, latency_ms: float = 10.0, steps: int = 0, sync_steps: bool = True,
              log=lambda msg: None) -> dict:
  """`--paper-link`: the paper's schedule on 1/236 of data-parallel's bandwidth need."""
  config = config.copy_and_resolve_references()
  config.learners.num, workers = 1, config.learners.num
  cli.validated(config, len(jax.devices()), learners=True)
  h = config.outer.sync_every
  steps = h * max(1, -(-(steps or 8 * h) // h))
  devices = jax.devices()[:config.learners.devices]
  bare = BareSteps(config, devices)
  try:
    bare_s = bare.step_time(h)
    params = sum(x.size for x in jax.tree.leaves(model_lib.init_params_host(config)))
    rate = paper_link(params, workers, bare_s)
    spec = wan_lib.WanSpec(up_bytes_per_s=rate, down_bytes_per_s=rate, latency_s=latency_ms / 1e3)
    int4_per_param = codec_lib.encoded_size(1 << 20, "int4", config.outer.codec_block) / (1 << 20)
    need_h = min_sync_every(params, int4_per_param, rate * bare_s)
    link = {"mb_s": rate / 1e6, "gbps": rate * 8 / 1e9, "latency_ms": latency_ms, "dp_workers": max(workers, 2),
            "chosen": f"1/{PAPER_REDUCTION} of data-parallel's {PAPER_REDUCTION * rate / 1e6:.2f} MB/s", "min_h": need_h}
    log(f"bench wan --paper-link: {params:,} params, bare step {1e3 * bare_s:.1f} ms; data-parallel among "
        f"{link['dp_workers']} needs {PAPER_REDUCTION * rate / 1e6:.2f} MB/s each way; the link: {rate / 1e6:.4f} MB/s "
        f"({rate * 8 / 1e6:.3f} Mbit/s), {latency_ms:g} ms one-way; int4 at P = H fits from H = {need_h} (H = {h})")
    rows = [run_mode(config, paper_mode(config), devices, spec, steps, bare, sync_steps, log)]
  finally:
    bare.close()
  util = rows[0]["compute_utilization"]
  return {"link": link, "bare_step_s": bare_s, "params": params, "sync_every": h, "rows": rows,
          "goal": {"paper_utilization": util, "met": util >= GOAL_UTIL, "fits": h >= need_h}}


def run(config, *, gbps: float = 0.0, latency_ms: float = 10.0, link_periods: float = 0.5, steps: int = 0,
        int4: bool = True, sync_steps: bool = True, log=lambda msg: None) -> dict:
  """The benchmark; returns {"link": ..., "bare_step_s": ..., "rows": [...], "goal": ...}."""

  config = config.copy_and_resolve_references()
  config.learners.num = 1
  cli.validated(config, len(jax.devices()), learners=True)
  h = config.outer.sync_every
  steps = h * max(1, -(-(steps or 8 * h) // h))
  devices = jax.devices()[:config.learners.devices]
  log(f"bench wan: 1 learner on {len(devices)} {devices[0].platform} device(s) of {len(jax.devices())}, "
      f"batch {config.data.global_batch}, H={h}, config P={config.outer.num_fragments}")
  bare = BareSteps(config, devices)
  try:
    bare_s = bare.step_time(h)
    params = sum(x.size for x in jax.tree.leaves(model_lib.init_params_host(config)))
    model_bytes = 4 * params
    if gbps > 0:
      spec = wan_lib.WanSpec.from_gbps(gbps, latency_ms)
      how = f"--gbps {gbps:g}"
    else:
      rate = model_bytes / (link_periods * h * bare_s)
      spec = wan_lib.WanSpec(up_bytes_per_s=rate, down_bytes_per_s=rate, latency_s=latency_ms / 1e3)
      how = (f"auto: the fp32 model ({model_bytes / 1e6:.3f} MB) in {link_periods:g} x H step-times of "
             f"{1e3 * bare_s:.1f} ms")
    link = {"mb_s": spec.up_bytes_per_s / 1e6, "gbps": spec.up_bytes_per_s * 8 / 1e9, "latency_ms": latency_ms,
            "chosen": how}
    log(f"  {params:,} params; link {link['mb_s']:.3f} MB/s ({link['gbps'] * 1e3:.2f} Mbit/s) each way, "
        f"{latency_ms:g} ms one-way ({how})")
    rows = [run_mode(config, m, devices, spec, steps, bare, sync_steps, log) for m in modes(config, int4)]
  finally:
    bare.close()
  return {"link": link, "bare_step_s": bare_s, "params": params, "sync_every": h, "rows": rows,
          "goal": verdict(rows)}


def main(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__)
  config = fv.config
  need = config.learners.devices
  if len(cli.devices(need, "bench wan")) < need:
    raise cli.UsageError(f"the learner needs learners.devices={need} devices, this process sees "
                         f"{len(jax.devices())}; run with XLA_FLAGS=--xla_force_host_platform_device_count={need}")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  if fv["paper-link"].value:
    result = run_paper(config, latency_ms=fv["latency-ms"].value, steps=fv.steps, sync_steps=fv["sync-steps"].value,
                       log=log)
    if fv.json:
      print(json.dumps(result, indent=2))
      return 0
    print(format_table(result["rows"]))
    goal = result["goal"]
    print(f"goal: on 1/{PAPER_REDUCTION} of data-parallel's bandwidth, the paper's schedule keeps utilization "
          f"{goal['paper_utilization']:.3f} (needs >= {GOAL_UTIL}): {'met' if goal['met'] else 'NOT met'}"
          + ("" if goal["fits"] else f"; H = {result['sync_every']} is below the {result['link']['min_h']} "
             "the link can carry"))
    return 0
  result = run(config, gbps=fv.gbps, latency_ms=fv["latency-ms"].value, link_periods=fv["link-periods"].value,
               steps=fv.steps, int4=fv.int4, sync_steps=fv["sync-steps"].value, log=log)
  if fv.json:
    print(json.dumps(result, indent=2))
    return 0
  link, goal = result["link"], result["goal"]
  print(f"emulated link: {link['mb_s']:.3f} MB/s ({link['gbps'] * 1e3:.2f} Mbit/s) each way, "
        f"{link['latency_ms']:g} ms one-way ({link['chosen']}); bare step {1e3 * result['bare_step_s']:.1f} ms, "
        f"H={result['sync_every']}, {result['params']:,} params")
  print(format_table(result["rows"]))
  print(f"goal: all-at-once stalls {100 * goal['all_at_once_stall']:.1f}% (needs >= {100 * GOAL_STALL:.0f}%: "
        f"{'yes' if goal['link_slow_enough'] else 'no'}); streaming + overlap utilization "
        f"{goal['streaming_utilization']:.3f} (needs >= {GOAL_UTIL}): {'met' if goal['met'] else 'NOT met'}")
  return 0

"""`python -m diloco_jax bench wan --config configs/tiny_cpu.py [--gbps X --latency-ms L --steps N --json]`

A learner's compute utilization on an emulated slow link (inner-step time / wall time), with and without
overlap: a real gRPC syncer and one learner (a quorum of one) in this process, the bandwidth cap and
latency applied in the client (`GrpcTransport(wan=WanLink(...))`). Modes (`modes`): all-at-once
(synchronous DiLoCo), streaming (the config's P staggered, tau >= 1) and stream+int4 (`--int4`). The link:
`--gbps` per direction, or by default one that moves the fp32 model in `--link-periods` x H step-times
(`run`). Each timed step waits for the device (`--sync-steps`, default: without it the figures mix in the
device catching up; `wan_mode.run_mode` says how a mode is timed and what each column means). The goal:
with overlap, util >= 0.95 on a link where all-at-once stalls the learner >= 30% of its time.

`--paper-link`: the paper's link instead, 1/236 of what bf16 data-parallel training of the same model
needs, at one-way latencies of 1, 20 and 80 ms (`--latencies-ms`), under the config's own schedule with and
without overlap, and P = H (`wan_paper.run_paper`). The goal there: util >= 0.95 at 80 ms. It prints the
smallest H whose traffic fits the link and what binds. docs/benchmarks.md, "WAN emulation".
"""

from __future__ import annotations

import json
import os
import sys

# Fake CPU devices must be set before jax creates its backend (the Makefile sets 8; so do we if unset).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

from diloco_jax import cli  # noqa: E402
from diloco_jax.compute import model as model_lib  # noqa: E402
from diloco_jax.outer import schedule  # noqa: E402
from diloco_jax.tools.bench import bench_flags
from diloco_jax.tools.bench.wan_mode import BareSteps, Mode, run_mode  # noqa: E402
from diloco_jax.tools.bench.wan_paper import PAPER_REDUCTION, run_paper  # noqa: E402
from diloco_jax.transports import wan as wan_lib  # noqa: E402

GOAL_UTIL = 0.95
GOAL_STALL = 0.30


def modes(config, int4: bool = True) -> list[Mode]:
  """all-at-once, streaming + overlap, and optionally streaming + overlap with int4 both ways (same model,
  H, steps and link; only the sync schedule and codecs differ):

    all-at-once   P = 1 (the whole model syncs every H steps), tau = 0 (the learner waits for each merge),
                  fp32 up and down: synchronous DiLoCo.
    streaming     the config's P fragments staggered over H, tau >= 1 (adopt later, never wait),
                  max_in_flight >= 2, fp32 up and down: only the overlap and the staggering differ.
    stream+int4   as streaming, int4 both ways (`--int4`, on by default).
  """
  o = config.outer
  tau = max(int(o.tau), 1)
  in_flight = max(schedule.in_flight_limit(int(o.max_in_flight), o.num_fragments, o.sync_every, tau), 2)
  out = [Mode("all-at-once", 1, 0, 1, "fp32", "fp32"),
         Mode("streaming", None, tau, in_flight, "fp32", "fp32")]
  if int4:
    out.append(Mode("stream+int4", None, tau, in_flight, "int4", "int4"))
  return out


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


def run(config, *, gbps: float = 0.0, latency_ms: float = 10.0, link_periods: float = 0.5, steps: int = 0,
        int4: bool = True, sync_steps: bool = True, log=lambda msg: None) -> dict:
  """The benchmark; returns {"link": ..., "bare_step_s": ..., "rows": [...], "goal": ...}.

  The link: `gbps` per direction, or by default derived from the measured bare step time t and the model's
  fp32 bytes B so that the link moves B in `link_periods` x H step-times (default 0.5): the all-at-once
  sync then needs about H x t of transfer per H steps (up, then down), i.e. a stall near 50%. `steps`
  (default 8 H) is rounded up to a multiple of H so every mode makes the same number of syncs.
  """

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


def bench_wan(argv) -> int:
  fv = cli.parse(argv, bench_flags.wan, doc=__doc__)
  config = fv.config
  need = config.learners.devices
  if len(cli.devices(need, "bench wan")) < need:
    raise cli.UsageError(f"the learner needs learners.devices={need} devices, this process sees "
                         f"{len(jax.devices())}; run with XLA_FLAGS=--xla_force_host_platform_device_count={need}")
  log = lambda msg: print(msg, file=sys.stderr, flush=True)
  if fv["paper-link"].value:
    latencies = [float(x) for x in fv["latencies-ms"].value]
    result = run_paper(config, latencies_ms=latencies, steps=fv.steps, sync_steps=fv["sync-steps"].value,
                       link_scale=fv["link-scale"].value, log=log)
    if fv.json:
      print(json.dumps(result, indent=2))
      return 0
    print(format_table(result["rows"]))
    goal = result["goal"]
    print(f"goal: on {result['link']['scale']:g} x 1/{PAPER_REDUCTION} of bf16 data-parallel's bandwidth at "
          f"{goal['latency_ms']:g} ms, the "
          f"config's schedule keeps utilization {goal['config_utilization']:.3f} (needs >= {GOAL_UTIL}): "
          f"{'met' if goal['met'] else 'NOT met'}" + (f"; binds: {goal['binds']}" if goal["binds"] else "")
          + ("" if goal["fits"] else f" (H = {result['sync_every']} is below the {result['link']['min_h']} "
             "whose payloads the link can carry)"))
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

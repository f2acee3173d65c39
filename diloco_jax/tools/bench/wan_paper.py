"""`bench wan --paper-link`: the paper's link at realistic latencies (`run_paper`). The link carries 1/236 of
what data-parallel training of the same model needs (Decoupled DiLoCo: 198 -> 0.84 Gbps), data-parallel
being a ring all-reduce of the bf16 gradient among `learners.num` workers every bare step (`paper_link`);
one-way latencies of 1, 20 and 80 ms (same region, cross-region, cross-continent); the schedules
(`paper_modes`): no overlap, the config's own (P, H, tau, codecs, in-flight limit), the same with the
in-flight limit the latency needs (`in_flight_for`), and P = H with int4. Goal: the config's schedule keeps
utilization >= 0.95 at 80 ms. Imported by `wan.py`, which sets the fake CPU device count before jax starts.
"""

from __future__ import annotations

import dataclasses
import math

import jax

from diloco_jax import cli
from diloco_jax.compute import model as model_lib
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import schedule
from diloco_jax.tools.bench.bench_flags import LATENCIES_MS
from diloco_jax.tools.bench.wan_mode import BareSteps, Mode, run_mode
from diloco_jax.transports import wan as wan_lib

GOAL_UTIL = 0.95
PAPER_REDUCTION = 236  # Decoupled DiLoCo: 198 Gbps for data-parallel, 0.84 Gbps with 8 learners
DP_BYTES_PER_PARAM = 2  # data-parallel's gradient in bf16, as the paper's 198 Gbps assumes


def paper_link(params: int, workers: int, bare_step_s: float) -> float:
  """Bytes per second each way: data-parallel's ring all-reduce of the bf16 gradient among `workers`,
  2 (n - 1) / n x 2 bytes per parameter every bare step, divided by the paper's reduction. (The ring's
  bytes are counted one way, a learner's pushes and pulls both: conservative for Decoupled DiLoCo.)"""
  n = max(int(workers), 2)
  return 2 * (n - 1) / n * DP_BYTES_PER_PARAM * params / bare_step_s / PAPER_REDUCTION


def min_sync_every(params: int, sizes_bytes_per_param: float, link_bytes_per_step: float) -> int:
  """The smallest H for which a fragment's payload per step (params / H x bytes per param) fits the
  link's bytes per step."""
  return max(1, int(-(-params * sizes_bytes_per_param // link_bytes_per_step)))


def in_flight_for(latency_s: float, fragment_bytes: float, rate: float, spacing_s: float, tau_s: float) -> int:
  """Fragments in flight that keep a learner from waiting: a sync holds one for its push and pull (2
  one-way latencies and the payload each way, on kept connections) or `tau_s`, whichever is longer, and a
  fragment falls due every `spacing_s`; plus one on its way."""
  sync_s = 4 * latency_s + 2 * fragment_bytes / rate
  return math.ceil(max(sync_s, tau_s) / spacing_s) + 1


def paper_mode(config) -> Mode:
  """P = H (one fragment due every step), int4 both ways, tau >= 1, the schedule's in-flight limit (or
  the config's, if set)."""
  o = config.outer
  tau, h = max(int(o.tau), 1), int(o.sync_every)
  return Mode("P = H", h, tau, schedule.in_flight_limit(int(o.max_in_flight), h, h, tau), "int4", "int4")


def paper_modes(config, needed: int) -> list[Mode]:
  """no overlap (tau = 0, one in flight), the config's schedule, the config's with `needed` in flight
  (only if more than its own), and P = H with as many in flight as it needs for the same latency."""
  o = config.outer
  tau = max(int(o.tau), 1)
  own = schedule.in_flight_limit(int(o.max_in_flight), o.num_fragments, o.sync_every, tau)
  out = [Mode("no overlap", None, 0, 1, o.codec, o.downlink_codec),
         Mode("config", None, tau, own, o.codec, o.downlink_codec)]
  if needed > own:
    out.append(dataclasses.replace(out[-1], name="config+flight", max_in_flight=needed))
  return out + [paper_mode(config)]


def run_paper(config, *, latencies_ms=LATENCIES_MS, steps: int = 0, sync_steps: bool = True, link_scale: float = 1.0,
              log=lambda msg: None) -> dict:
  """Every mode of `paper_modes` at every latency on the paper's link; returns {"link", "rows", "goal"...}.
  The goal: the config's schedule (or, if the config's in-flight limit binds, the same with the limit the
  latency needs) keeps util >= 0.95 at the largest latency; `binds` says what stops it where it does not:
  the link's bandwidth when H is below the smallest H whose payloads fit it (`min_sync_every`). `link_scale`
  multiplies the link (an experiment: is it the bandwidth or the latency that binds?)."""
  config = config.copy_and_resolve_references()
  config.learners.num, workers = 1, config.learners.num
  cli.validated(config, len(jax.devices()), learners=True)
  o, h = config.outer, config.outer.sync_every
  steps = h * max(1, -(-(steps or 8 * h) // h))
  devices = jax.devices()[:config.learners.devices]
  bare = BareSteps(config, devices)
  rows = []
  try:
    bare_s = bare.step_time(h)
    params = sum(x.size for x in jax.tree.leaves(model_lib.init_params_host(config)))
    rate = link_scale * paper_link(params, workers, bare_s)
    up = codec_lib.encoded_size(1 << 20, o.codec, o.codec_block) / (1 << 20)
    down = codec_lib.encoded_size(1 << 20, o.downlink_codec, o.codec_block) / (1 << 20)
    int4 = codec_lib.encoded_size(1 << 20, "int4", o.codec_block) / (1 << 20)
    need_h = min_sync_every(params, max(up, down), rate * bare_s)
    link = {"mb_s": rate / 1e6, "gbps": rate * 8 / 1e9, "dp_workers": max(workers, 2), "min_h": need_h,
            "scale": link_scale, "chosen": f"{link_scale:g} x 1/{PAPER_REDUCTION} of bf16 data-parallel's "
            f"{PAPER_REDUCTION * rate / link_scale / 1e6:.3f} MB/s"}
    log(f"bench wan --paper-link: {params:,} params, bare step {1e3 * bare_s:.1f} ms; the link {rate / 1e6:.4f} MB/s "
        f"each way ({link['chosen']} among {link['dp_workers']}); {o.codec}/{o.downlink_codec} at H = {h} fits "
        f"from H = {need_h}")
    for latency in latencies_ms:
      spec = wan_lib.WanSpec(up_bytes_per_s=rate, down_bytes_per_s=rate, latency_s=latency / 1e3)
      frag = params / o.num_fragments * max(up, down)
      needed = in_flight_for(latency / 1e3, frag, rate, h / o.num_fragments * bare_s, max(int(o.tau), 1) * bare_s)
      for mode in paper_modes(config, needed):
        if mode.name == "P = H":
          mode = dataclasses.replace(mode, max_in_flight=max(mode.max_in_flight, in_flight_for(
              latency / 1e3, params / h * int4, rate, bare_s, mode.tau * bare_s)))
        rows.append(run_mode(config, mode, devices, spec, steps, bare, sync_steps, log))
  finally:
    bare.close()
  # A fragment falls due again H steps after its last sync, which the learner then waits for (learner/loop.py).
  sync_s = 4 * max(latencies_ms) / 1e3 + 2 * params / o.num_fragments * max(up, down) / rate
  return {"link": link, "bare_step_s": bare_s, "params": params, "sync_every": h, "rows": rows,
          "goal": paper_goal(rows, max(latencies_ms), h, need_h, sync_s=sync_s, period_s=h * bare_s)}


BUSY_LINK = 0.8  # a direction that carried this share of what the link could in the timed steps binds


def link_busy(row) -> dict:
  """The share of the link's capacity each direction carried during the row's timed steps."""
  capacity = row["link_mb_s"] * 1e6 * row["wall_s"]
  return {"up": row["bytes_sent"] / capacity, "down": row["bytes_received"] / capacity}


def paper_goal(rows, latency_ms: float, h: int, need_h: int, sync_s: float = 0.0, period_s: float = 0.0) -> dict:
  """The best overlapping config schedule's utilization at `latency_ms`, whether it meets the goal, and
  what binds: bandwidth when H is below what the link carries at the codecs' sizes, or when a direction
  of the config's row was busy >= `BUSY_LINK` (the bytes actually sent, e.g. full fp32 answers); the
  fragment's period when one sync (`sync_s`: 4 one-way latencies and its bytes both ways) outlasts the H
  bare steps after which the fragment is due again (`period_s`), which no in-flight limit helps."""
  at = {r["mode"]: r["compute_utilization"] for r in rows if r["latency_ms"] == latency_ms}
  busy = next((link_busy(r) for r in rows if r["latency_ms"] == latency_ms and r["mode"] == "config"), {})
  util = max(at.get("config", float("nan")), at.get("config+flight", float("nan")))
  if h < need_h:
    binds = "bandwidth"
  elif busy and max(busy.values()) >= BUSY_LINK:
    binds = f"{max(busy, key=busy.get)}link bandwidth ({100 * max(busy.values()):.0f}% busy)"
  elif util < GOAL_UTIL and sync_s > period_s > 0:
    binds = f"fragment period (a sync takes {sync_s:.2f} s, H steps {period_s:.2f} s)"
  elif at.get("config", 0.0) < GOAL_UTIL <= util:
    binds = "in-flight limit"
  else:
    binds = "" if util >= GOAL_UTIL else "latency"
  return {"latency_ms": latency_ms, "config_utilization": util, "met": util >= GOAL_UTIL, "fits": h >= need_h,
          "binds": binds, "link_busy": busy, "sync_s": sync_s, "period_s": period_s}

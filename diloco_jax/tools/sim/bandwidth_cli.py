"""`python -m diloco_jax sim bandwidth [flags]`: the WAN bandwidth each method needs for a target utilization.

Examples:
  python -m diloco_jax sim bandwidth                   # the Streaming DiLoCo 10B setting, beside the paper
  python -m diloco_jax sim bandwidth --params 70e9 --step-s 2 --sites 4 --utilization 0.9,0.95

Prints Gbit/s per site and direction for each method and target compute utilization; every published cell
beside this model's value and the difference (only in the published setting); the requirement over
--sites sites; and the published 8-datacenter figure (198 -> 0.84 Gbps) reproduced. A PNG plot goes to
--out.
"""

from __future__ import annotations

import dataclasses
import json
import os

from diloco_jax import cli
from diloco_jax.tools.sim import bandwidth
from diloco_jax.tools.sim.args import definer, numbers

_DEFAULT = bandwidth.BandwidthConfig()


def _flags(fv):
  d = _DEFAULT
  define = definer(fv)
  define("float", "params", d.params, "Model parameters.")
  define("float", "bytes-per-param", d.bytes_per_param, "Bytes of a (outer) gradient element before "
         "quantization.")
  define("float", "step-s", d.step_s, "Inner step time.")
  define("integer", "inner-steps", d.inner_steps, "H.")
  define("integer", "fragments", d.fragments, "P.")
  define("integer", "tau", d.tau, "Overlap steps.")
  define("integer", "sites", d.sites, "Sites (datacenters) on the WAN ring.")
  define("float", "fwd-fraction", d.fwd_fraction, "Forward share of a step.")
  define("integer", "quant-bits", d.quant_bits, "Bits of a quantized element.")
  define("integer", "quant-block", d.quant_block, "Elements per bf16 scale.")
  define("list", "utilization", [f"{u:g}" for u in bandwidth.UTILIZATIONS], "Target compute utilizations "
         "(comma list, in (0, 1]).")
  define("bool", "json", False, "Print JSON instead of a table.")
  define("string", "out", "runs/sim", "Directory for PNG plots.")
  define("bool", "plot", True, "Write the PNG (--noplot to skip).")


def config_from(fv) -> bandwidth.BandwidthConfig:
  v = lambda name: fv[name].value
  try:
    return bandwidth.BandwidthConfig(
        params=v("params"), bytes_per_param=v("bytes-per-param"), step_s=v("step-s"),
        inner_steps=v("inner-steps"), fragments=v("fragments"), tau=v("tau"), sites=v("sites"),
        fwd_fraction=v("fwd-fraction"), quant_bits=v("quant-bits"), quant_block=v("quant-block"),
    ).validate()
  except ValueError as e:
    raise cli.UsageError(str(e)) from None


def format_report(cfg: bandwidth.BandwidthConfig, utilizations: list[float]) -> str:
  rows = bandwidth.table(cfg, utilizations)
  us = [f"{u:g}" for u in utilizations]
  lines = [f"Gbit/s per site and direction for a target compute utilization: {cfg.params / 1e9:g}B params, "
           f"{cfg.step_s:g} s/step, {cfg.sites} sites, H={cfg.inner_steps}, P={cfg.fragments}, tau={cfg.tau}",
           f"{'method':<32}" + "".join(f"{100 * float(u):>9g}%" for u in us)]
  for r in rows:
    lines.append(f"{r['label']:<32}" + "".join(f"{r['gbps'][u]:>10.3g}" for u in us))
  lines.append("")
  mismatch = bandwidth.published_mismatch(cfg)
  if mismatch is None:
    lines.append("Published cells (Streaming DiLoCo, this setting; every cell this planner holds):")
    for c in bandwidth.published_cells(cfg):
      lines.append(f"  {c['label']:<32} at {100 * c['utilization']:g}%: ours {c['ours']:.3g}, published "
                   f"{c['published']:g}, difference {c['diff_pct']:+.1f}%")
  else:
    lines.append(f"Published cells: none apply; they are for the Streaming DiLoCo setting, and this run has "
                 f"{mismatch}.")
  here = bandwidth.sites_figure(cfg)
  g = here["gbps"]
  lines.append(f"{cfg.sites} sites at {100 * here['utilization']:g}% utilization: this model needs {g['dp']:.3g} "
               f"Gbps data-parallel; DiLoCo {g['diloco']:.3g}; streaming {g['streaming']:.3g}; + overlap "
               f"{g['streaming_overlap']:.3g}; + int{cfg.quant_bits} {g['streaming_overlap_q']:.3g} Gbps "
               f"(reduction {here['reduction']:.0f}x).")
  fig8 = bandwidth.eight_datacenter_figure(cfg)
  g = fig8["gbps"]
  lines.append(f"Published figure (always {fig8['sites']} datacenters, as published, whatever --sites; "
               f"{100 * fig8['utilization']:g}% utilization, {cfg.step_s:g} s/step): a "
               f"{fig8['solved_params'] / 1e9:.2f}B-param model needs {g['dp']:.0f} Gbps data-parallel; DiLoCo "
               f"{g['diloco']:.1f}; streaming {g['streaming']:.1f}; + overlap {g['streaming_overlap']:.2f}; "
               f"+ int{cfg.quant_bits} {g['streaming_overlap_q']:.2f} Gbps (reduction {fig8['reduction']:.0f}x; "
               f"published {bandwidth.PUBLISHED_8DC[0]:g} -> {bandwidth.PUBLISHED_8DC[1]:g}, "
               f"{fig8['published']['reduction']:.0f}x).")
  lines.append(f"Assumptions: ring all-reduce 2(n-1)/n; comm overlaps the backward pass "
               f"({1 - cfg.fwd_fraction:.2f} of a step) for DP/DiLoCo/streaming and tau steps with overlap; "
               f"{cfg.bytes_per_param:g} bytes/param before quantization; int{cfg.quant_bits} adds one bf16 "
               f"scale per {cfg.quant_block} params ({cfg.quant_bytes_per_param:.4f} B/param); latency ignored.")
  return "\n".join(lines)


def sim_bandwidth(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__, config=False)
  cfg = config_from(fv)
  utilizations = numbers(fv, "utilization")
  for u in utilizations:
    if not 0 < u <= 1:
      raise cli.UsageError(f"--utilization must be in (0, 1], got {u:g}")
  plot = None
  if fv.plot:
    from diloco_jax.tools.sim import plots  # noqa: PLC0415 - matplotlib is slow to import: only when plotting

    plot = plots.plot_bandwidth(cfg, os.path.join(fv.out, "bandwidth_vs_utilization.png"))
  if fv.json:
    print(json.dumps({"config": dataclasses.asdict(cfg), "rows": bandwidth.table(cfg, utilizations),
                      "published": bandwidth.published_cells(cfg),
                      "published_mismatch": bandwidth.published_mismatch(cfg),
                      "sites": bandwidth.sites_figure(cfg), "eight_datacenters": bandwidth.eight_datacenter_figure(cfg),
                      "plot": plot}, indent=2))
    return 0
  print(format_report(cfg, utilizations))
  if plot:
    print(f"Plot: {plot}")
  return 0

"""`python -m diloco_jax sim {goodput,bandwidth,sizing}`: the scale simulator, the bandwidth planner and
the machine sizing of a run (`sim/sizing.py`).

Examples:
  python -m diloco_jax sim goodput --table                 # the published grid, beside the paper
  python -m diloco_jax sim goodput --chips 1200000 --learners 8 --strategy dp,elastic,diloco
  python -m diloco_jax sim goodput --chips 150000,600000,2400000 --strategy diloco --learners 4,8 --json
  python -m diloco_jax sim bandwidth                       # Streaming DiLoCo 10B table + 8-datacenter figure
  python -m diloco_jax sim bandwidth --params 70e9 --step-s 2 --sites 4 --utilization 0.9,0.95

Progress goes to stderr; tables (or JSON with --json) to stdout; PNG plots to --out (default runs/sim).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from diloco_jax.sim import bandwidth, goodput


def _int_list(text: str) -> list[int]:
  try:
    return [int(float(x)) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
  try:
    return [float(x) for x in text.split(",") if x]
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _build_parser(prog: str) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  d = goodput.SimConfig()

  g = sub.add_parser("goodput", help="goodput and uptime of DP / elastic DP / Decoupled DiLoCo under failures",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  g.add_argument("--table", action="store_true",
                 help="simulate the published grid (150k..2.4M chips x DP, elastic DP, M=2,4,8,16)")
  g.add_argument("--chips", type=_int_list, default=[d.chips], help="total chips (comma list to sweep)")
  g.add_argument("--strategy", default="dp,elastic,diloco",
                 help=f"comma list of {', '.join(goodput.STRATEGIES)}")
  g.add_argument("--learners", type=_int_list, default=[d.learners], help="M for diloco (comma list)")
  g.add_argument("--mtbi-years", type=float, default=d.mtbi_chip_s / goodput.YEAR_S,
                 help="mean time between interruptions of one chip, in years")
  g.add_argument("--slice-chips", type=int, default=d.slice_chips, help="chips per slice (failure unit)")
  g.add_argument("--restart-s", type=float, default=d.restart_s, help="dp: full-job restart time")
  g.add_argument("--reshape-s", type=float, default=d.reshape_s, help="elastic: one reshape (shrink or grow)")
  g.add_argument("--repair-s", type=float, default=d.repair_s, help="a failed slice is out this long")
  g.add_argument("--rejoin-wait-s", type=float, default=d.rejoin_wait_s,
                 help="a repaired slice waits this long to rejoin at a failure's reshape")
  g.add_argument("--step-s", type=float, default=d.step_s, help="inner/training step time")
  g.add_argument("--step-cv", type=float, default=d.step_cv, help="coefficient of variation of a step")
  g.add_argument("--ckpt-every-steps", type=int, default=d.ckpt_every_steps, help="dp checkpoint interval")
  g.add_argument("--ckpt-cost-s", type=float, default=d.ckpt_cost_s, help="dp blocking cost of a checkpoint")
  g.add_argument("--inner-steps", type=int, default=d.inner_steps, help="H")
  g.add_argument("--fragments", type=int, default=d.fragments, help="P")
  g.add_argument("--snapshot-s", type=float, default=d.snapshot_s, help="blocking cost of one fragment push")
  g.add_argument("--t-sync-s", type=float, default=d.t_sync_s, help="syncer merge + publish time")
  g.add_argument("--min-quorum", type=int, default=d.min_quorum, help="K")
  g.add_argument("--tau", type=int, default=d.tau, help="overlap steps (grace window budget)")
  g.add_argument("--grace-gamma", type=float, default=d.grace_gamma, help="grace window gamma (< 1)")
  g.add_argument("--max-grace-s", type=float, default=d.max_grace_s, help="grace window cap")
  g.add_argument("--learner-recovery", default=d.learner_recovery, choices=("elastic", "restart"),
                 help="how a learner survives a failure: elastic inside, or restart and rejoin")
  g.add_argument("--rejoin-s", type=float, default=d.rejoin_s, help="restart mode: pull of the global model")
  g.add_argument("--speed-spread", type=float, default=d.speed_spread,
                 help="learner speeds uniform in [1 - spread, 1] (mixed hardware)")
  g.add_argument("--failures-per-job", type=int, default=d.failures_per_job,
                 help="simulated recoveries per job (sets the horizon; more = tighter CIs)")
  g.add_argument("--horizon-s", type=float, default=0.0, help="> 0: simulated seconds (overrides the above)")
  g.add_argument("--repeats", type=int, default=3, help="seeded repeats per cell (for the CI)")
  g.add_argument("--seed", type=int, default=0)
  g.add_argument("--json", action="store_true", help="print JSON instead of a table")
  g.add_argument("--out", default="runs/sim", help="directory for PNG plots")
  g.add_argument("--no-plot", action="store_true", help="skip the PNG")

  b = sub.add_parser("bandwidth", help="WAN bandwidth needed for a target compute utilization",
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  bd = bandwidth.BandwidthConfig()
  b.add_argument("--params", type=float, default=bd.params, help="model parameters")
  b.add_argument("--bytes-per-param", type=float, default=bd.bytes_per_param,
                 help="bytes of a (outer) gradient element before quantization")
  b.add_argument("--step-s", type=float, default=bd.step_s, help="inner step time")
  b.add_argument("--inner-steps", type=int, default=bd.inner_steps, help="H")
  b.add_argument("--fragments", type=int, default=bd.fragments, help="P")
  b.add_argument("--tau", type=int, default=bd.tau, help="overlap steps")
  b.add_argument("--sites", type=int, default=bd.sites, help="sites (datacenters) on the WAN ring")
  b.add_argument("--fwd-fraction", type=float, default=bd.fwd_fraction, help="forward share of a step")
  b.add_argument("--quant-bits", type=int, default=bd.quant_bits, help="bits of a quantized element")
  b.add_argument("--quant-block", type=int, default=bd.quant_block, help="elements per bf16 scale")
  b.add_argument("--utilization", type=_float_list, default=list(bandwidth.UTILIZATIONS),
                 help="target compute utilizations (comma list, in (0, 1])")
  b.add_argument("--json", action="store_true", help="print JSON instead of a table")
  b.add_argument("--out", default="runs/sim", help="directory for PNG plots")
  b.add_argument("--no-plot", action="store_true", help="skip the PNG")
  return parser


def _progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def _sim_config(args) -> goodput.SimConfig:
  return goodput.SimConfig(
      mtbi_chip_s=args.mtbi_years * goodput.YEAR_S, slice_chips=args.slice_chips,
      restart_s=args.restart_s, reshape_s=args.reshape_s, repair_s=args.repair_s,
      rejoin_wait_s=args.rejoin_wait_s, step_s=args.step_s, step_cv=args.step_cv,
      ckpt_every_steps=args.ckpt_every_steps, ckpt_cost_s=args.ckpt_cost_s, inner_steps=args.inner_steps,
      fragments=args.fragments, snapshot_s=args.snapshot_s, t_sync_s=args.t_sync_s,
      min_quorum=args.min_quorum, tau=args.tau, grace_gamma=args.grace_gamma, max_grace_s=args.max_grace_s,
      learner_recovery=args.learner_recovery, rejoin_s=args.rejoin_s, speed_spread=args.speed_spread,
      failures_per_job=args.failures_per_job, horizon_s=args.horizon_s,
  )


def assumptions_text(cfg: goodput.SimConfig) -> str:
  """The assumptions behind a goodput run, in one paragraph (printed with every table)."""
  return (
      f"Assumptions: per-chip MTBI {cfg.mtbi_chip_s / goodput.YEAR_S:g} y (Poisson); a failure takes out "
      f"its {cfg.slice_chips}-chip slice. DP: warm restart {cfg.restart_s:g} s (hot spare, in-memory state), "
      f"checkpoint every {cfg.ckpt_every_steps} step(s) costing {cfg.ckpt_cost_s:g} s; work since the last one is lost. "
      f"Elastic DP: reshape {cfg.reshape_s:g} s pauses the whole job, the in-flight step is lost, the slice "
      f"is out {cfg.repair_s:g} s and rejoins at the next failure's reshape within {cfg.rejoin_wait_s:g} s, "
      f"else with its own reshape. Decoupled DiLoCo: each of M learners is an elastic DP job of N/M chips "
      f"(learner recovery: {cfg.learner_recovery}); H={cfg.inner_steps}, P={cfg.fragments}, push snapshot "
      f"{cfg.snapshot_s:g} s; syncer rounds by syncer.policy (K={cfg.min_quorum}, tau={cfg.tau}, "
      f"gamma={cfg.grace_gamma:g}, max grace {cfg.max_grace_s:g} s, t_sync {cfg.t_sync_s:g} s). "
      f"Step {cfg.step_s:g} s (cv {cfg.step_cv:g}). Failures during a restart or reshape are absorbed by it. "
      f"Horizon: {cfg.failures_per_job} recoveries per job."
  )


def _format_table(rows: list[dict], with_published: bool) -> str:
  chips = sorted({r["chips"] for r in rows})
  keys = []
  for r in rows:
    if (r["strategy"], r["learners"]) not in keys:
      keys.append((r["strategy"], r["learners"]))
  head = f"{'goodput %':>11} |" + "".join(f"{c:>24,}" if with_published else f"{c:>14,}" for c in chips)
  sub = (f"{'':>11} |" + "".join(f"{'sim ± CI  pub  diff':>24}" for _ in chips)) if with_published else None
  lines = [head] + ([sub] if sub else []) + ["-" * len(head)]
  for key in keys:
    cells = []
    for c in chips:
      r = next((r for r in rows if (r["strategy"], r["learners"]) == key and r["chips"] == c), None)
      if r is None:
        cells.append(f"{'':>24}" if with_published else f"{'':>14}")
      elif with_published:
        cells.append(f"{100 * r['goodput']:6.1f} ±{100 * r['goodput_ci']:4.1f} {r['published']:4d} "
                     f"{r['diff_points']:+5.1f}")
      else:
        cells.append(f"{100 * r['goodput']:7.1f} ±{100 * r['goodput_ci']:4.1f}")
    lines.append(f"{goodput.row_label(*key):>11} |" + "".join(f"{x:>24}" if with_published else f"{x:>14}"
                                                              for x in cells))
  lines.append("")
  lines.append(f"{'uptime %':>11} |" + "".join(f"{c:>14,}" for c in chips))
  for key in keys:
    cells = []
    for c in chips:
      r = next((r for r in rows if (r["strategy"], r["learners"]) == key and r["chips"] == c), None)
      cells.append("" if r is None else f"{100 * r['uptime']:.1f}")
    lines.append(f"{goodput.row_label(*key):>11} |" + "".join(f"{x:>14}" for x in cells))
  return "\n".join(lines)


def _run_goodput(args) -> int:
  base = _sim_config(args)
  if args.repeats < 1:
    raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
  strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
  for s in strategies:
    if s not in goodput.STRATEGIES:
      raise ValueError(f"--strategy must be a comma list of {goodput.STRATEGIES}, got {s!r}")
  for n in args.chips:
    if n < 1:
      raise ValueError(f"--chips must be >= 1, got {n}")
  for m in args.learners:
    if m < 1:
      raise ValueError(f"--learners (M) must be >= 1, got {m}")
  dataclasses.replace(base, strategy="diloco", learners=1, chips=max(args.chips)).validate()
  start = time.perf_counter()
  if args.table:
    rows = goodput.table(base, repeats=args.repeats, seed=args.seed, progress=_progress)
  else:
    rows = []
    combos = [(s, 1) for s in strategies if s != "diloco"]
    combos += [("diloco", m) for m in args.learners] if "diloco" in strategies else []
    for strategy, m in combos:
      for n in args.chips:
        cfg = dataclasses.replace(base, chips=n, strategy=strategy, learners=m)
        est = goodput.simulate(cfg, repeats=args.repeats, seed=args.seed)
        rows.append({"strategy": strategy, "learners": m, "chips": n, "goodput": est.goodput,
                     "goodput_ci": est.goodput_ci, "uptime": est.uptime, "uptime_ci": est.uptime_ci,
                     "published": None, "diff_points": None, "failures_per_repeat": est.failures,
                     "horizon_s": est.horizon_s, **est.extra})
        _progress(f"{goodput.row_label(strategy, m):>10} {n:>9,} chips: goodput {100 * est.goodput:5.1f}% "
                  f"uptime {100 * est.uptime:5.1f}%")
  elapsed = time.perf_counter() - start
  plot = None
  if not args.no_plot and len({r["chips"] for r in rows}) > 1:
    from diloco_jax.sim import plots  # matplotlib is slow to import: only when plotting

    plot = plots.plot_goodput(rows, os.path.join(args.out, "goodput_vs_chips.png"))
  if args.json:
    out = {"rows": rows, "assumptions": dataclasses.asdict(base), "repeats": args.repeats,
           "seed": args.seed, "elapsed_s": elapsed, "plot": plot}
    if args.table:
      out["max_abs_diff_points"] = max(abs(r["diff_points"]) for r in rows)
    print(json.dumps(out, indent=2))
    return 0
  print(_format_table(rows, with_published=args.table))
  print()
  print(assumptions_text(base))
  if args.table:
    worst = max(rows, key=lambda r: abs(r["diff_points"]))
    misses = [r for r in rows if abs(r["diff_points"]) > 5]
    print(f"Largest difference: {worst['diff_points']:+.1f} points ({goodput.row_label(worst['strategy'], worst['learners'])}"
          f" at {worst['chips']:,} chips); cells beyond 5 points: {len(misses)} of {len(rows)}.")
  print(f"{args.repeats} repeats per cell, seed {args.seed}, ±: 95% CI; {elapsed:.1f} s"
        + (f"; plot: {plot}" if plot else ""))
  return 0


def _run_bandwidth(args) -> int:
  cfg = bandwidth.BandwidthConfig(
      params=args.params, bytes_per_param=args.bytes_per_param, step_s=args.step_s,
      inner_steps=args.inner_steps, fragments=args.fragments, tau=args.tau, sites=args.sites,
      fwd_fraction=args.fwd_fraction, quant_bits=args.quant_bits, quant_block=args.quant_block,
  ).validate()
  for u in args.utilization:
    if not 0 < u <= 1:
      raise ValueError(f"--utilization must be in (0, 1], got {u}")
  rows = bandwidth.table(cfg, args.utilization)
  fig8 = bandwidth.eight_datacenter_figure(cfg)
  plot = None
  if not args.no_plot:
    from diloco_jax.sim import plots

    plot = plots.plot_bandwidth(cfg, os.path.join(args.out, "bandwidth_vs_utilization.png"))
  if args.json:
    print(json.dumps({"config": dataclasses.asdict(cfg), "rows": rows, "eight_datacenters": fig8,
                      "plot": plot}, indent=2))
    return 0
  us = [f"{u:g}" for u in args.utilization]
  print(f"Gbit/s per site for a target compute utilization: {cfg.params / 1e9:g}B params, "
        f"{cfg.step_s:g} s/step, {cfg.sites} sites, H={cfg.inner_steps}, P={cfg.fragments}, tau={cfg.tau}")
  print(f"{'method':<32}" + "".join(f"{100 * float(u):>9g}%" for u in us) + "   published@95%")
  for r in rows:
    pub = f"   {r['published_95']:g} (ours/pub {r['ratio_95']:.2f})" if "published_95" in r else ""
    print(f"{r['label']:<32}" + "".join(f"{r['gbps'][u]:>10.3g}" for u in us) + pub)
  print()
  g = fig8["gbps"]
  print(f"8 datacenters at {100 * fig8['utilization']:g}% utilization, {cfg.step_s:g} s/step: a "
        f"{fig8['solved_params'] / 1e9:.2f}B-param model needs {g['dp']:.0f} Gbps data-parallel; DiLoCo "
        f"{g['diloco']:.1f}; streaming {g['streaming']:.1f}; + overlap {g['streaming_overlap']:.2f}; "
        f"+ int{cfg.quant_bits} {g['streaming_overlap_q']:.2f} Gbps (reduction {fig8['reduction']:.0f}x; "
        f"published 198 -> 0.84, {fig8['published']['reduction']:.0f}x).")
  print(f"Assumptions: ring all-reduce 2(n-1)/n; comm overlaps the backward pass ({1 - cfg.fwd_fraction:.2f} "
        f"of a step) for DP/DiLoCo/streaming and tau steps with overlap; {cfg.bytes_per_param:g} bytes/param "
        f"before quantization; int{cfg.quant_bits} adds one bf16 scale per {cfg.quant_block} params "
        f"({cfg.quant_bytes_per_param:.4f} B/param); latency ignored."
        + (f" Plot: {plot}" if plot else ""))
  return 0


def main(argv=None) -> int:
  """Entry point: argv[0] is the program name, argv[1:] the arguments. Returns an exit code."""
  argv = list(sys.argv if argv is None else argv)
  if argv[1:2] == ["sizing"]:  # absl flags with --config: its own module
    from diloco_jax.sim import sizing
    return sizing.main([f"{argv[0]} sizing"] + argv[2:])
  parser = _build_parser(argv[0] if argv else "python -m diloco_jax sim")
  args = parser.parse_args(argv[1:])
  try:
    if args.command == "goodput":
      return _run_goodput(args)
    return _run_bandwidth(args)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())

r"""`python -m diloco_jax sim goodput [flags]`: goodput of DP, elastic DP and Decoupled DiLoCo under failures.

Examples:
  python -m diloco_jax sim goodput --table --learners 8 --chips 1200000,2400000   # the published grid (part)
  python -m diloco_jax sim goodput --chips 1200000 --learners 8 --strategy dp,elastic,diloco
  python -m diloco_jax sim goodput --chips 150000,600000,2400000 --strategy diloco --learners 4,8 --json
  # The paper's mixed-hardware experiment: K = M, K = 1 without grace, K = 1 + grace, failures negligible.
  python -m diloco_jax sim goodput --quorum-settings all,k1,k1grace --groups 0.847:4,1:4 --step-cv 0.1 \
      --mtbi-years 1e9

Goodput = useful chip-time / provisioned chip-time: it excludes time stalled by failures, lost work, and
time a learner is blocked on the outer loop (as the learner blocks: docs/simulator.md). Differences from
published values are shown only for cells that were published (the grid at a per-chip MTBI of 1 year; the
quorum settings in the paper's own setting). Progress goes to stderr; tables (or --json) to stdout; a PNG
plot to --out when more than one chip count is simulated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import flags

from diloco_jax import cli
from diloco_jax.tools.sim import goodput
from diloco_jax.tools.sim.args import definer, numbers, parse_groups, progress

_DEFAULT = goodput.SimConfig()


def _flags(fv):
  d = _DEFAULT
  define = definer(fv)
  define("bool", "table", False, "Simulate the published grid (150k..2.4M chips x DP, elastic DP, M=2,4,8,16); "
         "--chips, --strategy and --learners, when given, select part of it.")
  define("list", "chips", [str(d.chips)], "Total chips (comma list to sweep).")
  define("list", "strategy", ["dp", "elastic", "diloco"], f"Comma list of {', '.join(goodput.STRATEGIES)}.")
  define("list", "learners", [str(d.learners)], "M for diloco (comma list).")
  define("list", "quorum-settings", [], "Run diloco under these quorum settings side by side: "
         + "; ".join(f"{k}: {v}" for k, v in goodput.QUORUM_SETTINGS.items()) + ".")
  define("string", "groups", "", "Mixed hardware: SPEED:LEARNERS groups, e.g. 0.847:4,1:4 (4 learners 18% "
         "slower beside 4 at full speed); sets M.")
  define("float", "speed-spread", d.speed_spread, "Learner speeds uniform in [1 - spread, 1] (instead of "
         "--groups).")
  define("float", "mtbi-years", d.mtbi_chip_s / goodput.YEAR_S, "Mean time between interruptions of one chip, "
         "in years.")
  define("integer", "slice-chips", d.slice_chips, "Chips per slice (the failure unit).")
  define("float", "restart-s", d.restart_s, "dp: full-job restart time.")
  define("float", "reshape-s", d.reshape_s, "elastic: one reshape (shrink or grow).")
  define("float", "repair-s", d.repair_s, "A failed slice is out this long.")
  define("float", "rejoin-wait-s", d.rejoin_wait_s, "A repaired slice waits this long to rejoin at a "
         "failure's reshape.")
  define("float", "step-s", d.step_s, "Inner / training step time of a speed-1 learner.")
  define("float", "step-cv", d.step_cv, "Coefficient of variation of one step's time.")
  define("integer", "ckpt-every-steps", d.ckpt_every_steps, "dp: checkpoint interval.")
  define("float", "ckpt-cost-s", d.ckpt_cost_s, "dp: blocking cost of a checkpoint.")
  define("integer", "inner-steps", d.inner_steps, "H.")
  define("integer", "fragments", d.fragments, "P.")
  define("float", "snapshot-s", d.snapshot_s, "Blocking cost of one fragment push.")
  define("float", "t-sync-s", d.t_sync_s, "Syncer merge + publish time.")
  define("integer", "min-quorum", d.min_quorum, "K.")
  define("integer", "tau", d.tau, "Overlap steps (the grace window's budget; the learner adopts tau steps "
         "after its snapshot).")
  define("float", "grace-gamma", d.grace_gamma, "Grace window gamma (< 1).")
  define("float", "max-grace-s", d.max_grace_s, "Grace window cap.")
  define("integer", "max-in-flight", d.max_in_flight, "Fragments a learner may have pushed but not adopted "
         "(outer.max_in_flight).")
  flags.DEFINE_enum("learner-recovery", d.learner_recovery, ["elastic", "restart"],
                    "How a learner survives a failure: elastic inside, or restart and rejoin.", flag_values=fv)
  define("float", "rejoin-s", d.rejoin_s, "restart mode: pull of the global model.")
  define("integer", "failures-per-job", d.failures_per_job, "Simulated recoveries per job (sets the horizon; "
         "more = tighter CIs).")
  define("float", "horizon-s", 0.0, "> 0: simulated seconds, in full (overrides --failures-per-job and "
         "--max-pushes).")
  define("integer", "max-pushes", d.max_pushes, "The outer loop is simulated over a window of at most this many "
         "pushes per repeat (bounds a cell's time at any MTBI).")
  define("integer", "repeats", 3, "Seeded repeats per cell (for the 95% CI).")
  define("integer", "seed", 0, "Random seed.")
  define("bool", "json", False, "Print JSON instead of a table.")
  define("string", "out", "runs/sim", "Directory for PNG plots.")
  define("bool", "plot", True, "Write the PNG (--noplot to skip).")


def sim_config(fv) -> goodput.SimConfig:
  v = lambda name: fv[name].value
  return goodput.SimConfig(
      mtbi_chip_s=v("mtbi-years") * goodput.YEAR_S, slice_chips=v("slice-chips"), restart_s=v("restart-s"),
      reshape_s=v("reshape-s"), repair_s=v("repair-s"), rejoin_wait_s=v("rejoin-wait-s"), step_s=v("step-s"),
      step_cv=v("step-cv"), ckpt_every_steps=v("ckpt-every-steps"), ckpt_cost_s=v("ckpt-cost-s"),
      inner_steps=v("inner-steps"), fragments=v("fragments"), snapshot_s=v("snapshot-s"), t_sync_s=v("t-sync-s"),
      min_quorum=v("min-quorum"), tau=v("tau"), grace_gamma=v("grace-gamma"), max_grace_s=v("max-grace-s"),
      max_in_flight=v("max-in-flight"), learner_recovery=v("learner-recovery"), rejoin_s=v("rejoin-s"),
      groups=parse_groups(v("groups")), speed_spread=v("speed-spread"), failures_per_job=v("failures-per-job"),
      horizon_s=v("horizon-s"), max_pushes=v("max-pushes"),
  )


def assumptions_text(cfg: goodput.SimConfig, quorum_settings: bool = False) -> str:
  """The assumptions behind a goodput run, in one paragraph (printed with every table)."""
  quorum = "K and grace per setting above" if quorum_settings else f"K={cfg.min_quorum}"
  if cfg.groups:
    speeds = "learner speeds " + ", ".join(f"{s:g} x{c}" for s, c in cfg.groups)
  elif cfg.speed_spread:
    speeds = f"learner speeds uniform in [{1 - cfg.speed_spread:g}, 1]"
  else:
    speeds = "learners of equal speed"
  return (
      f"Assumptions: per-chip MTBI {cfg.mtbi_chip_s / goodput.YEAR_S:g} y (Poisson); a failure takes out "
      f"its {cfg.slice_chips}-chip slice. DP: warm restart {cfg.restart_s:g} s (hot spare, in-memory state), "
      f"checkpoint every {cfg.ckpt_every_steps} step(s) costing {cfg.ckpt_cost_s:g} s; "
      "work since the last one is lost. "
      f"Elastic DP: reshape {cfg.reshape_s:g} s pauses the whole job, the in-flight step is lost, the slice "
      f"is out {cfg.repair_s:g} s and rejoins at the next failure's reshape within {cfg.rejoin_wait_s:g} s, "
      f"else with its own reshape. Decoupled DiLoCo: each of M learners is an elastic DP job of N/M chips "
      f"(learner recovery: {cfg.learner_recovery}); H={cfg.inner_steps}, P={cfg.fragments}, push snapshot "
      f"{cfg.snapshot_s:g} s, max in flight {cfg.max_in_flight}; {speeds}; syncer rounds by syncer.policy "
      f"({quorum}, tau={cfg.tau}, gamma={cfg.grace_gamma:g}, max grace {cfg.max_grace_s:g} s, "
      f"t_sync {cfg.t_sync_s:g} s); learners block as the real learner does. Step {cfg.step_s:g} s "
      f"(cv {cfg.step_cv:g}). Failures during a restart or reshape are absorbed by it. Horizon: "
      + (f"{cfg.horizon_s:g} s." if cfg.horizon_s > 0 else
         f"{cfg.failures_per_job} recoveries per job; outer loop over at most {cfg.max_pushes:,} pushes.")
  )


def format_table(rows: list[dict]) -> str:
  """Goodput (with published value and difference where one applies) and uptime, chips across."""
  with_published = any(r.get("published") is not None for r in rows)
  width = 24 if with_published else 14
  chips = sorted({r["chips"] for r in rows})
  labels = list(dict.fromkeys(goodput.label(r) for r in rows))
  lw = max(11, *(len(x) for x in labels))
  cell = {(goodput.label(r), r["chips"]): r for r in rows}
  head = f"{'goodput %':>{lw}} |" + "".join(f"{c:>{width},}" for c in chips)
  lines = [head]
  if with_published:
    lines.append(f"{'':>{lw}} |" + "".join(f"{'sim ± CI  pub  diff':>{width}}" for _ in chips))
  lines.append("-" * len(head))
  for label in labels:
    cells = []
    for c in chips:
      r = cell.get((label, c))
      if r is None:
        cells.append("")
      elif r.get("published") is not None:
        cells.append(f"{100 * r['goodput']:6.1f} ±{100 * r['goodput_ci']:4.1f} {r['published']:4d} "
                     f"{r['diff_points']:+5.1f}")
      else:
        cells.append(f"{100 * r['goodput']:7.1f} ±{100 * r['goodput_ci']:4.1f}" + (" " * 10 if with_published else ""))
    lines.append(f"{label:>{lw}} |" + "".join(f"{x:>{width}}" for x in cells))
  lines.append("")
  lines.append(f"{'uptime %':>{lw}} |" + "".join(f"{c:>14,}" for c in chips))
  for label in labels:
    cells = ["" if (label, c) not in cell else f"{100 * cell[(label, c)]['uptime']:.1f}" for c in chips]
    lines.append(f"{label:>{lw}} |" + "".join(f"{x:>14}" for x in cells))
  return "\n".join(lines)


def format_quorum_settings(rows: list[dict], cfg: goodput.SimConfig) -> str:
  """The three quorum settings side by side, with the lockstep expectation and the paper's values."""
  mismatch = goodput.published_hetero_mismatch(cfg)
  lines = [f"{'setting':<24} {'chips':>10} {'goodput % ± CI':>15} {'blocked %':>9} {'contrib/round':>13} "
           f"{'late %':>7} {'rounds':>8} {'paper':>6} {'diff':>6}"]
  for r in rows:
    pub = goodput.PUBLISHED_HETERO[r["setting"]]
    diff = f"{100 * r['goodput'] - pub:+6.1f}" if mismatch is None else f"{'n/a':>6}"
    lines.append(f"{goodput.QUORUM_SETTINGS[r['setting']]:<24} {r['chips']:>10,} "
                 f"{100 * r['goodput']:8.1f} ± {100 * r['goodput_ci']:4.1f} {100 * r['blocked_fraction']:9.1f} "
                 f"{r['mean_contributors']:13.2f} {100 * r['late_fraction']:7.1f} {r['rounds']:8,.0f} "
                 f"{pub:6d} {diff}")
  lockstep = goodput.lockstep_goodput(cfg)
  lines.append(f"Lockstep expectation (every learner at the slowest one's pace; the mean over learners of "
               f"slowest / own speed): {100 * lockstep:.1f}%.")
  paper = f"Paper ({goodput.PUBLISHED_HETERO_SETTING}): "
  lines.append(paper + ("this is its setting; diff = simulated - published (points)." if mismatch is None else
                        f"not its setting ({mismatch}): its values are shown for reference, without a diff."))
  return "\n".join(lines)


def _check_combination(fv, cfg: goodput.SimConfig) -> None:
  """Flags that cannot go together are errors, never silently ignored."""
  present = lambda name: fv[name].present
  if fv.table and fv["quorum-settings"].value:
    raise cli.UsageError("--table and --quorum-settings are two different runs: give one")
  if fv.table and cfg.groups:
    raise cli.UsageError("--groups fixes M, but --table sweeps M = 2, 4, 8, 16: drop one")
  if fv["quorum-settings"].value:
    if present("min-quorum"):
      raise cli.UsageError("--quorum-settings sets K for each setting: drop --min-quorum")
    if present("strategy") and fv.strategy != ["diloco"]:
      raise cli.UsageError("--quorum-settings runs Decoupled DiLoCo only: drop --strategy or make it diloco")


def _learner_counts(fv, cfg: goodput.SimConfig) -> list[int]:
  counts = numbers(fv, "learners", int)
  if cfg.groups:
    total = sum(c for _, c in cfg.groups)
    if fv["learners"].present and counts != [total]:
      raise cli.UsageError(f"--groups hold {total} learners but --learners is {','.join(map(str, counts))}")
    return [total]
  return counts


def run(fv) -> dict:
  """Simulate what the flags ask for; returns rows and metadata (the JSON output)."""
  base = sim_config(fv)
  _check_combination(fv, base)
  strategies = [s.strip() for s in fv.strategy if s.strip()]
  for s in strategies:
    if s not in goodput.STRATEGIES:
      raise cli.UsageError(f"--strategy must be a comma list of {', '.join(goodput.STRATEGIES)}, got {s!r}")
  chips = numbers(fv, "chips", int)
  learners = _learner_counts(fv, base)
  settings = [s.strip() for s in fv["quorum-settings"].value if s.strip()]
  if fv.repeats < 1:
    raise cli.UsageError(f"--repeats must be >= 1, got {fv.repeats}")
  try:
    for n in chips:
      if n < 1:
        raise ValueError(f"--chips must be >= 1, got {n}")
    for m in learners:
      dataclasses.replace(base, strategy="diloco", learners=m, chips=max(chips + [m])).validate()
    for s in settings:
      goodput.with_quorum_setting(base, s)
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  base = dataclasses.replace(base, learners=learners[0])
  start = time.perf_counter()
  if fv.table:
    rows_spec = list(goodput.TABLE_ROWS)
    if fv["strategy"].present or fv["learners"].present:
      ms = learners if fv["learners"].present else [m for s, m in goodput.TABLE_ROWS if s == "diloco"]
      rows_spec = ([(s, 1) for s in strategies if s != "diloco"] +
                   ([("diloco", m) for m in ms] if "diloco" in strategies else []))
    grid_chips = chips if fv["chips"].present else list(goodput.TABLE_CHIPS)
    rows = goodput.table(base, repeats=fv.repeats, seed=fv.seed, progress=progress, chips=grid_chips,
                         rows=rows_spec)
  else:
    if settings:
      combos = [("diloco", m, s) for m in learners for s in settings]
    else:
      combos = [(s, 1, None) for s in strategies if s != "diloco"]
      combos += [("diloco", m, None) for m in learners] if "diloco" in strategies else []
    rows = []
    for strategy, m, setting in combos:
      for n in chips:
        cfg = dataclasses.replace(base, chips=n, strategy=strategy, learners=m)
        if setting:
          cfg = goodput.with_quorum_setting(cfg, setting)
        est = goodput.simulate(cfg, repeats=fv.repeats, seed=fv.seed)
        rows.append({"strategy": strategy, "learners": m, "chips": n, "setting": setting,
                     "goodput": est.goodput, "goodput_ci": est.goodput_ci, "uptime": est.uptime,
                     "uptime_ci": est.uptime_ci, "published": None, "diff_points": None,
                     "failures_per_repeat": est.failures, "horizon_s": est.horizon_s, **est.extra})
        progress(f"{goodput.label(rows[-1]):>10} {n:>9,} chips: goodput {100 * est.goodput:5.1f}% "
                 f"uptime {100 * est.uptime:5.1f}%")
  return {"rows": rows, "assumptions": dataclasses.asdict(base), "repeats": fv.repeats, "seed": fv.seed,
          "elapsed_s": time.perf_counter() - start, "config": base, "settings": settings}


def sim_goodput(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__, config=False)
  try:
    result = run(fv)
  except ValueError as e:  # a bad combination found by the model's own checks
    raise cli.UsageError(str(e)) from None
  rows, base = result.pop("rows"), result.pop("config")
  published = [r for r in rows if r.get("published") is not None]
  plot = None
  if fv.plot and len({r["chips"] for r in rows}) > 1:
    from diloco_jax.tools.sim import plots  # noqa: PLC0415 - matplotlib is slow to import: only when plotting

    plot = plots.plot_goodput(rows, os.path.join(fv.out, "goodput_vs_chips.png"),
                              mtbi_years=base.mtbi_chip_s / goodput.YEAR_S)
  if fv.json:
    out = {"rows": rows, **result, "plot": plot}
    if published:
      out["max_abs_diff_points"] = max(abs(r["diff_points"]) for r in published)
    if result["settings"]:
      out["lockstep_goodput"] = goodput.lockstep_goodput(base)
      out["published_hetero"] = goodput.PUBLISHED_HETERO
      out["published_hetero_mismatch"] = goodput.published_hetero_mismatch(base)
    print(json.dumps(out, indent=2))
    return 0
  print(format_quorum_settings(rows, base) if result["settings"] else format_table(rows))
  print()
  print(assumptions_text(base, quorum_settings=bool(result["settings"])))
  if fv.table and published:
    worst = max(published, key=lambda r: abs(r["diff_points"]))
    misses = [r for r in published if abs(r["diff_points"]) > 5]
    print(f"Largest difference: {worst['diff_points']:+.1f} points ({goodput.label(worst)} at {worst['chips']:,} "
          f"chips); cells beyond 5 points: {len(misses)} of {len(published)} published cells"
          + (f" ({len(rows) - len(published)} simulated cells were not published)." if len(published) < len(rows)
             else "."))
  elif fv.table:
    print(f"No differences shown: the published grid is for a per-chip MTBI of {goodput.PUBLISHED_MTBI_YEARS:g} "
          f"year and chips {', '.join(f'{c:,}' for c in goodput.TABLE_CHIPS)}; this run's cells are not "
          f"among them (MTBI {base.mtbi_chip_s / goodput.YEAR_S:g} y).")
  print(f"{fv.repeats} repeats per cell, seed {fv.seed}, ±: 95% CI; {result['elapsed_s']:.1f} s"
        + (f"; plot: {plot}" if plot else ""))
  return 0

"""`python -m diloco_jax bench quality --config configs/small_cpu.py [--budgets 1,3,10] [--config.x=y]`

Trains, on the same token budget (same steps x global batch, and by default the same tokens in the same
steps: `data.baseline_order`), the data-parallel baseline and Decoupled DiLoCo (the config's M learners,
codecs, H and P), then prints both final eval losses (on the same held-out batches) and their ratio, and
the bytes each moved per worker and their ratio (`run_pair`).

`--budgets 1,3,10` repeats the pair at those multiples of `train.steps`, prints the ratio and the bytes
ratio per budget, and writes a PNG (`--plot`, default `<workdir>/quality.png`; `plot`). `--seeds N`
repeats every pair (and rung) at seeds config.seed + 0 .. N-1 and prints every run with the mean and
spread (`seeds.py`); `--frontier` adds the run to a loss-against-bytes plot (`frontier.py`).

`--ladder`: at each budget also Decoupled DiLoCo with the parts of the algorithm put back one at a time
(`ladder`), from exact averaging after every inner step to the config, each rung's increase over the one
before being the share of the gap its part costs. docs/benchmarks.md, "Quality and bytes".
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

from diloco_jax import cli
from diloco_jax import metrics as metrics_lib
from diloco_jax.runs import baseline, inprocess
from diloco_jax.tools.bench import bench_flags
from diloco_jax.tools.bench import frontier as frontier_lib
from diloco_jax.tools.bench import seeds as seeds_lib

# The goals this benchmark reports against (issue 22): DiLoCo's eval loss (the seeds' mean) within this
# factor of data-parallel at this multiple of the config's steps (small_cpu's 480 steps: its short-budget
# stress test), and for any budget at least 100x fewer bytes on every seed. The primary measure, tiny_cpu
# at about 20 tokens per parameter (~2,250 steps), is no multiple of its steps: docs/benchmarks.md.
LOSS_GOALS = {3: 1.08}
BYTES_GOAL = 100.0


# The exact-averaging outer loop: one fragment, no overlap, every live learner, the plain average of fp32
# outer gradients as the new global (outer lr 1 without momentum).
_EXACT = {"outer.num_fragments": 1, "outer.tau": 0, "outer.min_quorum": 0, "outer.lr": 1.0,
          "outer.momentum": 0.0, "outer.codec": "fp32", "outer.downlink_codec": "fp32", "outer.rda": False}


def ladder(config) -> list[tuple[str, str, object]]:
  """(name, the part the rung puts back, its config) from exact averaging after every inner step to
  `config` itself. A rung that changes nothing from the one before (a part the config does not use) is
  left out (tau = 0, K = all: no rung); the last rung is always the config, under the part that rung
  before it put back."""
  o = config.outer
  rungs = [
      ("exact, H = 1", "the inner optimizer: M learners on 1/M of the batch, averaged every step",
       {**_EXACT, "outer.sync_every": 1, "outer.sync_schedule": "periodic"}),
      (f"exact, H = {o.sync_every}", "local drift: H inner steps between averages", _EXACT),
      ("synchronous", f"codecs {o.codec}/{o.downlink_codec}, P = {o.num_fragments}, outer lr {o.lr:g} / "
       f"momentum {o.momentum:g}", {"outer.tau": 0, "outer.min_quorum": 0}),
      ("K = all", f"the overlap: tau = {o.tau}", {"outer.min_quorum": 0}),
      ("as configured", f"the quorum: K = {o.min_quorum or 'all'} with the grace window", {}),
  ]
  out = []
  for name, part, overrides in rungs:
    c = config.copy_and_resolve_references()
    for path, value in overrides.items():
      section, field = path.split(".")
      c[section][field] = value
    if out and c.to_dict() == out[-1][2].to_dict():
      if not overrides:  # the config itself: it takes the place of the rung it equals
        out[-1] = (name, out[-1][1], c)
      continue
    out.append((name, part, c))
  return out


def run_pair(config, root: pathlib.Path, quiet: bool = False, rungs: bool = False) -> dict:
  """Data-parallel, then Decoupled DiLoCo, on `config`; the comparison as a dict. With `rungs`, DiLoCo
  is trained at every rung of `ladder` (the last is `config` itself), listed under "ladder". Data-parallel
  bytes: a ring all-reduce of fp32 gradients every step, 2 (n-1)/n x gradient bytes per worker. DiLoCo
  bytes: what each learner sent and received."""
  dp = baseline.run(config, str(root / "dp"), quiet=quiet, export=False)
  steps = ladder(config) if rungs else [("as configured", "", config)]
  runs = []
  for i, (name, part, c) in enumerate(steps):
    workdir = root / ("diloco" if i == len(steps) - 1 else f"rung{i}")
    if rungs and not quiet:
      print(f"\nrung {i + 1}/{len(steps)}: {name} (puts back {part})", file=sys.stderr)
    runs.append(inprocess.run(c, str(workdir), quiet=quiet, export=False))
  dl = runs[-1]
  pair = {
      "seed": config.seed, "steps": config.train.steps,
      "dp_eval_loss": dp["final_eval_loss"], "diloco_eval_loss": dl["final_eval_loss"],
      "loss_ratio": dl["final_eval_loss"] / dp["final_eval_loss"],
      "dp_bytes_per_worker": dp["comm_bytes"], "diloco_bytes_per_learner": dl["comm_bytes"],
      "bytes_ratio": dp["comm_bytes"] / max(dl["comm_bytes"], 1),
      "tokens": dp["tokens"], "diloco_tokens": dl["tokens"], "outer_rounds": dl["outer_rounds"],
      "contributions_merged": dl["contributions_merged"], "dp_wall_s": dp["wall_s"], "diloco_wall_s": dl["wall_s"],
      "dp_curve": _curve(root / "dp" / "metrics.jsonl"),
      "diloco_curve": _curve(root / "diloco" / "global" / "metrics.jsonl"),  # the global model's
  }
  if rungs:
    pair["ladder"] = [{"rung": name, "puts_back": part, "eval_loss": r["final_eval_loss"],
                       "loss_ratio": r["final_eval_loss"] / dp["final_eval_loss"],
                       "bytes_ratio": dp["comm_bytes"] / max(r["comm_bytes"], 1), "outer_rounds": r["outer_rounds"],
                       "wall_s": r["wall_s"]} for (name, part, _), r in zip(steps, runs)]
  return pair


def run_seeds(config, root: pathlib.Path, seeds: int, quiet: bool = False, rungs: bool = False) -> dict:
  """`run_pair` at `seed` = the config's + 0 .. seeds - 1 (each seed's under `root/seed<s>`, one seed's in
  `root` itself), summarized by `summarize`. The config's seed is left as it was."""
  first = config.seed
  runs = []
  try:
    for i in range(seeds):
      config.seed = first + i
      if seeds > 1 and not quiet:
        print(f"\nseed {config.seed} ({i + 1} of {seeds})", file=sys.stderr)
      runs.append(run_pair(config, root / f"seed{config.seed}" if seeds > 1 else root, quiet=quiet, rungs=rungs))
  finally:
    config.seed = first
  return seeds_lib.summarize(runs)


def _curve(path: pathlib.Path) -> list[tuple[int, float]]:
  """(tokens, eval loss) points of a run's metrics log."""
  return [(r["tokens"], r["eval_loss"]) for r in metrics_lib.read_jsonl(path) if "eval_loss" in r]


def _settings(config) -> dict:
  o, t, inner = config.outer, config.train, config.learners.inner
  return {"H": o.sync_every, "schedule": _schedule(config), "P": o.num_fragments, "M": config.learners.num,
          "outer_lr": o.lr,
          "outer_momentum": o.momentum, "codec": o.codec, "downlink_codec": o.downlink_codec,
          "min_quorum": o.min_quorum, "tau": o.tau, "steps": t.steps, "lr": t.lr,
          "learners_inner": {k: v for k, v in inner.items() if v is not None}}


def _schedule(config) -> str:
  o = config.outer
  return "periodic" if o.sync_schedule == "periodic" else f"{o.sync_schedule} (power {o.schedule_power:g})"


def _print_pair(r: dict) -> None:
  print(f"\n{'':24}{'data-parallel':>16}{'Decoupled DiLoCo':>18}{'ratio':>10}")
  print(f"{'final eval loss':24}{r['dp_eval_loss']:>16.4f}{r['diloco_eval_loss']:>18.4f}{r['loss_ratio']:>10.4f}")
  print(f"{'bytes per worker':24}{r['dp_bytes_per_worker']:>16,.0f}{r['diloco_bytes_per_learner']:>18,.0f}"
        f"{r['bytes_ratio']:>9.1f}x")
  print(f"{'tokens':24}{r['tokens']:>16,}{r['diloco_tokens']:>18,}")
  print(f"{'wall s':24}{r['dp_wall_s']:>16.1f}{r['diloco_wall_s']:>18.1f}")


def _print_ladder(r: dict) -> None:
  """Each rung's eval loss against data-parallel and its increase over the rung before (in % of the
  data-parallel loss: the share of the gap the part it puts back costs); over seeds, the means and the
  range of the rung's ratio."""
  seeds = len(r["seeds"])
  print(f"\n{'rung':22}{'eval loss':>10}{'vs DP':>9}{'step':>9}{'bytes':>9}"
        + (f"{'vs DP min..max':>18}" if seeds > 1 else "") + "  puts back")
  print(f"{'data-parallel':22}{r['dp_eval_loss']:>10.4f}")
  previous = 1.0
  for rung in r["ladder"]:
    lo, hi = (rung["loss_ratio_spread"][k] for k in ("min", "max")) if seeds > 1 else (0, 0)
    print(f"{rung['rung']:22}{rung['eval_loss']:>10.4f}{100 * (rung['loss_ratio'] - 1):>+8.1f}%"
          f"{100 * (rung['loss_ratio'] - previous):>+8.1f}%{rung['bytes_ratio']:>8.1f}x"
          + (f"{100 * (lo - 1):>+9.1f}..{100 * (hi - 1):+.1f}%" if seeds > 1 else "") + f"  {rung['puts_back']}")
    previous = rung["loss_ratio"]


def _goal_line(budget: int, r: dict) -> str:
  loss_goal = LOSS_GOALS.get(budget)
  loss = (f"eval loss within {100 * (loss_goal - 1):.0f}% "
          f"({'met' if r['loss_ratio'] <= loss_goal else 'NOT met'})" if loss_goal else "no loss goal")
  fewest = r["spread"]["bytes_ratio"]["min"]
  return f"{loss}, >= {BYTES_GOAL:.0f}x fewer bytes on every seed ({'met' if fewest >= BYTES_GOAL else 'NOT met'})"


def plot(results: dict[int, dict], path: str) -> str:
  """Eval loss against tokens at the largest budget (both runs; the global model's for DiLoCo, evaluated
  every `train.eval_every` steps of learner 0), and the loss ratio against the budget. Every budget runs
  with everything else as configured (warmup, evaluation interval)."""
  import matplotlib  # noqa: PLC0415 - lazy: only this output needs it, and it adds a second to the import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use, as above

  budgets = sorted(results)
  top = results[budgets[-1]]
  fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
  for key, label in (("dp_curve", "data-parallel"), ("diloco_curve", "Decoupled DiLoCo (global model)")):
    points = [(t, loss) for t, loss in top[key] if t > 0]
    ax0.plot([t for t, _ in points], [loss for _, loss in points], marker="o", ms=3, label=label)
  ax0.set_xlabel("tokens")
  ax0.set_ylabel("eval loss (nats per byte)")
  ax0.set_title(f"{budgets[-1]}x budget: {top['steps']} steps")
  ax0.grid(True, alpha=0.3)
  ax0.legend()
  ax1.plot(budgets, [results[b]["loss_ratio"] for b in budgets], marker="o", label="DiLoCo / data-parallel")
  goals = [(b, LOSS_GOALS[b]) for b in budgets if b in LOSS_GOALS]
  if goals:
    ax1.plot([b for b, _ in goals], [g for _, g in goals], ls="none", marker="_", ms=20, mew=2, color="C3",
             label="goal")
  ax1.axhline(1.0, color="gray", lw=0.8)
  ax1.set_xscale("log")
  ax1.set_xticks(budgets, [f"{b}x" for b in budgets])
  ax1.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax1.set_xlabel("budget (multiple of train.steps)")
  ax1.set_ylabel("final eval loss ratio")
  ax1.set_title("DiLoCo / data-parallel, same tokens")
  ax1.grid(True, alpha=0.3)
  ax1.legend()
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _parse_budgets(values: list[str]) -> list[int]:
  try:
    budgets = sorted({int(v) for v in values})
  except ValueError:
    raise cli.UsageError(f"--budgets: integers expected, got {','.join(values)}") from None
  if not budgets or budgets[0] < 1:
    raise cli.UsageError(f"--budgets: multiples must be >= 1, got {','.join(values)}")
  return budgets


def bench_quality(argv) -> int:
  fv = cli.parse(argv, bench_flags.quality, doc=__doc__)
  config = fv.config
  budgets = _parse_budgets(fv.budgets)
  base_steps = config.train.steps
  # The DiLoCo run's devices, which the baseline uses all of (its evaluator shares the first learner's).
  available = len(cli.devices(config.learners.num * config.learners.devices, "bench quality"))
  for b in budgets:  # every budget's (and rung's) config is valid before the first run starts
    config.train.steps = b * base_steps
    cli.validated(config, available, learners=False)
    for _, _, c in ladder(config) if fv.ladder else [(None, None, config)]:
      cli.validated(c, available, learners=True)
  root = pathlib.Path(fv.workdir)
  shutil.rmtree(root, ignore_errors=True)
  print(f"bench quality: data-parallel, then Decoupled DiLoCo (M={config.learners.num}, "
        f"codec {config.outer.codec}/{config.outer.downlink_codec}, H={config.outer.sync_every} "
        f"{_schedule(config)}, P={config.outer.num_fragments}, outer lr {config.outer.lr}, "
        f"K={config.outer.min_quorum or 'all'}), "
        f"{config.data.global_batch} sequences a step, at {', '.join(f'{b * base_steps}' for b in budgets)} steps"
        + (f", seeds {config.seed} to {config.seed + fv.seeds - 1}" if fv.seeds > 1 else ""),
        file=sys.stderr)
  results = {}
  for b in budgets:
    config.train.steps = b * base_steps
    results[b] = run_seeds(config, root / f"x{b}" if len(budgets) > 1 else root, fv.seeds, quiet=fv.json,
                           rungs=fv.ladder)
    if not fv.json:
      if len(budgets) > 1:
        print(f"\nbudget {b}x ({b * base_steps} steps):")
      if fv.seeds > 1:
        seeds_lib.print_seeds(results[b])
      else:
        _print_pair(results[b])
      if fv.ladder:
        _print_ladder(results[b])
      print(f"\ngoal: {_goal_line(b, results[b])}")
  config.train.steps = base_steps
  _report(fv, config, results, root)
  return 0


def _report(fv, config, results: dict[int, dict], root: pathlib.Path) -> None:
  """The plots (budgets, frontier) and the output: JSON, or the table of budgets."""
  budgets = sorted(results)
  out = {"budgets": {str(b): r for b, r in results.items()}, "config": _settings(config)}
  if len(budgets) > 1:
    out["plot"] = plot(results, fv.plot or str(root / "quality.png"))
  if fv.frontier:
    label = fv.label or (f"K={config.outer.min_quorum or 'all'} H={config.outer.sync_every} "
                         f"{config.outer.codec} lr {config.outer.lr:g}/{config.outer.momentum:g}")
    points = frontier_lib.append(fv.frontier, [frontier_lib.point(label, b, r) for b, r in results.items()])
    out["frontier"] = frontier_lib.plot(points, str(pathlib.Path(fv.frontier).with_suffix(".png")))
  if fv.json:
    single = {**results[budgets[0]], "config": _settings(config),
              **({"frontier": out["frontier"]} if fv.frontier else {})}
    print(json.dumps(out if len(budgets) > 1 else single, indent=2))
  elif len(budgets) > 1:
    print(f"\n{'budget':>8}{'steps':>8}{'tokens':>12}{'DP loss':>10}{'DiLoCo':>10}{'ratio':>9}{'min..max':>16}"
          f"{'bytes':>9}  goal" + (f" (means of {fv.seeds} seeds)" if fv.seeds > 1 else ""))
    for b in budgets:
      r = results[b]
      ratio = r["spread"]["loss_ratio"]
      print(f"{str(b) + 'x':>8}{r['steps']:>8}{r['tokens']:>12,}{r['dp_eval_loss']:>10.4f}"
            f"{r['diloco_eval_loss']:>10.4f}{r['loss_ratio']:>9.4f}{ratio['min']:>8.4f}..{ratio['max']:.4f}"
            f"{r['bytes_ratio']:>8.1f}x  {_goal_line(b, r)}")
    print(f"\nplot: {out['plot']}")
  if fv.frontier and not fv.json:
    print(f"frontier: {out['frontier']} ({fv.frontier})")

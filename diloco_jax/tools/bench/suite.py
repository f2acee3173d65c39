"""`python -m diloco_jax bench suite [--out FILE --repeats N --benches a,b|all]` (`make bench`): the headline
benchmarks in a fixed order (`BENCHES`), each run `--repeats` times in a process of its own with `--json`,
and one JSON file of their figures: the commit (and whether the tree was dirty), the date, the machine's
load average before and after each run, every run's headline figures (`figures`) and raw result, and each
figure's spread (min, median, max). docs/benchmarks.md's tables cite it; `sim syncer --bench-syncer FILE`
reads its merge rates. By default the quick ones (minutes); `--benches all` adds hetero and chaos (tens
of minutes each), whose repeats are seeds (`Bench.per_repeat`). Run one at a time on a quiet machine: they
time themselves against the machine.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from absl import flags

from diloco_jax import cli

REPO = pathlib.Path(__file__).resolve().parents[3]


@dataclasses.dataclass(frozen=True)
class Bench:
  """One headline benchmark: its `bench` arguments and the figures taken from its JSON result."""

  name: str
  argv: tuple[str, ...]
  figures: Callable[[object], dict]
  long: bool = False  # only with --benches all (or named)
  # Arguments for repeat k (0-based): a seeded bench's repeats are seeds, so a spread covers seeds as well as
  # the machine's noise.
  per_repeat: Callable[[int], tuple[str, ...]] = lambda k: ()


def _syncer(result) -> dict:
  rows = {(r["path"], r["threads"]): r for r in result["rows"]}
  fused = rows[("fused", 1)]
  return {"fused_params_per_core_s": fused["params_per_cpu_s"],
          "unfused_params_per_core_s": rows[("unfused", 1)]["params_per_cpu_s"],
          "fused_x_unfused": fused["speedup_per_core"]}


def _transport(rows) -> dict:
  return {f"{r['path']}_{r['codec']}_{op}_mb_s": r[f"{op}_mb_s"] for r in rows for op in ("push", "pull")}


def _wan(result) -> dict:
  return {f"{r['mode']}_util": r["compute_utilization"] for r in result["rows"]}


def _hetero(result) -> dict:
  rows = result["rows"]
  out = {f"{k}_goodput": v["goodput"] for k, v in rows.items()}
  if "all" in rows:
    out.update({f"{k}_loss_vs_k_all": v["eval_loss"] / rows["all"]["eval_loss"] for k, v in rows.items() if k != "all"})
  return out


def _chaos(result) -> dict:
  return {"ratio": result["ratio"], "diloco_goodput": result["diloco"]["goodput"],
          "diloco_predicted": result["diloco"]["predicted"], "dp_goodput": result["dp"]["goodput"],
          "dp_predicted": result["dp"]["predicted"],
          **{f"{k}_predicted_at_applied_rate": result[k].get("predicted_at_applied_rate") for k in ("diloco", "dp")}}


CHAOS_DIR = "runs/bench_suite_chaos"


def _chaos_repeat(k: int) -> tuple[str, ...]:
  """Repeat k is failure seed k in a workdir of its own; from the second on it reuses the first repeat's
  undisturbed Decoupled DiLoCo run (the schedule does not touch it: 3 to 4 minutes saved per repeat)."""
  first = REPO / CHAOS_DIR / "seed0" / "bench_chaos.json"
  reuse = (f"--diloco-reference={first}",) if k > 0 and first.exists() else ()
  return (f"--seed={k}", f"--workdir={CHAOS_DIR}/seed{k}", *reuse)


def _wan_paper(result) -> dict:
  return {f"{r['mode']}@{r['latency_ms']:g}ms_util": r["compute_utilization"] for r in result["rows"]}


BENCHES = (
    Bench("syncer", ("syncer", "--threads=1"), _syncer),
    Bench("syncer-int4", ("syncer", "--threads=1", "--downlink=int4"), _syncer),
    Bench("transport", ("transport", "--mb=64"), _transport),
    Bench("overhead", ("overhead", "--config=configs/small_cpu.py"), lambda r: {"ratio": r["ratio"]}),
    Bench("wan", ("wan", "--config=configs/tiny_cpu.py"), _wan),
    Bench("wan-paper", ("wan", "--config=configs/tiny_cpu.py", "--paper-link"), _wan_paper),
    Bench("hetero", ("hetero", "--config=configs/tiny_cpu.py"), _hetero, long=True,
          per_repeat=lambda k: (f"--config.seed={k}",)),
    # 1,500 steps took 7 to 31 failures per strategy at one every 15 s (tiny_cpu's own 60 steps: one or two).
    Bench("chaos", ("chaos", "--config=configs/tiny_cpu.py", "--config.train.steps=1500"), _chaos, long=True,
          per_repeat=_chaos_repeat),
)


def chosen(names: list[str]) -> list[Bench]:
  """The benches named (in the suite's order), `all`, or by default the quick ones; UsageError otherwise."""
  if names == ["all"]:
    return list(BENCHES)
  if not names:
    return [b for b in BENCHES if not b.long]
  known = {b.name for b in BENCHES}
  bad = [n for n in names if n not in known]
  if bad:
    raise cli.UsageError(f"--benches: unknown {bad}; expected some of {sorted(known)} or all")
  return [b for b in BENCHES if b.name in names]


def spread(runs: list[dict]) -> dict:
  """{figure: {"min", "median", "max", "n"}} over the runs that gave it."""
  names = dict.fromkeys(k for r in runs for k in r.get("figures", {}))
  out = {}
  for name in names:
    values = [r["figures"][name] for r in runs if isinstance(r.get("figures", {}).get(name), (int, float))]
    if values:
      out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values)}
  return out


def _json_of(stdout: str):
  """The JSON result a `bench ... --json` printed (anything before its first bracket is skipped)."""
  starts = [i for i in (stdout.find("{"), stdout.find("[")) if i >= 0]
  return json.loads(stdout[min(starts):]) if starts else None


def run_once(bench: Bench, timeout_s: float, repeat: int = 0) -> dict:
  """Repeat `repeat` of `bench` in a child process: its figures, raw result, wall time and load around it."""
  env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") +
                                     " --xla_force_host_platform_device_count=8").strip()}
  cmd = ([sys.executable, "-m", "diloco_jax", "bench", *bench.argv, *bench.per_repeat(repeat)]
         + ([] if bench.name == "chaos" else ["--json"]))
  load0, t0 = os.getloadavg(), time.monotonic()
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
  run = {"command": " ".join(cmd[1:]), "rc": proc.returncode, "wall_s": time.monotonic() - t0,
         "load_avg_before": load0, "load_avg_after": os.getloadavg()}
  if proc.returncode != 0:
    return {**run, "error": proc.stderr[-2000:]}
  try:
    raw = (json.loads((REPO / CHAOS_DIR / f"seed{repeat}" / "bench_chaos.json").read_text()) if bench.name == "chaos"
           else _json_of(proc.stdout))
    return {**run, "figures": bench.figures(raw), "raw": raw}
  except (ValueError, KeyError, TypeError, OSError) as e:
    return {**run, "error": f"unreadable result: {type(e).__name__}: {e}", "stdout": proc.stdout[-2000:]}


def _commit() -> dict:
  git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
  return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _flags(fv):
  flags.DEFINE_string("out", "runs/bench/figures.json", "the JSON file of figures", flag_values=fv)
  flags.DEFINE_integer("repeats", 1, "runs of each benchmark", flag_values=fv)
  flags.DEFINE_list("benches", [], "benchmarks to run, in the suite's order (default: the quick ones; all: "
                    f"every one): {', '.join(b.name for b in BENCHES)}", flag_values=fv)
  flags.DEFINE_float("timeout-s", 3600.0, "give up on one run after this long", flag_values=fv)


def bench_suite(argv) -> int:
  """`python -m diloco_jax bench suite`; see the module docstring."""
  fv = cli.parse(argv, _flags, doc=__doc__, config=False)
  if fv.repeats < 1:
    raise cli.UsageError(f"--repeats must be >= 1, got {fv.repeats}")
  benches = chosen(fv.benches)
  out = pathlib.Path(fv.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  doc = {**_commit(), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
         "cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "repeats": fv.repeats, "benches": {}}
  for bench in benches:
    runs = []
    for k in range(fv.repeats):
      print(f"bench suite: {bench.name} ({k + 1}/{fv.repeats}), load {os.getloadavg()[0]:.1f}", file=sys.stderr,
            flush=True)
      runs.append(run_once(bench, fv["timeout-s"].value, k))
      doc["benches"][bench.name] = {"runs": runs, "spread": spread(runs)}
      out.write_text(json.dumps(doc, indent=1, default=str) + "\n")  # what is done so far survives an interrupt
  doc["load_avg_end"] = os.getloadavg()
  out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
  for name, b in doc["benches"].items():
    for fig, s in b["spread"].items():
      print(f"{name:<12} {fig:<32} {s['min']:>14.4g} {s['median']:>14.4g} {s['max']:>14.4g}  (n={s['n']})")
    for r in b["runs"]:
      if "error" in r:
        print(f"{name:<12} FAILED: {r['error'].strip().splitlines()[-1] if r['error'].strip() else r['rc']}")
  print(f"figures: {out}")
  return 0

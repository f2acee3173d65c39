"""`bench quality --seeds N`: the pairs of N seeds summarized (mean and spread) and printed. Pure but for print.

The seeds' runs are matched pairs (data-parallel and Decoupled DiLoCo on the same seed's init and tokens), so
the ratio is taken per seed and then averaged, never as a ratio of means.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

# The figures averaged over seeds (and given a spread); the rest of a summary is the first seed's.
SUMMARIZED = ("dp_eval_loss", "diloco_eval_loss", "loss_ratio", "bytes_ratio", "dp_bytes_per_worker",
              "diloco_bytes_per_learner", "outer_rounds", "contributions_merged", "dp_wall_s", "diloco_wall_s")
RUNG_SUMMARIZED = ("eval_loss", "loss_ratio", "bytes_ratio", "outer_rounds", "wall_s")
# Each seed's run as listed under "seeds" (its curves stay in its workdir's metrics.jsonl).
PER_SEED = ("seed", "dp_eval_loss", "diloco_eval_loss", "loss_ratio", "bytes_ratio", "outer_rounds",
            "contributions_merged", "dp_wall_s", "diloco_wall_s")


def spread(values: Sequence[float]) -> dict:
  """Mean, min, median and max of `values` (at least one)."""
  if not values:
    raise ValueError("spread of no values")
  return {"mean": statistics.fmean(values), "min": min(values), "median": statistics.median(values),
          "max": max(values)}


def summarize(runs: Sequence[dict]) -> dict:
  """One budget's pairs over seeds (`quality.run_pair`'s dicts) as one: the `SUMMARIZED` figures are the
  seeds' means, `spread` holds each one's mean / min / median / max, `seeds` every run's figures, and (with
  a ladder) each rung's figures are the seeds' means with the spread of its loss ratio. Steps, tokens and
  curves are the first seed's (the token counts are the same for every seed)."""
  if not runs:
    raise ValueError("no runs to summarize")
  out = dict(runs[0])
  out["spread"] = {k: spread([float(r[k]) for r in runs]) for k in SUMMARIZED}
  out.update({k: v["mean"] for k, v in out["spread"].items()})
  out["seeds"] = [{k: r[k] for k in PER_SEED} for r in runs]
  if "ladder" in runs[0]:
    out["ladder"] = [
        {**rungs[0], **{k: statistics.fmean(float(x[k]) for x in rungs) for k in RUNG_SUMMARIZED},
         "loss_ratio_spread": spread([float(x["loss_ratio"]) for x in rungs])}
        for rungs in zip(*(r["ladder"] for r in runs))]
  return out


def print_seeds(summary: dict) -> None:
  """Every seed's pair, then the mean, min, median and max of each column."""
  cols = (("DP loss", "dp_eval_loss", ".4f"), ("DiLoCo loss", "diloco_eval_loss", ".4f"),
          ("ratio", "loss_ratio", ".4f"), ("bytes ratio", "bytes_ratio", ".1f"), ("rounds", "outer_rounds", ".0f"),
          ("pushes", "contributions_merged", ".0f"))
  print(f"\n{'seed':>8}" + "".join(f"{name:>13}" for name, _, _ in cols))
  for run in summary["seeds"]:
    print(f"{run['seed']:>8}" + "".join(f"{run[key]:>13{fmt}}" for _, key, fmt in cols))
  for stat in ("mean", "min", "median", "max"):
    print(f"{stat:>8}" + "".join(f"{summary['spread'][key][stat]:>13{fmt}}" for _, key, fmt in cols))
  ratio = summary["spread"]["loss_ratio"]
  print(f"\nDiLoCo / data-parallel over {len(summary['seeds'])} seeds: mean {ratio['mean']:.4f} "
        f"({100 * (ratio['mean'] - 1):+.1f}%), min {ratio['min']:.4f}, median {ratio['median']:.4f}, "
        f"max {ratio['max']:.4f}; bytes ratio {summary['spread']['bytes_ratio']['min']:.1f}x to "
        f"{summary['spread']['bytes_ratio']['max']:.1f}x")

"""`bench quality --frontier FILE.jsonl [--label NAME]`: the loss-against-bytes frontier of every method tried.

Each run appends one point per budget to FILE (its label, the seeds' loss ratios: mean, min, max, and the
mean bytes ratio) and redraws `FILE` with `.png` for `.jsonl`: loss ratio against bytes ratio (log), one
marker per point with its seeds' range, so a user can pick the trade-off. docs/benchmarks.md, "Frontier".
"""

from __future__ import annotations

import json
import pathlib


def point(label: str, budget: int, summary: dict) -> dict:
  """One budget's summary (`seeds.summarize`) as a frontier point."""
  ratio = summary["spread"]["loss_ratio"]
  return {"label": label, "steps": summary["steps"], "budget": budget, "seeds": len(summary["seeds"]),
          "loss_ratio": ratio["mean"], "loss_ratio_min": ratio["min"], "loss_ratio_max": ratio["max"],
          "bytes_ratio": summary["spread"]["bytes_ratio"]["mean"]}


def append(path: str, points: list[dict]) -> list[dict]:
  """Append `points` to the JSONL file at `path` (created); returns every point it holds."""
  p = pathlib.Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  with p.open("a") as f:
    for x in points:
      f.write(json.dumps(x) + "\n")
  return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def plot(points: list[dict], path: str) -> str:
  """Loss ratio (mean, bars to min and max over seeds) against bytes ratio, one labelled marker per point."""
  import matplotlib  # noqa: PLC0415 - lazy: only this output needs it, and it adds a second to the import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use, as above

  fig, ax = plt.subplots(figsize=(10, 4.8))
  markers = "osD^vP*X"
  for i, x in enumerate(points):
    ax.errorbar([x["bytes_ratio"]], [x["loss_ratio"]], fmt=markers[i % len(markers)], ms=6, capsize=3,
                yerr=[[x["loss_ratio"] - x["loss_ratio_min"]], [x["loss_ratio_max"] - x["loss_ratio"]]],
                label=f"{x['label']} ({x['steps']} steps, {x['seeds']} seeds)")
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  ax.axhline(1.0, color="gray", lw=0.8)
  ax.set_xscale("log")
  ax.set_xlabel("bytes ratio (data-parallel / Decoupled DiLoCo, per worker)")
  ax.set_ylabel("eval loss ratio (DiLoCo / data-parallel)")
  ax.set_title("loss against bytes: every method tried")
  ax.grid(True, alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

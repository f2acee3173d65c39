"""PNG figures for the simulator (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from diloco_jax.sim import bandwidth, goodput  # noqa: E402


def plot_goodput(rows: Sequence[dict], path: str) -> str:
  """Goodput against chips, one line per strategy (with 95% CI bars), published values dashed."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  keys = []
  for r in rows:
    if (r["strategy"], r["learners"]) not in keys:
      keys.append((r["strategy"], r["learners"]))
  for i, (strategy, m) in enumerate(keys):
    mine = [r for r in rows if (r["strategy"], r["learners"]) == (strategy, m)]
    chips = [r["chips"] for r in mine]
    color = f"C{i}"
    ax.errorbar(chips, [100 * r["goodput"] for r in mine], yerr=[100 * r["goodput_ci"] for r in mine],
                marker="o", color=color, capsize=3, label=goodput.row_label(strategy, m))
    if all(r.get("published") is not None for r in mine):
      ax.plot(chips, [r["published"] for r in mine], ls="--", marker="x", color=color, alpha=0.6)
  ax.set_xscale("log")
  ax.set_xlabel("chips (per-chip MTBI 1 year)")
  ax.set_ylabel("goodput (%)")
  ax.set_title("Simulated goodput (solid) vs published (dashed)")
  ax.set_ylim(0, 100)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="lower left")
  return _save(fig, path)


def plot_bandwidth(cfg: bandwidth.BandwidthConfig, path: str, points: int = 60) -> str:
  """Required WAN Gbps against target compute utilization, one line per method (log scale)."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  us = [0.3 + 0.69 * i / (points - 1) for i in range(points)]
  for method in bandwidth.METHODS:
    ax.plot([100 * u for u in us], [bandwidth.required_gbps(cfg, method, u) for u in us],
            label=bandwidth.LABELS[method])
  for method, gbps in bandwidth.PUBLISHED_STREAMING_95.items():
    ax.plot([95], [gbps], marker="x", color="k", ls="none")
  ax.set_yscale("log")
  ax.set_xlabel("compute utilization (%)")
  ax.set_ylabel("required WAN bandwidth (Gbit/s)")
  ax.set_title(f"{cfg.params / 1e9:g}B params, {cfg.step_s:g} s/step, H={cfg.inner_steps}, "
               f"P={cfg.fragments}, tau={cfg.tau}, {cfg.sites} sites (x: published)", fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

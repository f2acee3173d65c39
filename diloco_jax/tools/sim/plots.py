"""PNG figures for the simulator (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import os
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

from diloco_jax.tools.sim import bandwidth, goodput  # noqa: E402


def goodput_labels(mtbi_years: float, with_published: bool) -> tuple[str, str]:
  """(x label, title) of the goodput plot: the run's own MTBI; "published" only when some are drawn."""
  xlabel = f"chips (per-chip MTBI {mtbi_years:g} year{'' if mtbi_years == 1 else 's'})"
  title = ("Simulated goodput (solid, 95% CI) vs published (dashed)" if with_published
           else "Simulated goodput (95% CI); no published values for this setting")
  return xlabel, title


def bandwidth_labels(cfg: bandwidth.BandwidthConfig) -> tuple[str, str, dict]:
  """(y label, title, published markers {(method, utilization): Gbps}) of the bandwidth plot: markers only
  in the published setting."""
  markers = dict(bandwidth.PUBLISHED_STREAMING) if bandwidth.published_mismatch(cfg) is None else {}
  title = (f"{cfg.params / 1e9:g}B params, {cfg.step_s:g} s/step, H={cfg.inner_steps}, P={cfg.fragments}, "
           f"tau={cfg.tau}, {cfg.sites} sites" + (" (x: published)" if markers else ""))
  return "required WAN bandwidth per site, each way (Gbit/s)", title, markers


def plot_goodput(rows: Sequence[dict], path: str, mtbi_years: float) -> str:
  """Goodput against chips, one line per row (with 95% CI bars); published values dashed where they apply."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  labels = list(dict.fromkeys(goodput.label(r) for r in rows))
  any_published = False
  for i, label in enumerate(labels):
    mine = [r for r in rows if goodput.label(r) == label]
    chips = [r["chips"] for r in mine]
    color = f"C{i}"
    ax.errorbar(chips, [100 * r["goodput"] for r in mine], yerr=[100 * r["goodput_ci"] for r in mine],
                marker="o", color=color, capsize=3, label=label)
    published = [(r["chips"], r["published"]) for r in mine if r.get("published") is not None]
    if published:
      any_published = True
      ax.plot(*zip(*published), ls="--", marker="x", color=color, alpha=0.6)
  ax.set_xscale("log")
  xlabel, title = goodput_labels(mtbi_years, any_published)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("goodput (%)")
  ax.set_title(title)
  ax.set_ylim(0, 100)
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize=8, loc="lower left")
  return _save(fig, path)


def plot_bandwidth(cfg: bandwidth.BandwidthConfig, path: str, points: int = 60) -> str:
  """Required WAN Gbps against target compute utilization, one line per method (log scale); the published
  cells as crosses when `cfg` is their setting."""
  fig, ax = plt.subplots(figsize=(7, 4.5))
  us = [0.3 + 0.69 * i / (points - 1) for i in range(points)]
  for method in bandwidth.METHODS:
    ax.plot([100 * u for u in us], [bandwidth.required_gbps(cfg, method, u) for u in us],
            label=bandwidth.LABELS[method])
  ylabel, title, markers = bandwidth_labels(cfg)
  for (_, u), gbps in markers.items():
    ax.plot([100 * u], [gbps], marker="x", color="k", ls="none")
  ax.set_yscale("log")
  ax.set_xlabel("compute utilization (%)")
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  ax.grid(True, which="both", alpha=0.3)
  ax.legend(fontsize=8)
  return _save(fig, path)


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path

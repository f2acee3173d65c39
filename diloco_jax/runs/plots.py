"""The figures of runs' metrics (PNGs, readable at a glance), drawn at the end of `train`, `baseline` and
`local` into `<workdir>/plots`, and by the `plot` command (tools/plot.py) for any runs side by side.

  eval_loss.png  eval loss against tokens: each DiLoCo run's global model, and each baseline's model
  step_rate.png  inner steps per second of each learner (and each baseline) over wall time
  versions.png   each fragment's version over wall time (`syncer/metrics.jsonl`)
  bytes.png      bytes on the wire per learner against the run's tokens, with the data-parallel all-reduce
                 bytes per worker (a baseline run's, else computed for the DiLoCo run's devices)

A figure with nothing to show for any run is not written.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence

from diloco_jax import cli
from diloco_jax import metrics as metrics_lib

FIGURES = ("eval_loss", "step_rate", "versions", "bytes")


@dataclasses.dataclass
class Run:
  """The metrics of one run directory, as read from its files."""

  path: pathlib.Path
  kind: str  # "diloco" | "baseline"
  config: dict | None  # config.json, as plain JSON
  records: dict[str, list[dict]]  # "global", "syncer", "baseline", "learner_<i>" -> JSONL records
  params: int | None  # model parameters, from a summary (None while the run has none)

  @property
  def label(self) -> str:
    return f"{self.path.name} ({'Decoupled DiLoCo' if self.kind == 'diloco' else 'data-parallel'})"

  def learners(self) -> list[tuple[str, list[dict]]]:
    return sorted(((k, v) for k, v in self.records.items() if k.startswith("learner_")),
                  key=lambda kv: int(kv[0].split("_")[1]))


def _read(path: pathlib.Path) -> list[dict]:
  """The complete records of a JSONL file (a line being written is skipped); [] if there is none."""
  if not path.exists():
    return []
  out = []
  for line in path.read_text().splitlines():
    try:
      out.append(json.loads(line))
    except ValueError:
      continue
  return out


def _json(path: pathlib.Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError):
    return None


def load_run(path: str | pathlib.Path) -> Run:
  """Reads a run directory; ValueError if it holds no metrics of either kind."""
  path = pathlib.Path(path)
  learner_dirs = sorted(p for p in path.glob("learner_*") if p.is_dir())
  config = _json(path / "config.json")
  summary = _json(path / "summary.json") or {}
  if learner_dirs:
    records = {d.name: _read(d / "metrics.jsonl") for d in learner_dirs}
    records["global"] = _read(path / "global" / "metrics.jsonl")
    records["syncer"] = _read(path / "syncer" / "metrics.jsonl")
    summaries = [summary] + [_json(d / "summary.json") or {} for d in learner_dirs] + summary.get("learners", [])
    params = next((s["params"] for s in summaries if isinstance(s, dict) and s.get("params")), None)
    return Run(path, "diloco", config, records, params)
  if (path / "metrics.jsonl").exists():
    return Run(path, "baseline", config, {"baseline": _read(path / "metrics.jsonl")}, summary.get("params"))
  raise ValueError(f"{path}: no metrics (expected learner_<i>/metrics.jsonl or metrics.jsonl)")


def _pyplot():
  import matplotlib  # noqa: PLC0415 - lazy: only drawing needs matplotlib, and it takes a while to import

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use, as above

  return plt


def _start(run: Run) -> float:
  times = [r["time"] for records in run.records.values() for r in records if "time" in r]
  return min(times) if times else 0.0


def _eval_loss(ax, runs: Sequence[Run]) -> bool:
  drawn = False
  for i, run in enumerate(runs):
    records = run.records["global"] if run.kind == "diloco" else run.records["baseline"]
    points = [(r["tokens"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if points:
      ax.plot(*zip(*sorted(points)), marker="o", ms=3, color=f"C{i}", label=run.label)
      drawn = True
  ax.set_xlabel("tokens (DiLoCo: merged into the global model)")
  ax.set_ylabel("eval loss (nats per token)")
  ax.set_title("The trained model's eval loss")
  return drawn


def _rates(records: list[dict], t0: float) -> list[tuple[float, float]]:
  """(seconds since t0, steps per second since the previous record) of a trainer's records."""
  out, prev = [], None
  for r in records:
    if "step" not in r or "time" not in r or "loss" not in r:
      continue
    if prev is not None and r["time"] > prev["time"] and r["step"] > prev["step"]:
      out.append((r["time"] - t0, (r["step"] - prev["step"]) / (r["time"] - prev["time"])))
    prev = r
  return out


def _step_rate(ax, runs: Sequence[Run]) -> bool:
  drawn = False
  styles = ["-", "--", ":", "-."]
  for i, run in enumerate(runs):
    t0 = _start(run)
    series = run.learners() if run.kind == "diloco" else [("baseline", run.records["baseline"])]
    for j, (name, records) in enumerate(series):
      points = _rates(records, t0)
      if points:
        # A colour per learner (as in bytes.png); a baseline in black, never a learner's colour.
        ax.plot(*zip(*points), ls=styles[i % len(styles)], color="k" if run.kind == "baseline" else f"C{j}",
                marker=".",
                label=f"{run.path.name}: {name.replace('_', ' ')}")
        drawn = True
  ax.set_xlabel("wall time since the run's first record (s)")
  ax.set_ylabel("inner steps per second")
  ax.set_title("Step rate of each learner")
  return drawn


def _versions(ax, runs: Sequence[Run]) -> bool:
  drawn = False
  styles = ["-", "--", ":", "-."]
  for i, run in enumerate(runs):
    records = [r for r in run.records.get("syncer", []) if r.get("versions")]
    if not records:
      continue
    t0 = _start(run)
    for p in range(len(records[-1]["versions"])):
      points = [(r["time"] - t0, r["versions"][p]) for r in records if len(r["versions"]) > p]
      ax.step(*zip(*points), where="post", ls=styles[i % len(styles)], color=f"C{p}",
              label=f"{run.path.name}: fragment {p}")
      drawn = True
  ax.set_xlabel("wall time since the run's first record (s)")
  ax.set_ylabel("global version")
  ax.yaxis.get_major_locator().set_params(integer=True)
  ax.set_title("Fragment versions (outer steps) over time")
  return drawn


def _dp_reference(run: Run) -> tuple[str, list[tuple[float, float]]] | None:
  """The computed data-parallel all-reduce bytes per worker on a DiLoCo run's devices, over its tokens."""
  c = run.config
  if not c or not run.params:
    return None
  workers = c["learners"]["num"] * c["learners"]["devices"]
  per_step = metrics_lib.ring_allreduce_bytes(run.params, workers)
  tokens_per_step = c["data"]["global_batch"] * c["data"]["seq_len"]
  steps = c["train"]["steps"]
  return (f"data-parallel all-reduce per worker (computed, {workers} workers)",
          [(s * tokens_per_step, s * per_step) for s in (1, steps)])


def _bytes(ax, runs: Sequence[Run]) -> bool:
  drawn = False
  styles = ["-", "--", ":", "-."]
  baselines = [r for r in runs if r.kind == "baseline"]
  for i, run in enumerate(runs):
    if run.kind == "baseline":
      points = [(r["tokens"], r["comm_bytes"]) for r in run.records["baseline"] if r.get("comm_bytes")]
      if points:
        ax.plot(*zip(*points), color="k", ls="--", label=f"{run.path.name}: all-reduce per worker")
        drawn = True
      continue
    learners = run.learners()
    for j, (_, records) in enumerate(learners):
      # A learner reads 1/M of the run's batch: its tokens times M are the run's.
      points = [(r["tokens"] * len(learners), r["comm_bytes"]) for r in records if r.get("comm_bytes")]
      if points:  # a colour per learner, as in the step rates; a line style per run
        ax.plot(*zip(*points), color=f"C{j}", ls=styles[i % len(styles)], lw=1,
                label=f"{run.path.name}: learner {j}")
        drawn = True
    reference = None if baselines else _dp_reference(run)
    if reference is not None and drawn:
      label, points = reference
      ax.plot(*zip(*points), color="k", ls=":", label=label)
  ax.set_yscale("log")
  ax.set_xlabel("tokens (the whole run's)")
  ax.set_ylabel("bytes on the wire (sent + received)")
  ax.set_title("Bytes on the wire: per learner vs data-parallel per worker")
  return drawn


_DRAW = {"eval_loss": _eval_loss, "step_rate": _step_rate, "versions": _versions, "bytes": _bytes}


def write_plots(run_dirs: Sequence[str | pathlib.Path], out: str | pathlib.Path) -> list[pathlib.Path]:
  """Draws every figure that has something to show for `run_dirs` into `out`; returns the files written."""
  runs = [load_run(d) for d in run_dirs]
  plt = _pyplot()
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name in FIGURES:
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    if _DRAW[name](ax, runs):
      ax.grid(True, alpha=0.3)
      ax.legend(fontsize=7)
      fig.tight_layout()
      fig.savefig(out / f"{name}.png", dpi=100)
      written.append(out / f"{name}.png")
    plt.close(fig)
  return written


def outputs(workdir: str | pathlib.Path, command: str) -> str:
  """Writes the run's plots into `<workdir>/plots` and returns the lines that say where its TensorBoard
  logs and plots are (the last lines of `train`, `baseline` and `local`)."""
  workdir = pathlib.Path(workdir)
  try:
    written = write_plots([workdir], workdir / "plots")
    plots = f"plots: {', '.join(cli.shown(p) for p in written)}" if written else "plots: nothing to plot yet"
  except Exception as e:  # noqa: BLE001 - a figure must not fail the run that produced the data
    plots = f"{command}: could not write the plots: {type(e).__name__}: {e}"
  where = cli.shown(workdir)
  return (f"TensorBoard logs: {where} (view: tensorboard --logdir {where}; "
          f"overlay runs: --logdir of their parent directory)\n{plots} "
          f"(others: python -m diloco_jax plot {where} [RUN ...])")


"""`python -m diloco_jax plot RUN [RUN ...] [--out DIR]`: PNGs of the runs' metrics, readable at a glance.

  python -m diloco_jax plot runs/default runs/dp --out runs/compare

A RUN is the workdir of `local` or `train` (Decoupled DiLoCo: `learner_<i>/`, `global/`, `syncer/`) or of
`baseline` (data-parallel: `metrics.jsonl` at its top); it may still be running. Written to `--out`
(default `<first RUN>/plots`): `eval_loss.png`, `step_rate.png`, `versions.png` and `bytes.png`, what each
shows in docs/observability.md, "Plots". A figure with nothing to show for any RUN (e.g. versions for a
baseline alone) is not written.
"""

from __future__ import annotations

import pathlib
import sys

from absl import flags

from diloco_jax import cli
from diloco_jax.runs import plots


def _flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("out", None, "directory for the PNGs (default <first RUN>/plots)", flag_values=fv)


def plot_runs(argv) -> int:
  """`python -m diloco_jax plot RUN [RUN ...] [--out DIR]`; see the module docstring."""
  fv, runs = cli.parse_with_args(argv, _flags, doc=__doc__, config=False)
  if not runs:
    raise cli.UsageError("name at least one RUN directory (the workdir of local, train or baseline)")
  try:
    written = plots.write_plots(runs, fv.out or pathlib.Path(runs[0]) / "plots")
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  for path in written:
    print(path)
  if not written:
    print("plot: nothing to plot in " + ", ".join(runs), file=sys.stderr)
    return 1
  return 0

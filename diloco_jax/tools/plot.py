"""`python -m diloco_jax plot RUN [RUN ...] [--out DIR]`: PNGs of the runs' metrics, readable at a glance.

  python -m diloco_jax plot runs/default runs/dp --out runs/compare

A RUN is the workdir of `local` or `train` (Decoupled DiLoCo: `learner_<i>/`, `global/`, `syncer/`) or of
`baseline` (data-parallel: `metrics.jsonl` at its top); it may still be running. Written to `--out`
(default `<first RUN>/plots`):

  eval_loss.png  eval loss against tokens: each DiLoCo run's global model (`global/metrics.jsonl`, tokens
                 merged) and each baseline's model, overlaid
  step_rate.png  inner steps per second of each learner (and each baseline) over wall time
  versions.png   each fragment's version over wall time (`syncer/metrics.jsonl`)
  bytes.png      bytes on the wire per learner against the run's tokens, with the data-parallel all-reduce
                 bytes per worker: a baseline RUN's, else computed for the DiLoCo run's devices
                 (2 (n-1)/n x 4 bytes x params per step, n = learners.num x learners.devices)

A figure with nothing to show for any RUN (e.g. versions for a baseline alone) is not written.
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

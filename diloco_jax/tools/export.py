r"""`python -m diloco_jax export`: the global model of a syncer's checkpoint, as a model directory
(`runs/export.py` says what it holds) that `eval` and `sample` load.

  python -m diloco_jax export --syncer-workdir runs/x/syncer --config configs/small_cpu.py --run-id local \
      --out runs/x/model

It exports from a syncer's checkpoint directory on request (a running syncer's latest periodic checkpoint,
or a stopped one's final); `train`, `baseline` and `local` export at their end themselves. The config (its
`--config.x=y` overrides) and `--run-id` must be the run's: they make the fingerprint the checkpoint is
checked against. `--out` may be a gs:// path.
"""

from __future__ import annotations

import sys

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax.runs import export as export_lib


def export_model(argv) -> int:
  """`python -m diloco_jax export --syncer-workdir DIR --config C [--run-id R] --out DIR`."""
  fv = cli.parse(argv, command_flags.export, doc=__doc__)
  config = cli.validated(fv.config, None, learners=True, data=False)
  run_id = fv["run-id"].value
  try:
    found = export_lib.syncer_params(config, fv["syncer-workdir"].value.split(","), run_id)
  except ValueError as e:
    raise cli.UsageError(f"--config/--run-id: {e}") from None
  if found is None:
    raise cli.UsageError(f"--syncer-workdir: no syncer checkpoint in {fv['syncer-workdir'].value!r}")
  params, info = found
  try:
    out = export_lib.export(fv.out, config, params, source="syncer checkpoint", run_id=run_id,
                            syncer_checkpoint_step=info["step"], rounds=info["rounds"], versions=info["versions"])
  except config_lib.ConfigError as e:  # the tokenizer the config names is missing or does not match
    raise cli.UsageError(str(e)) from None
  print(f"export: global model of checkpoint step {info['step']} ({info['rounds']} rounds, versions "
        f"{info['versions']}) -> {out}", file=sys.stderr)
  return 0

"""`python -m diloco_jax sim <name> [flags]`: the scale simulator, the bandwidth planner and the sizing of
a run's machines.

  goodput    goodput and uptime of data-parallel, elastic data-parallel and Decoupled DiLoCo under
             failures and mixed hardware; the paper's table and its three quorum settings
  bandwidth  the WAN bandwidth each method needs for a target compute utilization
  sizing     a config's syncer memory and disk, bytes per learner and outer period (`sim/sizing.py`)
  syncer     the syncer's memory, ingest rate and shard count for every shipped config and several M

Examples:
  python -m diloco_jax sim goodput --table
  python -m diloco_jax sim goodput --chips 1200000 --learners 8 --strategy dp,elastic,diloco
  python -m diloco_jax sim goodput --quorum-settings all,k1,k1grace --groups 0.847:4,1:4 --step-cv 0.1 \
      --mtbi-years 1e9
  python -m diloco_jax sim bandwidth --params 70e9 --step-s 2 --sites 4
  python -m diloco_jax sim sizing --config configs/b1.py --learners 8 --step-s 0.33
  python -m diloco_jax sim syncer --learners 2,4,8 --step-s 1

`python -m diloco_jax sim <name> --help` lists its flags. Progress goes to stderr; tables (or JSON with
--json) to stdout; PNG plots to --out (default runs/sim).
"""

from __future__ import annotations

import math
import sys

from absl import flags

from diloco_jax import cli, subcommands

SIMULATORS = {"goodput": "diloco_jax.tools.sim.goodput_cli", "bandwidth": "diloco_jax.tools.sim.bandwidth_cli",
              "sizing": "diloco_jax.tools.sim.sizing", "syncer": "diloco_jax.tools.sim.syncer_cli"}


def progress(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def definer(fv: flags.FlagValues):
  """`define(kind, name, default, help)`: absl's DEFINE_<kind> on `fv` (the simulators define many flags)."""
  return lambda kind, name, default, help_: getattr(flags, f"DEFINE_{kind}")(name, default, help_, flag_values=fv)


def numbers(fv, name: str, kind=float) -> list:
  """A comma-list flag (`flags.DEFINE_list`) as numbers; a bad element is a usage error naming the flag."""
  values = []
  for text in fv[name].value:
    try:
      x = float(text)
    except ValueError:
      x = math.nan
    if not math.isfinite(x) or (kind is int and not x.is_integer()):
      what = "integers" if kind is int else "numbers"
      raise cli.UsageError(f"--{name} must be a comma list of {what}, got {','.join(fv[name].value)!r}")
    values.append(kind(x))
  return values


def parse_groups(text: str) -> tuple[tuple[float, int], ...]:
  """`--groups SPEED:LEARNERS[,SPEED:LEARNERS...]` (e.g. 0.847:4,1:4) as ((speed, learners), ...)."""
  groups = []
  for part in (x for x in text.split(",") if x.strip()):
    try:
      speed, count = part.split(":")
      groups.append((float(speed), int(count)))
    except ValueError:
      raise cli.UsageError(f"--groups must be SPEED:LEARNERS[,SPEED:LEARNERS...], e.g. 0.847:4,1:4; "
                           f"got {text!r}") from None
  return tuple(groups)


def main(argv) -> int:
  return subcommands.dispatch(SIMULATORS, list(argv), __doc__, what="simulator")

"""Flag helpers shared by the simulator commands (and `bench hetero`'s --groups): absl flag definitions in
one line, comma lists of numbers, speed groups, progress lines on stderr."""

from __future__ import annotations

import math
import sys

from absl import flags

from diloco_jax import cli


def progress(message: str) -> None:
  """A progress line on stderr (stdout holds the tables or JSON)."""
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


"""Flag helpers shared by the simulator commands (and `bench hetero`'s --groups): absl flag definitions in
one line, comma lists of numbers, speed groups, progress lines on stderr."""

from __future__ import annotations

import math
import sys

from absl import flags

from diloco_jax import cli
from diloco_jax.outer import chunked


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


def sim_syncer(fv: flags.FlagValues) -> None:
  """`sim syncer`'s flags (tools/sim/syncer_cli.py, which loads jax): here, so that its --help does not."""
  define = definer(fv)
  define("list", "configs", [], "Config files (comma list; default: every configs/*.py of this repository).")
  define("list", "learners", ["2", "4", "8"], "M values (comma list of integers >= 1).")
  define("float", "step-s", 1.0, "Inner step time in seconds (every config, every M).")
  define("integer", "shards", 2, "Shard count for the per-shard and total memory columns.")
  define("float", "merge-rate", 0.0, "Parameters absorbed per second per core; 0: from --bench-syncer, else "
         "measured here (`bench syncer`, fused, 1 thread, for the config's downlink: fp32 or quantized).")
  define("string", "bench-syncer", "", "A `bench syncer --json` result, or `make bench`'s figures file "
         "(runs/bench/figures.json): the merge rates per core it measured.")
  define("integer", "cores-per-shard", 32, "Cores of a shard's host (merge threads: syncer.merge_threads, or "
         f"with 0 these cores up to {chunked.DEFAULT_THREAD_LIMIT}).")
  define("float", "host-memory-gb", 256.0, "Memory of a shard's host, GB (default: an n2-highmem-32, 32 vCPUs "
         "and 256 GB, a syncer machine of launch/tpu/presets.sh).")
  define("bool", "json", False, "Print JSON instead of a table.")

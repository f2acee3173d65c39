"""`python -m diloco_jax bench <name> [flags]`: benchmarks that print figures.

  step       tokens/s of the jitted inner step and its FLOP rate against a measured matmul rate
  quality    data-parallel vs Decoupled DiLoCo on the same token budget: eval loss and bytes
  overhead   a learner's tokens/s with its outer loop active against the bare inner step
  transport  fragment push/pull throughput over loopback gRPC against a raw socket copy
  wan        compute utilization on an emulated slow link, staggered fragments vs all-at-once

Each benchmark is a module `diloco_jax.bench.<name>` with `main(argv)`.
"""

import importlib
import sys

BENCHMARKS = ("step", "quality", "overhead", "transport", "wan")


def main(argv) -> int:
  if len(argv) < 2 or argv[1] in ("-h", "--help"):
    print(__doc__)
    return 0
  name = argv[1]
  if name not in BENCHMARKS:
    print(f"unknown benchmark {name!r}; expected one of: {', '.join(BENCHMARKS)}", file=sys.stderr)
    return 2
  module = importlib.import_module(f"diloco_jax.bench.{name}")
  return module.main([f"{argv[0]} {name}"] + list(argv[2:])) or 0

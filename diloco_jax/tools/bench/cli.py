"""`python -m diloco_jax bench <name> [flags]`: benchmarks that print figures.

  step       tokens/s of the jitted inner step and its FLOP rate against a measured matmul rate
  quality    data-parallel vs Decoupled DiLoCo on the same token budget: eval loss and bytes (--ladder:
             the gap split by part)
  overhead   a learner's tokens/s with its outer loop active against the bare inner step
  transport  fragment push/pull throughput over loopback gRPC against a raw socket copy
  wan        compute utilization on an emulated slow link, staggered fragments vs all-at-once
  syncer     parameters the syncer absorbs per second (merge, outer step, downlink) against memory speed
  multihost  a learner spanning several processes against one process on the same devices
  chaos      goodput under one failure schedule: Decoupled DiLoCo vs data-parallel vs the simulator
  hetero     mixed-speed learners: goodput and quality of K = M, K = 1 and K = 1 + grace, beside the
             simulator, the data-parallel baseline and the paper

Each benchmark is a module `diloco_jax.tools.bench.<name>` with `main(argv)`.
"""

from diloco_jax import subcommands

BENCHMARKS = {name: f"diloco_jax.tools.bench.{name}" for name in ("step", "quality", "overhead", "transport", "wan",
                                                             "syncer", "multihost", "chaos", "hetero")}


def main(argv) -> int:
  return subcommands.dispatch(BENCHMARKS, list(argv), __doc__, what="benchmark")

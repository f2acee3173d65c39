"""The one command line: `python -m diloco_jax <command> [flags]`.

Commands:
  train     Decoupled DiLoCo: M learners on slices of this process's devices, with the syncer core.
  baseline  Synchronous data-parallel training of the same model and data, for comparisons.
  syncer    The gRPC syncer service.
  learner   One learner process talking to a gRPC syncer.
  local     A syncer and N learner processes on this machine.
  chaos     The same under a seeded fault schedule (kills, stops, cut-offs, syncer restarts), with a report.
  sim       Scale simulator and bandwidth planner (goodput, bandwidth).
  bench     Benchmarks that print figures (step, quality, overhead, transport, wan).

Each command's module exposes `main(argv)`; `python -m diloco_jax <command> --help` lists its flags.
"""

import sys

from diloco_jax import subcommands

COMMANDS = {
    "train": "diloco_jax.inprocess",
    "baseline": "diloco_jax.baseline",
    "syncer": "diloco_jax.syncer.app",
    "learner": "diloco_jax.learner.process",
    "local": "diloco_jax.launch_local",
    "chaos": "diloco_jax.chaos",
    "sim": "diloco_jax.sim.cli",
    "bench": "diloco_jax.bench.cli",
}


PROGRAM = "python -m diloco_jax"


def main(argv=None) -> int:
  """Runs `argv[1]`'s command with the rest of `argv`; every command's --help names it as PROGRAM does."""
  argv = list(sys.argv if argv is None else argv)
  return subcommands.dispatch(COMMANDS, [PROGRAM] + argv[1:], __doc__)


if __name__ == "__main__":
  sys.exit(main())

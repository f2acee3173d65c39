"""The one command line: `python -m diloco_jax <command> [flags]`.

Commands:
  train     Decoupled DiLoCo: M learners on slices of this process's devices, with the syncer core.
  baseline  Synchronous data-parallel training of the same model and data, for comparisons.
  syncer    The gRPC syncer service.
  learner   One learner process talking to a gRPC syncer.
  local     A syncer, the global model's evaluator and N learner processes on this machine.
  chaos     The same under a seeded fault schedule (kills, stops, cut-offs, syncer restarts), with a report.
  evaluator The global model's eval curve, from a gRPC syncer (an observer: it never joins).
  status    What a running syncer is doing: learners, fragments, counters, goodput (--watch).
  plot      PNGs of runs' metrics: eval loss vs tokens, step rates, versions, bytes on the wire.
  sim       Scale simulator and bandwidth planner (goodput, bandwidth).
  bench     Benchmarks that print figures (step, quality, overhead, transport, wan).
  tokenizer Train a SentencePiece tokenizer on text.
  tokenize  Pre-tokenize text into ArrayRecord shards (data.format="array_record").
  export    Export the global model of a syncer's checkpoint (params, config, tokenizer).
  eval      Loss of exported models (nats per token, bits per byte) on the eval set or any text.
  sample    Generate text from an exported model.

Each command's module exposes `main(argv)`; `python -m diloco_jax <command> --help` lists its flags.
"""

import sys

from diloco_jax import subcommands

COMMANDS = {
    "train": "diloco_jax.runs.inprocess",
    "baseline": "diloco_jax.runs.baseline",
    "syncer": "diloco_jax.syncer.app",
    "learner": "diloco_jax.learner.process",
    "local": "diloco_jax.runs.local",
    "evaluator": "diloco_jax.evaluator.process",
    "status": "diloco_jax.tools.status",
    "plot": "diloco_jax.runs.plots",
    "chaos": "diloco_jax.tools.chaos",
    "sim": "diloco_jax.tools.sim.cli",
    "bench": "diloco_jax.tools.bench.cli",
    "tokenizer": "diloco_jax.data.tokenizer",
    "tokenize": "diloco_jax.data.shards",
    "export": "diloco_jax.runs.export",
    "eval": "diloco_jax.tools.evaluate",
    "sample": "diloco_jax.tools.sample",
    "replay": "diloco_jax.tools.replay",
}


PROGRAM = "python -m diloco_jax"


def main(argv=None) -> int:
  """Runs `argv[1]`'s command with the rest of `argv`; every command's --help names it as PROGRAM does."""
  argv = list(sys.argv if argv is None else argv)
  return subcommands.dispatch(COMMANDS, [PROGRAM] + argv[1:], __doc__)


if __name__ == "__main__":
  sys.exit(main())

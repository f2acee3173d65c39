"""The one table of `python -m diloco_jax <command> [flags]`, and its dispatch.

Each entry names the function that runs the command ("module:function", called with the command's argv,
argv[0] being e.g. "python -m diloco_jax bench step") and one line of help. A module is imported only when
its command runs, so `--help` of the table imports no jax. `bench` and `sim` are groups of subcommands.
`python -m diloco_jax <command> --help` lists a command's flags.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import pathlib
import sys

from diloco_jax import cli

PROGRAM = "python -m diloco_jax"


@dataclasses.dataclass(frozen=True)
class Command:
  """A command: `target` is "module:function" (the function takes argv and returns an exit status).
  `flags`: for a command whose module loads jax, "module:function" of a light module that defines its flags
  (`config`: whether it takes --config), so that its --help imports neither the command's module nor jax."""

  target: str
  help: str
  flags: str = ""
  config: bool = True


@dataclasses.dataclass(frozen=True)
class Group:
  """A command made of subcommands (`bench <name>`, `sim <name>`)."""

  help: str
  what: str  # the word for one subcommand, in the error for an unknown one
  commands: dict[str, Command]
  epilog: str = ""


BENCH = Group("benchmarks that print figures", "benchmark", {
    "step": Command("diloco_jax.tools.bench.step:bench_step",
                    "tokens/s of the jitted inner step and its FLOP rate against a measured matmul rate",
                    flags="diloco_jax.tools.bench.bench_flags:step"),
    "quality": Command("diloco_jax.tools.bench.quality:bench_quality",
                       "data-parallel vs Decoupled DiLoCo on one token budget: eval loss and bytes (--ladder)",
                       flags="diloco_jax.tools.bench.bench_flags:quality"),
    "overhead": Command("diloco_jax.tools.bench.overhead:bench_overhead",
                        "a learner's tokens/s with its outer loop active against the bare inner step",
                        flags="diloco_jax.tools.bench.bench_flags:overhead"),
    "transport": Command("diloco_jax.tools.bench.transport:bench_transport",
                         "fragment push/pull throughput over loopback gRPC against a raw socket copy"),
    "wan": Command("diloco_jax.tools.bench.wan:bench_wan",
                   "compute utilization on an emulated slow link, staggered fragments vs all-at-once",
                   flags="diloco_jax.tools.bench.bench_flags:wan"),
    "syncer": Command("diloco_jax.tools.bench.syncer:bench_syncer",
                      "parameters the syncer absorbs per second (merge, outer step, downlink) vs memory speed",
                      flags="diloco_jax.tools.bench.bench_flags:syncer", config=False),
    "multihost": Command("diloco_jax.tools.bench.multihost:bench_multihost",
                         "a learner spanning several processes against one process on the same devices",
                         flags="diloco_jax.tools.bench.bench_flags:multihost"),
    "chaos": Command("diloco_jax.tools.bench.chaos:bench_chaos",
                     "goodput under one failure schedule: Decoupled DiLoCo vs data-parallel vs the simulator",
                     flags="diloco_jax.tools.bench.bench_flags:chaos"),
    "hetero": Command("diloco_jax.tools.bench.hetero:bench_hetero",
                      "mixed-speed learners: goodput and quality of K = M, K = 1 and K = 1 + grace",
                      flags="diloco_jax.tools.bench.bench_flags:hetero"),
    "suite": Command("diloco_jax.tools.bench.suite:bench_suite",
                     "the headline benchmarks in a fixed order, repeated, into one JSON file (make bench)"),
})

SIM = Group("the scale simulator, the bandwidth planner and the sizing of a run's machines", "simulator", {
    "goodput": Command("diloco_jax.tools.sim.goodput_cli:sim_goodput",
                       "goodput and uptime of data-parallel, elastic DP and Decoupled DiLoCo under failures"),
    "bandwidth": Command("diloco_jax.tools.sim.bandwidth_cli:sim_bandwidth",
                         "the WAN bandwidth each method needs for a target compute utilization"),
    "sizing": Command("diloco_jax.tools.sim.sizing:sim_sizing",
                      "a config's syncer memory and disk, bytes per learner and outer period",
                      flags="diloco_jax.command_flags:sim_sizing"),
    "syncer": Command("diloco_jax.tools.sim.syncer_cli:sim_syncer",
                      "the syncer's memory, ingest rate and shard count for every shipped config and several M",
                      flags="diloco_jax.tools.sim.args:sim_syncer", config=False),
}, epilog="""Examples:
  python -m diloco_jax sim goodput --table
  python -m diloco_jax sim goodput --chips 1200000 --learners 8 --strategy dp,elastic,diloco
  python -m diloco_jax sim goodput --quorum-settings all,k1,k1grace --groups 0.847:4,1:4 --step-cv 0.1 \\
      --mtbi-years 1e9
  python -m diloco_jax sim bandwidth --params 70e9 --step-s 2 --sites 4
  python -m diloco_jax sim sizing --config configs/b1.py --learners 8 --step-s 0.33
  python -m diloco_jax sim syncer --learners 2,4,8 --step-s 1

Progress goes to stderr; tables (or JSON with --json) to stdout; PNG plots to --out (default runs/sim).""")

COMMANDS: dict[str, Command | Group] = {
    "train": Command("diloco_jax.runs.inprocess:train",
                     "Decoupled DiLoCo: M learners on slices of this process's devices, with the syncer core",
                     flags="diloco_jax.command_flags:train"),
    "baseline": Command("diloco_jax.runs.baseline:train_baseline",
                        "synchronous data-parallel training of the same model and data, for comparisons",
                        flags="diloco_jax.command_flags:baseline"),
    "syncer": Command("diloco_jax.syncer.app:run_syncer_process", "the gRPC syncer service",
                      flags="diloco_jax.command_flags:syncer"),
    "learner": Command("diloco_jax.learner.process:run_learner_process",
                       "one learner process talking to a gRPC syncer", flags="diloco_jax.command_flags:learner"),
    "local": Command("diloco_jax.runs.local:launch",
                     "a syncer, the global model's evaluator and N learner processes on this machine",
                     flags="diloco_jax.command_flags:local"),
    "evaluator": Command("diloco_jax.evaluator.process:run_evaluator_process",
                         "the global model's eval curve, from a gRPC syncer (an observer: it never joins)",
                         flags="diloco_jax.command_flags:evaluator"),
    "chaos": Command("diloco_jax.tools.chaos.command:run_chaos",
                     "`local` under a seeded fault schedule (kills, stops, cut-offs, syncer restarts), with a report",
                     flags="diloco_jax.command_flags:chaos"),
    "status": Command("diloco_jax.tools.status:show_status",
                      "what a running syncer is doing: learners, fragments, counters, goodput (--watch)"),
    "plot": Command("diloco_jax.tools.plot:plot_runs",
                    "PNGs of runs' metrics: eval loss vs tokens, step rates, versions, bytes on the wire"),
    "sim": SIM,
    "bench": BENCH,
    "tokenizer": Command("diloco_jax.tools.tokenizer:train_tokenizer", "train a SentencePiece tokenizer on text"),
    "tokenize": Command("diloco_jax.tools.tokenize:tokenize_text",
                        "pre-tokenize text into ArrayRecord shards (data.format=\"array_record\")",
                        flags="diloco_jax.command_flags:tokenize", config=False),
    "export": Command("diloco_jax.tools.export:export_model",
                      "export the global model of a syncer's checkpoint (params, config, tokenizer)",
                      flags="diloco_jax.command_flags:export"),
    "eval": Command("diloco_jax.tools.evaluate:evaluate_models",
                    "loss of exported models (nats per token, bits per byte) on the eval set or any text",
                    flags="diloco_jax.command_flags:evaluate", config=False),
    "sample": Command("diloco_jax.tools.sample:sample_text", "generate text from an exported model",
                      flags="diloco_jax.command_flags:sample", config=False),
    "replay": Command("diloco_jax.tools.replay:replay_tape",
                      "replay a syncer's recorded tape (--record-tape) through a fresh core, checking it bit for bit"),
    "sizes": Command("diloco_jax.tools.sizes:print_sizes",
                     "the package's largest module, class and function, and every one over the size targets"),
}


def _listing(commands: dict[str, Command | Group], indent: str) -> list[str]:
  width = max(len(name) for name in commands)
  lines = []
  for name, entry in commands.items():
    lines.append(f"{indent}{name:<{width}}  {entry.help}")
    if isinstance(entry, Group):
      lines.extend(_listing(entry.commands, indent + "  "))
  return lines


def usage(program: str, commands: dict[str, Command | Group], help_: str = "", epilog: str = "",
          what: str = "command") -> str:
  """The help of a table: a usage line, `help_`, every command (and every subcommand of a group) with its
  line, and `epilog`."""
  lines = [f"usage: {program} <{what}> [flags]", ""]
  if help_:
    lines += [f"{help_[0].upper()}{help_[1:]}.", ""]
  lines += [f"{what.capitalize()}s:"] + _listing(commands, "  ")
  lines += ["", f"`{program} <{what}> --help` lists its flags."]
  if epilog:
    lines += ["", epilog]
  return "\n".join(lines)


def resolve(target: str):
  """The function "module:function" names (the module imported now)."""
  module, function = target.split(":")
  return getattr(importlib.import_module(module), function)


def dispatch(program: str, args: list[str], commands: dict[str, Command | Group], *, help_: str = "",
             epilog: str = "", what: str = "command") -> int:
  """Runs `args[0]`'s entry of `commands` with argv `[f"{program} {args[0]}"] + args[1:]`; prints the
  table's help on no command, -h, --help or help; an unknown name is exit status 2."""
  if not args or args[0] in ("-h", "--help", "help"):
    print(usage(program, commands, help_, epilog, what))
    return 0
  name, rest = args[0], list(args[1:])
  entry = commands.get(name)
  if entry is None:
    print(f"unknown {what} {name!r}; expected one of: {', '.join(commands)}", file=sys.stderr)
    return 2
  if isinstance(entry, Group):
    return dispatch(f"{program} {name}", rest, entry.commands, help_=entry.help, epilog=entry.epilog,
                    what=entry.what)
  if entry.flags and any(a in cli.HELP_FLAGS for a in rest):
    print(light_help(f"{program} {name}", entry))
    return 0
  return resolve(entry.target)([f"{program} {name}"] + rest) or 0


def light_help(program: str, entry: Command) -> str:
  """A command's --help from its `flags` and its module's docstring read from source (neither imported)."""
  module = entry.target.split(":")[0]
  spec = importlib.util.find_spec(module)  # imports the parent packages only (they import nothing heavy)
  doc = ast.get_docstring(ast.parse(pathlib.Path(spec.origin).read_text())) or ""
  return cli.command_help(program, doc, resolve(entry.flags), config=entry.config)


def main(argv: list[str] | None = None) -> int:
  """`python -m diloco_jax <command> [flags]`: `argv[1:]` (default sys.argv's) dispatched on COMMANDS."""
  argv = list(sys.argv if argv is None else argv)
  cli.die_with_parent()  # a child of `local`: not one second after the launcher
  return dispatch(PROGRAM, argv[1:], COMMANDS)

"""The flags of every benchmark that loads jax, defined here so that `bench <name> --help` prints them without
importing the benchmark (`commands.dispatch`); each benchmark parses its argv with the same function."""

from __future__ import annotations

from absl import flags

from diloco_jax.outer.codec import CODECS
from diloco_jax.tools.sim import goodput as sim_goodput

SETTINGS = sim_goodput.QUORUM_SETTINGS  # bench hetero: all, k1, k1grace, the paper's three rows
SLOW_SPEED = 1 / 1.18  # bench hetero: the slow learners, 18% slower
LATENCIES_MS = (1.0, 20.0, 80.0)  # bench wan --paper-link: one-way latencies (same region, cross-region, continent)


def chaos(fv: flags.FlagValues) -> None:
  """`bench chaos` (tools/bench/chaos.py)."""
  flags.DEFINE_integer("learners", 6, "learners (data-parallel: the same devices in one job)", flag_values=fv)
  flags.DEFINE_integer("seed", 0, "seed of the failure times and targets", flag_values=fv)
  flags.DEFINE_float("mtbf-s", 15.0, "mean seconds between failures, whole job", flag_values=fv)
  flags.DEFINE_float("min-step-s", 0.1, "emulation.min_step_s, if the config sets none: every learner (and the "
                     "data-parallel job) steps at this emulated accelerator speed, so that on a shared CPU a "
                     "failed learner does not speed up the others", flag_values=fv)
  flags.DEFINE_float("repair-s", 10.0, "seconds a failed learner (data-parallel: the job) stays out",
                     flag_values=fv)
  flags.DEFINE_string("schedule", None, "a `chaos` schedule file instead of the Poisson failures",
                      flag_values=fv)
  flags.DEFINE_string("workdir", "runs/bench_chaos", "scratch directory", flag_values=fv)
  flags.DEFINE_string("diloco-reference", None, "reuse the undisturbed DiLoCo run of a `chaos` report.json "
                      "or a `bench chaos` bench_chaos.json (same config and learners)", flag_values=fv)
  flags.DEFINE_integer("repeats", 20, "simulator repeats", flag_values=fv)
  flags.DEFINE_float("timeout-s", 3600.0, "give up on a run after this long", flag_values=fv)


def hetero(fv: flags.FlagValues) -> None:
  """`bench hetero` (tools/bench/hetero.py)."""
  flags.DEFINE_string("groups", "", "SPEED:LEARNERS[,...] (e.g. 0.847:2,1:2); default: half of learners.num at "
                      f"{SLOW_SPEED:.3f} (18% slower), the rest at 1. Sets emulation.speeds in this order.",
                      flag_values=fv)
  flags.DEFINE_float("step-cv", 0.1, "Step-time noise (coefficient of variation of each step).", flag_values=fv)
  flags.DEFINE_float("step-s", 0.0, "A speed-1 learner's emulated step time; 0: twice the measured one.",
                     flag_values=fv)
  flags.DEFINE_list("settings", list(SETTINGS), f"Quorum settings to run, of {', '.join(SETTINGS)}.",
                    flag_values=fv)
  flags.DEFINE_bool("baseline", True, "Also train the data-parallel baseline on the same token budget.",
                    flag_values=fv)
  flags.DEFINE_bool("processes", False, "Run each setting as a syncer and learner processes over gRPC.",
                    flag_values=fv)
  flags.DEFINE_integer("sim-repeats", 3, "Simulator repeats per setting.", flag_values=fv)
  flags.DEFINE_string("workdir", "runs/bench_hetero", "Scratch directory (emptied first).", flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)


def multihost(fv: flags.FlagValues) -> None:
  """`bench multihost` (tools/bench/multihost.py)."""
  flags.DEFINE_integer("devices", 4, "devices of the learner, in all", flag_values=fv)
  flags.DEFINE_integer("processes", 2, "processes of the multi-process configurations", flag_values=fv)
  flags.DEFINE_integer("chunks", 3, "alternating measurement chunks per side", flag_values=fv)
  flags.DEFINE_integer("steps", 0, "steps per chunk (default 2 H)", flag_values=fv)
  flags.DEFINE_bool("json", False, "print the result as JSON", flag_values=fv)
  # One process of a configuration (the command runs itself once per process).
  flags.DEFINE_string("worker-out", None, "internal: run as a worker writing its figures here", flag_values=fv)
  flags.DEFINE_string("coordinator", None, "internal", flag_values=fv)
  flags.DEFINE_integer("num-processes", 1, "internal", flag_values=fv)
  flags.DEFINE_integer("process-id", 0, "internal", flag_values=fv)


def overhead(fv: flags.FlagValues) -> None:
  """`bench overhead` (tools/bench/overhead.py)."""
  flags.DEFINE_integer("chunks", 30, "Alternating measurement chunks per side.", flag_values=fv)
  flags.DEFINE_integer("steps", 0, "Steps per chunk (default: whole sync periods of H, at least 8).",
                       flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)


def quality(fv: flags.FlagValues) -> None:
  """`bench quality` (tools/bench/quality.py)."""
  flags.DEFINE_string("workdir", "runs/bench_quality", "Scratch directory (emptied first).", flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)
  flags.DEFINE_list("budgets", ["1"], "Multiples of train.steps to run the pair at (e.g. 1,3,10).",
                    flag_values=fv)
  flags.DEFINE_string("plot", None, "PNG path for --budgets with more than one budget "
                      "(default <workdir>/quality.png).", flag_values=fv)
  flags.DEFINE_integer("seeds", 1, "Seeds to repeat every pair at (the config's seed + 0 .. N-1).",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_string("frontier", None, "JSONL file of the loss-against-bytes frontier: this run's points are "
                      "appended and FILE.png redrawn with every point (tools/bench/frontier.py).", flag_values=fv)
  flags.DEFINE_string("label", None, "This run's name on the frontier (default: its outer settings).",
                      flag_values=fv)
  flags.DEFINE_bool("ladder", False, "Also train the rungs of `ladder` (the parts of Decoupled DiLoCo put "
                    "back one at a time) and print each one's share of the gap.", flag_values=fv)


def step(fv: flags.FlagValues) -> None:
  """`bench step` (tools/bench/step.py)."""
  flags.DEFINE_integer("steps", 10, "Timed inner steps (after the warm-up).", flag_values=fv, lower_bound=1)
  flags.DEFINE_integer("warmup", 2, "Untimed steps after the compile.", flag_values=fv, lower_bound=0)
  flags.DEFINE_integer("devices", 0, "Devices of the mesh (0 = mesh.num_devices, or all).", flag_values=fv,
                       lower_bound=0)
  flags.DEFINE_enum("matmul_dtype", "float32", ["float32", "bfloat16"],
                    "Dtype of the reference matmul.", flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the results as one JSON object on stdout.", flag_values=fv)


def syncer(fv: flags.FlagValues) -> None:
  """`bench syncer` (tools/bench/syncer.py)."""
  flags.DEFINE_integer("params", 1 << 24, "parameters of the fragment (16M: 64 MB of float32)", flag_values=fv)
  flags.DEFINE_integer("pushes", 4, "M: pushes merged per round", flag_values=fv)
  flags.DEFINE_enum("codec", "int4", list(CODECS), "the pushes' codec", flag_values=fv)
  flags.DEFINE_enum("downlink", "fp32", list(CODECS), "the downlink codec", flag_values=fv)
  flags.DEFINE_integer("block", 64, "quantization block", flag_values=fv)
  flags.DEFINE_integer("rounds", 5, "timed rounds per path (the median counts)", flag_values=fv)
  flags.DEFINE_list("threads", ["1", "0"], "merge threads of the fused path, one row each (0: this host's "
                    "cores, at most 8)", flag_values=fv)
  flags.DEFINE_bool("json", False, "print the result as JSON", flag_values=fv)


def wan(fv: flags.FlagValues) -> None:
  """`bench wan` (tools/bench/wan.py)."""
  flags.DEFINE_float("gbps", 0.0, "Link bandwidth per direction in Gbit/s (0: derive it from the step "
                     "time, see --link-periods).", flag_values=fv)
  flags.DEFINE_float("latency-ms", 10.0, "One-way link latency in ms.", flag_values=fv)
  flags.DEFINE_float("link-periods", 0.5, "Auto bandwidth: the link moves the full fp32 model in this "
                     "many sync periods (H step-times).", flag_values=fv)
  flags.DEFINE_integer("steps", 0, "Timed inner steps per mode (default 8 H; rounded up to a multiple "
                       "of H).", flag_values=fv)
  flags.DEFINE_bool("int4", True, "Also run streaming + overlap with int4 both ways.", flag_values=fv)
  flags.DEFINE_bool("sync-steps", True, "Wait for each timed inner step to finish on the device (see the "
                    "module docstring); --nosync-steps times the loop as run_learner runs it.", flag_values=fv)
  flags.DEFINE_bool("paper-link", False, "Size the link at 1/236 of bf16 data-parallel's need and run the "
                    "config's schedule and P = H on it at --latencies-ms (see the module docstring).", flag_values=fv)
  flags.DEFINE_float("link-scale", 1.0, "--paper-link: multiply the link by this (1: the paper's).",
                     flag_values=fv)
  flags.DEFINE_list("latencies-ms", [f"{x:g}" for x in LATENCIES_MS], "--paper-link: one-way latencies in ms.",
                    flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)

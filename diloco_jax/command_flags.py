"""The flags of every command whose module loads jax, defined here so that `<command> --help` prints them
without importing that module (`commands.dispatch`). A command's module parses its argv with the same
function (`cli.parse(argv, command_flags.<name>, doc=__doc__)`). Light commands keep their flags at home.
"""

from __future__ import annotations

import os

from absl import flags

from diloco_jax.protocol import run_token
from diloco_jax.transports import client_flags


def train(fv: flags.FlagValues) -> None:
  """`train`: an in-process run (runs/inprocess.py)."""
  flags.DEFINE_string("workdir", None, "Output directory (metrics, checkpoints, summary.json).",
                      flag_values=fv, required=True)
  flags.DEFINE_bool("export", True, "export the global model to WORKDIR/model at the end", flag_values=fv)
  flags.DEFINE_string("record-tape", None, "append every step of the syncer's state machine to this file "
                      "(`python -m diloco_jax replay --tape FILE` replays it bit for bit)", flag_values=fv)


def baseline(fv: flags.FlagValues) -> None:
  """`baseline`: synchronous data-parallel training (runs/baseline.py)."""
  flags.DEFINE_string("workdir", None, "Output directory (metrics, checkpoints, summary.json).", flag_values=fv,
                      required=True)
  flags.DEFINE_bool("export", True, "export the final model to WORKDIR/model", flag_values=fv)


def syncer(fv: flags.FlagValues) -> None:
  """`syncer`: the gRPC syncer service (syncer/app.py)."""
  flags.DEFINE_string("workdir", None, "where syncer checkpoints and the port file go", flag_values=fv,
                      required=True)
  flags.DEFINE_string("bind", "127.0.0.1:50051", "host:port to serve on (port 0: any free port)",
                      flag_values=fv)
  flags.DEFINE_string("token-file", None, f"file holding the run token (else ${run_token.TOKEN_ENV})",
                      flag_values=fv)
  flags.DEFINE_string("run-id", "", "run id, part of the fingerprint every learner must match",
                      flag_values=fv)
  flags.DEFINE_string("tls-cert", None, "PEM server certificate (enables TLS)", flag_values=fv)
  flags.DEFINE_string("tls-key", None, "PEM private key of --tls-cert", flag_values=fv)
  flags.DEFINE_string("tls-client-ca", None, "PEM CA: require client certificates it signed (mutual TLS)",
                      flag_values=fv)
  flags.DEFINE_bool("allow-remote", False, "permit binding a non-loopback address", flag_values=fv)
  flags.DEFINE_integer("max-workers", 0, "RPC worker threads (0: sized for the run's learners, at least 32)",
                       flag_values=fv)
  flags.DEFINE_bool("resume", True, "resume from the latest checkpoint in --workdir", flag_values=fv)
  flags.DEFINE_integer("shard", 0, "this process's shard of a sharded syncer, in [0, --shards)", flag_values=fv)
  flags.DEFINE_integer("shards", 1, "syncer shards of the run (each a process owning some fragments)",
                       flag_values=fv)
  flags.DEFINE_string("record-tape", None, "append every step of the syncer's state machine to this file "
                      "(a debugging record: `python -m diloco_jax replay --tape FILE` replays it bit for bit)",
                      flag_values=fv)


def learner(fv: flags.FlagValues) -> None:
  """`learner`: one learner process (learner/process.py)."""
  client_flags.define(fv)  # --syncer, --token-file, --tls-*
  flags.DEFINE_integer("learner-id", None, "this learner's id, in [0, learners.num)", flag_values=fv,
                       required=True)
  flags.DEFINE_string("workdir", None, "this learner's directory (checkpoints, metrics, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_string("run-id", "", "run id: must be the syncer's (it enters the fingerprint)", flag_values=fv)
  flags.DEFINE_integer("devices", None, "devices of this learner (default learners.device_counts[id], else "
                       "learners.devices)",
                       flag_values=fv)
  flags.DEFINE_string("checkpoint-dir", None, "where checkpoints go, local or gs:// (default "
                      "WORKDIR/checkpoints)", flag_values=fv)
  distributed(fv)


def local(fv: flags.FlagValues) -> None:
  """`local`: a syncer, an evaluator and N learner processes on this machine (runs/local.py)."""
  flags.DEFINE_string("workdir", None, "run directory (token, logs, syncer/, learner_<i>/, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_integer("learners", 0, "learner processes (default config.learners.num; sets it)",
                       flag_values=fv)
  flags.DEFINE_string("run-id", "local", "run id (enters the fingerprint; keep it to resume a workdir)",
                      flag_values=fv)
  flags.DEFINE_bool("eval", True, "run the global model's evaluator, and evaluate the syncer's final global "
                    "model (loads its checkpoint)", flag_values=fv)
  flags.DEFINE_bool("export", True, "with --eval, export that model to WORKDIR/model", flag_values=fv)
  flags.DEFINE_float("stop-timeout-s", 60.0, "grace for a child after SIGTERM before SIGKILL",
                     flag_values=fv)
  flags.DEFINE_float("start-timeout-s", 300.0, "how long to wait for the syncer's port file", flag_values=fv)
  flags.DEFINE_integer("hosts-per-learner", 1, "processes per learner (jax.distributed on loopback), each "
                       "with 1/H of the learner's fake CPU devices", flag_values=fv)
  flags.DEFINE_integer("syncer-shards", 1, "syncer processes, each owning some fragments (at most "
                       "outer.num_fragments)", flag_values=fv, lower_bound=1)


def evaluator(fv: flags.FlagValues) -> None:
  """`evaluator`: the global model's eval curve from a syncer (evaluator/process.py)."""
  client_flags.define(fv)
  flags.DEFINE_string("workdir", None, "where the eval records go (metrics.jsonl, event files, summary.json)",
                      flag_values=fv, required=True)
  flags.DEFINE_string("run-id", "", "run id: must be the syncer's (it enters the fingerprint)", flag_values=fv)
  flags.DEFINE_float("poll-s", 1.0, "seconds between two looks at the syncer's progress", flag_values=fv)


def chaos(fv: flags.FlagValues) -> None:
  """`chaos`: `local` under a seeded fault schedule (tools/chaos/command.py)."""
  flags.DEFINE_integer("learners", 3, "learner processes (the per-learner batch of the config is kept)",
                       flag_values=fv)
  flags.DEFINE_integer("seed", 0, "seed of the standard schedule (times and targets)", flag_values=fv)
  flags.DEFINE_string("schedule", None, "a JSON list of events instead of the standard schedule",
                      flag_values=fv)
  flags.DEFINE_string("workdir", "runs/chaos", "run directory: reference/, chaos/, report.json, timeline.png",
                      flag_values=fv)
  flags.DEFINE_string("reference", None, "reuse the undisturbed run of this report.json (same config and "
                      "learners) instead of measuring it", flag_values=fv)
  flags.DEFINE_float("timeout-s", 3600.0, "give up on a run after this long", flag_values=fv)
  flags.DEFINE_string("run-id", "chaos", "run id", flag_values=fv)
  flags.DEFINE_integer("eval-batches", 0, "batches the final global model of both runs is evaluated on (0: "
                       "the config's data.eval_batches; the few a config evaluates on during training are "
                       "too noisy to compare two runs' final losses)", flag_values=fv)
  flags.DEFINE_list("summarize", None, "instead of running: print a markdown table of these report.json "
                    "files (e.g. runs/sweep/seed*/report.json)", flag_values=fv)


def sim_sizing(fv: flags.FlagValues) -> None:
  """`sim sizing`: a config's memory, disk and bytes (tools/sim/sizing.py)."""
  flags.DEFINE_integer("learners", 0, "M, the number of learners (default: config.learners.num)", flag_values=fv)
  flags.DEFINE_float("step-s", 0.0, "inner step time in seconds, to print average bandwidths", flag_values=fv)
  flags.DEFINE_bool("json", False, "print JSON instead of text", flag_values=fv)
  flags.DEFINE_list("accelerators", [], "TPU slices to size a learner's device memory on, e.g. v5p-128,v6e-256 "
                    "(default: the shipped config's presets, `hbm.PRESETS`)", flag_values=fv)


def tokenize(fv: flags.FlagValues) -> None:
  """`tokenize`: text into ArrayRecord token shards (tools/tokenize.py)."""
  flags.DEFINE_string("tokenizer", None, "SentencePiece model (`python -m diloco_jax tokenizer`)",
                      flag_values=fv, required=True)
  flags.DEFINE_string("data", None, "text file or directory (local or gs://)", flag_values=fv, required=True)
  flags.DEFINE_string("out", None, "output directory (local or gs://)", flag_values=fv, required=True)
  flags.DEFINE_integer("shards", 16, "train files (a learner reads windows of all of them)", flag_values=fv)
  flags.DEFINE_integer("eval-shards", 1, "eval files", flag_values=fv)
  flags.DEFINE_float("eval-fraction", 0.05, "expected fraction of files held out for eval", flag_values=fv)
  flags.DEFINE_integer("chunk-tokens", 0, "tokens per ArrayRecord record (0: the format's default)",
                       flag_values=fv)
  flags.DEFINE_integer("max-bytes", 0, "read at most this much text (0 = all)", flag_values=fv)


def export(fv: flags.FlagValues) -> None:
  """`export`: the global model of a syncer's checkpoint (tools/export.py)."""
  flags.DEFINE_string("syncer-workdir", None, "the syncer's --workdir (or an in-process run's WORKDIR/syncer); "
                      "a sharded syncer's: every shard's, comma-separated", flag_values=fv, required=True)
  flags.DEFINE_string("run-id", "", "the run's id (the syncer's --run-id; `local` uses 'local', `train` "
                      "'in-process')", flag_values=fv)
  flags.DEFINE_string("out", None, "model directory to write (local or gs://)", flag_values=fv, required=True)


def evaluate(fv: flags.FlagValues) -> None:
  """`eval`: loss of exported models (tools/evaluate.py)."""
  flags.DEFINE_multi_string("model", None, "exported model directory (repeat to compare several)",
                            flag_values=fv, required=True)
  flags.DEFINE_string("data", None, "text file or directory to evaluate on (default: each model's own eval "
                      "set)", flag_values=fv)
  flags.DEFINE_integer("batch-size", 0, "windows per batch (default data.global_batch)", flag_values=fv)
  flags.DEFINE_integer("devices", 0, "devices to use (default all)", flag_values=fv)
  flags.DEFINE_bool("json", False, "print one JSON object per model instead of a line", flag_values=fv)


def sample(fv: flags.FlagValues) -> None:
  """`sample`: text from an exported model (tools/sample.py)."""
  flags.DEFINE_string("model", None, "exported model directory", flag_values=fv, required=True)
  flags.DEFINE_string("prompt", "", "text to continue", flag_values=fv)
  flags.DEFINE_integer("max-tokens", 200, "tokens to generate at most", flag_values=fv)
  flags.DEFINE_float("temperature", 0.0, "0: greedy; > 0: sample from softmax(logits / temperature)",
                     flag_values=fv)
  flags.DEFINE_integer("top-k", 0, "with a temperature, draw among the k most likely tokens (0: all)",
                       flag_values=fv)
  flags.DEFINE_integer("seed", 0, "random seed of the draws", flag_values=fv)
  flags.DEFINE_integer("devices", 0, "devices to use (default all)", flag_values=fv)


def distributed(fv: flags.FlagValues) -> None:
  """The flags of a learner spanning several processes (defaults from the environment): what
  `compute.multihost.spec_from_flags` reads."""
  env_int = lambda name: int(os.environ[name]) if os.environ.get(name, "").strip() else None
  flags.DEFINE_bool("distributed", False, "this learner spans several processes (one per host of a TPU "
                    "slice): initialize jax.distributed, auto-detected on Cloud TPU; implied by "
                    "--num-processes > 1", flag_values=fv)
  flags.DEFINE_string("coordinator", os.environ.get("DILOCO_COORDINATOR"), "host:port of the jax.distributed "
                      "coordinator, which process 0 starts (env DILOCO_COORDINATOR)", flag_values=fv)
  flags.DEFINE_integer("num-processes", env_int("DILOCO_NUM_PROCESSES"), "processes of this learner (env "
                       "DILOCO_NUM_PROCESSES)", flag_values=fv)
  flags.DEFINE_integer("process-id", env_int("DILOCO_PROCESS_ID"), "this process's index in [0, "
                       "--num-processes); process 0 talks to the syncer (env DILOCO_PROCESS_ID)", flag_values=fv)
  flags.DEFINE_integer("init-timeout-s", 300, "how long the processes wait for each other at start "
                       "(jax.distributed's initialization timeout: hosts of a slice can come up minutes apart)",
                       flag_values=fv)

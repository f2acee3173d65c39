"""The config's fields: one table of every field with its default and its tier (`SCHEMA`).

A config is an ml_collections ConfigDict built by a `configs/*.py:get_config()` from `base_config()`.
Tiers: `user` (what a researcher sets; documented first), `expert` (algorithm and model details),
`operations` (limits, timeouts, logging and checkpoints) and `emulation` (emulated hardware, links and
faults for tests and benchmarks). docs/configs.md documents every field under its tier (a test checks it).
0 in a field marked "derived" below means "derive it" (`resolve.py` fills it in, once per process).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import ml_collections
from ml_collections import config_dict

USER, EXPERT, OPERATIONS, EMULATION = "user", "expert", "operations", "emulation"
TIERS = (USER, EXPERT, OPERATIONS, EMULATION)

OPTIMIZERS = ("adamw", "sgd")
BASELINE_ORDERS = ("learner_shards", "shuffled")
# The fields of `train` that make the inner optimizer; `learners.inner` may override each for the learners.
INNER_FIELDS = {"optimizer": str, "lr": float, "warmup_steps": int, "min_lr_ratio": float,
                "weight_decay": float, "b1": float, "b2": float, "eps": float, "grad_clip": float}


class ConfigError(ValueError):
  """A config field holds a value that cannot work; the message names the field."""


class Field(NamedTuple):
  default: Any  # None: a placeholder of type `kind` (unset)
  tier: str
  kind: type | None = None


def _f(default, tier: str, kind: type | None = None) -> Field:
  return Field(default, tier, kind)


U, E, OP, X = USER, EXPERT, OPERATIONS, EMULATION
# section ("" = top level) -> field -> (default, tier). docs/configs.md has each field's full meaning.
SCHEMA: dict[str, dict[str, Field]] = {
    "": {"seed": _f(0, U)},
    "model": {
        "vocab_size": _f(256, U),  # byte-level tokens
        "d_model": _f(128, U),
        "num_layers": _f(2, U),
        "num_heads": _f(4, U),
        "num_kv_heads": _f(4, U),  # < num_heads gives grouped-query attention
        "head_dim": _f(32, U),
        "mlp_dim": _f(512, U),
        "max_seq_len": _f(128, E),
        "rope_theta": _f(10_000.0, E),
        "tie_embeddings": _f(True, E),
        "dtype": _f("float32", E),  # activations; params are always float32
        "remat": _f(False, E),
    },
    "data": {
        "format": _f("bytes", U),  # "bytes": byte-level text read at start; "array_record": token shards
        "path": _f("", U),  # bytes: "" = the embedded corpus (this interpreter's standard library sources)
        "tokenizer": _f("", U),  # array_record: the SentencePiece model (`python -m diloco_jax tokenizer`)
        "train_files": _f("", U),  # array_record: glob pattern(s) of train shards
        "eval_files": _f("", U),  # array_record: glob pattern(s) of eval shards
        "seq_len": _f(128, U),
        "global_batch": _f(16, U),  # sequences per step over the whole run (all learners together)
        "eval_fraction": _f(0.05, E),  # of files, held out for eval (file-level split)
        "eval_batches": _f(4, E),
        "max_bytes": _f(0, OP),  # cap on corpus bytes read (0 = no cap); keeps tests fast
        # The baseline's batch at step s: the M learners' batches side by side, or one shuffle of all windows.
        "baseline_order": _f("learner_shards", E),
    },
    "train": {  # the inner optimizer and the loop
        "steps": _f(100, U),
        "optimizer": _f("adamw", E),  # "sgd": plain SGD with the same schedule and decay (pins identities)
        "lr": _f(3e-3, U),
        "warmup_steps": _f(10, U),
        "min_lr_ratio": _f(0.1, E),
        "weight_decay": _f(0.1, E),
        "b1": _f(0.9, E),
        "b2": _f(0.95, E),
        "eps": _f(1e-8, E),
        "grad_clip": _f(1.0, E),  # global-norm clipping threshold; 0 = off
        "log_every": _f(10, OP),
        "eval_every": _f(50, OP),
        "checkpoint_every": _f(0, OP),  # 0 = only at the end
        "keep_checkpoints": _f(2, OP),
    },
    "mesh": {  # axis sizes of one learner's mesh (or the baseline's); one -1 fill
        "data": _f(-1, E),
        "fsdp": _f(1, E),
        "tensor": _f(1, E),
        "num_devices": _f(0, OP),  # baseline: devices to use (0 = all)
    },
    "learners": {
        "num": _f(4, U),  # M
        "devices": _f(2, U),  # devices per learner slice (locally: fake CPU devices)
        "device_counts": _f((), E),  # per-learner devices, one per learner; derived: () = `devices` each
        "peer_timeout_s": _f(60.0, OP),  # a multi-process learner is out when one process is silent this long
    },
    # The learners' inner optimizer; derived: None = the `train` field.
    "learners.inner": {name: _f(None, E, kind) for name, kind in INNER_FIELDS.items()},
    "outer": {
        "num_fragments": _f(2, U),  # P
        "sync_every": _f(20, U),  # H: inner steps between two syncs of the same fragment
        "sync_schedule": _f("periodic", E),  # "periodic" every H steps; "front_loaded": dense early
        "schedule_power": _f(2.0, E),  # front_loaded only: 1 = periodic; 2 = gaps growing to about 2H
        "tau": _f(2, E),  # overlap: adopt the merged fragment >= tau steps after the snapshot
        "alpha": _f(0.0, E),  # theta <- alpha * theta + (1 - alpha) * global (0 = overwrite)
        "keep_local_progress": _f(True, E),  # adoption keeps the inner steps taken since the snapshot
        "lr": _f(0.7, U),
        "momentum": _f(0.9, U),
        "merge": _f("tokens", E),
        "rda": _f(False, E),
        "staleness_beta": _f(0.0, E),  # late pushes weighted by (1 + staleness) ** -beta
        "codec": _f("int4", U),  # uplink: the learners' outer gradients
        "error_feedback": _f(False, E),  # a push carries what the last one's codec rounded away (outer/feedback.py)
        "downlink_codec": _f("fp32", E),  # the global fragments sent back
        "codec_block": _f(64, E),
        "fragment_plan": _f("strided", E),
        # K; derived: 0 = learners.num (every live learner: the slowest gates every round).
        "min_quorum": _f(1, U),
        "scale_partial_rounds": _f(True, E),  # a round moves the model by the share of the work it holds
        # 0.9: with phase alignment the aligned pushes land in one round (docs/benchmarks.md, "The quorum at
        # equal speeds"); learners still never wait beyond it (< 1: the result is out before tau steps).
        "grace_gamma": _f(0.9, E),
        "min_grace_s": _f(0.0, E),
        "max_grace_s": _f(5.0, E),
        # A learner moves its next sync of a fragment by this share of how late its push came after the
        # others' (learner/phase.py; 0 = off). Sync steps then depend on timing: a test that compares runs
        # step for step turns it off.
        "phase_gain": _f(0.5, E),
        "max_norm_ratio": _f(10.0, E),  # refuse an outer gradient > this x the learners' median norm (0 = off)
        # Derived: 0 = what the schedule needs, ceil(tau P / H) + 1 (`fragments.in_flight_limit`).
        "max_in_flight": _f(0, OP),
        "downlink_history": _f(0, OP),  # references kept per fragment; derived: 0 = 2 x learners.num
        "lease_s": _f(30.0, OP),  # a learner silent this long leaves the quorum
        # A learner whose step counter stands this long (plus one step), unless it waits on the syncer, stops
        # counting toward quorums. Derived: 0 = outer.max_grace_s, at least 0.5 s.
        "stall_s": _f(0.0, OP),
    },
    "comms": {  # a learner process's gRPC client (learner/process.py)
        "chunk_kb": _f(1024, OP),  # Push chunk size (must stay under syncer.max_message_mb)
        "unreachable_deadline_s": _f(300.0, OP),  # keep retrying an unreachable syncer this long, then fail
        "backoff_s": _f(0.1, OP),  # first retry delay; doubles up to max_backoff_s
        "max_backoff_s": _f(2.0, OP),  # bounds how long after a syncer restart a learner reaches it
        "call_timeout_s": _f(120.0, OP),  # deadline of one call attempt (a Pull adds its long-poll time)
        "shutdown_grace_s": _f(30.0, OP),  # after SIGTERM/SIGINT the final flush gets this long
    },
    "syncer": {  # the gRPC syncer process (syncer/app.py)
        "chunk_kb": _f(1024, OP),  # Pull chunk size
        "max_message_mb": _f(4, OP),  # gRPC message size limit, both ways
        "max_push_mb": _f(2048, OP),  # declared size of one Push (also capped by the largest fragment in fp32)
        "rate_limit_per_s": _f(50.0, OP),  # calls per source (identity + connection) per second (0 = unlimited)
        "rate_limit_burst": _f(200.0, OP),
        "max_pull_wait_s": _f(60.0, OP),  # long-poll cap of one Pull
        "stream_stall_s": _f(10.0, OP),  # a Push or Pull stream that moves no payload bytes this long is cut
        "stream_deadline_s": _f(600.0, OP),  # no Push or Pull stream lasts longer (long-poll wait excluded)
        "data_plane": _f(True, OP),  # also serve payloads on a raw-TCP port (gRPC stays the control plane)
        "merge_threads": _f(0, OP),  # threads of a round's merge; derived: 0 = this host's cores, at most 8
        "checkpoint_every_rounds": _f(10, OP),  # closed rounds between checkpoints; 0 = at stop
        "keep_checkpoints": _f(3, OP),
        "shutdown_grace_s": _f(2.0, OP),  # in-flight calls get this long after SIGTERM/SIGINT
    },
    "emulation": {  # emulated hardware, links and faults (tests, chaos, benchmarks); all off by default
        # Mixed hardware (learner/pace.py): learner i's steps stretched to step_s / speeds[i] x noise.
        "speeds": _f((), X),  # one speed factor per learner; derived: () = all 1
        "step_cv": _f(0.0, X),  # the noise's coefficient of variation
        "step_s": _f(0.0, X),  # a speed-1 learner's step time; 0 = the learner's own measured (median) step
        "min_step_s": _f(0.0, X),  # every inner step takes at least this long (a fixed-speed accelerator)
        "wan_gbps": _f(0.0, X),  # WAN bandwidth per direction (0 = no cap)
        "wan_latency_ms": _f(0.0, X),  # one-way latency (0 = none)
        "cutoff_file": _f("", X),  # the link is down while this file exists ({learner}: the id)
    },
}
del U, E, OP, X


def base_config() -> ml_collections.ConfigDict:
  """Every field at its default (`SCHEMA`): what a config file starts from."""
  c = ml_collections.ConfigDict()
  for section, fields in SCHEMA.items():
    node = c
    for part in filter(None, section.split(".")):
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    for name, field in fields.items():
      node[name] = config_dict.placeholder(field.kind) if field.default is None else field.default
  return c


def field_paths(tier: str | None = None) -> tuple[str, ...]:
  """Every field's dotted path (`model.d_model`, `seed`), in schema order; only `tier`'s with a tier."""
  return tuple(f"{section}.{name}" if section else name for section, fields in SCHEMA.items()
               for name, field in fields.items() if tier in (None, field.tier))


def tier_of(path: str) -> str:
  """The tier of the field at dotted `path`; KeyError for a path the schema does not have."""
  section, _, name = path.rpartition(".")
  return SCHEMA[section][name].tier


def use_token_shards(c: ml_collections.ConfigDict, directory: str, vocab_size: int) -> None:
  """Point config `c` at tokenized data prepared in `directory` (local or gs://) by the two commands

    python -m diloco_jax tokenizer --data TEXT --vocab VOCAB --out DIRECTORY/tokenizer.model
    python -m diloco_jax tokenize --tokenizer DIRECTORY/tokenizer.model --data TEXT --out DIRECTORY/tokens

  (the tokenizer has `vocab_size` pieces, which the model's vocabulary must match)."""
  c.data.format = "array_record"
  c.data.tokenizer = f"{directory}/tokenizer.model"
  c.data.train_files = f"{directory}/tokens/train-*.array_record"
  c.data.eval_files = f"{directory}/tokens/eval-*.array_record"
  c.model.vocab_size = vocab_size

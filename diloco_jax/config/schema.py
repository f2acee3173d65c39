"""The one config system: ml_collections ConfigDicts built by `configs/*.py:get_config()`.

`base_config()` holds every field with its default; config files override what they need. `validate()`
checks a config before anything compiles and raises `ConfigError` naming the bad field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib

import ml_collections
from ml_collections import config_dict

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.outer.codec import CODECS
from diloco_jax.outer.fragments import PLANS
from diloco_jax.outer.schedule import SCHEDULES
from diloco_jax.outer.merge import MERGE_RULES

OPTIMIZERS = ("adamw", "sgd")
BASELINE_ORDERS = ("learner_shards", "shuffled")
# The fields of `train` that make the inner optimizer; `learners.inner` may override each for the learners.
INNER_FIELDS = {"optimizer": str, "lr": float, "warmup_steps": int, "min_lr_ratio": float,
                "weight_decay": float, "b1": float, "b2": float, "eps": float, "grad_clip": float}


class ConfigError(ValueError):
  """A config field holds a value that cannot work; the message names the field."""


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.model = ml_collections.ConfigDict()
  c.model.vocab_size = 256  # byte-level tokens
  c.model.d_model = 128
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 4  # < num_heads gives grouped-query attention
  c.model.head_dim = 32
  c.model.mlp_dim = 512
  c.model.max_seq_len = 128
  c.model.rope_theta = 10_000.0
  c.model.tie_embeddings = True
  c.model.dtype = "float32"  # activations; params are always float32
  c.model.remat = False

  c.data = ml_collections.ConfigDict()
  c.data.format = "bytes"  # "bytes": byte-level text read at start; "array_record": pre-tokenized shards
  c.data.path = ""  # bytes: "" = the embedded corpus (this interpreter's standard library sources)
  c.data.tokenizer = ""  # array_record: the SentencePiece model (`python -m diloco_jax tokenizer`)
  c.data.train_files = ""  # array_record: glob pattern(s) of train shards (`python -m diloco_jax tokenize`)
  c.data.eval_files = ""  # array_record: glob pattern(s) of eval shards
  c.data.seq_len = 128
  c.data.global_batch = 16  # sequences per step over the whole run (all learners together)
  c.data.eval_fraction = 0.05  # of files, held out for eval (file-level split)
  c.data.eval_batches = 4
  c.data.max_bytes = 0  # cap on corpus bytes read (0 = no cap); keeps tests fast
  # The baseline's batch at step s: "learner_shards" = the M learners' batches of step s side by side (both
  # runs train on the same tokens in the same order); "shuffled" = one shuffle of all windows.
  c.data.baseline_order = "learner_shards"

  c.train = ml_collections.ConfigDict()  # the inner optimizer and the loop
  c.train.steps = 100
  c.train.optimizer = "adamw"  # "sgd": plain SGD with the same schedule and decay (pins identities in tests)
  c.train.lr = 3e-3
  c.train.warmup_steps = 10
  c.train.min_lr_ratio = 0.1
  c.train.weight_decay = 0.1
  c.train.b1 = 0.9
  c.train.b2 = 0.95
  c.train.eps = 1e-8
  c.train.grad_clip = 1.0  # global-norm clipping threshold; 0 = off
  c.train.log_every = 10
  c.train.eval_every = 50
  c.train.checkpoint_every = 0  # 0 = only at the end
  c.train.keep_checkpoints = 2
  # Each inner step takes at least this long (the loop sleeps the rest): emulates an accelerator of a fixed
  # speed, so that on a shared CPU a stopped or dead learner does not speed up the others (chaos and
  # goodput measurements). 0 = as fast as the devices go.
  c.train.min_step_s = 0.0

  c.mesh = ml_collections.ConfigDict()  # axis sizes of one learner's mesh (or the baseline's); one -1 fill
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.mesh.num_devices = 0  # baseline: devices to use (0 = all)

  c.learners = ml_collections.ConfigDict()
  c.learners.num = 4  # M
  c.learners.devices = 2  # devices per learner slice (locally: fake CPU devices)
  c.learners.device_counts = ()  # per-learner devices, one per learner; () = learners.devices each
  # Emulated mixed hardware (learner/pace.py): learner i's inner steps are stretched to step_s / speeds[i]
  # seconds, times a noise factor of mean 1 and coefficient of variation step_cv.
  c.learners.speeds = ()  # one speed factor per learner; () = all 1 (no emulation unless step_cv > 0)
  c.learners.step_cv = 0.0
  c.learners.step_s = 0.0  # a speed-1 learner's step time; 0 = the learner's own measured (median) step
  # A learner spanning several processes is out when one of them is silent this long (learner/group.py).
  c.learners.peer_timeout_s = 60.0
  # The learners' inner optimizer: each field of `train` listed in INNER_FIELDS; None = the rule of
  # `learner_train()` applied to `train` and M.
  c.learners.inner = ml_collections.ConfigDict({k: config_dict.placeholder(t) for k, t in INNER_FIELDS.items()})

  c.outer = ml_collections.ConfigDict()
  c.outer.num_fragments = 2  # P
  c.outer.sync_every = 20  # H: inner steps between two syncs of the same fragment
  # When fragments sync (fragments.py): "periodic" every H steps; "front_loaded" as many syncs over
  # train.steps, dense early and sparse late: the periodic steps x moved to T (x / T) ** schedule_power.
  c.outer.sync_schedule = "periodic"
  c.outer.schedule_power = 2.0  # front_loaded only: 1 = periodic; 2 = gaps growing linearly to about 2H
  c.outer.tau = 2  # overlap: adopt the merged fragment >= tau steps after the snapshot
  c.outer.alpha = 0.0  # theta <- alpha * theta + (1 - alpha) * global (0 = overwrite)
  c.outer.keep_local_progress = True  # adoption keeps the inner steps taken since the snapshot
  c.outer.lr = 0.7
  c.outer.momentum = 0.9
  c.outer.merge = "tokens"
  c.outer.rda = False
  c.outer.staleness_beta = 0.0  # late pushes weighted by (1 + staleness) ** -beta
  c.outer.codec = "int4"  # uplink: the learners' outer gradients
  c.outer.downlink_codec = "fp32"  # the global fragments sent back
  c.outer.codec_block = 64
  c.outer.fragment_plan = "strided"
  # K: 1 with the adaptive grace window (the default) never makes a learner wait for another; 0 = every
  # live learner (K = M: the slowest gates every round; a dead one stops counting once its lease lapses).
  c.outer.min_quorum = 1
  c.outer.scale_partial_rounds = True  # a round moves the model by the share of the live learners' work it holds
  c.outer.grace_gamma = 0.5
  c.outer.min_grace_s = 0.0
  c.outer.max_grace_s = 5.0
  c.outer.max_in_flight = 0  # fragments pushed but not yet adopted, per learner; 0: ceil(tau P / H) + 1
  c.outer.downlink_history = 0  # references kept per fragment for delta downlinks; 0 = 2 x learners.num
  c.outer.lease_s = 30.0  # a learner silent this long leaves the quorum
  c.outer.max_norm_ratio = 10.0  # refuse an outer gradient > this x the fragment's recent median norm (0 = off)
  # A learner whose inner-step counter has not moved for this long (plus one of its steps), unless it
  # waits on the syncer, stops counting toward quorums until it moves again. 0 = outer.max_grace_s (at
  # least 0.5 s): a stopped learner is waited for no longer than a straggler. Heartbeats go out every
  # third of it (at most every second, at least four per lease).
  c.outer.stall_s = 0.0

  c.comms = ml_collections.ConfigDict()  # a learner process's gRPC client (learner/process.py)
  c.comms.chunk_kb = 1024  # Push chunk size (must stay under syncer.max_message_mb)
  c.comms.unreachable_deadline_s = 300.0  # keep retrying an unreachable syncer this long, then fail
  c.comms.backoff_s = 0.1  # first retry delay; doubles up to max_backoff_s
  c.comms.max_backoff_s = 2.0  # bounds how long after a syncer restart a learner reaches it
  c.comms.call_timeout_s = 120.0  # deadline of one call attempt (a Pull adds its long-poll time)
  c.comms.wan_gbps = 0.0  # emulated WAN bandwidth per direction (0 = no cap)
  c.comms.wan_latency_ms = 0.0  # emulated one-way latency (0 = none)
  c.comms.shutdown_grace_s = 30.0  # after SIGTERM/SIGINT the final flush gets this long, then it is abandoned
  c.comms.cutoff_file = ""  # chaos testing: the link is down while this file exists ({learner}: the id)

  c.syncer = ml_collections.ConfigDict()  # the gRPC syncer process (syncer/server.py)
  c.syncer.chunk_kb = 1024  # Pull chunk size
  c.syncer.max_message_mb = 4  # gRPC message size limit, both ways
  c.syncer.max_push_mb = 2048  # declared size of one Push (also capped by the largest fragment in fp32)
  c.syncer.rate_limit_per_s = 50.0  # calls per learner per second, sustained (0 = unlimited)
  c.syncer.rate_limit_burst = 200.0
  c.syncer.max_pull_wait_s = 60.0  # long-poll cap of one Pull
  c.syncer.stream_stall_s = 10.0  # a Push or Pull stream that moves no payload bytes this long is cut
  c.syncer.stream_deadline_s = 600.0  # no Push or Pull stream lasts longer (long-poll wait excluded)
  c.syncer.data_plane = True  # also serve push/pull payloads on a raw-TCP port (gRPC stays the control plane)
  c.syncer.merge_threads = 0  # threads of a round's merge, outer step and downlink encode; 0 = the cores, <= 8
  c.syncer.checkpoint_every_rounds = 10  # closed rounds (over all fragments) between checkpoints; 0 = at stop
  c.syncer.keep_checkpoints = 3
  c.syncer.shutdown_grace_s = 2.0  # in-flight calls get this long after SIGTERM/SIGINT
  return c


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


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, *, learners: bool = False) -> None:
  """Check a config; raise ConfigError naming the field. `num_devices`: devices available to the job."""
  m = c.model
  for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim"):
    if m[f] < 1:
      _fail(f"model.{f}", f"must be >= 1, got {m[f]}")
  if m.num_heads % m.num_kv_heads:
    _fail("model.num_kv_heads", f"must divide model.num_heads ({m.num_heads}), got {m.num_kv_heads}")
  if m.head_dim % 2:
    _fail("model.head_dim", f"must be even for rotary positions, got {m.head_dim}")
  if m.dtype not in ("float32", "bfloat16"):
    _fail("model.dtype", f"must be 'float32' or 'bfloat16', got {m.dtype!r}")
  d = c.data
  if d.format not in ("bytes", "array_record"):
    _fail("data.format", f"must be 'bytes' or 'array_record', got {d.format!r}")
  if d.format == "bytes" and m.vocab_size != 256:
    _fail("model.vocab_size", f"must be 256 with data.format='bytes' (a token is a byte), got {m.vocab_size}")
  if d.format == "array_record":
    for f in ("tokenizer", "train_files", "eval_files"):
      if not d[f]:
        _fail(f"data.{f}", "is required with data.format='array_record'")
  if d.seq_len < 2:
    _fail("data.seq_len", f"must be >= 2, got {d.seq_len}")
  if d.seq_len > m.max_seq_len:
    _fail("data.seq_len", f"({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len})")
  if d.global_batch < 1:
    _fail("data.global_batch", f"must be >= 1, got {d.global_batch}")
  if not 0.0 < d.eval_fraction < 1.0:
    _fail("data.eval_fraction", f"must be in (0, 1), got {d.eval_fraction}")
  t = c.train
  if t.steps < 1:
    _fail("train.steps", f"must be >= 1, got {t.steps}")
  if t.min_step_s < 0:
    _fail("train.min_step_s", f"must be >= 0, got {t.min_step_s}")
  if t.log_every < 1 or t.eval_every < 1:
    _fail("train.log_every" if t.log_every < 1 else "train.eval_every", "must be >= 1")
  _validate_inner(t, t.steps, lambda f: f"train.{f}")
  if d.baseline_order not in BASELINE_ORDERS:
    _fail("data.baseline_order", f"must be one of {BASELINE_ORDERS}, got {d.baseline_order!r}")
  # (With learners.device_counts, the learners' own shares must divide: `_validate_learner_set`.)
  if (d.baseline_order == "learner_shards" and c.learners.num >= 1 and not c.learners.device_counts
      and d.global_batch % c.learners.num):
    _fail("data.global_batch", f"({d.global_batch}) must divide over learners.num ({c.learners.num}) "
          "for data.baseline_order='learner_shards' (or set it to 'shuffled')")
  axes = {"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": c.mesh.tensor}
  fills = [k for k, v in axes.items() if v == -1]
  if len(fills) > 1:
    _fail(f"mesh.{fills[1]}", "only one mesh axis may be -1 (the fill)")
  for k, v in axes.items():
    if v == 0 or v < -1:
      _fail(f"mesh.{k}", f"must be >= 1 or -1 (fill), got {v}")
  if m.num_kv_heads % max(c.mesh.tensor, 1):
    _fail("mesh.tensor", f"({c.mesh.tensor}) must divide model.num_kv_heads ({m.num_kv_heads})")
  if c.syncer.merge_threads < 0:
    _fail("syncer.merge_threads", f"must be >= 0 (0: this host's cores, at most 8), got {c.syncer.merge_threads}")
  o = c.outer
  if learners:
    if c.learners.num < 1:
      _fail("learners.num", f"must be >= 1, got {c.learners.num}")
    _validate_learner_set(c)
    if o.num_fragments < 1:
      _fail("outer.num_fragments", f"must be >= 1, got {o.num_fragments}")
    if o.sync_every < 1:
      _fail("outer.sync_every", f"must be >= 1, got {o.sync_every}")
    if o.num_fragments > o.sync_every:
      _fail("outer.num_fragments", f"({o.num_fragments}) must be <= outer.sync_every ({o.sync_every}) "
            "so that fragment offsets are distinct")
    for field in ("codec", "downlink_codec"):
      if o[field] not in CODECS:
        _fail(f"outer.{field}", f"must be one of {CODECS}, got {o[field]!r}")
    if o.merge not in MERGE_RULES:
      _fail("outer.merge", f"must be one of {MERGE_RULES}, got {o.merge!r}")
    if o.fragment_plan not in PLANS:
      _fail("outer.fragment_plan", f"must be one of {PLANS}, got {o.fragment_plan!r}")
    if o.sync_schedule not in SCHEDULES:
      _fail("outer.sync_schedule", f"must be one of {SCHEDULES}, got {o.sync_schedule!r}")
    if not (math.isfinite(o.schedule_power) and o.schedule_power >= 1.0):
      _fail("outer.schedule_power", f"must be a finite number >= 1 (1: periodic spacing), got {o.schedule_power}")
    if not 0.0 <= o.alpha < 1.0:
      _fail("outer.alpha", f"must be in [0, 1), got {o.alpha}")
    if o.min_quorum < 0 or o.min_quorum > c.learners.num:
      _fail("outer.min_quorum", f"must be in [0 (all), learners.num={c.learners.num}], got {o.min_quorum}")
    if o.stall_s < 0:
      _fail("outer.stall_s", f"must be >= 0 (0 = outer.max_grace_s), got {o.stall_s}")
    if o.lease_s <= 0:
      _fail("outer.lease_s", f"must be > 0, got {o.lease_s}")
    if o.max_in_flight < 0:
      _fail("outer.max_in_flight", f"must be >= 1, or 0 (what the schedule needs), got {o.max_in_flight}")
    if o.codec_block < 1:
      _fail("outer.codec_block", f"must be >= 1, got {o.codec_block}")
    if o.downlink_history < 0:
      _fail("outer.downlink_history", f"must be >= 0 (0: 2 x learners.num), got {o.downlink_history}")
    inner = c.learners.inner
    _validate_inner(learner_train(c), t.steps,
                    lambda f: f"learners.inner.{f}" if inner[f] is not None else f"train.{f} (via learners.inner)")
    if not o.max_norm_ratio >= 0:
      _fail("outer.max_norm_ratio", f"must be >= 0 (0 = off), got {o.max_norm_ratio}")
    if not c.comms.shutdown_grace_s >= 0:
      _fail("comms.shutdown_grace_s", f"must be >= 0, got {c.comms.shutdown_grace_s}")
    for field in ("stream_stall_s", "stream_deadline_s"):
      if not c.syncer[field] > 0:
        _fail(f"syncer.{field}", f"must be > 0, got {c.syncer[field]}")
    if not c.learners.peer_timeout_s > 0:
      _fail("learners.peer_timeout_s", f"must be > 0, got {c.learners.peer_timeout_s}")
  if num_devices is not None:
    if learners:
      counts = [learner_devices(c, i) for i in range(c.learners.num)]
      meshes = [(n, learner_batch(c, i)) for i, n in enumerate(counts)]
      want = sum(counts)
      field = "learners.device_counts" if c.learners.device_counts else "learners.devices"
    else:
      want = c.mesh.num_devices or num_devices
      meshes = [(want, d.global_batch)]
      field = "mesh.num_devices"
    if want > num_devices:
      _fail(field, f"asks for {want} devices but only {num_devices} exist")
    for mesh_devices, per_mesh_batch in sorted(set(meshes)):
      try:
        sizes = mesh_lib.resolve_axis_sizes(axes, mesh_devices)
      except ValueError as e:
        _fail("mesh", str(e))
      batch_ways = sizes["data"] * sizes["fsdp"]  # the batch is split over data and fsdp
      # Every mesh also evaluates batches of data.global_batch sequences (the same eval set everywhere).
      for batch, what in ((per_mesh_batch, "per-mesh batch"), (d.global_batch, "eval batch")):
        if batch % batch_ways:
          _fail("data.global_batch", f"{what} {batch} does not divide over the data*fsdp axes "
                f"({batch_ways} ways) of a {mesh_devices}-device mesh")


def _validate_learner_set(c: ml_collections.ConfigDict) -> None:
  """The learners' devices, batch shares and emulated speeds (`learners.*`)."""
  lc, num = c.learners, c.learners.num
  if lc.devices < 1:
    _fail("learners.devices", f"must be >= 1, got {lc.devices}")
  for field in ("device_counts", "speeds"):
    values = tuple(lc[field])
    if values and len(values) != num:
      _fail(f"learners.{field}", f"needs one value per learner (learners.num={num}) or none, got {len(values)}")
  for n in lc.device_counts:
    if not isinstance(n, int) or n < 1:
      _fail("learners.device_counts", f"must hold integers >= 1, got {tuple(lc.device_counts)}")
  for v in lc.speeds:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 100):
      _fail("learners.speeds", f"must hold numbers in (0, 100], got {tuple(lc.speeds)}")
  if not 0.0 <= lc.step_cv < 1.0:
    _fail("learners.step_cv", f"must be in [0, 1), got {lc.step_cv}")
  if not (math.isfinite(lc.step_s) and lc.step_s >= 0):
    _fail("learners.step_s", f"must be >= 0 (0: the measured step time), got {lc.step_s}")
  counts = [learner_devices(c, i) for i in range(num)]
  if any(c.data.global_batch * n % sum(counts) for n in counts):
    why = (f"in proportion to learners.device_counts {tuple(counts)}" if lc.device_counts
           else f"over learners.num ({num})")
    _fail("data.global_batch", f"({c.data.global_batch}) must divide {why}")


def learner_devices(c: ml_collections.ConfigDict, learner_id: int) -> int:
  """Devices of learner `learner_id`: `learners.device_counts[i]`, else `learners.devices` (also for an id
  beyond a too-short `device_counts`, which `validate` refuses: callers may size devices before that)."""
  counts = tuple(c.learners.device_counts)
  return int(counts[learner_id]) if learner_id < len(counts) else int(c.learners.devices)


def learner_batch(c: ml_collections.ConfigDict, learner_id: int) -> int:
  """Sequences per step of learner `learner_id`: its devices' share of `data.global_batch` (so that all
  learners together read the global batch per step; equal shares when every learner has the same devices)."""
  total = sum(learner_devices(c, i) for i in range(c.learners.num))
  return c.data.global_batch * learner_devices(c, learner_id) // total


def learner_speed(c: ml_collections.ConfigDict, learner_id: int) -> float:
  """The emulated speed factor of learner `learner_id` (1 unless `learners.speeds` says otherwise)."""
  speeds = tuple(c.learners.speeds)
  return float(speeds[learner_id]) if speeds else 1.0


def _validate_inner(t, steps: int, name) -> None:
  """Checks the inner-optimizer fields of `t` (a train section); `name(field)` is the field to blame."""
  if t.optimizer not in OPTIMIZERS:
    _fail(name("optimizer"), f"must be one of {OPTIMIZERS}, got {t.optimizer!r}")
  if not t.lr > 0:
    _fail(name("lr"), f"must be > 0, got {t.lr}")
  if not 0 <= t.warmup_steps <= steps:
    _fail(name("warmup_steps"), f"must be in [0, train.steps={steps}], got {t.warmup_steps}")
  for f in ("b1", "b2"):
    if not 0.0 <= t[f] < 1.0:
      _fail(name(f), f"must be in [0, 1), got {t[f]}")
  if not 0.0 <= t.min_lr_ratio <= 1.0:
    _fail(name("min_lr_ratio"), f"must be in [0, 1], got {t.min_lr_ratio}")
  for f in ("weight_decay", "eps", "grad_clip"):
    if not t[f] >= 0:
      _fail(name(f), f"must be >= 0, got {t[f]}")


def learner_train(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The learners' `train` section: `train` with the learner rule applied and `learners.inner` on top.

  Every field of `learners.inner` that is not None replaces the matching `train` field as it is.
  """
  t = ml_collections.ConfigDict(c.train.to_dict())
  for field, value in c.learners.inner.items():
    if value is not None:
      t[field] = value
  return t


def stall_bound_s(config) -> float:
  """`outer.stall_s`, or with 0 (the default) the grace window's cap `outer.max_grace_s` (at least 0.5 s):
  a stopped learner is waited for no longer than a straggler would be."""
  o = config.outer
  return float(o.stall_s) if o.stall_s > 0 else max(float(o.max_grace_s), 0.5)


def heartbeat_interval_s(config) -> float:
  """How often a learner heartbeats: a third of the stall bound (so that a learner making progress is
  never taken for a stopped one), at most every second and at least four times per lease."""
  return max(min(1.0, float(config.outer.lease_s) / 4, stall_bound_s(config) / 3), 0.02)


# Fields every process of one run must agree on: a learner whose fingerprint differs is refused.
_FINGERPRINT_FIELDS = ("model", "data.seq_len", "outer.num_fragments", "outer.sync_every", "outer.codec",
                       "outer.codec_block", "outer.fragment_plan", "outer.sync_schedule", "outer.schedule_power",
                       "learners.num", "seed")


def fingerprint(c: ml_collections.ConfigDict, run_id: str = "") -> str:
  """A short hash of the run id and the config fields that must match across a run's processes."""
  def get(path):
    node = c
    for part in path.split("."):
      node = node[part]
    return node.to_dict() if isinstance(node, ml_collections.ConfigDict) else node

  blob = json.dumps({"run_id": run_id, **{f: get(f) for f in _FINGERPRINT_FIELDS}}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


CONFIG_FILE = "config.json"
FINGERPRINT_FILE = "fingerprint.txt"


def save_resolved(c: ml_collections.ConfigDict, workdir: str | os.PathLike, run_id: str = "") -> pathlib.Path:
  """Writes the config as this process runs it (after every override) to `<workdir>/config.json`, and its
  run fingerprint to `<workdir>/fingerprint.txt` beside it; returns the config file's path. Both are
  replaced atomically (a run resumed with other overrides records the ones it resumed with)."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  files = {CONFIG_FILE: c.to_json_best_effort(indent=2, sort_keys=True) + "\n",
           FINGERPRINT_FILE: f"{fingerprint(c, run_id)}\n"}
  for name, text in files.items():
    tmp = workdir / f"{name}.tmp"
    tmp.write_text(text)
    tmp.replace(workdir / name)
  return workdir / CONFIG_FILE


def load_resolved(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config a run saved with `save_resolved` (its fingerprint matches the saved one). JSON has no
  tuples: fields that are tuples in `base_config` (e.g. `learners.speeds`) come back as tuples."""
  loaded = json.loads((pathlib.Path(workdir) / CONFIG_FILE).read_text())

  def restore(node: dict, template) -> None:
    for key, value in node.items():
      want = template.get(key) if isinstance(template, ml_collections.ConfigDict) else None
      if isinstance(value, dict):
        restore(value, want)
      elif isinstance(value, list) and isinstance(want, tuple):
        node[key] = tuple(value)

  restore(loaded, base_config())
  return ml_collections.ConfigDict(loaded)

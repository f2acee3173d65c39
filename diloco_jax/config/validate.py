"""The one check of a config's fields: `validate()` raises `ConfigError` naming the bad field.

It runs before anything compiles. Its second stage, which needs the model's shapes and the data files
(the fragment plan, `data.check_files`), is `cli.validated`: the one function a command calls, which
runs both and returns the resolved spec. Nothing built from the spec checks a field again.
"""

from __future__ import annotations

import math

import ml_collections

from diloco_jax.config.resolve import resolve, resolve_axis_sizes
from diloco_jax.config.schema import BASELINE_ORDERS, OPTIMIZERS, ConfigError
from diloco_jax.outer.codec import CODECS
from diloco_jax.outer.fragments import PLANS
from diloco_jax.outer.merge import MERGE_RULES
from diloco_jax.outer.schedule import SCHEDULES


def _fail(field: str, message: str):
  raise ConfigError(f"config.{field}: {message}")


def validate(c: ml_collections.ConfigDict, num_devices: int | None = None, *, learners: bool = False) -> None:
  """Check a config; raise ConfigError naming the field. `learners`: also the fields of the learners, the
  outer loop and the syncer (the baseline has none); `num_devices`: devices available to the job. A
  `data.global_batch` that does not split names the nearest larger one that does."""
  try:
    _validate(c, num_devices, learners)
  except ConfigError as e:
    if not str(e).startswith("config.data.global_batch:"):
      raise
    fits = _batch_that_splits(c, num_devices, learners)
    raise ConfigError(f"{e}; e.g. --config.data.global_batch={fits}" if fits else str(e)) from None


_BATCH_SEARCH = 64  # how many larger batches `_batch_that_splits` tries


def _batch_that_splits(c: ml_collections.ConfigDict, num_devices: int | None, learners: bool) -> int | None:
  """The smallest data.global_batch above `c`'s that every batch split of the config accepts (None if
  none of the next _BATCH_SEARCH does): what the error suggests works as suggested."""
  trial = ml_collections.ConfigDict(c.to_dict())
  for batch in range(c.data.global_batch + 1, c.data.global_batch + 1 + _BATCH_SEARCH):
    trial.data.global_batch = batch
    try:
      _validate(trial, num_devices, learners)
    except ConfigError as e:
      if str(e).startswith("config.data.global_batch:"):
        continue
    return batch
  return None


def _validate(c: ml_collections.ConfigDict, num_devices: int | None, learners: bool) -> None:
  _validate_model_and_data(c)
  t = c.train
  if t.steps < 1:
    _fail("train.steps", f"must be >= 1, got {t.steps}")
  if c.emulation.min_step_s < 0:
    _fail("emulation.min_step_s", f"must be >= 0, got {c.emulation.min_step_s}")
  if t.log_every < 1 or t.eval_every < 1:
    _fail("train.log_every" if t.log_every < 1 else "train.eval_every", "must be >= 1")
  _validate_inner(t, t.steps, lambda f: f"train.{f}")
  d = c.data
  if d.baseline_order not in BASELINE_ORDERS:
    _fail("data.baseline_order", f"must be one of {BASELINE_ORDERS}, got {d.baseline_order!r}")
  # (With learners, their own shares must divide, whatever the baseline's order: `_validate_learner_set`.)
  if (not learners and d.baseline_order == "learner_shards" and c.learners.num >= 1
      and not c.learners.device_counts and d.global_batch % c.learners.num):
    _fail("data.global_batch", f"({d.global_batch}) must divide over learners.num ({c.learners.num}) "
          "for data.baseline_order='learner_shards' (or --config.data.baseline_order=shuffled)")
  axes = _mesh_axes(c)
  fills = [k for k, v in axes.items() if v == -1]
  if len(fills) > 1:
    _fail(f"mesh.{fills[1]}", "only one mesh axis may be -1 (the fill)")
  for k, v in axes.items():
    if v == 0 or v < -1:
      _fail(f"mesh.{k}", f"must be >= 1 or -1 (fill), got {v}")
  if c.model.num_kv_heads % max(c.mesh.tensor, 1):
    _fail("mesh.tensor", f"({c.mesh.tensor}) must divide model.num_kv_heads ({c.model.num_kv_heads})")
  if c.syncer.merge_threads < 0:
    _fail("syncer.merge_threads", f"must be >= 0 (0: this host's cores, at most 8), got {c.syncer.merge_threads}")
  if learners:
    if c.learners.num < 1:
      _fail("learners.num", f"must be >= 1, got {c.learners.num}")
    _validate_learner_set(c)
    _validate_outer(c)
    _validate_inner(resolve(c).learners.inner, t.steps, lambda f: f"learners.inner.{f}"
                    if c.learners.inner[f] is not None else f"train.{f} (via learners.inner)")
    _validate_processes(c)
  if num_devices is not None:
    _validate_devices(c, num_devices, learners)


def _mesh_axes(c) -> dict[str, int]:
  return {"data": c.mesh.data, "fsdp": c.mesh.fsdp, "tensor": c.mesh.tensor}


def _validate_model_and_data(c) -> None:
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


def _validate_outer(c) -> None:
  """The outer loop's and the syncer's rules (`outer.*`)."""
  o = c.outer
  if o.num_fragments < 1:
    _fail("outer.num_fragments", f"must be >= 1, got {o.num_fragments}")
  if o.sync_every < 1:
    _fail("outer.sync_every", f"must be >= 1, got {o.sync_every}")
  if o.num_fragments > o.sync_every:
    _fail("outer.num_fragments", f"({o.num_fragments}) must be <= outer.sync_every ({o.sync_every}) "
          "so that fragment offsets are distinct")
  for field, names in (("codec", CODECS), ("downlink_codec", CODECS), ("merge", MERGE_RULES),
                       ("fragment_plan", PLANS), ("sync_schedule", SCHEDULES)):
    if o[field] not in names:
      _fail(f"outer.{field}", f"must be one of {names}, got {o[field]!r}")
  if not (math.isfinite(o.schedule_power) and o.schedule_power >= 1.0):
    _fail("outer.schedule_power", f"must be a finite number >= 1 (1: periodic spacing), got {o.schedule_power}")
  if o.tau < 0:
    _fail("outer.tau", f"must be >= 0, got {o.tau}")
  if not 0.0 <= o.phase_gain <= 1.0:
    _fail("outer.phase_gain", f"must be in [0, 1] (0: off), got {o.phase_gain}")
  if not 0.0 <= o.alpha < 1.0:
    _fail("outer.alpha", f"must be in [0, 1), got {o.alpha}")
  if not o.staleness_beta >= 0:
    _fail("outer.staleness_beta", f"must be >= 0, got {o.staleness_beta}")
  if o.min_quorum < 0 or o.min_quorum > c.learners.num:
    _fail("outer.min_quorum", f"must be in [0 (all), learners.num={c.learners.num}], got {o.min_quorum}")
  if not 0.0 <= o.grace_gamma < 1.0:
    _fail("outer.grace_gamma", f"must be in [0, 1), got {o.grace_gamma}")
  if not 0.0 <= o.min_grace_s <= o.max_grace_s:
    _fail("outer.min_grace_s", f"({o.min_grace_s}) must be in [0, outer.max_grace_s ({o.max_grace_s})]")
  if o.stall_s < 0:
    _fail("outer.stall_s", f"must be >= 0 (0 = outer.max_grace_s), got {o.stall_s}")
  if not o.lease_s > 0:
    _fail("outer.lease_s", f"must be > 0, got {o.lease_s}")
  if o.max_in_flight < 0:
    _fail("outer.max_in_flight", f"must be >= 1, or 0 (what the schedule needs), got {o.max_in_flight}")
  if o.codec_block < 1:
    _fail("outer.codec_block", f"must be >= 1, got {o.codec_block}")
  if o.downlink_history < 0:
    _fail("outer.downlink_history", f"must be >= 0 (0: 2 x learners.num), got {o.downlink_history}")
  if not o.max_norm_ratio >= 0:
    _fail("outer.max_norm_ratio", f"must be >= 0 (0 = off), got {o.max_norm_ratio}")


def _validate_processes(c) -> None:
  """Limits of the learner and syncer processes (`comms.*`, `syncer.*`, `learners.peer_timeout_s`)."""
  if not c.comms.shutdown_grace_s >= 0:
    _fail("comms.shutdown_grace_s", f"must be >= 0, got {c.comms.shutdown_grace_s}")
  for field in ("stream_stall_s", "stream_deadline_s"):
    if not c.syncer[field] > 0:
      _fail(f"syncer.{field}", f"must be > 0, got {c.syncer[field]}")
  if not c.learners.peer_timeout_s > 0:
    _fail("learners.peer_timeout_s", f"must be > 0, got {c.learners.peer_timeout_s}")


def _validate_learner_set(c: ml_collections.ConfigDict) -> None:
  """The learners' devices and batch shares (`learners.*`), and their emulated speeds (`emulation.*`)."""
  lc, em, num = c.learners, c.emulation, c.learners.num
  if lc.devices < 1:
    _fail("learners.devices", f"must be >= 1, got {lc.devices}")
  for field, values in (("learners.device_counts", tuple(lc.device_counts)), ("emulation.speeds", tuple(em.speeds))):
    if values and len(values) != num:
      _fail(field, f"needs one value per learner (learners.num={num}) or none, got {len(values)}")
  for n in lc.device_counts:
    if not isinstance(n, int) or n < 1:
      _fail("learners.device_counts", f"must hold integers >= 1, got {tuple(lc.device_counts)}")
  for v in em.speeds:
    if not (isinstance(v, (int, float)) and math.isfinite(v) and 0 < v <= 100):
      _fail("emulation.speeds", f"must hold numbers in (0, 100], got {tuple(em.speeds)}")
  if not 0.0 <= em.step_cv < 1.0:
    _fail("emulation.step_cv", f"must be in [0, 1), got {em.step_cv}")
  if not (math.isfinite(em.step_s) and em.step_s >= 0):
    _fail("emulation.step_s", f"must be >= 0 (0: the measured step time), got {em.step_s}")
  counts = resolve(c).learners.device_counts
  if any(c.data.global_batch * n % sum(counts) for n in counts):
    why = (f"in proportion to learners.device_counts {tuple(counts)}" if lc.device_counts
           else f"over learners.num ({num})")
    _fail("data.global_batch", f"({c.data.global_batch}) must divide {why}")


def _validate_devices(c, num_devices: int, learners: bool) -> None:
  """The devices asked for exist, and every mesh splits its batch and the eval batch over data x fsdp."""
  d = c.data
  if learners:
    spec = resolve(c).learners
    meshes = list(zip(spec.device_counts, spec.batches))
    want = sum(spec.device_counts)
    field = "learners.device_counts" if c.learners.device_counts else "learners.devices"
  else:
    want = c.mesh.num_devices or num_devices
    meshes = [(want, d.global_batch)]
    field = "mesh.num_devices"
  if want > num_devices:
    _fail(field, f"asks for {want} devices but only {num_devices} exist")
  for mesh_devices, per_mesh_batch in sorted(set(meshes)):
    try:
      sizes = resolve_axis_sizes(_mesh_axes(c), mesh_devices)
    except ValueError as e:
      _fail("mesh", str(e))
    batch_ways = sizes["data"] * sizes["fsdp"]  # the batch is split over data and fsdp
    # Every mesh also evaluates batches of data.global_batch sequences (the same eval set everywhere).
    for batch, what in ((per_mesh_batch, "per-mesh batch"), (d.global_batch, "eval batch")):
      if batch % batch_ways:
        _fail("data.global_batch", f"{what} {batch} does not divide over the data*fsdp axes "
              f"({batch_ways} ways) of a {mesh_devices}-device mesh")


def _validate_inner(t, steps: int, name) -> None:
  """Checks the inner-optimizer fields of `t` (a train section); `name(field)` is the field to blame."""
  if t.optimizer not in OPTIMIZERS:
    _fail(name("optimizer"), f"must be one of {OPTIMIZERS}, got {t.optimizer!r}")
  if not t.lr > 0:
    _fail(name("lr"), f"must be > 0, got {t.lr}")
  if not 0 <= t.warmup_steps <= steps:
    _fail(name("warmup_steps"), f"must be in [0, train.steps={steps}], got {t.warmup_steps}")
  for f in ("b1", "b2"):
    if not 0.0 <= getattr(t, f) < 1.0:
      _fail(name(f), f"must be in [0, 1), got {getattr(t, f)}")
  if not 0.0 <= t.min_lr_ratio <= 1.0:
    _fail(name("min_lr_ratio"), f"must be in [0, 1], got {t.min_lr_ratio}")
  for f in ("weight_decay", "eps", "grad_clip"):
    if not getattr(t, f) >= 0:
      _fail(name(f), f"must be >= 0, got {getattr(t, f)}")

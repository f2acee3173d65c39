"""A config resolved: `resolve(config) -> RunSpec`, frozen specs per part, every derived value filled in.

Each process resolves its config once (`cli.validated` returns the spec) and hands the spec, or its parts,
to what it builds; no part derives its piece of the config again. The specs use the config's section and
field names (`spec.outer.codec` reads as `config.outer.codec`), with the fields whose 0, () or None
means "derive it" resolved here, and a few derived values beside them (`learners.batches`,
`outer.heartbeat_s`). What needs the model's shapes (the fragment plan) is not here: `outer/fragments`.
`as_config(spec)` is the resolved config that `config.json` records; resolving it gives the same spec.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import ml_collections

from diloco_jax.config.schema import SCHEMA
from diloco_jax.outer import chunked, schedule


class _Section:
  """A frozen section of a RunSpec, read as a ConfigDict section reads: `s.field`, `s["field"]`, `s.to_dict()`."""

  def __getitem__(self, field: str):
    return getattr(self, field)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class ModelSpec(_Section):
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float
  tie_embeddings: bool
  dtype: str
  remat: bool


@dataclasses.dataclass(frozen=True)
class DataSpec(_Section):
  format: str
  path: str
  tokenizer: str
  train_files: str
  eval_files: str
  seq_len: int
  global_batch: int
  eval_fraction: float
  eval_batches: int
  max_bytes: int
  baseline_order: str


@dataclasses.dataclass(frozen=True)
class TrainSpec(_Section):
  """The `train` section: the baseline's inner optimizer and loop, or a learner's (`learners.inner`)."""

  steps: int
  optimizer: str
  lr: float
  warmup_steps: int
  min_lr_ratio: float
  weight_decay: float
  b1: float
  b2: float
  eps: float
  grad_clip: float
  log_every: int
  eval_every: int
  checkpoint_every: int
  keep_checkpoints: int


@dataclasses.dataclass(frozen=True)
class MeshSpec(_Section):
  data: int
  fsdp: int
  tensor: int
  num_devices: int


@dataclasses.dataclass(frozen=True)
class LearnersSpec(_Section):
  num: int
  devices: int
  device_counts: tuple[int, ...]  # learner i's devices (resolved: one per learner)
  peer_timeout_s: float
  inner: TrainSpec  # the learners' `train`: `train` with every set `learners.inner` field on top
  batches: tuple[int, ...]  # derived: learner i's sequences per step, its devices' share of data.global_batch


@dataclasses.dataclass(frozen=True)
class OuterSpec(_Section):
  num_fragments: int
  sync_every: int  # H as configured (a front-loaded schedule's gaps differ: `outer.fragments.FragmentPlan`)
  sync_schedule: str
  schedule_power: float
  tau: int
  alpha: float
  keep_local_progress: bool
  lr: float
  momentum: float
  merge: str
  rda: bool
  staleness_beta: float
  codec: str
  error_feedback: bool
  downlink_codec: str
  codec_block: int
  fragment_plan: str
  min_quorum: int  # resolved: 0 -> learners.num
  scale_partial_rounds: bool
  grace_gamma: float
  min_grace_s: float
  max_grace_s: float
  phase_gain: float
  max_norm_ratio: float
  max_in_flight: int  # resolved: 0 -> what the schedule needs
  downlink_history: int  # resolved: 0 -> 2 x learners.num
  lease_s: float
  stall_s: float  # resolved: 0 -> max(max_grace_s, 0.5)
  heartbeat_s: float  # derived: how often a learner heartbeats


@dataclasses.dataclass(frozen=True)
class CommsSpec(_Section):
  chunk_kb: int
  unreachable_deadline_s: float
  backoff_s: float
  max_backoff_s: float
  call_timeout_s: float
  shutdown_grace_s: float


@dataclasses.dataclass(frozen=True)
class SyncerSpec(_Section):
  chunk_kb: int
  max_message_mb: int
  max_push_mb: int
  rate_limit_per_s: float
  rate_limit_burst: float
  max_pull_wait_s: float
  stream_stall_s: float
  stream_deadline_s: float
  data_plane: bool
  merge_threads: int  # resolved: 0 -> this host's cores, at most 8
  checkpoint_every_rounds: int
  keep_checkpoints: int
  shutdown_grace_s: float


@dataclasses.dataclass(frozen=True)
class EmulationSpec(_Section):
  speeds: tuple[float, ...]  # resolved: one per learner (() -> all 1)
  step_cv: float
  step_s: float
  min_step_s: float
  wan_gbps: float
  wan_latency_ms: float
  cutoff_file: str


@dataclasses.dataclass(frozen=True)
class RunSpec(_Section):
  """A run's config, resolved: what every part of a process is built from."""

  seed: int
  model: ModelSpec
  data: DataSpec
  train: TrainSpec
  mesh: MeshSpec
  learners: LearnersSpec
  outer: OuterSpec
  comms: CommsSpec
  syncer: SyncerSpec
  emulation: EmulationSpec


def resolve(config) -> RunSpec:
  """The RunSpec of `config` (a ConfigDict; a RunSpec is returned as it is). Pure, and total: a config
  that `validate` refuses resolves without raising, so that a command may size its devices first."""
  if isinstance(config, RunSpec):
    return config
  num = int(config.learners.num)
  train = TrainSpec(**_section(config, "train"))
  inner = dataclasses.replace(train, **{k: v for k, v in _section(config, "learners.inner").items() if v is not None})
  counts = _device_counts(config.learners.device_counts, int(config.learners.devices), num)
  total = sum(counts) or 1
  learners = LearnersSpec(**{**_section(config, "learners"), "device_counts": counts, "inner": inner,
                             "batches": tuple(int(config.data.global_batch) * n // total for n in counts)})
  speeds = tuple(float(v) for v in config.emulation.speeds) or (1.0,) * num
  syncer = _section(config, "syncer")
  syncer["merge_threads"] = int(syncer["merge_threads"]) or chunked.default_threads()
  return RunSpec(seed=config.seed, model=ModelSpec(**_section(config, "model")),
                 data=DataSpec(**_section(config, "data")), train=train, mesh=MeshSpec(**_section(config, "mesh")),
                 learners=learners, outer=OuterSpec(**_outer(_section(config, "outer"), num)),
                 comms=CommsSpec(**_section(config, "comms")), syncer=SyncerSpec(**syncer),
                 emulation=EmulationSpec(**{**_section(config, "emulation"), "speeds": speeds}))


def _section(config, name: str) -> dict:
  """The schema's fields of section `name` of `config` (fields the schema does not have are left out)."""
  node = config
  for part in name.split("."):
    node = node[part]
  return {field: node[field] for field in SCHEMA[name]}


def _device_counts(counts, devices: int, num: int) -> tuple[int, ...]:
  """Learner i's devices: `device_counts[i]`, else `devices` (also past a too-short `device_counts`)."""
  counts = tuple(counts)
  return tuple(int(counts[i]) if i < len(counts) else devices for i in range(num))


def _outer(o: dict, num: int) -> dict:
  """The `outer` section with its derived fields filled in (`num`: learners.num)."""
  tau = int(o["tau"])
  spacing = max(1, schedule.min_spacing(o["sync_schedule"], int(o["sync_every"]), tau))
  stall_s = float(o["stall_s"]) if o["stall_s"] > 0 else max(float(o["max_grace_s"]), 0.5)
  return {**o, "min_quorum": int(o["min_quorum"]) or num, "downlink_history": int(o["downlink_history"]) or 2 * num,
          "max_in_flight": schedule.in_flight_limit(int(o["max_in_flight"]), int(o["num_fragments"]), spacing, tau),
          "stall_s": stall_s, "heartbeat_s": heartbeat_interval_s(float(o["lease_s"]), stall_s)}


def heartbeat_interval_s(lease_s: float, stall_s: float) -> float:
  """How often a learner heartbeats: a third of the stall bound (so that a learner making progress is never
  taken for a stopped one), at most every second and at least four times per lease."""
  return max(min(1.0, lease_s / 4, stall_s / 3), 0.02)


def as_config(spec: RunSpec) -> ml_collections.ConfigDict:
  """The config of `spec`: every schema field at its resolved value (derived-only values left out)."""
  c = ml_collections.ConfigDict()
  for section, fields in SCHEMA.items():
    node, source = c, spec
    for part in filter(None, section.split(".")):
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node, source = node[part], getattr(source, part)
    for name in fields:
      node[name] = getattr(source, name)
  return c


def resolve_axis_sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Mesh axis sizes with the single -1 filled so that their product is `num_devices`."""
  fills = [k for k, v in axes.items() if v == -1]
  if len(fills) > 1:
    raise ValueError(f"only one axis may be -1, got {dict(axes)}")
  fixed = math.prod(v for v in axes.values() if v != -1)
  if fills:
    if num_devices % fixed:
      raise ValueError(f"axes {dict(axes)} do not divide {num_devices} devices")
    return {k: (num_devices // fixed if v == -1 else v) for k, v in axes.items()}
  if fixed != num_devices:
    raise ValueError(f"axes {dict(axes)} need {fixed} devices, got {num_devices}")
  return dict(axes)

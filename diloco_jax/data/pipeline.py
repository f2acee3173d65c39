"""The data a learner trains and evaluates on: grain pipelines over packed windows, one disjoint shard per
learner, from the byte corpus (`corpus.py`) or token shards (`token_windows.py`), by `data.format`.

Learner `k` of `M` reads windows `k, k + M, k + 2M, ...`: the shards are disjoint and cover every window.

Pipeline per learner (grain 0.2 dataset API; a learner spanning several processes reads its batches in
parts, one per process: `train_iterator`)::

  MapDataset.source(windows)[k::M].seed(s).shuffle().repeat().batch(b, drop_remainder=True)
      .to_iter_dataset()

The resulting iterator's `get_state()` is a small JSON-able dict (`{"next_index": n}`) that orbax stores
with the checkpoint; `set_state()` on a fresh iterator of the same config resumes at the same batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from diloco_jax.config.schema import ConfigError
from diloco_jax.data import corpus, token_windows

# Bounded host-side prefetch: batch assembly is a few numpy slices, so a couple of threads keep up with any
# step time, and a small buffer keeps memory flat when many learners share one process.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def check_files(config) -> None:
  """The data files the config names, checked before a run starts (`token_windows.check_shards` with
  `data.format = "array_record"`). Raises ConfigError naming the field. Nothing to check for bytes (the
  corpus is read when the data is first used)."""
  if config.data.format == "array_record":
    token_windows.check_shards(config)


def _train_source(data_cfg):
  if data_cfg.format == "array_record":
    return token_windows.split_windows(data_cfg, "train_files")
  return corpus.PackedWindows(_corpus(data_cfg).train, data_cfg.seq_len)


def _corpus(data_cfg) -> corpus.Corpus:
  return corpus.load_corpus(data_cfg.path, data_cfg.max_bytes, data_cfg.eval_fraction)


def _shard_seed(seed: int, shard_index: int, num_shards: int) -> int:
  # Each shard shuffles with its own stream; a hash (not seed + shard_index) keeps (seed=0, shard=1) and
  # (seed=1, shard=0) apart.
  digest = hashlib.sha1(f"{seed}/{shard_index}/{num_shards}".encode()).hexdigest()
  return int(digest, 16) % (2**31)


def train_iterator(data_cfg, *, batch_size: int, num_shards: int = 1, shard_index: int = 0,
                   seed: int = 0, part: int = 0, num_parts: int = 1) -> grain.DatasetIterator:
  """An endless, shuffled iterator of train batches for one shard (one learner).

  Args:
    data_cfg: the `config.data` ConfigDict (path, seq_len, eval_fraction, max_bytes are read).
    batch_size: sequences per batch for this shard (the learner's share of `data.global_batch`).
    num_shards: number of disjoint shards (learners).
    shard_index: which shard, in [0, num_shards).
    seed: run seed; combined with `shard_index` so every shard has its own deterministic order.
    part / num_parts: read only rows [part * b, (part + 1) * b) of every batch, b = batch_size / num_parts
      (the share of one process of a learner spanning `num_parts` processes). Process p reads sub-batches
      p, p + H, p + 2H, ... of `batch(b)` on the same stream (H = num_parts), so that the H parts of batch
      i, side by side, are exactly batch i of the one-process pipeline: the data a learner sees does not
      depend on how many hosts it spans, and each host reads only its own rows.

  Returns:
    A grain DatasetIterator over `{"tokens": int32[batch_size / num_parts, seq_len + 1]}`. Each epoch of the shard is
    reshuffled. `get_state()` / `set_state()` checkpoint and restore the position.

  Raises:
    ConfigError (a ValueError) naming the field when an argument cannot work.
  """
  if batch_size < 1:
    raise ConfigError(f"config.data.global_batch: per-shard batch_size must be >= 1, got {batch_size}")
  if num_shards < 1:
    raise ConfigError(f"config.learners.num: num_shards must be >= 1, got {num_shards}")
  if not 0 <= shard_index < num_shards:
    raise ConfigError(f"config.learners.num: shard_index {shard_index} out of range [0, {num_shards})")
  if num_parts < 1 or batch_size % num_parts or not 0 <= part < num_parts:
    raise ConfigError(f"config.data.global_batch: a learner's batch of {batch_size} cannot be read in part {part} "
                      f"of {num_parts} equal parts (one per process of the learner)")
  source = _train_source(data_cfg)
  ds = grain.MapDataset.source(source)[shard_index::num_shards]
  if len(ds) < batch_size:
    more = "data.train_files" if data_cfg.format == "array_record" else "data.path, data.max_bytes"
    raise ConfigError(
        f"config.data.global_batch: shard {shard_index} of {num_shards} holds {len(ds)} windows of "
        f"data.seq_len+1={data_cfg.seq_len + 1} tokens (of {source!r}), fewer than one batch of "
        f"{batch_size}; use more data ({more}) or a smaller data.global_batch / data.seq_len")
  ds = ds.seed(_shard_seed(seed, shard_index, num_shards)).shuffle().repeat()
  if num_parts == 1:
    ds = ds.batch(batch_size, drop_remainder=True)
  else:
    # The repeated stream is endless, so sub-batch i * num_parts + part is part `part` of batch i.
    ds = ds.batch(batch_size // num_parts, drop_remainder=True)[part::num_parts]
  return iter(ds.to_iter_dataset(_READ_OPTIONS))


class SideBySide:
  """Batches of several iterators concatenated along the batch axis, one batch of each per step, with
  `get_state()` / `set_state()` over all of them (a JSON-able dict, like a grain iterator's)."""

  def __init__(self, iterators: list):
    self._iterators = iterators

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batches = [next(it) for it in self._iterators]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  def get_state(self) -> dict:
    return {"side_by_side": [it.get_state() for it in self._iterators]}

  def set_state(self, state: dict) -> None:
    states = state.get("side_by_side") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != len(self._iterators):
      raise ValueError(f"data iterator state does not hold {len(self._iterators)} shard states "
                       "(a checkpoint from another data.baseline_order or learners.num?)")
    for it, s in zip(self._iterators, states):
      it.set_state(s)


def baseline_iterator(data_cfg, *, num_learners: int, seed: int = 0, batches: Sequence[int] | None = None):
  """The data-parallel baseline's train batches of `data.global_batch` sequences.

  With `data.baseline_order = "learner_shards"` (the default) the batch of step s is the M learners'
  batches of step s side by side: learner k's shard iterator (`train_iterator(..., num_shards=M,
  shard_index=k)`) supplies the next b_k rows, b_k = global_batch / M, or `batches[k]` (the learners' own
  batch sizes, the resolved `learners.batches`, when their device counts differ; they sum to global_batch). The
  baseline then trains on exactly the tokens the Decoupled DiLoCo learners train on, in the same steps, so a
  comparison of the two differs only in the algorithm. With "shuffled" it is one shuffle of all windows.
  """
  if data_cfg.baseline_order == "shuffled" or num_learners == 1:
    return train_iterator(data_cfg, batch_size=data_cfg.global_batch, seed=seed)
  if not batches and data_cfg.global_batch % num_learners:
    raise ConfigError(f"config.data.global_batch: ({data_cfg.global_batch}) must divide over learners.num "
                      f"({num_learners}) for data.baseline_order='learner_shards'")
  sizes = list(batches) if batches else [data_cfg.global_batch // num_learners] * num_learners
  if len(sizes) != num_learners or sum(sizes) != data_cfg.global_batch:
    raise ConfigError(f"config.data.global_batch: the learners' batches {sizes} must be one per learner "
                      f"({num_learners}) and sum to {data_cfg.global_batch}")
  return SideBySide([train_iterator(data_cfg, batch_size=b, num_shards=num_learners, shard_index=k, seed=seed)
                     for k, b in enumerate(sizes)])


def eval_batches(data_cfg, *, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  """Deterministic eval batches from the eval split: windows in order, cycling if the split is short.

  Every learner and the baseline get exactly the same batches, so their eval losses compare directly.

  Returns:
    `num_batches` dicts `{"tokens": int32[batch_size, seq_len + 1]}`.
  """
  if batch_size < 1:
    raise ConfigError(f"config.data.global_batch: eval batch_size must be >= 1, got {batch_size}")
  if num_batches < 1:
    raise ConfigError(f"config.data.eval_batches: must be >= 1, got {num_batches}")
  seq_len = data_cfg.seq_len
  if data_cfg.format == "array_record":
    source = token_windows.split_windows(data_cfg, "eval_files")
    if len(source) < 1:
      raise ConfigError(f"config.data.eval_files: {source!r} holds no window of data.seq_len+1 tokens")
  else:
    tokens = _corpus(data_cfg).eval
    if tokens.size < seq_len + 1:
      # A tiny eval split still yields one full window: repeat its tokens (np.resize tiles cyclically).
      tokens = np.resize(tokens, seq_len + 1)
    source = corpus.PackedWindows(tokens, seq_len)
  idx = np.arange(batch_size * num_batches) % len(source)
  return [
      {"tokens": np.stack([source[i]["tokens"] for i in idx[b * batch_size:(b + 1) * batch_size]])}
      for b in range(num_batches)
  ]


def tokens_in_batch(batch: Mapping[str, Any] | np.ndarray) -> int:
  """Predicted tokens in a batch: batch_size * seq_len (each window of seq_len + 1 tokens has seq_len
  targets). Accepts the batch dict or its `tokens` array."""
  tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
  b, width = tokens.shape[:2]
  return int(b) * (int(width) - 1)

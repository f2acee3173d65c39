"""One model replica training on one mesh: the piece the data-parallel baseline and every Decoupled
DiLoCo learner share.

`MeshTrainer` owns the sharded train state, its data shard (a grain iterator), the jitted inner and eval
steps, checkpoints and the step/token counters. Its mesh may span several processes (a multi-host
learner): every process then builds the same trainer, reads only its own rows of each batch
(`mesh.process_rows`), and writes the checkpoints together with the others. `run_loop` is the loop skeleton
both the baseline and the
learners run (metrics records, evals, checkpoints); what differs (the learner's outer loop) happens inside
the step function they hand it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from diloco_jax.compute import checkpoint as checkpoint_lib
from diloco_jax.compute import inner
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.data import pipeline as data_lib


class NonFiniteLoss(FloatingPointError):
  """The loss became NaN or Inf: training stops loudly instead of silently wasting compute."""


class MeshTrainer:
  """Inner training of one replica on `devices`.

  Args:
    config: the run's RunSpec (`config.resolve`) or its config.
    devices: the devices of this replica's mesh (a learner's slice, or all devices for the baseline).
    workdir: where checkpoints go (`<workdir>/checkpoints`, local or `gs://`); None disables checkpoints.
    batch_size: sequences per step for this replica.
    num_shards / shard_index: this replica's disjoint data shard.
    async_checkpoints: False for trainers that share a process (see `TrainCheckpointer`).
    checkpoint_dir: where checkpoints go instead of `<workdir>/checkpoints` (local or `gs://`).
    train_cfg: the inner optimizer's settings; default `config.train` (learners: the spec's `learners.inner`).
    data_iterator: this process's train batches; default its rows of this replica's shard of
      `data.train_iterator`.
  """

  def __init__(self, config, devices: Sequence[jax.Device], workdir: str | os.PathLike | None, *,
               batch_size: int, num_shards: int = 1, shard_index: int = 0, async_checkpoints: bool = True,
               checkpoint_dir: str | os.PathLike | None = None, train_cfg=None, data_iterator=None):
    self.config = config
    self.train_cfg = config.train if train_cfg is None else train_cfg
    self.mesh = mesh_lib.make_mesh(devices, mesh_lib.mesh_axes_from_config(config))
    self.graphdef, self.state, self.shardings = inner.init_state(config, self.mesh, self.train_cfg)
    self.step_fn = inner.make_inner_step(self.graphdef, self.train_cfg, self.mesh, self.shardings)
    self.eval_fn = inner.make_eval_step(self.graphdef, self.mesh, self.shardings.params)
    self.batch_size = batch_size
    # This process's rows of every batch: all of them unless the mesh spans several processes.
    self.rows = mesh_lib.process_rows(self.mesh, batch_size)
    rows = self.rows[1] - self.rows[0]
    if data_iterator is None:
      data_iterator = data_lib.train_iterator(config.data, batch_size=batch_size, num_shards=num_shards,
                                              shard_index=shard_index, seed=config.seed,
                                              part=self.rows[0] // rows, num_parts=batch_size // rows)
    self.data = data_iterator
    self._eval_batches = None
    self.step = 0  # host copy of state.step: reading the device copy would stall the dispatch queue
    self.tokens = 0
    self.checkpointer = None
    if checkpoint_dir is None and workdir is not None:
      checkpoint_dir = checkpoint_lib.join(workdir, "checkpoints")
    if checkpoint_dir is not None:
      self.checkpointer = checkpoint_lib.TrainCheckpointer(checkpoint_dir,
                                                           keep=config.train.keep_checkpoints,
                                                           async_save=async_checkpoints)
    self.last_metrics = None
    self._next_step_at = 0.0  # emulation.min_step_s pacing

  @property
  def num_params(self) -> int:
    return model_lib.count_params(self.state.params)

  def restore(self) -> bool:
    """Resume from the latest checkpoint in the workdir, if any. Returns whether one was found."""
    if self.checkpointer is None:
      return False
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), self.state)
    restored = self.checkpointer.restore(abstract)
    if restored is None:
      return False
    self.state, data_state, meta = restored
    self.data.set_state(data_state)
    self.step, self.tokens = int(meta["step"]), int(meta["tokens"])
    return True

  def save(self, extra_meta: dict | None = None) -> None:
    if self.checkpointer is not None:
      meta = {"step": self.step, "tokens": self.tokens, **(extra_meta or {})}
      self.checkpointer.save(self.step, self.state, self.data.get_state(), meta)

  def set_state(self, state: inner.TrainState) -> None:
    """Replace the train state (a learner adopting a merged fragment); shardings must be unchanged."""
    self.state = state

  def train_step(self):
    """One inner step; returns its metrics as device arrays (not fetched). With `emulation.min_step_s`, paced
    to at least that long per step (an emulated accelerator's speed)."""
    pace = self.config.emulation.min_step_s
    if pace > 0:
      now = time.perf_counter()
      if self._next_step_at > now:
        time.sleep(self._next_step_at - now)
      self._next_step_at = max(now, self._next_step_at) + pace
    batch = next(self.data)
    self.state, metrics = self.step_fn(self.state, inner.put_batch(batch["tokens"], self.mesh, self.batch_size))
    self.step += 1
    # The whole batch's tokens (this process's rows are only part of it).
    self.tokens += data_lib.tokens_in_batch(batch) * self.batch_size // len(batch["tokens"])
    self.last_metrics = metrics
    return metrics

  def fetch_metrics(self) -> dict[str, float]:
    """Brings the latest step's metrics to the host (a sync point: call at log intervals only) and fails
    loudly on a non-finite loss."""
    metrics = {k: float(v) for k, v in jax.device_get(self.last_metrics).items()}
    if not math.isfinite(metrics["loss"]):
      raise NonFiniteLoss(f"loss is {metrics['loss']} at step {self.step}; lower train.lr or check the data")
    return metrics

  def evaluate(self, params=None) -> float:
    """Mean loss over the held-out eval batches (the same batches every time, in every replica)."""
    if self._eval_batches is None:
      self._eval_batches = eval_set(self.config, self.mesh)
    return mean_loss(self.eval_fn, self.state.params if params is None else params, self._eval_batches)

  def close(self) -> None:
    if self.checkpointer is not None:
      self.checkpointer.close()


def eval_set(config, mesh) -> list[jax.Array]:
  """The run's shared eval set on `mesh`: `data.eval_batches` batches of `data.global_batch` sequences,
  the same for every replica and evaluator whatever its train batch, so their eval losses compare."""
  host = data_lib.eval_batches(config.data, batch_size=config.data.global_batch,
                               num_batches=config.data.eval_batches)
  out = []
  for b in host:  # every process holds the whole eval batch and feeds its rows of it
    start, stop = mesh_lib.process_rows(mesh, len(b["tokens"]))
    out.append(inner.put_batch(b["tokens"][start:stop], mesh, len(b["tokens"])))
  return out


def mean_loss(eval_fn, params, batches: Sequence[jax.Array]) -> float:
  """Mean of `eval_fn(params, batch)` over `batches` (one host sync at the end)."""
  return float(np.mean(jax.device_get([eval_fn(params, b) for b in batches])))


class RateMeter:
  """Tokens per second between two reads (wall clock)."""

  def __init__(self, tokens: int = 0):
    self._t, self._tokens = time.perf_counter(), tokens

  def read(self, tokens: int) -> float:
    now = time.perf_counter()
    rate = (tokens - self._tokens) / max(now - self._t, 1e-9)
    self._t, self._tokens = now, tokens
    return rate


def run_loop(trainer: MeshTrainer, log, *, steps: int, step_fn: Callable[[], None] | None = None,
             record_fields: Callable[[], dict] | None = None, on_record: Callable[[dict], None] | None = None,
             on_step: Callable[[], None] | None = None, should_stop: Callable[[], bool] | None = None,
             checkpoint_meta: dict | None = None) -> float | None:
  """Step `trainer` until `steps` (or `should_stop()`); returns the last eval loss (None if none ran).

  `log`: a `metrics.MetricsLog` (or None).

  `step_fn` runs one step (default `trainer.train_step`; a learner's also runs its outer loop). Every
  `train.log_every` steps and at the last, a record {step, tokens, tokens_per_s, loss, grad_norm,
  **record_fields()} goes to `log` (and `on_record`), with `eval_loss` every `train.eval_every` steps and at
  the last; a checkpoint every `train.checkpoint_every` steps (0: none here; the caller saves at the end).
  """
  t = trainer.config.train
  step_fn = step_fn or trainer.train_step
  rate = RateMeter(trainer.tokens)
  eval_loss = None
  while trainer.step < steps and not (should_stop and should_stop()):
    step_fn()
    s = trainer.step
    if s % t.log_every == 0 or s == steps:
      record = {"step": s, "tokens": trainer.tokens, "tokens_per_s": rate.read(trainer.tokens),
                **(record_fields() if record_fields else {}), **trainer.fetch_metrics()}
      if s % t.eval_every == 0 or s == steps:
        eval_loss = record["eval_loss"] = trainer.evaluate()
      if log is not None:
        log.write(record)
      if on_record:
        on_record(record)
    if t.checkpoint_every and s % t.checkpoint_every == 0:
      trainer.save(checkpoint_meta)
    if on_step:
      on_step()
  return eval_loss

"""Trainer checkpoints: an async orbax CheckpointManager of the train state (parameters, optimizer state,
step), the data iterator's state and a few counters. A run started on a workdir that holds a checkpoint
resumes from the latest one.

Directories are local paths or URLs such as `gs://bucket/run` (etils epath, as orbax uses; a `pathlib`
path would turn `gs://` into a local folder named `gs:`). A learner spanning several processes writes
each checkpoint from all of them at once (orbax coordinates them through `jax.distributed`): each process
writes the shards its devices hold, process 0 the metadata, so the directory must be one that every process
reaches (`gs://` on Cloud TPU, where each host has its own disk).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import orbax.checkpoint as ocp
from etils import epath

# Several managers saving the same step at once from threads of one process (the in-process learners)
# trip over each other's temporary directories in orbax; such saves go one at a time.
_THREADED_SAVES = threading.Lock()


def as_path(directory: str | os.PathLike) -> epath.Path:
  """`directory` as an epath: URLs (`gs://...`) unchanged, local paths made absolute."""
  text = os.fspath(directory)
  return epath.Path(text if "://" in text else os.path.abspath(text))


def join(directory: str | os.PathLike, *names: str) -> epath.Path:
  """`directory / names...`, keeping a URL a URL."""
  return as_path(directory).joinpath(*names)


class TrainCheckpointer:
  """Saves and restores (state, data_state, meta) under `directory`, keeping the newest `keep`.

  `async_save=False` makes each save complete before `save` returns, one at a time per process: for
  several trainers sharing a process (the in-process learners).
  """

  def __init__(self, directory: str | os.PathLike, keep: int = 2, async_save: bool = True):
    self.directory = as_path(directory)
    self._async = async_save
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                             create=True),
    )

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
    """Saves `step` (once: a step already saved is skipped). Async saves copy the arrays off the device
    before returning and finish in the background."""
    if self._manager.latest_step() == step:
      return
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta),
    )
    if self._async:
      self._manager.save(step, args=args)
      return
    with _THREADED_SAVES:
      self._manager.save(step, args=args)
      self._manager.wait_until_finished()

  def restore(self, abstract_state: Any) -> tuple[Any, dict, dict] | None:
    """The latest checkpoint restored into the shardings of `abstract_state`, or None if there is none."""
    step = self._manager.latest_step()
    if step is None:
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    ))
    return restored.state, restored.data, restored.meta

  def close(self) -> None:
    """Waits for pending saves, then releases the manager. Call before the process exits."""
    self._manager.wait_until_finished()
    self._manager.close()

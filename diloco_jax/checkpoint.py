"""Trainer checkpoints: an async orbax CheckpointManager of the train state (parameters, optimizer state,
step), the data iterator's state and a few counters. A run started on a workdir that holds a checkpoint
resumes from the latest one."""

from __future__ import annotations

import os
import pathlib
from typing import Any

import orbax.checkpoint as ocp


class TrainCheckpointer:
  """Saves and restores (state, data_state, meta) under `directory`, keeping the newest `keep`."""

  def __init__(self, directory: str | os.PathLike, keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                             create=True),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, meta: dict) -> None:
    """Starts an async save; the arrays are copied off the device before this returns."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta),
    ))

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

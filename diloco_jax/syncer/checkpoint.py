"""Syncer persistence: the core's `state_dict()` (global fragments, outer optimizer state, versions,
counters) in an orbax `CheckpointManager`, so that a restarted syncer resumes where it stopped.

A state dict is any nesting of dicts, lists and tuples whose leaves are numpy arrays (or numpy scalars) and
JSON values. `split_state` separates it into a flat dict of arrays (saved with `StandardSave`) and a JSON
skeleton that records where each array goes (saved with `JsonSave`); `join_state` puts them back together.
Both are pure, and round-trip exactly (dtypes, shapes, tuples, integer dict keys).

Atomicity is orbax's: a step is written into a temporary directory and renamed into place when complete,
so a crash mid-save leaves the previous step as the latest one, and `latest_step()` never sees a partial
step. Steps are save sequence numbers (1, 2, ...); the number of closed rounds is recorded in the meta.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from diloco_jax.syncer.core import SyncerCore
from diloco_jax.syncer.snapshot import ARRAY_KEY, join_state, split_state

log = logging.getLogger(__name__)


class SyncerCheckpointer:
  """An orbax CheckpointManager for syncer state dicts.

  Args:
    directory: where steps live (created if missing).
    keep: how many recent steps to keep.
    async_save: save in the background (`wait()` before exit); the state is copied first.
  """

  def __init__(self, directory: str | pathlib.Path, *, keep: int = 3, async_save: bool = True):
    self.directory = pathlib.Path(directory).resolve()
    self.directory.mkdir(parents=True, exist_ok=True)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                           enable_async_checkpointing=async_save)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest complete step, or None."""
    self._manager.reload()  # another process (a previous syncer) may have written steps
    return self._manager.latest_step()

  def save(self, state: Any, *, rounds: int = 0, copy: bool = True) -> int:
    """Save a state dict as the next step; return the step. Asynchronous if so configured. `copy=False`:
    the state's arrays are private to this call (nobody changes them afterwards), see `split_state`."""
    arrays, skeleton = split_state(state, copy=copy)
    step = (self._manager.latest_step() or 0) + 1
    meta = {"skeleton": skeleton, "rounds": int(rounds), "format": 1}
    items = {"meta": ocp.args.JsonSave(meta)}
    if arrays:
      items["arrays"] = ocp.args.StandardSave(arrays)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    log.info("syncer checkpoint step %d (%d rounds) -> %s", step, rounds, self.directory)
    return step

  def restore(self, step: int | None = None) -> tuple[Any, dict]:
    """(state dict, info) of `step` (default: the latest). info: {"step", "rounds"}."""
    self._manager.wait_until_finished()
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no syncer checkpoint in {self.directory}")
    meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    arrays = {}
    if _has_arrays(meta["skeleton"]):
      arrays = self._manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.StandardRestore()))["arrays"]
      arrays = {k: np.asarray(v) for k, v in arrays.items()}
    return join_state(arrays, meta["skeleton"]), {"step": step, "rounds": meta["rounds"]}

  def wait(self) -> None:
    """Block until a pending asynchronous save is on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def _has_arrays(skeleton) -> bool:
  if isinstance(skeleton, dict):
    return ARRAY_KEY in skeleton or any(_has_arrays(v) for v in skeleton.values())
  if isinstance(skeleton, list):
    return any(_has_arrays(v) for v in skeleton)
  return False


class Journal:
  """The syncer's journal: the core's `journal_record()` (versions, rounds, epoch, counters), rewritten
  atomically (a temporary file renamed over the old one) at every change, so that after a kill -9 the
  restarted syncer never publishes a version lower than one learners saw, and its event counters (bytes,
  joins, rejections, ...) go on from where they were (`SyncerCore.attach_journal`).

  A record whose versions moved is fsynced before the rename (a version is durable, also against a host
  crash, before any learner can see it); the others only survive the process (kill -9), not the host.
  With `timeline`, every change of versions also appends {"t": wall time, "epoch", "versions",
  "tokens_merged"} to that JSON-lines file (what `chaos` measures and plots). The core calls it under its lock,
  in order.
  """

  def __init__(self, path: str | pathlib.Path, timeline: str | pathlib.Path | None = None):
    self.path = pathlib.Path(path)
    self._tmp = self.path.with_name(self.path.name + ".tmp")
    self._timeline = open(timeline, "a", encoding="utf-8") if timeline else None

  def read(self) -> dict | None:
    """The last record written, or None (no journal yet; an unreadable one is logged and ignored)."""
    try:
      return json.loads(self.path.read_text())
    except FileNotFoundError:
      return None
    except (OSError, ValueError) as e:
      log.warning("syncer journal %s unreadable, ignored: %s", self.path, e)
      return None

  def __call__(self, record: dict, versions_changed: bool) -> None:
    data = json.dumps(record, separators=(",", ":")).encode()
    with open(self._tmp, "wb") as f:
      f.write(data)
      if versions_changed:
        f.flush()
        os.fsync(f.fileno())
    os.replace(self._tmp, self.path)
    if versions_changed and self._timeline is not None:
      self._timeline.write(json.dumps({"t": time.time(), "epoch": record["epoch"], "versions": record["versions"],
                                       "tokens_merged": record["counters"]["tokens_merged"]}) + "\n")
      self._timeline.flush()

  def close(self) -> None:
    if self._timeline is not None:
      self._timeline.close()


def save_core(checkpointer: SyncerCheckpointer, core: SyncerCore, *, rounds: int = 0) -> int:
  """Checkpoint a SyncerCore (its state_dict is a consistent snapshot taken under the core's lock).

  Copies of the state: the snapshot itself (under the lock: the core updates its arrays in place) and
  orbax's own copy of host arrays before an asynchronous write; `split_state` adds none."""
  return checkpointer.save(core.state_dict(), rounds=rounds, copy=False)


def restore_core(checkpointer: SyncerCheckpointer, core: SyncerCore, step: int | None = None) -> dict | None:
  """Load the latest (or given) step into a SyncerCore; return its info, or None if there is none."""
  if step is None and checkpointer.latest_step() is None:
    return None
  state, info = checkpointer.restore(step)
  core.load_state_dict(state)
  log.info("syncer resumed from checkpoint step %d (%d rounds)", info["step"], info["rounds"])
  return info

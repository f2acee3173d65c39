"""Recovery after a syncer restart: the version floor, the lifetime history, the counters carried. Pure.

A restored syncer numbers its versions from at least the highest version its previous lifetime published
(the journal's), so the versions learners see never go backwards even when the checkpoint is older. The
counters of events continue from the journal; the counters of the global model come from the checkpoint,
and what the crash took from the model (rounds merged after the checkpoint, contributions of open rounds)
is counted: learners push that work again (docs/operations.md, "Recovery").
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

from diloco_jax.protocol.messages import EpochRecord
from diloco_jax.syncer.state import MODEL_COUNTERS, merge_counters

MAX_HISTORY = 64  # lifetimes kept in the history (older ones: their learners rebase, see operations.md)


def version_floor(versions: Sequence[int], record: dict) -> list[int] | None:
  """The versions raised to the journal's, or None when none moves (nothing was served in this lifetime
  yet, so renumbering it is safe)."""
  journaled = [int(v) for v in record["versions"]]
  if len(journaled) != len(versions) or len(record["rounds"]) != len(versions):
    raise ValueError(f"journal holds {len(journaled)} fragments, this run has {len(versions)}")
  floor = [max(v, f) for v, f in zip(versions, journaled)]
  return None if floor == list(versions) else floor


def renumbered(history: Sequence[EpochRecord], versions: Sequence[int], rounds: Sequence[int]) -> list[EpochRecord]:
  """The history with the current lifetime's version offsets set for `versions`."""
  offsets = tuple(v - r for v, r in zip(versions, rounds))
  return [*history[:-1], dataclasses.replace(history[-1], version_offsets=offsets)]


def counters_after_restart(counters: dict[str, Any], record: dict, rounds: Sequence[int]) -> dict[str, Any]:
  """The counters of a restored core (`counters`, from its checkpoint) continued from the previous lifetime's
  journal `record`: event counters take the larger count, model counters stay the checkpoint's, and the
  restart and what it lost are counted."""
  n = len(rounds)
  saved = merge_counters(n, record.get("counters", {}))
  model = {k: copy.deepcopy(counters[k]) for k in MODEL_COUNTERS}
  events = {}
  for k, v in saved.items():
    if k in MODEL_COUNTERS:
      continue
    if k == "rejected":
      events[k] = {r: max(int(a), int(counters["rejected"].get(r, 0))) for r, a in v.items()}
    else:
      events[k] = max(v, counters.get(k, 0))
  out = merge_counters(n, events, model)
  out["restarts"] += 1
  out["rounds_rolled_back"] += max(0, sum(int(r) for r in record["rounds"]) - sum(rounds))
  out["contributions_rolled_back"] += max(0, saved["contributions_merged"] - model["contributions_merged"])
  out["tokens_rolled_back"] += max(0, saved["tokens_merged"] - model["tokens_merged"])
  out["contributions_lost_open"] += int(record.get("open_contributions", 0))
  return out


def restored_history(saved: Sequence, epoch: int, versions: Sequence[int], rounds: Sequence[int]) -> list[EpochRecord]:
  """A checkpoint's lifetimes (as saved: [epoch, start_rounds, version_offsets] rows) and the new one that
  begins from it, at most `MAX_HISTORY` in all."""
  history = [EpochRecord(int(e), tuple(int(x) for x in starts), tuple(int(x) for x in offsets))
             for e, starts, offsets in saved or ()]
  return history[-(MAX_HISTORY - 1):] + [
      EpochRecord(epoch, tuple(rounds), tuple(v - r for v, r in zip(versions, rounds)))]

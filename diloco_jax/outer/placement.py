"""Which syncer shard owns which fragment: a pure function of the fragment sizes and the shard count.

A sharded syncer is S ordinary syncer processes (`syncer --shard I --shards S`), each owning a set of whole
fragments. Every process of a run (each shard, each learner, the evaluator, `status`) computes the same map
from the config's fragment plan (`compute/plans.config_owners`), so nothing about the placement travels on
the wire; a call that reaches the wrong shard anyway is refused ("wrong_shard"). The simulator's sizing
(`tools/sim/syncer.py`) uses the same function.
"""

from __future__ import annotations

from collections.abc import Sequence


def assign_shards(weights: Sequence[int], shards: int) -> list[list[int]]:
  """Fragment indices per shard, balanced by `weights` (bytes, or elements): largest first, each to the
  lightest shard so far (ties: the lower index). Every shard gets at least one fragment; needs
  1 <= shards <= fragments."""
  if not 1 <= shards <= len(weights):
    raise ValueError(f"shards must be in [1, {len(weights)}] (whole fragments per shard), got {shards}")
  owned: list[list[int]] = [[] for _ in range(shards)]
  load = [0] * shards
  for p in sorted(range(len(weights)), key=lambda p: (-weights[p], p)):
    s = min(range(shards), key=lambda s: (load[s], s))
    owned[s].append(p)
    load[s] += weights[p]
  return [sorted(ps) for ps in owned]


def shard_of(sizes: Sequence[int], shards: int) -> list[int]:
  """The shard owning each fragment (`assign_shards` of the fragment sizes), indexed by fragment."""
  out = [0] * len(sizes)
  for s, fragments in enumerate(assign_shards(sizes, shards)):
    for p in fragments:
      out[p] = s
  return out

"""Meshes and sharding rules, all in one place.

A learner owns a mesh over an explicit list of devices with the named axes ("data", "fsdp", "tensor").
The baseline builds one mesh over all devices; the Decoupled DiLoCo trainer carves `jax.devices()` into M
disjoint slices, one per learner. A learner spanning several processes (`jax.distributed`) has one mesh
over the devices of all its processes; `process_rows` says which rows of a batch this process feeds.

Axes are `Auto` (GSPMD propagation): parameters and batches are placed explicitly, and XLA inserts the
collectives in between; with `Explicit` axes every op of the model would need an output sharding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from diloco_jax.config.resolve import resolve_axis_sizes  # pure, shared with config validation

AXES = ("data", "fsdp", "tensor")

# Logical axis of a parameter dimension -> mesh axis. Embedding and MLP hidden dims split over tensor;
# the model dimension is split over fsdp (ZeRO-3 style); heads over tensor.
LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
)
# The batch dimension of activations and data: split over every axis that replicates parameters' work.
BATCH = ("data", "fsdp")


def make_mesh(devices: Sequence[jax.Device], axes: Mapping[str, int]) -> Mesh:
  """A mesh over exactly `devices` with the named axes of `axes` (one may be -1).

  `jax.make_mesh` orders the devices by the physical topology (TPU rings and tori); on CPU and GPU it keeps
  the given order. A slice of a TPU host that is no sub-torus (the in-process `train` carving a host's
  chips into learners) falls back to the devices in their given order.
  """
  sizes = resolve_axis_sizes({a: axes.get(a, 1) for a in AXES}, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  types = (AxisType.Auto,) * len(AXES)
  try:
    return jax.make_mesh(shape, AXES, axis_types=types, devices=list(devices))
  except (ValueError, NotImplementedError):
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=types)


def mesh_axes_from_config(config) -> dict[str, int]:
  return {"data": config.mesh.data, "fsdp": config.mesh.fsdp, "tensor": config.mesh.tensor}


def carve_slices(devices: Sequence[jax.Device], sizes: Sequence[int]) -> list[list[jax.Device]]:
  """Disjoint consecutive slices of `devices`, one per learner, of the given sizes (they may differ)."""
  if sum(sizes) > len(devices):
    raise ValueError(f"slices of sizes {list(sizes)} need {sum(sizes)} devices, only {len(devices)} exist")
  out, start = [], 0
  for n in sizes:
    out.append(list(devices[start:start + n]))
    start += n
  return out


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches are split on their leading dimension over the data and fsdp axes."""
  return NamedSharding(mesh, P(BATCH))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def process_rows(mesh: Mesh, batch_size: int) -> tuple[int, int]:
  """The rows [start, stop) of a `batch_size` batch that this process's devices hold under
  `batch_sharding(mesh)`: the part of every batch this process reads (all rows on a single process).

  Raises ValueError if they are not one contiguous block of `batch_size / k` rows for some k (a mesh whose
  batch axes interleave processes), since each process then could not read one part of the batch.
  """
  index_map = batch_sharding(mesh).addressable_devices_indices_map((batch_size,))
  starts = sorted({idx[0].indices(batch_size)[:2] for idx in index_map.values()})
  start, stop = starts[0][0], starts[-1][1]
  covered = sum(b - a for a, b in starts)
  rows = stop - start
  if covered != rows or batch_size % rows or start % rows:
    raise ValueError(f"this process's devices hold rows {starts} of a batch of {batch_size}: not one aligned "
                     f"block; order the mesh's devices by process")
  return start, stop


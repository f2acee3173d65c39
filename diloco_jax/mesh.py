"""Meshes and sharding rules, all in one place.

A learner owns a mesh over an explicit list of devices with the named axes ("data", "fsdp", "tensor").
The baseline builds one mesh over all devices; the Decoupled DiLoCo trainer carves `jax.devices()` into M
disjoint slices, one per learner.

Axes are `Auto` (GSPMD propagation): parameters and batches are placed explicitly, and XLA inserts the
collectives in between; with `Explicit` axes every op of the model would need an output sharding.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

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


def resolve_axis_sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Axis sizes with the single -1 filled so that their product is `num_devices`."""
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


def make_mesh(devices: Sequence[jax.Device], axes: Mapping[str, int]) -> Mesh:
  """A mesh over exactly `devices` with the named axes of `axes` (one may be -1)."""
  sizes = resolve_axis_sizes({a: axes.get(a, 1) for a in AXES}, len(devices))
  shape = tuple(sizes[a] for a in AXES)
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))


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

"""A learner's device memory per chip (HBM), by part, against the accelerator's, for the slices it runs on.

Parts, per chip of one learner of `learners.devices` chips: the float32 parameters, AdamW's two moments,
the base (the global fragments last adopted), the outer loop's buffers (the outer gradient of each sync in
flight, at most `outer.max_in_flight`, and an adoption's: fragment-sized float32, each sharded
like the parameters, `learner/device.py`), the multi-host transfers (`multihost.Broadcaster`: chunks in
transit, slices of more than one host only) and the inner step's temporaries (gradients, activations),
from an analytic model that `tests/tools/sim/test_hbm.py` checks against XLA's own figures
(`compiled.memory_analysis()`) on fake CPU devices. docs/tpu.md, "Device memory of a learner".
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import multihost

GiB = 2**30
# HBM per chip, from the Cloud TPU documentation (cloud.google.com/tpu/docs: v5p, v6e, v5e and v4
# system architecture pages): v5p 95 GiB, v6e 32 GiB, v5e 16 GiB, v4 32 GiB.
HBM_PER_CHIP = {"v5p": 95 * GiB, "v6e": 32 * GiB, "v5e": 16 * GiB, "v4": 32 * GiB}
# Chips per host VM (launch/tpu/presets.sh): a slice of more chips spans several hosts. v6e and v5e hosts
# of up to 8 chips hold a whole small slice.
CHIPS_PER_HOST = {"v5p": 4, "v6e": 4, "v5e": 4, "v4": 4}
SINGLE_HOST_CHIPS = {"v5p": 4, "v6e": 8, "v5e": 8, "v4": 4}
# The slices each shipped config is sized for (docs/tpu.md; a learner is one slice).
PRESETS = {"m150": ("v5p-8", "v6e-4"), "b1": ("v5p-32", "v6e-16"), "b12": ("v5p-128", "v6e-256")}


@dataclasses.dataclass(frozen=True)
class Slice:
  accelerator: str  # e.g. "v5p-128"
  generation: str
  chips: int
  hosts: int

  @property
  def hbm_per_chip(self) -> int:
    return HBM_PER_CHIP[self.generation]


def parse_slice(accelerator: str) -> Slice:
  """A Cloud TPU accelerator type (v5p-N: N TensorCores, N/2 chips; v4-N likewise; v6e-N, v5e-N: N chips).
  Raises ValueError naming it when unknown."""
  generation, _, n = accelerator.partition("-")
  if generation not in HBM_PER_CHIP or not n.isdigit() or int(n) < 1:
    raise ValueError(f"unknown accelerator type {accelerator!r} (known: {', '.join(f'{g}-N' for g in HBM_PER_CHIP)})")
  chips = int(n) // 2 if generation in ("v5p", "v4") else int(n)
  if chips < 1:
    raise ValueError(f"accelerator type {accelerator!r} has no whole chip")
  hosts = 1 if chips <= SINGLE_HOST_CHIPS[generation] else chips // CHIPS_PER_HOST[generation]
  return Slice(accelerator, generation, chips, hosts)


def _axes(config, chips: int) -> dict[str, int]:
  return mesh_lib.resolve_axis_sizes(mesh_lib.mesh_axes_from_config(config), chips)


def activation_bytes(model, rows: int, seq: int, tensor: int) -> int:
  """The inner step's activations on one chip, for `rows` sequences of `seq` tokens on it and the heads,
  MLP and vocabulary split `tensor` ways: every layer's input kept (remat), or every layer's whole forward
  set (no remat), plus one layer's whole set being recomputed and differentiated, and the float32 logits,
  their softmax and gradient."""
  a = np.dtype(model.dtype).itemsize
  heads, mlp = model.num_heads / tensor, model.mlp_dim / tensor
  attention = heads * seq * (4 + 4 + a)  # per token: the float32 scores, masked scores, probabilities
  per_token = a * (4 * model.d_model + 5 * heads * model.head_dim + 3 * mlp) + attention
  layer = rows * seq * per_token
  kept = rows * seq * model.d_model * a if model.remat else layer
  logits = 3 * 4 * rows * seq * model.vocab_size / tensor
  return int(model.num_layers * kept + (layer if model.remat else 0) + logits)


def learner_hbm(config, sizes, chips: int, hosts: int = 1) -> dict[str, int]:
  """Bytes per chip of a learner of `config` on `chips` chips over `hosts` hosts, by part, and `total`
  (module docstring). `sizes`: the elements of each fragment (`sizing.fragment_sizes`)."""
  axes = _axes(config, chips)
  shards = axes["fsdp"] * axes["tensor"]
  params = sum(sizes)
  in_flight = config.outer.max_in_flight or 1
  moments = 8 if config.learners.inner.optimizer == "adamw" else 0
  batch = config.learners.batches[0]
  rows = max(1, math.ceil(batch / (axes["data"] * axes["fsdp"])))
  largest = 4 * max(sizes) // shards
  # Each chunk in transit: one row per device in, the chunk out; and one running transfer's temporaries.
  chunks = 2 * (multihost.CHUNKS_IN_FLIGHT + 1) + 1
  transit = chunks * 4 * multihost.CHUNK_ELEMENTS if hosts > 1 else 0
  parts = {
      "parameters": 4 * params // shards,
      "optimizer": moments * params // shards,
      "base": 4 * params // shards,
      "outer_in_flight": in_flight * largest,
      # The global being adopted, a join's or rebase's zeros snapshot, and XLA's temporaries of the mix (one
      # fragment's shards, measured: tests/tools/sim/test_hbm.py).
      "adopting": 3 * largest,
      "broadcast": transit,
      "gradients": 4 * params // shards,
      "activations": activation_bytes(config.model, rows, config.data.seq_len, axes["tensor"]),
  }
  parts["total"] = sum(parts.values())
  parts.update(parameter_shards=shards, rows_per_chip=rows)
  return parts


def for_slice(config, sizes, accelerator: str) -> dict:
  """`learner_hbm` on one slice of `accelerator` (its chips are the learner's devices), with the chip's
  HBM and the headroom left."""
  sl = parse_slice(accelerator)
  parts = learner_hbm(config_for_devices(config, sl.chips), sizes, sl.chips, sl.hosts)
  return {"accelerator": accelerator, "chips": sl.chips, "hosts": sl.hosts, "hbm_per_chip": sl.hbm_per_chip,
          "headroom": sl.hbm_per_chip - parts["total"], "fits": parts["total"] <= sl.hbm_per_chip, **parts}


def config_for_devices(config, devices: int):
  """The run's RunSpec with `devices` chips per learner (what `launch/tpu/start.sh` passes a slice)."""
  c = config.copy_and_resolve_references()
  c.learners.devices, c.learners.device_counts = devices, ()
  return config_lib.resolve(c)


def measured(compiled) -> dict[str, int]:
  """XLA's own per-device figures of a compiled computation (`memory_analysis()`), where it has them."""
  analysis = compiled.memory_analysis()
  return {"arguments": int(analysis.argument_size_in_bytes), "outputs": int(analysis.output_size_in_bytes),
          "temporaries": int(analysis.temp_size_in_bytes), "aliased": int(analysis.alias_size_in_bytes)}



def default_slices(config, path: str) -> tuple[str, ...]:
  """The slices a config is sized on by default: a shipped config's presets (`PRESETS`, by file name), else
  the v5p slice of its `learners.devices` chips."""
  name = path.rsplit("/", 1)[-1].removesuffix(".py")
  return PRESETS.get(name, (f"v5p-{2 * config.learners.devices}",))


_PARTS = (("parameters", "parameters (fp32)"), ("optimizer", "AdamW moments (fp32)"),
          ("base", "base: the globals last adopted (fp32)"),
          ("outer_in_flight", "outer gradients in flight (max_in_flight)"),
          ("adopting", "an adoption (the global, zeros, temporaries)"),
          ("broadcast", "multi-host transfers in transit"),
          ("gradients", "gradients of the inner step"), ("activations", "activations (analytic)"))


def format_slices(slices) -> list[str]:
  """The per-chip lines of `sim sizing` for each slice of `for_slice`."""
  lines = []
  for s in slices:
    verdict = "fits" if s["fits"] else "DOES NOT FIT"
    lines.append(f"learner device memory per chip on {s['accelerator']} ({s['chips']} chips, {s['hosts']} hosts, "
                 f"{s['parameter_shards']}-way parameter sharding, {s['rows_per_chip']} sequences per chip): "
                 f"{s['total'] / GiB:,.1f} of {s['hbm_per_chip'] / GiB:,.0f} GiB HBM, {verdict}, headroom "
                 f"{s['headroom'] / GiB:,.1f} GiB")
    lines += [f"  {what:<44} {s[key] / GiB:>9,.2f} GiB" for key, what in _PARTS]
  return lines

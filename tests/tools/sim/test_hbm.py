"""sim/hbm.py: a learner's device memory per chip against XLA's own accounting on 8 fake CPU devices
(tiny_cpu, small_cpu), against the buffers a real learner holds, and the shipped configs on their slices.

Tolerances: the state (parameters and AdamW moments) within 5% of XLA's argument bytes (the replicated
norms and the batch are the rest); the step's temporaries (gradients and activations) within 10% on a
data-parallel mesh, and within a factor of 3 of the estimate when the mesh shards the parameters, where
XLA:CPU all-gathers whole weights and schedules without regard for memory (the TPU compiler does neither:
the figure for a TPU slice is the analytic one).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from configs import small_cpu, tiny_cpu
from diloco_jax import cli
from diloco_jax.compute import inner, multihost
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.learner import device as device_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.runs import inprocess
from diloco_jax.tools.sim import hbm, sizing, syncer_cli

SHARDED = {"data": 1, "fsdp": 4, "tensor": 2}
DATA_PARALLEL = {"data": -1, "fsdp": 1, "tensor": 1}


def _config(module, axes):
  c = module.get_config()
  c.learners.num, c.learners.devices = 1, 8
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = axes["data"], axes["fsdp"], axes["tensor"]
  return c


# small_cpu on the sharded mesh compiles longest (~20 s cold): in `make test-slow`.
@pytest.mark.parametrize("module,axes", [(tiny_cpu, SHARDED), (tiny_cpu, DATA_PARALLEL),
                                         pytest.param(small_cpu, SHARDED, marks=pytest.mark.slow),
                                         (small_cpu, DATA_PARALLEL)])
def test_inner_step_against_xla_memory_analysis(module, axes):
  spec = hbm.config_for_devices(_config(module, axes), 8)
  mesh = mesh_lib.make_mesh(jax.devices()[:8], axes)
  graphdef, state, shardings = inner.init_state(spec, mesh, spec.learners.inner)
  step = inner.make_inner_step(graphdef, spec.learners.inner, mesh, shardings)
  batch = jax.ShapeDtypeStruct((spec.learners.batches[0], spec.data.seq_len + 1), jnp.int32,
                               sharding=mesh_lib.batch_sharding(mesh))
  xla = hbm.measured(step.lower(state, batch).compile())
  est = hbm.learner_hbm(spec, sizing.fragment_sizes(spec), 8)
  assert est["parameters"] + est["optimizer"] == pytest.approx(xla["arguments"], rel=0.05)
  temporaries = est["gradients"] + est["activations"]
  if axes is DATA_PARALLEL:
    assert temporaries == pytest.approx(xla["temporaries"], rel=0.10)
  else:
    assert temporaries / 3 < xla["temporaries"] < 3 * temporaries


def test_outer_loop_buffers_as_a_learner_holds_them():
  c = _config(tiny_cpu, SHARDED)
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau, c.outer.max_in_flight = 2, 4, 3, 2
  c.outer.min_quorum, c.outer.max_grace_s = 1, 0.0
  est = hbm.learner_hbm(hbm.config_for_devices(c, 8), sizing.fragment_sizes(c), 8)
  job = inprocess.InProcessRun(c, None, devices=jax.devices()[:8])
  learner = job.learners[0]
  try:
    learner.join()
    while len(learner.in_flight) < 2:
      learner.train_step()
    held = {}
    for x in jax.tree.leaves([item.snapshot for item in learner.in_flight]):
      for shard in x.addressable_shards:
        held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    # Two fragments in flight, each at most the largest, a shard per device (the replicated norms above it).
    assert est["outer_in_flight"] / 2 < max(held.values()) <= 1.05 * est["outer_in_flight"]
    base = max(sum(s.data.nbytes for x in jax.tree.leaves(learner.base) for s in x.addressable_shards
                   if s.device == d) for d in held)
    assert base == pytest.approx(est["base"], rel=0.05)
    # An adoption: the global's and the snapshot's shards as arguments, and XLA's temporaries of the mix.
    plan, fragments = learner.plan, learner.fragments
    for item in learner.in_flight:
      p = item.fragment
      keys = fragments._keys[p]  # pylint: disable=protected-access
      leaves = fragments_lib.get_leaves(learner.trainer.state.params, keys)
      host = device_lib.host_pieces(plan, p, np.zeros(plan.size(p), np.float32))
      adopt = fragments._fns[p][1]["full"]  # pylint: disable=protected-access
      xla = hbm.measured(adopt.lower(leaves, leaves, host, item.snapshot, 0.5, 1.0).compile())
      shards = sum(s.data.nbytes for x in item.snapshot for s in x.addressable_shards if s.device == jax.devices()[0])
      assert xla["temporaries"] + 2 * shards <= 1.05 * est["adopting"], (xla, shards, est["adopting"])  # norms
    learner.flush()
  finally:
    job.close()


def test_multi_host_transfers_against_xla(monkeypatch):
  """A chunk's transfer holds a row per device in, the chunk out and as much in temporaries (XLA's count);
  the estimate allows `CHUNKS_IN_FLIGHT` + 1 chunks in transit and one running, on slices of several hosts."""
  monkeypatch.setattr(multihost, "CHUNK_ELEMENTS", 1 << 14)
  mesh = mesh_lib.make_mesh(jax.devices()[:8], SHARDED)
  broadcast = multihost.Broadcaster(mesh)
  rows = jax.ShapeDtypeStruct((8, multihost.CHUNK_ELEMENTS), jnp.uint32, sharding=broadcast._in)  # pylint: disable=protected-access
  spec = hbm.config_for_devices(_config(tiny_cpu, SHARDED), 8)
  sizes = sizing.fragment_sizes(spec)
  assert hbm.learner_hbm(spec, sizes, 8, hosts=1)["broadcast"] == 0
  estimate = hbm.learner_hbm(spec, sizes, 8, hosts=2)["broadcast"]
  for fn in (broadcast._fn, broadcast._sum):  # pylint: disable=protected-access
    xla = hbm.measured(fn.lower(rows).compile())
    held = xla["arguments"] + xla["outputs"]
    assert held == 2 * 4 * multihost.CHUNK_ELEMENTS
    assert (multihost.CHUNKS_IN_FLIGHT + 1) * held + xla["temporaries"] == estimate


def test_parse_slice():
  assert hbm.parse_slice("v5p-128") == hbm.Slice("v5p-128", "v5p", 64, 16)
  assert hbm.parse_slice("v6e-256") == hbm.Slice("v6e-256", "v6e", 256, 64)
  assert hbm.parse_slice("v6e-8").hosts == 1 and hbm.parse_slice("v5p-8").hosts == 1
  assert hbm.parse_slice("v6e-8").hbm_per_chip == 32 * hbm.GiB
  for bad in ("v5p", "v9-8", "v5p-x", "v5p-1"):
    with pytest.raises(ValueError, match="accelerator type"):
      hbm.parse_slice(bad)


def _fits(got, slices):
  assert [s["accelerator"] for s in got] == list(slices)
  for s in got:
    assert s["fits"] and s["headroom"] > 0.25 * s["hbm_per_chip"], s
    assert s["outer_in_flight"] > 0 and s["total"] == sum(s[k] for k, _ in hbm._PARTS)  # pylint: disable=protected-access


@pytest.mark.parametrize("name", ["m150", "b1"])
def test_shipped_configs_fit_their_slices(name):
  config = syncer_cli.load_config(str(helpers.REPO / "configs" / f"{name}.py"))
  _fits(sizing.sizing(config, accelerators=hbm.default_slices(config, f"configs/{name}.py"))["learner_hbm"],
        hbm.PRESETS[name])


def test_cli_sizes_b12_on_its_slices_and_refuses_an_unknown_accelerator(capsys):
  path = str(helpers.REPO / "configs" / "b12.py")
  assert sizing.sim_sizing(["sizing", "--config", path, "--json"]) == 0
  s = json.loads(capsys.readouterr().out)
  _fits(s["learner_hbm"], ("v5p-128", "v6e-256"))
  text = sizing.format_sizing(s, syncer_cli.load_config(path))
  assert "on v5p-128 (64 chips, 16 hosts" in text and "on v6e-256 (256 chips" in text
  assert "outer gradients in flight" in text and "DOES NOT FIT" not in text
  with pytest.raises(cli.UsageError):
    sizing.sim_sizing(["sizing", "--config", str(helpers.REPO / "configs" / "tiny_cpu.py"), "--accelerators", "v9-8"])
  assert "--accelerators: unknown accelerator type 'v9-8'" in capsys.readouterr().err

"""learner/device.py and the multi-host transfers (compute/multihost.py) on a mesh that shards the
parameters (8 fake CPU devices, fsdp 4 x tensor 2): every learner-side buffer of a fragment (the outer
gradients in flight, the adopted global, a broadcast) is held a shard per device, never whole."""

import jax
import numpy as np
import pytest

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import multihost
from diloco_jax.learner import comms as comms_lib
from diloco_jax.learner import device as device_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.runs import inprocess


def per_device_bytes(arrays) -> dict:
  """{device: bytes it holds of `arrays`}, from their addressable shards."""
  out = {}
  for x in jax.tree.leaves(arrays):
    for shard in x.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def _sharded(c):
  c.learners.num, c.learners.devices = 1, 8
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, 4, 2
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 2, 4, 3
  c.outer.min_quorum, c.outer.max_grace_s = 1, 0.0
  return c


def test_outer_loop_buffers_are_sharded_like_the_parameters(tiny_config):
  c = _sharded(tiny_config)
  job = inprocess.InProcessRun(c, None, devices=jax.devices()[:8])
  learner = job.learners[0]
  try:
    learner.join()
    while len(learner.in_flight) < 2:  # both fragments snapshotted, neither adopted yet (tau = 3)
      learner.train_step()
    plan, params = learner.plan, learner.trainer.state.params
    for item in learner.in_flight:
      fragment_bytes = 4 * plan.size(item.fragment)
      held = per_device_bytes(item.snapshot)
      assert len(held) == 8
      # The model's leaves shard 8 ways but for the norms (replicated): a device holds about an eighth.
      assert max(held.values()) < fragment_bytes / 4, (held, fragment_bytes)
      # The outer gradient is base - theta, bit for bit, in the fragment's order.
      want = (fragments_lib.gather(plan, learner.base, item.fragment)
              - fragments_lib.gather(plan, params, item.fragment))
      np.testing.assert_array_equal(comms_lib.to_host(learner.fragments.outer_gradient(item.fragment)), want)
    # No fragment-sized vector is replicated on the devices (a replicated zeros copy, a replicated snapshot).
    smallest = min(plan.size(p) for p in range(plan.num_fragments))
    whole = [x.shape for x in jax.live_arrays()
             if x.is_fully_replicated and x.size >= smallest and len(x.devices()) > 1]
    assert whole == []
    # An adoption's arguments on a device: its shards of the parameters, the base, the global and the snapshot.
    fns = learner.fragments._fns[0]  # pylint: disable=protected-access
    keys = learner.fragments._keys[0]  # pylint: disable=protected-access
    leaves = fragments_lib.get_leaves(params, keys)
    host = device_lib.host_pieces(plan, 0, np.zeros(plan.size(0), np.float32))
    compiled = fns[1]["full"].lower(leaves, fragments_lib.get_leaves(learner.base, keys), host,
                                    next(i.snapshot for i in learner.in_flight if i.fragment == 0), 0.5,
                                    1.0).compile()
    assert compiled.memory_analysis().argument_size_in_bytes < 4 * 4 * plan.size(0) / 4
    learner.flush()
  finally:
    job.close()


@pytest.mark.parametrize("chunk", [None, 100])
def test_broadcast_and_gather_move_a_fragment_shard_by_shard(monkeypatch, chunk):
  """Process 0's host -> pieces sharded over the mesh -> back, bit for bit (signed zeros, NaN payloads),
  in chunks; no device holds more than its shards."""
  if chunk:
    monkeypatch.setattr(multihost, "CHUNK_ELEMENTS", chunk)
  mesh = mesh_lib.make_mesh(jax.devices()[:8], {"data": 1, "fsdp": 4, "tensor": 2})
  shapes = [(64, 48), (8, 6), (32,)]
  specs = [jax.sharding.PartitionSpec("fsdp", "tensor"), jax.sharding.PartitionSpec("tensor", None),
           jax.sharding.PartitionSpec()]
  shardings = [jax.sharding.NamedSharding(mesh, s) for s in specs]
  total = sum(int(np.prod(s)) for s in shapes)
  vec = np.random.default_rng(0).standard_normal(total).astype(np.float32)
  vec[:3] = [0.0, -0.0, np.inf]
  vec[3:4] = np.array([0x7FC00123], np.uint32).view(np.float32)
  broadcast = multihost.Broadcaster(mesh)
  pieces = broadcast.pieces(vec, shapes, shardings)
  assert [x.shape for x in pieces] == shapes and [x.sharding for x in pieces] == shardings
  assert max(per_device_bytes(pieces).values()) == 4 * (64 * 48 // 8 + 8 * 6 // 2 + 32)
  np.testing.assert_array_equal(np.concatenate([np.asarray(x).reshape(-1) for x in pieces]).view(np.uint32),
                                vec.view(np.uint32))
  np.testing.assert_array_equal(broadcast.gather(pieces).view(np.uint32), vec.view(np.uint32))

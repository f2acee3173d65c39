"""Model: forward shapes, parameter shardings on a (2, 4) mesh, parameters born sharded."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib


def _mesh_2x4(config):
  config.model.num_kv_heads = 4  # heads split 4 ways over tensor
  return mesh_lib.make_mesh(jax.devices()[:8], {"data": 1, "fsdp": 2, "tensor": 4})


def test_forward_shapes_and_param_shardings(tiny_config):
  mesh = _mesh_2x4(tiny_config)
  graphdef, params = model_lib.init_params(tiny_config.model, mesh)
  tokens = jnp.zeros((4, 16), jnp.int32)
  logits = jax.jit(model_lib.apply, static_argnums=0)(graphdef, params, tokens)
  assert logits.shape == (4, 16, tiny_config.model.vocab_size)
  assert logits.dtype == jnp.float32
  layer = params["layers"][0]
  assert layer["mlp"]["gate"].sharding.spec == P("fsdp", "tensor")
  assert layer["mlp"]["down"].sharding.spec == P("tensor", "fsdp")
  assert layer["attn"]["q"].sharding.spec == P("fsdp", "tensor", None)
  assert params["embed"].sharding.spec == P("tensor", "fsdp")


def test_params_are_born_sharded(tiny_config):
  """Each device holds only its shard of a sharded parameter: nothing is materialized whole first."""
  mesh = _mesh_2x4(tiny_config)
  _, params = model_lib.init_params(tiny_config.model, mesh)
  gate = params["layers"][0]["mlp"]["gate"]
  d, f = gate.shape
  shard_shapes = {s.data.shape for s in gate.addressable_shards}
  assert shard_shapes == {(d // 2, f // 4)}
  # And the sharded init is the same function of the seed as an unsharded one.
  single = mesh_lib.make_mesh(jax.devices()[:1], {"data": 1, "fsdp": 1, "tensor": 1})
  _, ref = model_lib.init_params(tiny_config.model, single)
  np.testing.assert_allclose(np.asarray(gate), np.asarray(ref["layers"][0]["mlp"]["gate"]), rtol=0, atol=0)


def test_causal_no_peeking(tiny_config):
  """Changing a later token never changes earlier logits."""
  mesh = mesh_lib.make_mesh(jax.devices()[:1], {"data": 1, "fsdp": 1, "tensor": 1})
  graphdef, params = model_lib.init_params(tiny_config.model, mesh)
  a = jnp.arange(16, dtype=jnp.int32)[None] % 256
  b = a.at[0, 10].set(200)
  apply = jax.jit(model_lib.apply, static_argnums=0)
  la, lb = apply(graphdef, params, a), apply(graphdef, params, b)
  np.testing.assert_allclose(la[0, :10], lb[0, :10], atol=1e-5)
  assert not np.allclose(la[0, 10:], lb[0, 10:])


def test_untied_head_and_flops(tiny_config):
  tiny_config.model.tie_embeddings = False
  mesh = mesh_lib.make_mesh(jax.devices()[:1], {"data": 1, "fsdp": 1, "tensor": 1})
  _, params = model_lib.init_params(tiny_config.model, mesh)
  assert params["lm_head"].shape == (tiny_config.model.d_model, tiny_config.model.vocab_size)
  assert model_lib.flops_per_token(tiny_config.model, 64) > 6 * model_lib.count_params(params) * 0.5

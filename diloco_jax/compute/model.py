"""A decoder-only transformer in Flax NNX: pre-norm RMSNorm, rotary positions, causal (grouped-query)
attention, gated (SwiGLU) MLP, tied or untied embeddings.

Every parameter carries logical axis names (`vocab`, `embed`, `mlp`, `heads`, `kv_heads`, `head_dim`),
mapped to mesh axes by `mesh.LOGICAL_RULES`. Parameters are born sharded: `init_params` builds the model
abstractly first and materializes it with `jax.jit(..., out_shardings=...)`, so no device ever holds the
whole model unless the mesh says so.

The training state holds parameters as a pure nested dict (`{"layers": {0: {"attn": ...}}}`) so that the
optimizer, fragments, codecs and checkpoints all see plain arrays; `apply` merges them back into the
module for the forward pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from diloco_jax import config as config_lib
from diloco_jax.compute import mesh as mesh_lib

Params = dict[str, Any]


def _spec(*logical: str | None) -> tuple[str | None, ...]:
  rules = dict(mesh_lib.LOGICAL_RULES)
  return tuple(rules.get(name) if name else None for name in logical)


def _param_init(init, *logical):
  return nnx.with_partitioning(init, _spec(*logical))


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, *, rngs: nnx.Rngs):
    del rngs
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=_spec("norm"))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * self.scale[...]).astype(x.dtype)


def rotary(x, positions, theta: float):
  """Rotary position embedding on the last dim of x [batch, seq, heads, head_dim]."""
  half = x.shape[-1] // 2
  freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
  angles = positions[:, :, None, None].astype(jnp.float32) * freq
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    init = nnx.initializers.normal(stddev=d ** -0.5)
    out_init = nnx.initializers.normal(stddev=(h * hd) ** -0.5 / (2 * cfg.num_layers) ** 0.5)
    self.q = nnx.Param(_param_init(init, "embed", "heads", "head_dim")(rngs.params(), (d, h, hd)))
    self.k = nnx.Param(_param_init(init, "embed", "kv_heads", "head_dim")(rngs.params(), (d, kv, hd)))
    self.v = nnx.Param(_param_init(init, "embed", "kv_heads", "head_dim")(rngs.params(), (d, kv, hd)))
    self.o = nnx.Param(_param_init(out_init, "heads", "head_dim", "embed")(rngs.params(), (h, hd, d)))
    self.groups = h // kv
    self.theta = cfg.rope_theta

  def __call__(self, x, positions):
    dt = x.dtype
    q = jnp.einsum("bsd,dhk->bshk", x, self.q[...].astype(dt))
    k = jnp.einsum("bsd,dhk->bshk", x, self.k[...].astype(dt))
    v = jnp.einsum("bsd,dhk->bshk", x, self.v[...].astype(dt))
    q, k = rotary(q, positions, self.theta), rotary(k, positions, self.theta)
    k = jnp.repeat(k, self.groups, axis=2)
    v = jnp.repeat(v, self.groups, axis=2)
    logits = jnp.einsum("bqhk,bthk->bhqt", q, k).astype(jnp.float32) * (q.shape[-1] ** -0.5)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(dt)
    out = jnp.einsum("bhqt,bthk->bqhk", probs, v)
    return jnp.einsum("bshk,hkd->bsd", out, self.o[...].astype(dt))


class MLP(nnx.Module):
  """Gated MLP (SwiGLU)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    init = nnx.initializers.normal(stddev=d ** -0.5)
    out_init = nnx.initializers.normal(stddev=f ** -0.5 / (2 * cfg.num_layers) ** 0.5)
    self.gate = nnx.Param(_param_init(init, "embed", "mlp")(rngs.params(), (d, f)))
    self.up = nnx.Param(_param_init(init, "embed", "mlp")(rngs.params(), (d, f)))
    self.down = nnx.Param(_param_init(out_init, "mlp", "embed")(rngs.params(), (f, d)))

  def __call__(self, x):
    dt = x.dtype
    h = jax.nn.silu(x @ self.gate[...].astype(dt)) * (x @ self.up[...].astype(dt))
    return h @ self.down[...].astype(dt)


class Block(nnx.Module):

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.d_model, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions):
    x = x + self.attn(self.attn_norm(x), positions)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """Decoder-only language model: tokens [batch, seq] -> logits [batch, seq, vocab] (float32)."""

  def __init__(self, cfg, *, rngs: nnx.Rngs):
    self.cfg = cfg
    emb_init = nnx.initializers.normal(stddev=cfg.d_model ** -0.5)
    self.embed = nnx.Param(_param_init(emb_init, "vocab", "embed")(rngs.params(), (cfg.vocab_size, cfg.d_model)))
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, rngs=rngs)
    if not cfg.tie_embeddings:
      head_init = nnx.initializers.normal(stddev=cfg.d_model ** -0.5)
      self.lm_head = nnx.Param(_param_init(head_init, "embed", "vocab")(rngs.params(), (cfg.d_model, cfg.vocab_size)))

  def __call__(self, tokens):
    dt = jnp.dtype(self.cfg.dtype)
    x = self.embed[...].astype(dt)[tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    block = nnx.remat(Block.__call__) if self.cfg.remat else Block.__call__
    for layer in self.layers:
      x = block(layer, x, positions)
    x = self.final_norm(x)
    if self.cfg.tie_embeddings:
      logits = jnp.einsum("bsd,vd->bsv", x, self.embed[...].astype(dt))
    else:
      logits = x @ self.lm_head[...].astype(dt)
    return logits.astype(jnp.float32)


def _to_plain_cfg(model_cfg) -> config_lib.ModelSpec:
  """The model's shape as the config's frozen, hashable `ModelSpec` (static in the module's graph), from a
  spec or a config section."""
  if isinstance(model_cfg, config_lib.ModelSpec):
    return model_cfg
  fields = {f.name for f in dataclasses.fields(config_lib.ModelSpec)}
  return config_lib.ModelSpec(**{k: v for k, v in model_cfg.to_dict().items() if k in fields})


def abstract_model(model_cfg, mesh):
  """(graphdef, abstract params as ShapeDtypeStructs carrying their NamedShardings on `mesh`)."""
  cfg = _to_plain_cfg(model_cfg)
  graphdef, abstract = nnx.get_abstract_model(lambda: Transformer(cfg, rngs=nnx.Rngs(0)), mesh)
  return graphdef, nnx.to_pure_dict(abstract)


def abstract_params(model_cfg) -> Params:
  """The parameters' shapes and dtypes only (ShapeDtypeStructs, on one CPU device): plans and sizes of a
  model of any size, with no array allocated."""
  mesh = mesh_lib.make_mesh(jax.devices("cpu")[:1], {"data": 1, "fsdp": 1, "tensor": 1})
  return abstract_model(model_cfg, mesh)[1]


def init_params(model_cfg, mesh, seed: int = 0):
  """Returns (graphdef, params): params created directly in their shardings on `mesh`."""
  cfg = _to_plain_cfg(model_cfg)
  graphdef, abstract = abstract_model(model_cfg, mesh)
  shardings = jax.tree.map(lambda a: a.sharding, abstract)

  @functools.partial(jax.jit, out_shardings=shardings)
  def create():
    return nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)), nnx.Param))

  with jax.set_mesh(mesh):
    params = create()
  return graphdef, params


def init_params_host(config) -> Params:
  """The initial parameters as numpy arrays on the host (what the syncer starts from): the same values
  every learner creates from `config.seed`, whatever its mesh."""
  cpu = jax.devices("cpu")[:1]
  mesh = mesh_lib.make_mesh(cpu, {"data": 1, "fsdp": 1, "tensor": 1})
  _, params = init_params(config.model, mesh, config.seed)
  return jax.tree.map(np.asarray, params)


def apply(graphdef, params: Params, tokens):
  """Forward pass from pure-dict params."""
  return nnx.merge(graphdef, params)(tokens)


def count_params(params) -> int:
  return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


def flops_per_token(model_cfg, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward = 3x forward): 6 x matmul params + attention scores."""
  c = model_cfg
  per_layer = c.d_model * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * c.d_model * c.mlp_dim
  matmul_params = c.num_layers * per_layer + c.d_model * c.vocab_size
  attention = c.num_layers * 2 * 2 * seq_len * c.num_heads * c.head_dim  # QK^T and PV, causal average ~ half, kept full
  return 6.0 * matmul_params + 3.0 * attention

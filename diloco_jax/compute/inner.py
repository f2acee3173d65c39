"""The inner optimizer and its jitted steps.

`make_inner_step()` returns a pure `(state, batch) -> (state, metrics)` function, jitted with explicit
in/out shardings and the state donated; `make_eval_step()` the matching loss on held-out batches. Both
the data-parallel baseline and every Decoupled DiLoCo learner use these, on their own meshes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  step: jax.Array
  params: model_lib.Params
  opt_state: Any


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  """Linear warmup to `train.lr`, then cosine decay to `train.lr * train.min_lr_ratio`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=train_cfg.lr,
      warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.steps, train_cfg.warmup_steps + 1),
      end_value=train_cfg.lr * train_cfg.min_lr_ratio,
  )


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  """The inner optimizer of `train_cfg` (`config.train`, or a learner's: the spec's `learners.inner`).

  `adamw`: AdamW with global-norm clipping (off when `grad_clip` is 0); no weight decay on vectors (norm
  scales). `sgd`: plain SGD with the same clipping, schedule and decoupled weight decay, no momentum: its
  update is linear in the gradient, so M learners averaged after every step are exactly data-parallel SGD.
  """
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
  schedule = learning_rate_schedule(train_cfg)
  clip = [optax.clip_by_global_norm(train_cfg.grad_clip)] if train_cfg.grad_clip > 0 else []
  if train_cfg.optimizer == "sgd":
    return optax.chain(*clip, optax.add_decayed_weights(train_cfg.weight_decay, decay_mask),
                       optax.scale_by_learning_rate(schedule))
  return optax.chain(*clip, optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps,
                                        weight_decay=train_cfg.weight_decay, mask=decay_mask))


def init_state(config, mesh, train_cfg=None):
  """(graphdef, state, state_shardings): parameters and optimizer state born sharded on `mesh`.

  `train_cfg`: the optimizer's section (default `config.train`; learners pass the spec's `learners.inner`).
  """
  graphdef, params = model_lib.init_params(config.model, mesh, config.seed)
  tx = make_optimizer(config.train if train_cfg is None else train_cfg)
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  replicated = mesh_lib.replicated(mesh)

  # Optimizer moments take their parameter's sharding; scalars (counts) are replicated.
  abstract_opt = jax.eval_shape(tx.init, params)
  opt_shardings = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_shardings,
                                        transform_non_params=lambda x: replicated)
  state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings)

  def create(params):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))

  with jax.set_mesh(mesh):
    state = jax.jit(create, out_shardings=state_shardings, donate_argnums=0)(params)
  return graphdef, state, state_shardings


def token_losses(graphdef, params, tokens):
  """Next-token cross-entropy (nats) of every target: tokens [batch, seq + 1] -> [batch, seq]."""
  logits = model_lib.apply(graphdef, params, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def loss_fn(graphdef, params, tokens):
  """Mean next-token cross-entropy; tokens [batch, seq + 1]."""
  return token_losses(graphdef, params, tokens).mean()


def make_inner_step(graphdef, train_cfg, mesh, state_shardings):
  """The jitted inner step: (state, tokens) -> (state, {"loss", "grad_norm"}); the state is donated."""
  tx = make_optimizer(train_cfg)

  def step(state: TrainState, tokens):
    loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, tokens))(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

  replicated = mesh_lib.replicated(mesh)
  return jax.jit(step, in_shardings=(state_shardings, mesh_lib.batch_sharding(mesh)),
                 out_shardings=(state_shardings, replicated), donate_argnums=0)


def make_eval_step(graphdef, mesh, param_shardings):
  """The jitted eval step: (params, tokens) -> mean loss."""
  return jax.jit(lambda p, t: loss_fn(graphdef, p, t),
                 in_shardings=(param_shardings, mesh_lib.batch_sharding(mesh)),
                 out_shardings=mesh_lib.replicated(mesh))


def put_batch(tokens, mesh, batch_size: int | None = None) -> jax.Array:
  """Host batch -> device batch split over the data and fsdp axes.

  On a mesh of one process `tokens` is the whole batch. On a mesh spanning several processes it is this
  process's rows (`mesh_lib.process_rows`) of a batch of `batch_size` rows, and the global batch is
  assembled from every process's part.
  """
  sharding = mesh_lib.batch_sharding(mesh)
  if sharding.is_fully_addressable:
    return jax.device_put(tokens, sharding)
  return jax.make_array_from_process_local_data(sharding, tokens, (batch_size, *tokens.shape[1:]))

"""Tiny config for tests and CI: a 2-layer, 64-wide model on short sequences; seconds on 2 cores.

Run:
  python -m diloco_jax train --config configs/tiny_cpu.py --workdir runs/tiny
  python -m diloco_jax baseline --config configs/tiny_cpu.py --workdir runs/tiny_dp
"""

from diloco_jax.config.schema import base_config


def get_config():
  c = base_config()
  c.model.d_model = 64
  c.model.num_layers = 2
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.mlp_dim = 192
  c.model.max_seq_len = 64
  c.data.seq_len = 64
  c.data.global_batch = 16
  c.data.max_bytes = 400_000
  c.data.eval_batches = 2
  c.train.steps = 60
  c.train.lr = 3e-3
  c.train.warmup_steps = 5
  c.train.log_every = 10
  c.train.eval_every = 30
  c.learners.num = 4
  c.learners.devices = 2
  c.outer.num_fragments = 2
  c.outer.sync_every = 10
  c.outer.max_grace_s = 0.5
  c.outer.downlink_codec = "int4"
  c.outer.lr = 0.8
  c.outer.momentum = 0.5
  return c

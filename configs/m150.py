"""~150M-parameter model (154.4M: 12 layers x 1024 wide, SwiGLU 2816) for a TPU v5p slice: 8 learners of
4 chips each, pure data parallelism inside a learner (the model and its AdamW state fit on one chip).

Shapes follow the DiLoCo / Chinchilla-style 150M decoder (12 layers, 16 heads of 64). The vocabulary is
the byte-level 256 of the embedded corpus, so the count is nearly all transformer blocks; a tokenizer-backed
`data.path` with e.g. `--config.model.vocab_size=32000` would add 32.8M embedding parameters (tied).
Token budget: Chinchilla's ~20 tokens/parameter, 6,000 steps x 256 x 2,048 = 3.1B tokens.

Run (on the TPU VM hosts; 8 learners x 4 chips = 32 chips, e.g. v5p-64):
  python -m diloco_jax train --config configs/m150.py --workdir gs://BUCKET/runs/m150
  python -m diloco_jax baseline --config configs/m150.py --workdir gs://BUCKET/runs/m150_dp
  python -m diloco_jax bench step --config configs/m150.py --devices 4
"""

from diloco_jax.config import base_config


def get_config():
  c = base_config()
  c.model.vocab_size = 256
  c.model.d_model = 1024
  c.model.num_layers = 12
  c.model.num_heads = 16
  c.model.num_kv_heads = 16
  c.model.head_dim = 64
  c.model.mlp_dim = 2816
  c.model.max_seq_len = 2048
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.data.seq_len = 2048
  c.data.global_batch = 256  # 0.5M tokens per step over all learners
  c.data.eval_batches = 8
  c.train.steps = 6_000
  c.train.lr = 6e-4
  c.train.warmup_steps = 300
  c.train.log_every = 50
  c.train.eval_every = 500
  c.train.checkpoint_every = 1_000
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  c.learners.num = 8
  c.learners.devices = 4
  c.outer.num_fragments = 4
  c.outer.sync_every = 100
  c.outer.codec = "int4"
  return c

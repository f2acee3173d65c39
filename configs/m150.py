"""~150M-parameter model (155.3M: 12 layers x 896 wide, 16 heads of 64, SwiGLU 2560, 32,000-piece vocabulary)
for a TPU v5p slice: 8 learners of 4 chips each, pure data parallelism inside a learner (the model and its
AdamW state fit on one chip).

Shapes follow the DiLoCo / Chinchilla-style 150M decoder (12 layers x 896, 16 heads of 64); the tied
embedding is 28.7M of the count. Token budget: Chinchilla's ~20 tokens/parameter, 6,000 steps x 256 x
2,048 = 3.1B tokens.

Data: a 32,000-piece SentencePiece tokenizer and ArrayRecord token shards in `data/` (relative to where the
command runs; every host needs them, or put them on gs:// and override `data.tokenizer`, `data.train_files`
and `data.eval_files`, e.g. `--config.data.tokenizer=gs://BUCKET/data/tokenizer.model`). Prepare them once:
  python -m diloco_jax tokenizer --data CORPUS --vocab 32000 --out data/tokenizer.model
  python -m diloco_jax tokenize --tokenizer data/tokenizer.model --data CORPUS --out data/tokens --shards 64

Run (on the TPU VM hosts; 8 learners x 4 chips = 32 chips, e.g. v5p-64):
  python -m diloco_jax train --config configs/m150.py --workdir gs://BUCKET/runs/m150
  python -m diloco_jax baseline --config configs/m150.py --workdir gs://BUCKET/runs/m150_dp
  python -m diloco_jax bench step --config configs/m150.py --devices 4
"""

from diloco_jax.config.schema import base_config, use_token_shards


def get_config():
  c = base_config()
  use_token_shards(c, "data", vocab_size=32_000)
  c.model.d_model = 896
  c.model.num_layers = 12
  c.model.num_heads = 16
  c.model.num_kv_heads = 16
  c.model.head_dim = 64
  c.model.mlp_dim = 2560
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

"""~1B-parameter model (1.1B: 22 layers x 2048 wide, 16 query / 8 key-value heads of 128, SwiGLU 5632,
32,000-piece vocabulary) for a TPU v5p slice: 8 learners of 16 chips each, parameters and AdamW state
sharded ZeRO-3 style over `fsdp`.

The tied embedding is 65.5M of the count. Token budget: Chinchilla's ~20 tokens/parameter, 20,000 steps x
512 x 2,048 = 21B tokens.

Data: a 32,000-piece SentencePiece tokenizer and ArrayRecord token shards in `data/` (relative to where the
command runs; every host needs them, or put them on gs:// and override `data.tokenizer`, `data.train_files`
and `data.eval_files`, e.g. `--config.data.tokenizer=gs://BUCKET/data/tokenizer.model`). Prepare them once:
  python -m diloco_jax tokenizer --data CORPUS --vocab 32000 --out data/tokenizer.model
  python -m diloco_jax tokenize --tokenizer data/tokenizer.model --data CORPUS --out data/tokens --shards 256

Run (on the TPU VM hosts; 8 learners x 16 chips = 128 chips, e.g. v5p-256):
  python -m diloco_jax train --config configs/b1.py --workdir gs://BUCKET/runs/b1
  python -m diloco_jax baseline --config configs/b1.py --workdir gs://BUCKET/runs/b1_dp
  python -m diloco_jax bench step --config configs/b1.py --devices 16
"""

from diloco_jax.config.schema import base_config, use_token_shards


def get_config():
  c = base_config()
  use_token_shards(c, "data", vocab_size=32_000)
  c.model.d_model = 2048
  c.model.num_layers = 22
  c.model.num_heads = 16
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 5632
  c.model.max_seq_len = 2048
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.data.seq_len = 2048
  c.data.global_batch = 512  # 1M tokens per step over all learners
  c.data.eval_batches = 8
  c.train.steps = 20_000
  c.train.lr = 3e-4
  c.train.warmup_steps = 1_000
  c.train.log_every = 50
  c.train.eval_every = 1_000
  c.train.checkpoint_every = 1_000
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 1
  c.learners.num = 8
  c.learners.devices = 16
  c.outer.num_fragments = 4
  c.outer.sync_every = 100
  c.outer.codec = "int4"
  c.outer.max_grace_s = 30.0  # fragments of ~260M params take seconds to move over a WAN
  return c

"""~12B-parameter model (12.3B: 44 layers x 5120 wide, 40 query / 8 key-value heads of 128, SwiGLU 13824,
32,000-piece vocabulary) for a TPU v5p slice: 8 learners of 64 chips each, each learner's mesh fsdp=16 x
tensor=4 (heads, kv heads, MLP and vocab split 4 ways; the model dimension 16 ways).

The tied embedding is 164M of the count. Token budget: 120,000 steps x 1,024 x 2,048 = 252B tokens (~20
tokens/parameter).

Data: a 32,000-piece SentencePiece tokenizer and ArrayRecord token shards in `data/` (relative to where the
command runs; every host needs them, or put them on gs:// and override `data.tokenizer`, `data.train_files`
and `data.eval_files`, e.g. `--config.data.tokenizer=gs://BUCKET/data/tokenizer.model`). Prepare them once:
  python -m diloco_jax tokenizer --data CORPUS --vocab 32000 --out data/tokenizer.model
  python -m diloco_jax tokenize --tokenizer data/tokenizer.model --data CORPUS --out data/tokens --shards 1024

Run: one learner per v5p-128 slice (64 chips), 8 slices and a syncer VM, with the Cloud TPU scripts
(docs/tpu.md, launch/tpu/):
  RUN=b12 CONFIG=configs/b12.py LEARNERS=8xv5p-128 BUCKET=gs://BUCKET/diloco launch/tpu/create.sh
(`train` runs every learner in one process on one host's devices: it cannot span 8 slices.) On one slice:
  python -m diloco_jax bench step --config configs/b12.py --devices 64
"""

from diloco_jax.config.schema import base_config, use_token_shards


def get_config():
  c = base_config()
  use_token_shards(c, "data", vocab_size=32_000)
  c.model.d_model = 5120
  c.model.num_layers = 44
  c.model.num_heads = 40
  c.model.num_kv_heads = 8
  c.model.head_dim = 128
  c.model.mlp_dim = 13824
  c.model.max_seq_len = 2048
  c.model.dtype = "bfloat16"
  c.model.remat = True
  c.data.seq_len = 2048
  c.data.global_batch = 1024  # 2M tokens per step over all learners
  c.data.eval_batches = 8
  c.train.steps = 120_000
  c.train.lr = 1.5e-4
  c.train.warmup_steps = 2_000
  c.train.log_every = 50
  c.train.eval_every = 2_000
  c.train.checkpoint_every = 1_000
  c.mesh.data = 1
  c.mesh.fsdp = -1
  c.mesh.tensor = 4
  c.learners.num = 8
  c.learners.devices = 64
  c.outer.num_fragments = 4
  c.outer.sync_every = 100
  c.outer.codec = "int4"
  c.outer.max_grace_s = 120.0  # a fragment of ~3B params is GBs even at int4
  return c

"""Tokenized data: the SentencePiece tokenizer and its commands, and the grain pipeline over token shards
(`data.format = "array_record"`), on a few hundred KB of stdlib sources (the `token_data` fixture)."""

import collections
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import pipeline as data
from diloco_jax.data import shards, token_windows, tokenizer

data_cfg, corpus_texts, file_streams = helpers.data_cfg, helpers.corpus_texts, helpers.file_streams
TRICKY = "def f(x):\n\tif x:\r\n        return 'é漢字🙂'   # trailing  \n\n\n  \x00\x7f\u2028end"


def test_tokenizer_round_trips_text_and_counts_its_bytes(token_data):
  tok = tokenizer.load(str(token_data.tokenizer))
  assert tok.vocab_size == helpers.TOKEN_VOCAB and tok.eos_id == 2
  texts = list(corpus_texts(token_data).values()) + [TRICKY]
  for text in texts:
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.min() >= 0 and ids.max() < tok.vocab_size
    assert tok.eos_id not in ids  # eos only ever comes from the pipeline, between documents
    assert tok.decode(ids) == text  # lossless: code, whitespace, CRLF, characters outside the vocabulary
    assert int(tok.token_bytes[ids].sum()) == len(text.encode("utf-8"))
  big = "".join(texts)
  assert len(big) / tok.encode(big).size > 2.0  # it learned merges: more than 2 characters per token
  assert tok.token_bytes[tok.eos_id] == 0


def test_long_documents_encode_in_pieces_to_the_same_ids(token_data, monkeypatch):
  tok = tokenizer.load(str(token_data.tokenizer))
  text = "".join(corpus_texts(token_data).values())
  whole = tok.encode(text)
  monkeypatch.setattr(tokenizer, "_ENCODE_PIECE_CHARS", 997)
  np.testing.assert_array_equal(tok.encode(text), whole)
  np.testing.assert_array_equal(np.concatenate(tok.encode_many([text, TRICKY])),
                                np.concatenate([whole, tok.encode(TRICKY)]))


def test_byte_tokenizer_is_the_byte_corpus():
  tok = tokenizer.ByteTokenizer()
  ids = tok.encode(TRICKY)
  np.testing.assert_array_equal(ids, np.frombuffer(TRICKY.encode(), np.uint8))
  assert tok.decode(ids) == TRICKY and tok.eos_id == corpus_lib.SEPARATOR
  assert int(tok.token_bytes[ids].sum()) == len(TRICKY.encode()) - TRICKY.encode().count(0)


def test_learner_shards_are_disjoint_and_cover_every_window(token_data):
  cfg, num_shards, batch = data_cfg(token_data, seq_len=32), 3, 8
  paths = token_windows.resolve_files(cfg.train_files, "data.train_files")
  source = token_windows.TokenWindows(paths, 32, helpers.TOKEN_VOCAB)
  # Window contents identify windows here (code repeats, so compare multisets, as the byte corpus test does).
  want = collections.Counter(source[i]["tokens"].tobytes() for i in range(len(source)))
  got = collections.Counter()
  per_shard = []
  for k in range(num_shards):
    it = data.train_iterator(cfg, batch_size=batch, num_shards=num_shards, shard_index=k, seed=3)
    n_k = len(range(k, len(source), num_shards))
    rows = []
    while len(rows) < n_k:
      rows.extend(next(it)["tokens"])
    shard = collections.Counter(r.tobytes() for r in rows[:n_k])
    per_shard.append(shard)
    got += shard
  assert got == want
  # Disjoint by index: shard k reads exactly windows k, k + M, ... in some order.
  for k, shard in enumerate(per_shard):
    assert shard == collections.Counter(source[i]["tokens"].tobytes() for i in range(k, len(source), num_shards))


def test_restored_tokenized_iterator_yields_the_same_next_batch(token_data):
  cfg = data_cfg(token_data)
  it = data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=1, seed=5)
  paths = token_windows.resolve_files(cfg.train_files, "x")
  n = len(token_windows.TokenWindows(paths, cfg.seq_len, helpers.TOKEN_VOCAB))
  for _ in range(n // 2 // 4 + 3):  # past the end of the first epoch of this shard
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # orbax stores it as JSON
  expected = [next(it)["tokens"] for _ in range(2)]
  restored = data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=1, seed=5)
  assert not np.array_equal(next(restored)["tokens"], expected[0])
  restored.set_state(state)
  for batch in expected:
    np.testing.assert_array_equal(next(restored)["tokens"], batch)


def test_tokenized_eval_batches_are_the_eval_shard_in_order(token_data):
  cfg = data_cfg(token_data, seq_len=32)
  (stream,) = file_streams([str(token_data.shards / "eval-00000-of-00001.array_record")])
  n = (stream.size - 1) // 32
  batches = data.eval_batches(cfg, batch_size=4, num_batches=n // 4 + 2)
  rows = np.concatenate([b["tokens"] for b in batches])
  np.testing.assert_array_equal(rows[0], stream[:33])
  np.testing.assert_array_equal(rows[1], stream[32:65])
  np.testing.assert_array_equal(rows[n], rows[0])  # cycles


def _expect(config, field):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config)
    data.check_files(config)
  assert f"config.{field}" in str(e.value), str(e.value)


def test_bad_data_config_names_the_field(token_data, tmp_path):
  base = lambda: token_data.apply(config_lib.base_config())
  c = base()
  config_lib.validate(c)
  data.check_files(c)

  def bad(field, value, make=base):
    c = make()
    section, name = field.split(".")
    c[section][name] = value
    _expect(c, field)

  bad("data.format", "parquet")
  bad("data.tokenizer", "")
  bad("data.eval_files", "")
  bad("model.vocab_size", 1000, make=config_lib.base_config)  # bytes are 256
  bad("data.tokenizer", str(tmp_path / "missing.model"))
  (tmp_path / "junk.model").write_bytes(b"not a model")
  bad("data.tokenizer", str(tmp_path / "junk.model"))
  bad("model.vocab_size", 512)
  bad("data.train_files", str(tmp_path / "nothing-*.array_record"))
  bad("data.train_files", str(tmp_path / "*/train-*"))
  (tmp_path / "eval-bad.array_record").write_bytes(b"\x00" * 100)
  bad("data.eval_files", str(tmp_path / "eval-bad.array_record"))
  # Shards made with another tokenizer: their tokens.json says so.
  other = tmp_path / "other"
  shutil.copytree(token_data.shards, other)
  meta = json.loads((other / token_windows.SHARD_METADATA).read_text())
  meta["tokenizer"]["sha256"] = "0" * 64
  (other / token_windows.SHARD_METADATA).write_text(json.dumps(meta))
  bad("data.train_files", f"{other}/train-*.array_record")


@pytest.mark.process
def test_bad_data_fails_the_command_before_training(token_data, tmp_path):
  fields = {**token_data.overrides(), "model.vocab_size": 512}
  argv = [sys.executable, "-m", "diloco_jax", "baseline", "--config", "configs/tiny_cpu.py",
          *[f"--config.{k}={v}" for k, v in fields.items()], "--workdir", str(tmp_path / "never")]
  proc = subprocess.run(argv, cwd=helpers.REPO, capture_output=True, text=True, timeout=180,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "config.model.vocab_size: 512 differs from the 1000 pieces" in proc.stderr
  assert "Traceback" not in proc.stderr and not (tmp_path / "never").exists()


@pytest.mark.process
def test_tokenizer_and_tokenize_commands(token_data, tmp_path):
  """The two commands as a user runs them; their output reads back through the config."""
  run = lambda *args: subprocess.run([sys.executable, "-m", "diloco_jax", *args], cwd=helpers.REPO,
                                     capture_output=True, text=True, timeout=180)
  model = tmp_path / "sub" / "tok.model"
  proc = run("tokenizer", "--data", str(token_data.corpus), "--vocab", "600", "--out", str(model))
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "600 pieces" in proc.stdout and model.exists()
  out = tmp_path / "tokens"
  proc = run("tokenize", "--tokenizer", str(model), "--data", str(token_data.corpus), "--out", str(out),
             "--shards", "3")
  assert proc.returncode == 0, proc.stderr[-2000:]
  meta = json.loads((out / token_windows.SHARD_METADATA).read_text())
  assert sorted(meta["files"]) == ["eval-00000-of-00001.array_record"] + [shards.shard_name("train", i, 3)
                                                                         for i in range(3)]
  assert meta["chunk_tokens"] == shards.CHUNK_TOKENS and meta["vocab_size"] == 600
  c = config_lib.base_config()
  c.data.format, c.data.tokenizer, c.model.vocab_size = "array_record", str(model), 600
  c.data.train_files, c.data.eval_files = f"{out}/train-*.array_record", f"{out}/eval-*.array_record"
  data.check_files(c)
  assert sum(len(token_windows.TokenWindows([str(out / n)], 64, 600)) for n in meta["files"]) > 100


def test_tokenizer_refuses_a_vocabulary_the_text_cannot_fill(token_data):
  texts = list(corpus_texts(token_data).values())
  for vocab in (100, 200_000):
    with pytest.raises(config_lib.ConfigError, match="--vocab"):
      tokenizer.train_sentencepiece(texts, vocab)

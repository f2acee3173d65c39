"""Tests for diloco_jax.data.pipeline: corpus loading and split, packing, shards, checkpointable iterators."""

import collections
import json

import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import pipeline as data

MAX_BYTES = 300_000  # a slice of the embedded corpus: large enough for real shards, fast to read


def data_cfg(**overrides):
  c = config_lib.base_config().data
  c.max_bytes = MAX_BYTES
  c.seq_len = 64
  c.update(overrides)
  return c


def epoch_rows(it, n_records, batch_size):
  """The first epoch of a shard: its first `n_records` rows (shuffle is a permutation within an epoch)."""
  rows = []
  while len(rows) < n_records:
    rows.extend(next(it)["tokens"])
  return rows[:n_records]


def test_embedded_corpus_split_is_by_file_and_deterministic():
  corpus = corpus_lib.load_corpus("", 0, 0.05)
  train, ev = set(corpus.train_files), set(corpus.eval_files)
  assert train and ev
  assert not train & ev
  assert not any("site-packages" in f or f.startswith("test/") for f in train | ev)
  assert all(f.endswith(".py") for f in train | ev)
  # The eval set is exactly the files whose path hash falls under the fraction.
  assert ev == {f for f in train | ev if corpus_lib.is_eval_file(f, 0.05)}
  assert 0.01 < len(ev) / len(train | ev) < 0.15
  # Bytes: the files joined by one separator byte each.
  assert corpus.train.dtype == np.uint8
  assert corpus.train.size > 1_000_000
  assert np.count_nonzero(corpus.train == corpus_lib.SEPARATOR) >= len(train) - 1
  # Reloading from disk (cache cleared) gives the same corpus.
  corpus_lib.load_corpus.cache_clear()
  again = corpus_lib.load_corpus("", 0, 0.05)
  assert again.eval_files == corpus.eval_files
  np.testing.assert_array_equal(again.eval, corpus.eval)


def test_max_bytes_caps_the_corpus_and_the_cache_is_shared():
  corpus = corpus_lib.load_corpus(max_bytes=MAX_BYTES)
  n_files = len(corpus.train_files) + len(corpus.eval_files)
  assert corpus.num_bytes == MAX_BYTES + n_files - 2  # file bytes + one separator between files per split
  assert corpus.train_files and corpus.eval_files
  assert corpus_lib.load_corpus("", MAX_BYTES, 0.05) is corpus
  assert not corpus.train.flags.writeable  # shared through the cache, so read-only


def test_windows_overlap_by_one_token_and_cover_the_stream():
  tokens = np.arange(1000, dtype=np.uint8)
  src = corpus_lib.PackedWindows(tokens, 64)
  assert len(src) == (1000 - 1) // 64
  windows = [src[i]["tokens"] for i in range(len(src))]
  assert all(w.dtype == np.int32 and w.shape == (65,) for w in windows)
  for a, b in zip(windows, windows[1:]):
    assert a[-1] == b[0]
  # Inputs w[:-1] of all windows plus the last target rebuild the stream prefix, so every token is used.
  rebuilt = np.concatenate([w[:-1] for w in windows] + [windows[-1][-1:]])
  np.testing.assert_array_equal(rebuilt, tokens[:len(src) * 64 + 1])
  with pytest.raises(IndexError):
    src[len(src)]


def test_shards_are_disjoint_and_cover_every_record():
  cfg, num_shards, batch = data_cfg(), 3, 8
  all_windows = corpus_lib.PackedWindows(corpus_lib.load_corpus("", MAX_BYTES).train, cfg.seq_len)
  want = collections.Counter(all_windows[i]["tokens"].tobytes() for i in range(len(all_windows)))
  got = collections.Counter()
  for k in range(num_shards):
    it = data.train_iterator(cfg, batch_size=batch, num_shards=num_shards, shard_index=k, seed=1)
    n_k = len(range(k, len(all_windows), num_shards))
    got += collections.Counter(r.tobytes() for r in epoch_rows(it, n_k, batch))
  # Equal multisets: every record is read by exactly one shard, once per epoch. (Contents, not sets: real
  # text repeats, so two different records may hold the same bytes.)
  assert got == want


def test_shard_record_sets_are_pairwise_disjoint(tmp_path):
  # Random bytes make every window unique, so record contents identify record indices.
  rng = np.random.default_rng(0)
  for name in ("a.bin", "b.bin", "c.bin"):
    (tmp_path / name).write_bytes(rng.integers(1, 256, 20_000, dtype=np.uint8).tobytes())
  cfg, num_shards, batch = data_cfg(path=str(tmp_path), max_bytes=0, seq_len=32), 4, 4
  n = len(corpus_lib.PackedWindows(corpus_lib.load_corpus(cfg.path, 0, cfg.eval_fraction).train, 32))
  shards = []
  for k in range(num_shards):
    it = data.train_iterator(cfg, batch_size=batch, num_shards=num_shards, shard_index=k)
    shards.append({r.tobytes() for r in epoch_rows(it, len(range(k, n, num_shards)), batch)})
  assert sum(len(s) for s in shards) == n  # no duplicates within a shard's epoch
  all_windows = corpus_lib.PackedWindows(corpus_lib.load_corpus(cfg.path, 0, cfg.eval_fraction).train, 32)
  assert set().union(*shards) == {all_windows[i]["tokens"].tobytes() for i in range(n)}
  for i in range(num_shards):
    for j in range(i + 1, num_shards):
      assert not shards[i] & shards[j]


def test_shards_shuffle_differently_and_deterministically():
  cfg = data_cfg()
  first = lambda k, seed: next(data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=k, seed=seed))
  np.testing.assert_array_equal(first(0, 0)["tokens"], first(0, 0)["tokens"])
  assert not np.array_equal(first(0, 0)["tokens"], first(0, 1)["tokens"])
  # Shard 0's batch is not just its records in order (it was shuffled).
  src = corpus_lib.PackedWindows(corpus_lib.load_corpus("", MAX_BYTES).train, cfg.seq_len)
  in_order = np.stack([src[i]["tokens"] for i in range(0, 8, 2)])
  assert not np.array_equal(first(0, 0)["tokens"], in_order)


def test_restored_iterator_yields_the_same_next_batch():
  cfg = data_cfg()
  it = data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=1, seed=7)
  for _ in range(5):
    next(it)
  state = json.loads(json.dumps(it.get_state()))  # orbax stores it as JSON
  expected = next(it)["tokens"]
  fresh = data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=1, seed=7)
  assert not np.array_equal(next(fresh)["tokens"], expected)  # without the state: another batch
  restored = data.train_iterator(cfg, batch_size=4, num_shards=2, shard_index=1, seed=7)
  restored.set_state(state)
  np.testing.assert_array_equal(next(restored)["tokens"], expected)
  np.testing.assert_array_equal(next(restored)["tokens"], next(it)["tokens"])


def test_process_parts_side_by_side_are_the_learners_batches():
  # A learner spanning 2 processes reads the same batches as on one process, each process its own rows,
  # across an epoch boundary (the shard holds ~2300 windows: 600 batches of 4 pass it), and resumes alike.
  cfg = data_cfg()
  kwargs = dict(batch_size=4, num_shards=2, shard_index=1, seed=3)
  whole = data.train_iterator(cfg, **kwargs)
  parts = [data.train_iterator(cfg, **kwargs, part=p, num_parts=2) for p in range(2)]
  for step in range(600):
    expected = next(whole)["tokens"]
    got = [next(it)["tokens"] for it in parts]
    assert all(g.shape == (2, cfg.seq_len + 1) for g in got)
    np.testing.assert_array_equal(np.concatenate(got), expected, err_msg=f"step {step}")
  state = json.loads(json.dumps(parts[1].get_state()))
  restored = data.train_iterator(cfg, **kwargs, part=1, num_parts=2)
  restored.set_state(state)
  np.testing.assert_array_equal(next(restored)["tokens"], next(whole)["tokens"][2:])
  with pytest.raises(ValueError, match="part 0 of 3"):
    data.train_iterator(cfg, **kwargs, part=0, num_parts=3)


def test_user_directory(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_text("alpha " * 400)
  (tmp_path / "sub" / "b.txt").write_text("beta " * 400)
  (tmp_path / "c.md").write_text("gamma " * 400)
  (tmp_path / ".hidden").write_text("never read")
  cfg = data_cfg(path=str(tmp_path), max_bytes=0, seq_len=16)
  corpus = corpus_lib.load_corpus(cfg.path, 0, cfg.eval_fraction)
  files = corpus.train_files + corpus.eval_files
  assert sorted(files) == ["a.txt", "c.md", "sub/b.txt"]
  assert corpus.train_files and corpus.eval_files
  assert corpus.num_bytes == 2400 + 2000 + 2400 + 1  # 3 files in two splits: one separator
  assert b"never" not in corpus.train.tobytes() + corpus.eval.tobytes()
  batch = next(data.train_iterator(cfg, batch_size=4))
  assert batch["tokens"].shape == (4, 17) and batch["tokens"].dtype == np.int32
  ev = data.eval_batches(cfg, batch_size=2, num_batches=1)
  assert bytes(ev[0]["tokens"][0].astype(np.uint8)) == corpus.eval[:17].tobytes()


def test_single_user_file_is_split_by_bytes(tmp_path):
  f = tmp_path / "one.txt"
  f.write_bytes(bytes(range(1, 201)) * 10)
  corpus = corpus_lib.load_corpus(str(f), 0, 0.1)
  assert corpus.train_files == corpus.eval_files == ("one.txt",)
  assert corpus.train.size == 1800 and corpus.eval.size == 200
  assert corpus.train.tobytes() + corpus.eval.tobytes() == f.read_bytes()


@pytest.mark.parametrize("make", ["missing", "empty_dir", "empty_file"])
def test_bad_path_names_the_field(tmp_path, make):
  path = tmp_path / make
  if make == "empty_dir":
    path.mkdir()
  elif make == "empty_file":
    path.write_bytes(b"")
  with pytest.raises(ValueError, match=r"config\.data\.path"):
    data.train_iterator(data_cfg(path=str(path)), batch_size=2)


def test_bad_arguments_name_the_field(tmp_path):
  cfg = data_cfg()
  with pytest.raises(ValueError, match="data.global_batch"):
    data.train_iterator(cfg, batch_size=0)
  with pytest.raises(ValueError, match="learners.num"):
    data.train_iterator(cfg, batch_size=2, num_shards=0)
  with pytest.raises(ValueError, match="shard_index 2 out of range"):
    data.train_iterator(cfg, batch_size=2, num_shards=2, shard_index=2)
  (tmp_path / "small.txt").write_text("x" * 1000)
  (tmp_path / "z.txt").write_text("y" * 1000)  # the eval file
  with pytest.raises(ValueError, match="fewer than one batch"):
    data.train_iterator(data_cfg(path=str(tmp_path), seq_len=64), batch_size=16)


def test_eval_batches_are_ordered_and_cycle():
  cfg = data_cfg(seq_len=32)
  corpus = corpus_lib.load_corpus("", MAX_BYTES)
  n_windows = len(corpus_lib.PackedWindows(corpus.eval, 32))
  batches = data.eval_batches(cfg, batch_size=8, num_batches=n_windows // 8 + 2)
  rows = np.concatenate([b["tokens"] for b in batches])
  assert all(b["tokens"].shape == (8, 33) and b["tokens"].dtype == np.int32 for b in batches)
  np.testing.assert_array_equal(rows[0], corpus.eval[:33])
  np.testing.assert_array_equal(rows[1], corpus.eval[32:65])
  np.testing.assert_array_equal(rows[n_windows], rows[0])  # cycled back to the start
  again = data.eval_batches(cfg, batch_size=8, num_batches=2)
  np.testing.assert_array_equal(again[1]["tokens"], batches[1]["tokens"])


def test_tokens_in_batch_is_exact():
  cfg = data_cfg(seq_len=48)
  batch = next(data.train_iterator(cfg, batch_size=6))
  assert data.tokens_in_batch(batch) == 6 * 48 == batch["tokens"][:, 1:].size
  assert data.tokens_in_batch(np.zeros((3, 11), np.int32)) == 30

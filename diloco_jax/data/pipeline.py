"""Data: an embedded byte-level corpus and grain pipelines, one disjoint shard per learner.

The default corpus needs no download: it is the `.py` sources of the running interpreter's standard library
(without `site-packages` and the `test`/`tests` packages), read as bytes. Tokens are bytes (vocab 256,
token = byte value); files are joined with a single 0 byte, a value that never occurs in text, so the model
sees a clean document boundary. `config.data.path` may point to a user's text file or directory instead.

Train/eval is split by FILE (a stable hash of each file's relative path), so eval text is never trained on.
The train stream is packed into windows of `seq_len + 1` tokens that overlap by one token (window i starts
at i * seq_len), so inputs `w[:-1]` and targets `w[1:]` together predict every token of the stream once.
Learner `k` of `M` reads windows `k, k + M, k + 2M, ...`: the shards are disjoint and cover every window.

Pipeline per learner (grain 0.2 dataset API)::

  MapDataset.source(windows)[k::M].seed(s).shuffle().repeat().batch(b, drop_remainder=True)
      .to_iter_dataset()

A learner spanning H processes reads its batches in H parts, one per process: process p reads sub-batches
p, p + H, p + 2H, ... of `batch(b / H)` on the same stream, so that the H parts of batch i, side by side,
are exactly batch i of the one-process pipeline: the data a learner sees does not depend on how many
hosts it spans, and each host reads only its own rows.

The resulting iterator's `get_state()` is a small JSON-able dict (`{"next_index": n}`) that orbax stores
with the checkpoint; `set_state()` on a fresh iterator of the same config resumes at the same batch.

`data.format = "array_record"` reads a corpus pre-tokenized by `python -m diloco_jax tokenize` instead
(`data.tokenizer`, `data.train_files`, `data.eval_files`; local or gs:// paths): ArrayRecord files whose
records are consecutive chunks of one token stream per file (each document followed by the tokenizer's
eos id), as little-endian uint16 (uint32 above 65,536 pieces). `TokenWindows` gives the same packed windows
with random access (window i of a file starts at token i * seq_len; windows never span two files), so the
pipeline, the shards by learner and the iterator state are the same as above.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import hashlib
import json
import os
import sysconfig
from concurrent import futures
from typing import Any, Mapping, Sequence

import grain
import numpy as np
from etils import epath

from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.config.schema import ConfigError

VOCAB_SIZE = 256  # byte-level tokens
SEPARATOR = 0  # the byte placed between two files of a split
_HASH_BUCKETS = 10_000
# Directories left out of the embedded corpus: installed third-party code and the (huge, repetitive) tests.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})
# Bounded host-side prefetch: batch assembly is a few numpy slices, so a couple of threads keep up with any
# step time, and a small buffer keeps memory flat when many learners share one process.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
FORMATS = ("bytes", "array_record")
SHARD_METADATA = "tokens.json"  # written by `tokenize` beside its shards: tokenizer hash, counts


@dataclasses.dataclass(frozen=True)
class Corpus:
  """A tokenized corpus split by file.

  Attributes:
    train: 1-D uint8 tokens of the train files, joined by `SEPARATOR`. Read-only (shared by a cache).
    eval: 1-D uint8 tokens of the eval files, joined the same way. Read-only.
    train_files: relative paths (POSIX separators) of the train files, sorted.
    eval_files: relative paths of the eval files, sorted.
  """

  train: np.ndarray
  eval: np.ndarray
  train_files: tuple[str, ...]
  eval_files: tuple[str, ...]

  @property
  def num_bytes(self) -> int:
    return int(self.train.size + self.eval.size)


def _stdlib_root() -> str:
  return sysconfig.get_paths()["stdlib"] or os.path.dirname(os.__file__)


def _list_stdlib() -> tuple[str, list[str]]:
  """The standard library's `.py` files as (root, sorted relative POSIX paths)."""
  root = _stdlib_root()
  rels = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS]
    for name in filenames:
      if name.endswith(".py"):
        rels.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
  return root, sorted(rels)


def _list_user(path: str) -> tuple[str, list[str]]:
  """A user's file (root = its directory) or every file under a directory, recursively, sorted.

  Hidden files and directories (name starting with ".") are skipped so that pointing at a checkout does not
  train on `.git` objects.
  """
  if os.path.isfile(path):
    return os.path.dirname(path), [os.path.basename(path)]
  rels = []
  for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    for name in filenames:
      if not name.startswith("."):
        rels.append(os.path.relpath(os.path.join(dirpath, name), path).replace(os.sep, "/"))
  return path, sorted(rels)


def _read_files(root: str, rels: list[str], max_bytes: int) -> list[tuple[str, bytes]]:
  """Reads files in order; with `max_bytes > 0` stops once that many bytes are in (the last one truncated)."""
  out, total = [], 0
  for rel in rels:
    want = max_bytes - total if max_bytes > 0 else -1
    if want == 0:
      break
    with open(os.path.join(root, rel), "rb") as f:
      data = f.read(want)
    if data:  # empty files would only add separators
      out.append((rel, data))
      total += len(data)
  return out


def _is_eval(rel: str, eval_fraction: float) -> bool:
  # sha1 of the path, not Python's hash(): stable across processes, machines and PYTHONHASHSEED.
  h = int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16)
  return h % _HASH_BUCKETS < eval_fraction * _HASH_BUCKETS


def is_eval_file(rel: str, eval_fraction: float) -> bool:
  """Whether the file at relative path `rel` is held out for eval: the rule of `load_corpus`, which the
  `tokenize` command applies too."""
  return _is_eval(rel, eval_fraction)


def _join(chunks: list[bytes]) -> np.ndarray:
  return np.frombuffer(bytes([SEPARATOR]).join(chunks), dtype=np.uint8)


def _split(files: list[tuple[str, bytes]], eval_fraction: float) -> Corpus:
  """File-level train/eval split by path hash, with fallbacks so that neither split is empty."""
  if len(files) == 1:
    # One file cannot be split by file: hold out its tail instead (the only case where train and eval
    # come from the same file; their bytes are still disjoint).
    rel, data = files[0]
    cut = min(len(data) - 1, max(1, int(round(len(data) * (1.0 - eval_fraction)))))
    return Corpus(_join([data[:cut]]), _join([data[cut:]]), (rel,), (rel,))
  is_eval = [_is_eval(rel, eval_fraction) for rel, _ in files]
  if all(is_eval) or not any(is_eval):
    is_eval = [False] * (len(files) - 1) + [True]  # the last file (sorted) is the eval split
  train = [f for f, e in zip(files, is_eval) if not e]
  ev = [f for f, e in zip(files, is_eval) if e]
  return Corpus(
      train=_join([d for _, d in train]),
      eval=_join([d for _, d in ev]),
      train_files=tuple(r for r, _ in train),
      eval_files=tuple(r for r, _ in ev),
  )


@functools.lru_cache(maxsize=8)
def _load_corpus_cached(path: str, max_bytes: int, eval_fraction: float) -> Corpus:
  if path:
    if not os.path.exists(path):
      raise ConfigError(f"config.data.path: {path!r} does not exist")
    root, rels = _list_user(path)
  else:
    root, rels = _list_stdlib()
  files = _read_files(root, rels, max_bytes)
  if sum(len(d) for _, d in files) < 2:
    where = repr(path) if path else f"the embedded corpus (stdlib at {root!r})"
    raise ConfigError(f"config.data.path: {where} yields no text (found {len(rels)} files, "
                      f"{sum(len(d) for _, d in files)} bytes)")
  return _split(files, eval_fraction)


def load_corpus(path: str = "", max_bytes: int = 0, eval_fraction: float = 0.05) -> Corpus:
  """Loads and splits a byte-level corpus; cached per (path, max_bytes, eval_fraction).

  Args:
    path: "" for the embedded corpus (this interpreter's standard library `.py` files), else a text file or
      a directory of text files (all non-hidden files, recursively, in sorted order).
    max_bytes: if > 0, stop reading once this many bytes are in (the file that crosses it is truncated).
    eval_fraction: expected fraction of files held out for eval; a file is eval iff
      `int(sha1(relative_path)) % 10_000 < eval_fraction * 10_000`. If that leaves a split empty, the last
      file is eval and the rest train; a single file is split by bytes (its tail is eval).

  Returns:
    The Corpus. Its arrays are read-only and shared by every caller with the same arguments (the cache does
    not notice later changes to a user's files).

  Raises:
    ConfigError (a ValueError) naming `config.data.path` if the path does not exist or yields no bytes.
  """
  if max_bytes < 0:
    raise ConfigError(f"config.data.max_bytes: must be >= 0, got {max_bytes}")
  if not 0.0 < eval_fraction < 1.0:
    raise ConfigError(f"config.data.eval_fraction: must be in (0, 1), got {eval_fraction}")
  # Normalize before the cache so that equivalent calls (keyword or positional, relative or absolute path)
  # share one entry.
  path = os.path.abspath(os.path.expanduser(path)) if path else ""
  return _load_corpus_cached(path, int(max_bytes), float(eval_fraction))


load_corpus.cache_clear = _load_corpus_cached.cache_clear  # type: ignore[attr-defined]


class PackedWindows:
  """Random-access source of packed windows: record i is `{"tokens": int32[seq_len + 1]}` starting at
  token i * seq_len. Consecutive windows share one token, so every token after the first is a target once."""

  def __init__(self, tokens: np.ndarray, seq_len: int):
    if seq_len < 1:
      raise ConfigError(f"config.data.seq_len: must be >= 1, got {seq_len}")
    self._tokens = tokens
    self._seq_len = seq_len
    self._len = max(0, (tokens.size - 1) // seq_len)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    i = int(i)
    if not 0 <= i < self._len:
      raise IndexError(f"window {i} out of range [0, {self._len})")
    start = i * self._seq_len
    return {"tokens": self._tokens[start:start + self._seq_len + 1].astype(np.int32)}

  def __repr__(self) -> str:  # grain prints sources in its debug output
    return f"PackedWindows(num_tokens={self._tokens.size}, seq_len={self._seq_len}, len={self._len})"


def token_dtype(vocab_size: int) -> np.dtype:
  """How token shards store ids: little-endian uint16 up to 65,536 pieces, else uint32."""
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def resolve_files(patterns: str, field: str) -> list[str]:
  """The sorted files matching comma-separated glob patterns (local or gs://; wildcards in the file name
  only). Raises ConfigError naming `config.<field>` when a pattern matches nothing."""
  paths = set()
  for pattern in (p.strip() for p in patterns.split(",")):
    if not pattern:
      continue
    directory, name = pattern.rsplit("/", 1) if "/" in pattern else (".", pattern)
    if any(c in directory for c in "*?["):
      raise ConfigError(f"config.{field}: wildcards only in the file name, got {pattern!r}")
    root = epath.Path(directory or "/")
    found = [str(p) for p in root.glob(name) if p.is_file()] if root.is_dir() else []
    if not found:
      raise ConfigError(f"config.{field}: {pattern!r} matches no file (prepare shards with `python -m "
                        "diloco_jax tokenize --tokenizer FILE --data TEXT --out DIR`)")
    paths.update(found)
  if not paths:
    raise ConfigError(f"config.{field}: no file pattern given")
  return sorted(paths)


def _open_shard(path: str, dtype: np.dtype, field: str) -> tuple[Any, int, int]:
  """(record source, tokens per record, tokens in the file) of one token shard."""
  try:
    source = grain.sources.ArrayRecordDataSource(path)
    n = len(source)
    first, last = (len(source[0]), len(source[n - 1])) if n else (0, 0)
  except (RuntimeError, ValueError, OSError) as e:
    raise ConfigError(f"config.{field}: cannot read {path!r} as ArrayRecord ({e})") from None
  if first % dtype.itemsize or last % dtype.itemsize or last > first or (n and not last):
    raise ConfigError(f"config.{field}: {path!r} is not a token shard of {dtype.itemsize}-byte ids (records "
                      f"of {first} and {last} bytes); was it made with this data.tokenizer?")
  chunk = max(first // dtype.itemsize, 1)
  return source, chunk, (n - 1) * chunk + last // dtype.itemsize if n else 0


class TokenWindows:
  """Random-access packed windows over token shards: record i is `{"tokens": int32[seq_len + 1]}`.

  Each file holds one token stream, cut into records of a fixed number of tokens (the last may be
  shorter). Window j of a file starts at its token j * seq_len (windows overlap by one token, as
  `PackedWindows`); a file's last tokens that do not fill a window are not read. Files are opened once,
  in parallel (record counts come from each file's footer), and read lazily, one or two records a window.
  """

  def __init__(self, paths: Sequence[str], seq_len: int, vocab_size: int, field: str = "data.train_files"):
    if seq_len < 1:
      raise ConfigError(f"config.data.seq_len: must be >= 1, got {seq_len}")
    self._paths, self._seq_len, self._vocab = tuple(paths), seq_len, vocab_size
    self._dtype = token_dtype(vocab_size)
    with futures.ThreadPoolExecutor(max(1, min(16, len(self._paths)))) as pool:
      shards = list(pool.map(lambda p: _open_shard(p, self._dtype, field), self._paths))
    self._sources = [s for s, _, _ in shards]
    self._chunks = [c for _, c, _ in shards]
    self.file_tokens = tuple(n for _, _, n in shards)
    windows = [max(0, (n - 1) // seq_len) for n in self.file_tokens]
    self._starts = np.concatenate([[0], np.cumsum(windows)]).astype(np.int64)
    self._len = int(self._starts[-1])

  @property
  def num_tokens(self) -> int:
    """Tokens stored in all files (windows read all of them but each file's tail)."""
    return int(sum(self.file_tokens))

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    i = int(i)
    if not 0 <= i < self._len:
      raise IndexError(f"window {i} out of range [0, {self._len})")
    f = bisect.bisect_right(self._starts, i) - 1
    start = (i - int(self._starts[f])) * self._seq_len
    end = start + self._seq_len + 1
    chunk = self._chunks[f]
    first, last = start // chunk, (end - 1) // chunk
    raw = b"".join(self._sources[f][r] for r in range(first, last + 1))
    tokens = np.frombuffer(raw, self._dtype)[start - first * chunk:end - first * chunk].astype(np.int32)
    if tokens.size and int(tokens.max()) >= self._vocab:
      raise ValueError(f"{self._paths[f]}: token id {int(tokens.max())} >= the tokenizer's {self._vocab} pieces; "
                       "the shards were made with another tokenizer")
    return {"tokens": tokens}

  def __repr__(self) -> str:
    return (f"TokenWindows(files={len(self._paths)}, num_tokens={self.num_tokens}, seq_len={self._seq_len}, "
            f"len={self._len})")


@functools.lru_cache(maxsize=8)
def _token_windows_cached(paths: tuple[str, ...], seq_len: int, vocab_size: int, field: str) -> TokenWindows:
  return TokenWindows(paths, seq_len, vocab_size, field)


def _token_windows(data_cfg, field: str) -> TokenWindows:
  """The windows of `config.data.<field>` (train_files or eval_files), cached per file list."""
  vocab = tokenizer_lib.load(data_cfg.tokenizer).vocab_size
  paths = resolve_files(data_cfg[field], f"data.{field}")
  return _token_windows_cached(tuple(paths), int(data_cfg.seq_len), vocab, f"data.{field}")


def _train_source(data_cfg):
  if data_cfg.format == "array_record":
    return _token_windows(data_cfg, "train_files")
  return PackedWindows(_corpus(data_cfg).train, data_cfg.seq_len)


def check_files(config) -> None:
  """With `data.format = "array_record"`: the tokenizer loads and has `model.vocab_size` pieces; the train
  and eval patterns match readable shards made with this tokenizer (per `tokens.json`, where the `tokenize`
  command left one), and the eval shards hold at least one window. Raises ConfigError naming the field.
  Nothing to check for bytes (the corpus is read when the data is first used)."""
  d = config.data
  if d.format != "array_record":
    return
  tok = tokenizer_lib.load(d.tokenizer)
  if tok.vocab_size != config.model.vocab_size:
    raise ConfigError(f"config.model.vocab_size: {config.model.vocab_size} differs from the "
                      f"{tok.vocab_size} pieces of data.tokenizer {d.tokenizer!r}")
  for field in ("train_files", "eval_files"):
    paths = resolve_files(d[field], f"data.{field}")
    for directory in sorted({p.rsplit("/", 1)[0] if "/" in p else "." for p in paths}):
      meta_path = epath.Path(directory) / SHARD_METADATA
      if meta_path.exists():
        made_with = json.loads(meta_path.read_text()).get("tokenizer", {}).get("sha256")
        if made_with != tok.sha256:
          raise ConfigError(f"config.data.{field}: the shards in {directory!r} were made with another "
                            f"tokenizer (sha256 {str(made_with)[:16]}) than data.tokenizer {d.tokenizer!r} "
                            f"(sha256 {tok.sha256[:16]})")
    windows = _token_windows(d, field)
    if len(windows) < 1:
      raise ConfigError(f"config.data.{field}: the shards hold {windows.num_tokens} tokens, not one window "
                        f"of data.seq_len+1={d.seq_len + 1}")


def _corpus(data_cfg) -> Corpus:
  return load_corpus(data_cfg.path, data_cfg.max_bytes, data_cfg.eval_fraction)


def _shard_seed(seed: int, shard_index: int, num_shards: int) -> int:
  # Each shard shuffles with its own stream; a hash (not seed + shard_index) keeps (seed=0, shard=1) and
  # (seed=1, shard=0) apart.
  digest = hashlib.sha1(f"{seed}/{shard_index}/{num_shards}".encode()).hexdigest()
  return int(digest, 16) % (2**31)


def train_iterator(data_cfg, *, batch_size: int, num_shards: int = 1, shard_index: int = 0,
                   seed: int = 0, part: int = 0, num_parts: int = 1) -> grain.DatasetIterator:
  """An endless, shuffled iterator of train batches for one shard (one learner).

  Args:
    data_cfg: the `config.data` ConfigDict (path, seq_len, eval_fraction, max_bytes are read).
    batch_size: sequences per batch for this shard (the learner's share of `data.global_batch`).
    num_shards: number of disjoint shards (learners).
    shard_index: which shard, in [0, num_shards).
    seed: run seed; combined with `shard_index` so every shard has its own deterministic order.
    part / num_parts: read only rows [part * b, (part + 1) * b) of every batch, b = batch_size / num_parts
      (the share of one process of a learner spanning `num_parts` processes).

  Returns:
    A grain DatasetIterator over `{"tokens": int32[batch_size / num_parts, seq_len + 1]}`. Each epoch of the shard is
    reshuffled. `get_state()` / `set_state()` checkpoint and restore the position.

  Raises:
    ConfigError (a ValueError) naming the field when an argument cannot work.
  """
  if batch_size < 1:
    raise ConfigError(f"config.data.global_batch: per-shard batch_size must be >= 1, got {batch_size}")
  if num_shards < 1:
    raise ConfigError(f"config.learners.num: num_shards must be >= 1, got {num_shards}")
  if not 0 <= shard_index < num_shards:
    raise ConfigError(f"config.learners.num: shard_index {shard_index} out of range [0, {num_shards})")
  if num_parts < 1 or batch_size % num_parts or not 0 <= part < num_parts:
    raise ConfigError(f"config.data.global_batch: a learner's batch of {batch_size} cannot be read in part {part} "
                      f"of {num_parts} equal parts (one per process of the learner)")
  source = _train_source(data_cfg)
  ds = grain.MapDataset.source(source)[shard_index::num_shards]
  if len(ds) < batch_size:
    more = "data.train_files" if data_cfg.format == "array_record" else "data.path, data.max_bytes"
    raise ConfigError(
        f"config.data.global_batch: shard {shard_index} of {num_shards} holds {len(ds)} windows of "
        f"data.seq_len+1={data_cfg.seq_len + 1} tokens (of {source!r}), fewer than one batch of "
        f"{batch_size}; use more data ({more}) or a smaller data.global_batch / data.seq_len")
  ds = ds.seed(_shard_seed(seed, shard_index, num_shards)).shuffle().repeat()
  if num_parts == 1:
    ds = ds.batch(batch_size, drop_remainder=True)
  else:
    # The repeated stream is endless, so sub-batch i * num_parts + part is part `part` of batch i.
    ds = ds.batch(batch_size // num_parts, drop_remainder=True)[part::num_parts]
  return iter(ds.to_iter_dataset(_READ_OPTIONS))


class SideBySide:
  """Batches of several iterators concatenated along the batch axis, one batch of each per step, with
  `get_state()` / `set_state()` over all of them (a JSON-able dict, like a grain iterator's)."""

  def __init__(self, iterators: list):
    self._iterators = iterators

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batches = [next(it) for it in self._iterators]
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}

  def get_state(self) -> dict:
    return {"side_by_side": [it.get_state() for it in self._iterators]}

  def set_state(self, state: dict) -> None:
    states = state.get("side_by_side") if isinstance(state, dict) else None
    if not isinstance(states, list) or len(states) != len(self._iterators):
      raise ValueError(f"data iterator state does not hold {len(self._iterators)} shard states "
                       "(a checkpoint from another data.baseline_order or learners.num?)")
    for it, s in zip(self._iterators, states):
      it.set_state(s)


def baseline_iterator(data_cfg, *, num_learners: int, seed: int = 0, batches: Sequence[int] | None = None):
  """The data-parallel baseline's train batches of `data.global_batch` sequences.

  With `data.baseline_order = "learner_shards"` (the default) the batch of step s is the M learners'
  batches of step s side by side: learner k's shard iterator (`train_iterator(..., num_shards=M,
  shard_index=k)`) supplies the next b_k rows, b_k = global_batch / M, or `batches[k]` (the learners' own
  batch sizes, the resolved `learners.batches`, when their device counts differ; they sum to global_batch). The
  baseline then trains on exactly the tokens the Decoupled DiLoCo learners train on, in the same steps, so a
  comparison of the two differs only in the algorithm. With "shuffled" it is one shuffle of all windows.
  """
  if data_cfg.baseline_order == "shuffled" or num_learners == 1:
    return train_iterator(data_cfg, batch_size=data_cfg.global_batch, seed=seed)
  if not batches and data_cfg.global_batch % num_learners:
    raise ConfigError(f"config.data.global_batch: ({data_cfg.global_batch}) must divide over learners.num "
                      f"({num_learners}) for data.baseline_order='learner_shards'")
  sizes = list(batches) if batches else [data_cfg.global_batch // num_learners] * num_learners
  if len(sizes) != num_learners or sum(sizes) != data_cfg.global_batch:
    raise ConfigError(f"config.data.global_batch: the learners' batches {sizes} must be one per learner "
                      f"({num_learners}) and sum to {data_cfg.global_batch}")
  return SideBySide([train_iterator(data_cfg, batch_size=b, num_shards=num_learners, shard_index=k, seed=seed)
                     for k, b in enumerate(sizes)])


def eval_batches(data_cfg, *, batch_size: int, num_batches: int) -> list[dict[str, np.ndarray]]:
  """Deterministic eval batches from the eval split: windows in order, cycling if the split is short.

  Every learner and the baseline get exactly the same batches, so their eval losses compare directly.

  Returns:
    `num_batches` dicts `{"tokens": int32[batch_size, seq_len + 1]}`.
  """
  if batch_size < 1:
    raise ConfigError(f"config.data.global_batch: eval batch_size must be >= 1, got {batch_size}")
  if num_batches < 1:
    raise ConfigError(f"config.data.eval_batches: must be >= 1, got {num_batches}")
  seq_len = data_cfg.seq_len
  if data_cfg.format == "array_record":
    source = _token_windows(data_cfg, "eval_files")
    if len(source) < 1:
      raise ConfigError(f"config.data.eval_files: {source!r} holds no window of data.seq_len+1 tokens")
  else:
    tokens = _corpus(data_cfg).eval
    if tokens.size < seq_len + 1:
      # A tiny eval split still yields one full window: repeat its tokens (np.resize tiles cyclically).
      tokens = np.resize(tokens, seq_len + 1)
    source = PackedWindows(tokens, seq_len)
  idx = np.arange(batch_size * num_batches) % len(source)
  return [
      {"tokens": np.stack([source[i]["tokens"] for i in idx[b * batch_size:(b + 1) * batch_size]])}
      for b in range(num_batches)
  ]


def tokens_in_batch(batch: Mapping[str, Any] | np.ndarray) -> int:
  """Predicted tokens in a batch: batch_size * seq_len (each window of seq_len + 1 tokens has seq_len
  targets). Accepts the batch dict or its `tokens` array."""
  tokens = batch["tokens"] if isinstance(batch, Mapping) else batch
  b, width = tokens.shape[:2]
  return int(b) * (int(width) - 1)

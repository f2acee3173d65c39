"""Token shards: a corpus pre-tokenized by `python -m diloco_jax tokenize` (`data.format = "array_record"`).

`data.tokenizer`, `data.train_files`, `data.eval_files` (local or gs:// paths) name ArrayRecord files whose
records are consecutive chunks of one token stream per file (each document followed by the tokenizer's eos
id), as little-endian uint16 (uint32 above 65,536 pieces). `TokenWindows` gives the same packed windows as
the byte corpus's `corpus.PackedWindows`, with random access (window i of a file starts at token
i * seq_len; windows never span two files), so the pipeline, the shards by learner and the iterator state
are the same for both formats.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Sequence
from concurrent import futures
from typing import Any

import grain
import numpy as np
from etils import epath

from diloco_jax.config.schema import ConfigError
from diloco_jax.data import tokenizer as tokenizer_lib

SHARD_METADATA = "tokens.json"  # written by `tokenize` beside its shards: tokenizer hash, counts


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


def staged(path: str) -> str:
  """A local copy of a shard at a URL (gs://...), made once per host under $DILOCO_DATA_CACHE (default
  ~/.cache/diloco_jax/shards): array_record's reader opens local files only (given a gs:// name it hangs).
  A local path is returned as it is."""
  if "://" not in path:
    return path
  source = epath.Path(path)
  root = os.environ.get("DILOCO_DATA_CACHE") or str(pathlib.Path.home() / ".cache" / "diloco_jax" / "shards")
  local = pathlib.Path(root, hashlib.sha256(path.encode()).hexdigest()[:16], source.name)
  size = source.stat().length
  if not local.exists() or local.stat().st_size != size:
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f"{local.name}.{os.getpid()}.partial")
    source.copy(epath.Path(partial), overwrite=True)
    partial.replace(local)  # whole or not at all
  return str(local)


def _open_shard(path: str, dtype: np.dtype, field: str) -> tuple[Any, int, int]:
  """(record source, tokens per record, tokens in the file) of one token shard (a URL's through a local
  copy)."""
  try:
    path = staged(path)
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


def split_windows(data_cfg, field: str) -> TokenWindows:
  """The windows of `config.data.<field>` (train_files or eval_files), cached per file list."""
  vocab = tokenizer_lib.load(data_cfg.tokenizer).vocab_size
  paths = resolve_files(data_cfg[field], f"data.{field}")
  return _token_windows_cached(tuple(paths), int(data_cfg.seq_len), vocab, f"data.{field}")


def check_shards(config) -> None:
  """The tokenizer loads and has `model.vocab_size` pieces; the train and eval patterns match readable
  shards made with this tokenizer (per `tokens.json`, where the `tokenize` command left one), and the eval
  shards hold at least one window. Raises ConfigError naming the field."""
  d = config.data
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
    windows = split_windows(d, field)
    if len(windows) < 1:
      raise ConfigError(f"config.data.{field}: the shards hold {windows.num_tokens} tokens, not one window "
                        f"of data.seq_len+1={d.seq_len + 1}")

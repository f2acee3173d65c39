"""The byte-level corpus: text files read as bytes, split by file into train and eval, and packed windows.

The default corpus needs no download: it is the `.py` sources of the running interpreter's standard library
(without `site-packages` and the `test`/`tests` packages), read as bytes. Tokens are bytes (vocab 256,
token = byte value); files are joined with a single 0 byte, a value that never occurs in text, so the model
sees a clean document boundary. `config.data.path` may point to a user's text file or directory instead.

Train/eval is split by FILE (a stable hash of each file's relative path), so eval text is never trained on.
The train stream is packed into windows of `seq_len + 1` tokens that overlap by one token (window i starts
at i * seq_len, `PackedWindows`), so inputs `w[:-1]` and targets `w[1:]` together predict every token of
the stream once.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig

import numpy as np

from diloco_jax.config.schema import ConfigError

SEPARATOR = 0  # the byte placed between two files of a split
_HASH_BUCKETS = 10_000
# Directories left out of the embedded corpus: installed third-party code and the (huge, repetitive) tests.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


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


def is_eval_file(rel: str, eval_fraction: float) -> bool:
  """Whether the file at relative path `rel` is held out for eval: the rule of `load_corpus`, which the
  `tokenize` command applies too."""
  # sha1 of the path, not Python's hash(): stable across processes, machines and PYTHONHASHSEED.
  h = int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16)
  return h % _HASH_BUCKETS < eval_fraction * _HASH_BUCKETS


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
  is_eval = [is_eval_file(rel, eval_fraction) for rel, _ in files]
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

"""Pre-tokenized text as ArrayRecord shards: `write_shards` (the `tokenize` command, tools/tokenize.py).

Every file of the text is one document; a file goes to the eval split by the same path-hash rule as the
byte-level corpus (a single file holds out its tail instead, cut at a line end). Each document is encoded
and followed by the tokenizer's eos id; train documents go, in sorted order, to whichever train shard holds
the fewest tokens so far (balanced and disjoint), eval documents to the eval shards. A shard is records of
`chunk_tokens` consecutive tokens (little-endian uint16; uint32 above 65,536 pieces); `tokens.json` holds
the tokenizer's path and sha256, and per file its documents, tokens and text bytes. The pipeline reads them
as `data.format="array_record"` (`data/token_windows.py`'s `TokenWindows`).
"""

from __future__ import annotations

import heapq
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from diloco_jax.config.schema import ConfigError
from diloco_jax.data import corpus, token_windows
from diloco_jax.data import tokenizer as tokenizer_lib

CHUNK_TOKENS = 4096  # tokens per record: one or two reads per window of 2,049
# group_size 1: one record per chunk of the file, which random access needs (grain's recommendation).
_WRITER_OPTIONS = "group_size:1"
_ENCODE_BATCH = 64  # documents encoded together


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}-{index:05d}-of-{count:05d}.array_record"


class ShardWriter:
  """Appends token streams to one ArrayRecord file as records of `chunk_tokens` tokens."""

  def __init__(self, path: str, dtype: np.dtype, chunk_tokens: int):
    self.path, self._dtype, self._chunk = path, dtype, chunk_tokens
    self._writer = ArrayRecordWriter(path, _WRITER_OPTIONS)
    self._pending: list[np.ndarray] = []
    self._pending_tokens = 0
    self.tokens = self.documents = self.text_bytes = 0

  def add(self, tokens: np.ndarray, text_bytes: int) -> None:
    """One document's ids (its eos included)."""
    self._pending.append(tokens.astype(self._dtype))
    self._pending_tokens += tokens.size
    self.tokens += int(tokens.size)
    self.documents += 1
    self.text_bytes += int(text_bytes)
    if self._pending_tokens >= self._chunk:
      self._flush(final=False)

  def _flush(self, final: bool) -> None:
    stream = np.concatenate(self._pending) if self._pending else np.zeros(0, self._dtype)
    full = stream.size if final else stream.size - stream.size % self._chunk
    for start in range(0, full, self._chunk):
      self._writer.write(stream[start:start + self._chunk].tobytes())
    rest = stream[full:]
    self._pending, self._pending_tokens = ([rest] if rest.size else []), int(rest.size)

  def close(self) -> dict:
    self._flush(final=True)
    self._writer.close()
    return {"documents": self.documents, "tokens": self.tokens, "text_bytes": self.text_bytes}


def _split_single_file(rel: str, text: str, eval_fraction: float) -> list[tuple[str, str, bool]]:
  """One file cannot be split by file: its tail (from a line start) is the eval document."""
  cut = int(len(text) * (1.0 - eval_fraction))
  line = text.rfind("\n", 0, cut)
  cut = line + 1 if line > 0 else cut
  return [(rel, text[:cut], False), (rel, text[cut:], True)]


def _documents(path: str, eval_fraction: float, max_bytes: int) -> Iterable[tuple[str, str, bool]]:
  """(relative path, text, is_eval) of each document of `path`, in sorted order. If the path-hash rule
  leaves a split empty, the last file is eval and the rest train (as the byte-level corpus does)."""
  root, rels = tokenizer_lib.list_text_files(path)
  docs = tokenizer_lib.read_files(root, rels, max_bytes)
  if len(rels) == 1:
    for rel, text in docs:
      yield from _split_single_file(rel, text, eval_fraction)
    return
  held_out = {rel for rel in rels if corpus.is_eval_file(rel, eval_fraction)}
  if not held_out or len(held_out) == len(rels):
    held_out = {rels[-1]}
  for rel, text in docs:
    yield rel, text, rel in held_out


def _batches(items: Iterable, size: int) -> Iterator[list]:
  batch = []
  for item in items:
    batch.append(item)
    if len(batch) == size:
      yield batch
      batch = []
  if batch:
    yield batch


def write_shards(tok: tokenizer_lib.Tokenizer, data_path: str, out_dir: str, *, num_shards: int,
                 num_eval_shards: int = 1, eval_fraction: float = 0.05, chunk_tokens: int = CHUNK_TOKENS,
                 max_bytes: int = 0) -> dict:
  """Tokenizes `data_path` into shards in the local directory `out_dir`; returns (and writes) the
  metadata of `tokens.json`."""
  if num_shards < 1 or num_eval_shards < 1:
    raise ConfigError(f"--shards and --eval-shards must be >= 1, got {num_shards} and {num_eval_shards}")
  if chunk_tokens < 1:
    raise ConfigError(f"--chunk-tokens must be >= 1, got {chunk_tokens}")
  if not 0.0 < eval_fraction < 1.0:
    raise ConfigError(f"--eval-fraction must be in (0, 1), got {eval_fraction}")
  os.makedirs(out_dir, exist_ok=True)
  dtype = token_windows.token_dtype(tok.vocab_size)
  writers = {
      split: [ShardWriter(os.path.join(out_dir, shard_name(split, i, n)), dtype, chunk_tokens) for i in range(n)]
      for split, n in (("train", num_shards), ("eval", num_eval_shards))
  }
  # The shard with the fewest tokens so far takes the next document (ties: the lowest index).
  heaps = {split: [(0, i) for i in range(len(ws))] for split, ws in writers.items()}
  eos = np.asarray([tok.eos_id], np.int32)
  for batch in _batches(_documents(data_path, eval_fraction, max_bytes), _ENCODE_BATCH):
    batch = [(text, is_eval) for _, text, is_eval in batch if text]
    for (text, is_eval), ids in zip(batch, tok.encode_many([text for text, _ in batch])):
      ids = np.concatenate([ids, eos])
      split = "eval" if is_eval else "train"
      _, i = heapq.heappop(heaps[split])
      writers[split][i].add(ids, len(text.encode("utf-8")))
      heapq.heappush(heaps[split], (writers[split][i].tokens, i))
  files = {os.path.basename(w.path): w.close() for ws in writers.values() for w in ws}
  for split in writers:
    if not sum(files[os.path.basename(w.path)]["tokens"] for w in writers[split]):
      raise ConfigError(f"--data: {data_path!r} yields no {split} text")
  meta = {
      "format": 1, "tokenizer": tok.reference, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
      "dtype": dtype.str, "chunk_tokens": chunk_tokens, "source": data_path, "eval_fraction": eval_fraction,
      "tokens": {split: sum(files[os.path.basename(w.path)]["tokens"] for w in ws) for split, ws in writers.items()},
      "files": files,
  }
  with open(os.path.join(out_dir, token_windows.SHARD_METADATA), "w") as f:
    json.dump(meta, f, indent=2, sort_keys=True)
  return meta


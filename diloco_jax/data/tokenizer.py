"""Tokenizers: bytes (the zero-setup default) and a SentencePiece model trained locally on the user's text.

The `tokenizer` command (tools/tokenizer.py) trains one. The SentencePiece model is BPE with byte fallback
and no normalization (`identity`, no dummy prefix, runs of spaces kept), so that decoding the encoding of
any text gives back the text exactly, code included: a character the vocabulary lacks becomes its UTF-8
bytes (`<0x..>` pieces), never `<unk>`. Newlines and tabs are pieces of their own; digits are split one by
one. Ids: 0 `<unk>`, 1 `<s>`, 2 `</s>` (the document separator, `eos_id`), then 3 `\\n` and 4 `\\t`, then
the 256 byte pieces, then the learned ones.

Every tokenizer has the same small interface (`vocab_size`, `eos_id`, `encode`, `decode`, `token_bytes`,
`reference`): the data pipeline, the `tokenize` command, `eval` (bits per byte) and `sample` use it without
knowing which one they hold. Paths are local or `gs://` (etils epath). Nothing is downloaded.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import sentencepiece as spm
from etils import epath

from diloco_jax.config.schema import ConfigError
from diloco_jax.data import corpus

BYTE_VOCAB_SIZE = 256
# SentencePiece fields fixed for every model this module trains (see the module docstring).
_TRAINER_OPTIONS = dict(
    model_type="bpe", byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
    add_dummy_prefix=False, split_digits=True, allow_whitespace_only_pieces=True, split_by_whitespace=True,
    user_defined_symbols=["\n", "\t"], unk_id=0, bos_id=1, eos_id=2, pad_id=-1, character_coverage=0.9995,
    max_sentence_length=1 << 14, shuffle_input_sentence=True, minloglevel=2,
)
_SENTENCE_BYTES = 4096  # training text is fed to SentencePiece in line-aligned pieces of at most this size
_ENCODE_PIECE_CHARS = 1 << 22  # longer documents are encoded in newline-aligned pieces (same ids, less memory)


class Tokenizer(Protocol):
  """What the data pipeline, `eval` and `sample` need from a tokenizer."""

  vocab_size: int
  eos_id: int  # placed after every document; ends a sample

  def encode(self, text: str) -> np.ndarray: ...  # int32 ids

  def encode_many(self, texts: list[str]) -> list[np.ndarray]: ...

  def decode(self, ids: Iterable[int]) -> str: ...

  @property
  def token_bytes(self) -> np.ndarray: ...  # int64[vocab_size]: UTF-8 bytes of text each id stands for

  @property
  def reference(self) -> dict | None: ...  # {"path", "sha256"} of the model file; None for bytes


class ByteTokenizer:
  """Token = byte value (vocab 256); the separator byte 0 ends documents and stands for no text."""

  vocab_size = BYTE_VOCAB_SIZE
  eos_id = corpus.SEPARATOR
  reference = None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

  def encode_many(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids: Iterable[int]) -> str:
    return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    out = np.ones(BYTE_VOCAB_SIZE, np.int64)
    out[corpus.SEPARATOR] = 0
    return out


class SentencePieceTokenizer:
  """A SentencePiece model (the serialized proto), e.g. one trained by `train_sentencepiece`."""

  def __init__(self, model_proto: bytes, path: str = ""):
    self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
    self.vocab_size = int(self._sp.get_piece_size())
    self.eos_id = int(self._sp.eos_id())
    if self.eos_id < 0:
      raise ConfigError(f"config.data.tokenizer: {path!r} defines no end-of-sequence piece (eos_id), which "
                        "separates documents; train one with `python -m diloco_jax tokenizer`")
    self.sha256 = hashlib.sha256(model_proto).hexdigest()
    self.path = path
    self.model_proto = model_proto

  @property
  def reference(self) -> dict:
    return {"path": self.path, "sha256": self.sha256}

  def encode(self, text: str) -> np.ndarray:
    if len(text) <= _ENCODE_PIECE_CHARS:
      return np.asarray(self._sp.encode(text), np.int32)
    # Newlines are pieces of their own, so encoding newline-aligned pieces gives the same ids.
    return np.concatenate([np.asarray(ids, np.int32)
                           for ids in self._sp.encode(_line_aligned(text, _ENCODE_PIECE_CHARS))])

  def encode_many(self, texts: list[str]) -> list[np.ndarray]:
    """`encode` of each text, on all cores (SentencePiece's own threads)."""
    if any(len(t) > _ENCODE_PIECE_CHARS for t in texts):
      return [self.encode(t) for t in texts]
    return [np.asarray(ids, np.int32) for ids in self._sp.encode(texts, num_threads=os.cpu_count() or 1)]

  def decode(self, ids: Iterable[int]) -> str:
    return self._sp.decode([int(i) for i in ids])

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    sp = self._sp
    out = np.zeros(self.vocab_size, np.int64)
    for i in range(self.vocab_size):
      if sp.is_byte(i):
        out[i] = 1
      elif not (sp.is_control(i) or sp.is_unknown(i)):
        out[i] = len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return out


def _line_aligned(text: str, size: int) -> list[str]:
  """`text` cut after newlines into pieces of about `size` characters (a longer line is cut anywhere)."""
  pieces, start = [], 0
  while start < len(text):
    end = min(start + size, len(text))
    if end < len(text):
      cut = text.rfind("\n", start, end)
      end = cut + 1 if cut >= start else end
    pieces.append(text[start:end])
    start = end
  return pieces


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> SentencePieceTokenizer:
  p = epath.Path(path)
  if not p.is_file():
    raise ConfigError(f"config.data.tokenizer: {path!r} does not exist (make one with `python -m diloco_jax "
                      "tokenizer --data TEXT --vocab 32000 --out FILE`)")
  try:
    return SentencePieceTokenizer(p.read_bytes(), path)
  except RuntimeError as e:  # sentencepiece's error for a file that is not a model
    raise ConfigError(f"config.data.tokenizer: {path!r} is not a SentencePiece model ({e})") from None


def load(path: str) -> SentencePieceTokenizer:
  """The SentencePiece model at `path` (local or gs://), cached per path. Raises ConfigError naming
  `config.data.tokenizer` when it is missing or not a model."""
  return _load_cached(str(path))


load.cache_clear = _load_cached.cache_clear  # type: ignore[attr-defined]


def for_data(data_cfg) -> Tokenizer:
  """The tokenizer of `config.data`: bytes for `format="bytes"`, else the model at `data.tokenizer`."""
  if data_cfg.format == "bytes":
    return ByteTokenizer()
  return load(data_cfg.tokenizer)


def list_text_files(path: str) -> tuple[epath.Path, list[str]]:
  """(root, sorted relative paths) of a file, or of every non-hidden file under a directory (local or
  gs://). Hidden files and directories (a name starting with ".") are skipped, so that a checkout's `.git`
  is not read as text."""
  root = epath.Path(path)
  if root.is_file():
    return root.parent, [root.name]
  if not root.is_dir():
    raise FileNotFoundError(f"{path!r} does not exist")
  rels = []
  for dirpath, dirnames, filenames in root.walk():
    dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    base = os.path.relpath(os.fspath(dirpath), os.fspath(root))
    for name in filenames:
      if not name.startswith("."):
        rels.append(name if base == "." else f"{base}/{name}".replace(os.sep, "/"))
  return root, sorted(rels)


def read_text(root: epath.Path, rel: str) -> str:
  """A file's text: UTF-8, with invalid bytes replaced (U+FFFD)."""
  return (root / rel).read_bytes().decode("utf-8", errors="replace")


def read_documents(path: str, max_bytes: int = 0, *, shuffled: bool = False) -> Iterator[tuple[str, str]]:
  """(relative path, text) of each file of `path`, in sorted order (or, `shuffled`, in the order of a hash
  of the path: a sample from all over the tree when `max_bytes` stops early); with `max_bytes > 0`, stops
  once that many bytes of text are in (the file that crosses it is cut at a line end)."""
  root, rels = list_text_files(path)
  if shuffled:
    rels.sort(key=lambda rel: hashlib.sha1(rel.encode("utf-8")).hexdigest())
  return read_files(root, rels, max_bytes)


def read_files(root: epath.Path, rels: Iterable[str], max_bytes: int = 0) -> Iterator[tuple[str, str]]:
  """(relative path, text) of the files `rels` under `root`, in order, as `read_documents`."""
  total = 0
  for rel in rels:
    text = read_text(root, rel)
    if max_bytes > 0 and total + len(text.encode("utf-8")) > max_bytes:
      room = max_bytes - total
      text = text.encode("utf-8")[:room].decode("utf-8", errors="ignore")
      text = text[:text.rfind("\n") + 1] or text
      if text:
        yield rel, text
      return
    if text:
      total += len(text.encode("utf-8"))
      yield rel, text


def _sentences(documents: Iterable[str]) -> Iterator[str]:
  for text in documents:
    yield from _line_aligned(text, _SENTENCE_BYTES // 4)  # characters: up to 4 UTF-8 bytes each


def train_sentencepiece(documents: Iterable[str], vocab_size: int, *, num_threads: int = 0) -> bytes:
  """A SentencePiece BPE model (serialized) of exactly `vocab_size` pieces trained on `documents`.

  Raises ConfigError naming `--vocab` when the text cannot support that many pieces (SentencePiece's own
  check), or when `vocab_size` is below what the fixed pieces take (3 control, 2 symbols, 256 bytes)."""
  minimum = 3 + 2 + 256 + 1
  if vocab_size < minimum:
    raise ConfigError(f"--vocab: must be >= {minimum} (3 control pieces, newline, tab and 256 byte pieces "
                      f"come first), got {vocab_size}")
  buf = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(sentence_iterator=_sentences(documents), model_writer=buf,
                                   vocab_size=vocab_size, num_threads=num_threads or os.cpu_count() or 1,
                                   **_TRAINER_OPTIONS)
  except RuntimeError as e:
    raise ConfigError(f"--vocab: SentencePiece cannot train {vocab_size} pieces on this text ({e}); use more "
                      "text or a smaller --vocab") from None
  return buf.getvalue()


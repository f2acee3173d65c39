"""Loss of exported models: `python -m diloco_jax eval`.

  python -m diloco_jax eval --model runs/x/model                       # on the run's own eval set
  python -m diloco_jax eval --model runs/dp/model --model runs/x/model --data notes.txt

Without `--data` a model is evaluated on the eval windows of its own config (the batches every learner and
the baseline evaluate on), so the figure is the run's reported final eval loss. With `--data` (a text file
or a directory, local or gs://; each file one document, followed by the eos token as in training) it is
evaluated on that text: the token stream is cut into windows of `data.seq_len + 1` tokens overlapping by
one, plus a shorter last window, so every token but the first is predicted exactly once.

Reported per model: nats per token (the mean next-token cross-entropy) and bits per byte (total nats / ln 2
/ the UTF-8 bytes of the text the predicted tokens stand for; separators stand for none). Bits per byte
compare models with different tokenizers, e.g. a byte-level run and a tokenized one; several `--model`s
are evaluated on the same text in one command (a baseline and a Decoupled DiLoCo run).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence

import jax
import numpy as np

from diloco_jax import cli, command_flags
from diloco_jax.compute import inner
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.config.schema import ConfigError
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import pipeline as data_lib
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.runs import export as export_lib


@dataclasses.dataclass(frozen=True)
class EvalResult:
  nats: float  # summed over every predicted token
  tokens: int  # predicted tokens
  bytes: int  # UTF-8 bytes of text those tokens stand for

  @property
  def nats_per_token(self) -> float:
    return self.nats / max(self.tokens, 1)

  @property
  def bits_per_byte(self) -> float:
    return self.nats / math.log(2) / self.bytes if self.bytes else float("nan")

  def to_dict(self) -> dict:
    return {"nats_per_token": self.nats_per_token, "bits_per_byte": self.bits_per_byte, "tokens": self.tokens,
            "bytes": self.bytes}


def text_windows(tok: tokenizer_lib.Tokenizer, texts: Iterable[str], seq_len: int) -> list[np.ndarray]:
  """Windows (int32 rows) covering the token stream of `texts` (each followed by eos): full windows of
  `seq_len + 1` tokens overlapping by one, then the rest (if it predicts anything) as a shorter one."""
  stream = np.concatenate([np.append(ids, tok.eos_id).astype(np.int32)
                           for ids in tok.encode_many(list(texts))] or [np.zeros(0, np.int32)])
  source = corpus_lib.PackedWindows(stream, seq_len)
  windows = [source[i]["tokens"] for i in range(len(source))]
  rest = stream[len(source) * seq_len:]
  if rest.size >= 2:
    windows.append(rest)
  return windows


def config_windows(config) -> list[np.ndarray]:
  """The run's eval windows: the rows of `data.eval_batches` batches of `data.global_batch`, as the
  trainer evaluates them."""
  batches = data_lib.eval_batches(config.data, batch_size=config.data.global_batch,
                                  num_batches=config.data.eval_batches)
  return [row for b in batches for row in b["tokens"]]


@functools.lru_cache(maxsize=8)
def _token_losses_fn(graphdef, mesh):
  # Parameters keep the shardings they were restored with; the batch is split like a training batch.
  return jax.jit(functools.partial(inner.token_losses, graphdef),
                 in_shardings=(None, mesh_lib.batch_sharding(mesh)), out_shardings=mesh_lib.batch_sharding(mesh))


def evaluate(model: export_lib.Model, windows: Sequence[np.ndarray], batch_size: int = 0) -> EvalResult:
  """Summed next-token loss of `model` over `windows` (rows of equal length, but a last shorter one), in
  batches of `batch_size` rows (default `data.global_batch`), rounded up to split over the mesh."""
  ways = model.mesh.shape["data"] * model.mesh.shape["fsdp"]
  batch_size = -(-(batch_size or model.config.data.global_batch) // ways) * ways
  fn = _token_losses_fn(model.graphdef, model.mesh)
  token_bytes = model.tokenizer.token_bytes
  nats, tokens, nbytes = 0.0, 0, 0
  by_length: dict[int, list[np.ndarray]] = {}
  for w in windows:
    by_length.setdefault(int(w.size), []).append(np.asarray(w, np.int32))
  for rows in by_length.values():
    for start in range(0, len(rows), batch_size):
      real = np.stack(rows[start:start + batch_size])
      # Pad the last batch with copies of its first row; their losses are dropped below.
      batch = np.concatenate([real, np.repeat(real[:1], batch_size - len(real), axis=0)])
      losses = np.asarray(jax.device_get(fn(model.params, inner.put_batch(batch, model.mesh))))[:len(real)]
      nats += float(losses.astype(np.float64).sum())
      tokens += int(losses.size)
      nbytes += int(token_bytes[real[:, 1:]].sum())
  return EvalResult(nats=nats, tokens=tokens, bytes=nbytes)


def evaluate_models(argv) -> int:
  """`python -m diloco_jax eval --model DIR [--model DIR ...] [--data PATH]`; see the module docstring."""
  fv = cli.parse(argv, command_flags.evaluate, doc=__doc__, config=False)
  cli.enable_compilation_cache()
  devices = jax.devices()[:fv.devices or None]
  texts = None
  if fv.data:
    try:
      texts = [text for _, text in tokenizer_lib.read_documents(fv.data)]
    except FileNotFoundError as e:
      raise cli.UsageError(f"--data: {e}") from None
  for model_dir in fv.model:
    try:
      model = export_lib.load(model_dir, devices)
    except (FileNotFoundError, ValueError) as e:
      raise cli.UsageError(f"--model: {e}") from None
    seq_len = model.config.data.seq_len
    try:
      windows = text_windows(model.tokenizer, texts, seq_len) if texts is not None else config_windows(model.config)
    except ConfigError as e:  # the run's eval data is not on this machine
      raise cli.UsageError(f"{model_dir}: its eval set cannot be read ({e}); pass --data") from None
    if not windows:
      raise cli.UsageError(f"--data: {fv.data!r} holds fewer than 2 tokens")
    result = evaluate(model, windows, fv["batch-size"].value)
    on = fv.data or "its eval set"
    if fv.json:
      print(json.dumps({"model": model_dir, "data": on, **result.to_dict()}))
    else:
      print(f"{cli.shown(model_dir)}: {result.nats_per_token:.4f} nats/token, {result.bits_per_byte:.4f} "
            f"bits/byte over {result.tokens:,} tokens ({result.bytes:,} bytes) of {cli.shown(on)}")
  return 0

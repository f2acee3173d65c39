"""Pre-tokenize text into ArrayRecord shards: `python -m diloco_jax tokenize`.

  python -m diloco_jax tokenize --tokenizer data/tokenizer.model --data corpus/ --out data/tokens --shards 16

Every file of `--data` (a file or a directory, local or gs://; hidden files skipped) is one document,
encoded and followed by the tokenizer's eos id. Train documents are balanced over the `--shards` train
files, eval documents (by the byte corpus's path-hash rule, `--eval-fraction`) go to `--eval-shards`
files; `--out` (local or gs://) gets `train-*-of-*.array_record`, `eval-*-of-*.array_record` and
`tokens.json`. The rules and the record format: docs/operations.md, "Data".

A config reads them with `data.format="array_record"`, `data.tokenizer=FILE`,
`data.train_files="DIR/train-*.array_record"` and `data.eval_files="DIR/eval-*.array_record"`
(`data/token_windows.py`'s `TokenWindows`).
"""

from __future__ import annotations

import tempfile

from etils import epath

from diloco_jax import cli, command_flags
from diloco_jax.config.schema import ConfigError
from diloco_jax.data import shards, token_windows
from diloco_jax.data import tokenizer as tokenizer_lib


def tokenize_text(argv) -> int:
  """`python -m diloco_jax tokenize --tokenizer FILE --data PATH --out DIR --shards N`."""
  fv = cli.parse(argv, command_flags.tokenize, doc=__doc__, config=False)
  try:
    tok = tokenizer_lib.load(fv.tokenizer)
  except ConfigError as e:
    raise cli.UsageError(str(e).replace("config.data.tokenizer", "--tokenizer")) from None
  out = fv.out
  remote = "://" in out
  try:
    with tempfile.TemporaryDirectory(prefix="diloco_tokens_") as staging:
      local = staging if remote else out
      meta = shards.write_shards(tok, fv.data, local, num_shards=fv.shards,
                                 num_eval_shards=fv["eval-shards"].value, eval_fraction=fv["eval-fraction"].value,
                                 chunk_tokens=fv["chunk-tokens"].value or shards.CHUNK_TOKENS,
                                 max_bytes=fv["max-bytes"].value)
      if remote:
        dest = epath.Path(out)
        dest.mkdir(parents=True, exist_ok=True)
        # tokens.json last: its presence says the shards are complete.
        names = sorted(meta["files"]) + [token_windows.SHARD_METADATA]
        for name in names:
          epath.Path(local, name).copy(dest / name, overwrite=True)
  except FileNotFoundError as e:
    raise cli.UsageError(f"--data: {e}") from None
  except ConfigError as e:
    raise cli.UsageError(str(e)) from None
  t = meta["tokens"]
  print(f"tokenize: {t['train']:,} train tokens in {fv.shards} files, {t['eval']:,} eval tokens in "
        f"{fv['eval-shards'].value} -> {out}; use them with --config.data.format=array_record "
        f"--config.data.tokenizer={fv.tokenizer} --config.data.train_files={out}/train-*.array_record "
        f"--config.data.eval_files={out}/eval-*.array_record --config.model.vocab_size={tok.vocab_size}")
  return 0

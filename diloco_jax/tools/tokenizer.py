"""`python -m diloco_jax tokenizer`: a SentencePiece tokenizer trained on the user's text.

  python -m diloco_jax tokenizer --data corpus/ --vocab 32000 --out data/tokenizer.model

BPE with byte fallback and no normalization, so that decoding the encoding of any text gives back the text
exactly (`data/tokenizer.py` says how). The text is read from a sample all over `--data` (files in the order
of a hash of their path) up to `--max-bytes`. Nothing is downloaded.
"""

from __future__ import annotations

from absl import flags
from etils import epath

from diloco_jax import cli
from diloco_jax.config.schema import ConfigError
from diloco_jax.data import tokenizer as tokenizer_lib


def _define_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("data", None, "text file or directory (local or gs://) to learn the vocabulary from",
                      flag_values=fv, required=True)
  flags.DEFINE_integer("vocab", 32000, "pieces in the vocabulary (model.vocab_size of the configs using it)",
                       flag_values=fv)
  flags.DEFINE_string("out", None, "where to write the model file (local or gs://)", flag_values=fv,
                      required=True)
  flags.DEFINE_integer("max-bytes", 200_000_000, "read at most this much text (0 = all); SentencePiece "
                       "holds it all in memory while training", flag_values=fv)


def train_tokenizer(argv) -> int:
  """`python -m diloco_jax tokenizer --data PATH --vocab 32000 --out FILE`; see the module docstring."""
  fv = cli.parse(argv, _define_flags, doc=__doc__, config=False)
  max_bytes = fv["max-bytes"].value
  try:
    documents = (text for _, text in tokenizer_lib.read_documents(fv.data, max_bytes, shuffled=True))
    model = tokenizer_lib.train_sentencepiece(documents, fv.vocab)
  except (ConfigError, FileNotFoundError) as e:
    raise cli.UsageError(f"--data: {e}" if isinstance(e, FileNotFoundError) else str(e)) from None
  out = epath.Path(fv.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_bytes(model)
  tok = tokenizer_lib.SentencePieceTokenizer(model, fv.out)
  print(f"tokenizer: {tok.vocab_size} pieces (sha256 {tok.sha256[:16]}) -> {fv.out}; use it with "
        f"--config.model.vocab_size={tok.vocab_size} --config.data.tokenizer={fv.out}")
  return 0

"""Token shards (`data/shards.py`): every document once, with exact token counts."""

import collections

import grain

import helpers
from diloco_jax.data import corpus as corpus_lib
from diloco_jax.data import tokenizer

corpus_texts, file_streams, split_documents = helpers.corpus_texts, helpers.file_streams, helpers.split_documents


def test_shards_hold_every_document_once_with_exact_token_counts(token_data):
  tok = tokenizer.load(str(token_data.tokenizer))
  texts = corpus_texts(token_data)
  meta = token_data.meta
  assert meta["tokenizer"]["sha256"] == tok.sha256 and meta["dtype"] == "<u2"
  names = sorted(meta["files"])
  assert names == ["eval-00000-of-00001.array_record"] + [f"train-0000{i}-of-00004.array_record" for i in range(4)]
  streams = dict(zip(names, file_streams([str(token_data.shards / n) for n in names])))
  decoded = {n: [tok.decode(d) for d in split_documents(s, tok.eos_id)] for n, s in streams.items()}
  for name, stream in streams.items():
    assert stream.size == meta["files"][name]["tokens"]
    assert len(decoded[name]) == meta["files"][name]["documents"]
    assert sum(len(t.encode()) for t in decoded[name]) == meta["files"][name]["text_bytes"]
    # Records are chunks of 100 tokens, the last one shorter.
    sizes = [len(r) // 2 for r in grain.sources.ArrayRecordDataSource(str(token_data.shards / name))]
    assert set(sizes[:-1]) <= {100} and 0 < sizes[-1] <= 100
  # Every file of the corpus is exactly one document of exactly one shard, train and eval disjoint.
  eval_docs, train_docs = decoded[names[0]], [t for n in names[1:] for t in decoded[n]]
  assert collections.Counter(eval_docs + train_docs) == collections.Counter(texts.values())
  held_out = {n for n in texts if corpus_lib.is_eval_file(n, 0.05)}
  if not held_out or len(held_out) == len(texts):
    held_out = {sorted(texts)[-1]}  # the fallback when the hash rule leaves a split empty
  assert sorted(eval_docs) == sorted(texts[n] for n in held_out)
  # Token counts: each document's encoding plus its eos.
  want = {"train": sum(tok.encode(t).size + 1 for t in train_docs),
          "eval": sum(tok.encode(t).size + 1 for t in eval_docs)}
  assert meta["tokens"] == want
  # Greedy placement keeps the train files within one document of each other.
  sizes = [meta["files"][n]["tokens"] for n in names[1:]]
  assert max(sizes) - min(sizes) <= max(tok.encode(t).size + 1 for t in train_docs)

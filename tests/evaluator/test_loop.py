"""The global evaluator (`evaluator/loop.py`): each record's tokens are those of the model it evaluated, and
the run's last record is of the final model."""

import numpy as np

from diloco_jax.evaluator import loop as eval_loop


class MergingSource:
  """A syncer's global model where a merge lands between the evaluator's reads: each `fetch` returns the
  model, then the next merge (if any is left) lands before the next call."""

  def __init__(self, merges: int):
    self.version, self.tokens, self.merges_left = 0, 0, merges

  def _merge(self):
    if self.merges_left:
      self.version, self.tokens, self.merges_left = self.version + 1, self.tokens + 100, self.merges_left - 1

  def progress(self):
    return self.tokens, [self.version]

  def fetch(self):
    vectors, versions = [np.full(4, float(self.version), np.float32)], [self.version]
    self._merge()
    return vectors, versions


class SumEval:
  """The global model's "loss": its version (what the record must pair with its tokens)."""

  def params(self, vectors):
    return vectors

  def loss(self, params):
    return float(params[0][0])


def test_a_record_holds_the_tokens_of_the_model_it_evaluated_and_the_last_record_is_the_final_model():
  source = MergingSource(merges=2)
  evaluator = eval_loop.GlobalEvaluator(SumEval(), source, eval_loop.EvalSchedule(1, 100, 1))
  record = evaluator.evaluate()
  # Two merges landed mid-read; the record is of a model whose version matches the tokens read after it.
  assert record["versions"] == [2] and record["eval_loss"] == 2.0 and record["tokens"] == 200
  final = evaluator.stop(final=True)
  assert final["versions"] == [2] and final["tokens"] == 200 and final["repeat"]


def test_the_final_record_is_evaluated_again_when_the_tokens_moved_since_the_last():
  source = MergingSource(merges=0)
  evaluator = eval_loop.GlobalEvaluator(SumEval(), source, eval_loop.EvalSchedule(1, 100, 1))
  evaluator.evaluate()
  source.tokens += 100  # merged tokens the last record does not hold, on the same versions
  final = evaluator.stop(final=True)
  assert final["tokens"] == 100 and "repeat" not in final and final["final"]

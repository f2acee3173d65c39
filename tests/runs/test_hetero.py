"""Mixed-speed in-process runs: learners of different sizes weighted by their tokens, and a two-speed run
where the fast learners never wait for the slow ones."""

import statistics

import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.runs import inprocess

FP = helpers.FP


# ---- the grace window (the paper's Eq. 3, per learner) ----------------------------------------------------


# ---- the per-round decision record ------------------------------------------------------------------------


# ---- emulated speeds ----------------------------------------------------------------------------------------


# ---- runs ------------------------------------------------------------------------------------------------


def _small(c, steps: int):
  c.model.d_model, c.model.mlp_dim, c.model.head_dim = 32, 64, 8
  c.data.max_bytes, c.data.eval_batches = 60_000, 1
  c.train.steps, c.train.warmup_steps, c.train.log_every, c.train.eval_every = steps, 2, 5, 10_000
  c.outer.sync_every = 5
  return c


def test_learners_of_different_sizes_are_weighted_by_their_tokens(tiny_config, tmp_path):
  c = _small(tiny_config, steps=10)
  c.learners.num, c.learners.device_counts, c.data.global_batch = 2, (1, 3), 24
  c.outer.min_quorum = 0  # every round holds both learners: their weights side by side
  c.outer.stall_s = 60.0  # the larger learner compiles longer: still counted (not taken for a stopped one)
  config_lib.validate(c, 8, learners=True)
  summary = inprocess.run(c, str(tmp_path), quiet=True)
  assert [x["batch_size"] for x in summary["learners"]] == [6, 18]
  assert [x["devices"] for x in summary["learners"]] == [1, 3]
  assert summary["tokens"] == 10 * 24 * c.data.seq_len == summary["tokens_merged"]
  records = metrics_lib.read_jsonl(tmp_path / "syncer" / "rounds.jsonl")
  assert len(records) == summary["outer_rounds"] >= 4
  for r in records:
    weights = {x["learner"]: x["coefficient"] for x in r["contributions"]}
    assert weights[1] == pytest.approx(3 * weights[0]) and sum(weights.values()) == pytest.approx(1.0)


# In the process tier, which runs one test at a time: its premise is emulated speeds in real time (fast
# learners 2.5x faster than slow ones), which 3 fast-tier workers compiling cold on 2 cores broke (every
# learner overran its emulated step; 2 of the last 3 clean-clone CI runs).
@pytest.mark.process
def test_fast_learners_never_wait_for_slow_ones_with_the_shipped_quorum(tiny_config, tmp_path):
  """Two fast learners (speed 1) and two slow ones (speed 0.4) under the shipped quorum setting (K = 1 +
  grace): the fast ones finish long before the slow ones and are never blocked by them. Under K = M the
  same learners would wait for the slow ones at every round."""
  # 60 steps: 12 syncs of each fragment per fast learner. With 30, on a loaded machine compiling cold (a
  # clean-clone CI run) every learner overran its emulated step for most of its 6 syncs and no round was
  # left to close without the slow ones.
  c = _small(tiny_config, steps=60)
  assert c.outer.min_quorum == 1 and c.outer.max_grace_s > 0  # the shipped default: K = 1 + grace
  c.emulation.speeds = (1.0, 1.0, 0.4, 0.4)
  c.emulation.step_s = 0.1
  c.emulation.step_cv = 0.1
  summary = inprocess.run(c, str(tmp_path), quiet=True)
  fast = summary["learners"][:2]
  records = metrics_lib.read_jsonl(tmp_path / "syncer" / "rounds.jsonl")
  # The slow learners take 2.5x as long per step (emulated): in lockstep (K = M) a fast learner would wait
  # about 60 x 0.1 x (1 / 0.4 - 1) = 9 s for them. It waited less than a tenth of that, in all.
  lockstep_wait = 60 * c.emulation.step_s * (1 / 0.4 - 1)
  for x in fast:
    assert x["steps"] == 60 and x["pace"]["speed"] == 1.0
    assert x["blocked_s"] < 0.1 * lockstep_wait, (x, lockstep_wait)
  # Rounds closed without the slow learners while they were still training.
  assert any(set(r["contributors"]) <= {0, 1} and set(r["live"]) >= {2, 3} for r in records)
  assert summary["tokens_merged"] == summary["tokens"]  # nothing lost
  assert statistics.fmean(x["compute_s"] / (x["compute_s"] + x["blocked_s"]) for x in fast) > 0.9

"""`bench quality --budgets`: the data-parallel / Decoupled DiLoCo pair at several multiples of the steps,
with the ratios per budget and the PNG of the curves."""

import json

import pytest

from diloco_jax import cli
from diloco_jax.bench import quality


def test_budgets_run_the_pair_at_each_multiple_and_plot(tmp_path, capsys):
  argv = ["bench quality", "--config", "configs/tiny_cpu.py", "--config.train.steps=4",
          "--config.train.warmup_steps=1", "--config.train.eval_every=2", "--config.train.log_every=2",
          "--config.outer.sync_every=2", "--config.data.max_bytes=60000", "--config.data.eval_batches=1",
          "--budgets=2,1", f"--workdir={tmp_path / 'q'}", "--json"]
  assert quality.main(argv) == 0
  out = json.loads(capsys.readouterr().out)
  assert sorted(out["budgets"]) == ["1", "2"]
  for budget, steps in (("1", 4), ("2", 8)):
    r = out["budgets"][budget]
    assert r["steps"] == steps
    assert r["tokens"] == r["diloco_tokens"] == steps * 16 * 64  # the same tokens on both sides
    assert r["loss_ratio"] == pytest.approx(r["diloco_eval_loss"] / r["dp_eval_loss"])
    assert r["bytes_ratio"] == pytest.approx(r["dp_bytes_per_worker"] / r["diloco_bytes_per_learner"])
    # Both curves start at the same initial model and end at the final eval losses.
    assert r["dp_curve"][0][0] == r["diloco_curve"][0][0] == 0
    assert r["dp_curve"][-1][1] == pytest.approx(r["dp_eval_loss"])
    assert r["diloco_curve"][-1][1] == pytest.approx(r["diloco_eval_loss"])
  assert out["config"]["steps"] == 4  # the config's own budget, not the last multiple run
  with open(out["plot"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("values", [["0"], ["1", "x"], []])
def test_bad_budgets_are_a_usage_error(values, capsys):
  with pytest.raises(cli.UsageError):
    quality._parse_budgets(values)
  assert "error: --budgets:" in capsys.readouterr().err

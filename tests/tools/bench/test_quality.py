"""`bench quality --budgets`: the data-parallel / Decoupled DiLoCo pair at several multiples of the steps,
with the ratios per budget and the PNG of the curves."""

import json

import pytest

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.tools.bench import quality, seeds

# Two learners of a 32-wide model: what these tests check (the pair per budget, the rungs) needs no more.
SMALL = ["--config.learners.num=2", "--config.model.d_model=32", "--config.model.mlp_dim=64",
         "--config.model.head_dim=8"]


@pytest.mark.slow  # trains the pair at three budgets (~85 s cold): in `make test-slow`
def test_budgets_run_the_pair_at_each_multiple_and_plot(tmp_path, capsys):
  argv = ["bench quality", "--config", "configs/tiny_cpu.py", "--config.train.steps=4",
          "--config.train.warmup_steps=1", "--config.train.eval_every=2", "--config.train.log_every=2",
          "--config.outer.sync_every=2", "--config.data.max_bytes=60000", "--config.data.eval_batches=1",
          *SMALL,
          "--budgets=2,1", f"--workdir={tmp_path / 'q'}", "--json"]
  assert quality.bench_quality(argv) == 0
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
  with pytest.raises(cli.UsageError):  # before anything runs
    quality.bench_quality(["bench quality", "--config", "configs/tiny_cpu.py", f"--budgets={','.join(values)}"])
  assert "error: --budgets:" in capsys.readouterr().err


def test_the_ladder_puts_the_parts_back_one_at_a_time(tmp_path, capsys):
  """Each rung differs from the one before in the part it names; the last is the config as given, whose
  figures are the pair's; a part the config does not use gets no rung."""

  c = config_lib.base_config()
  c.outer.sync_every, c.outer.tau, c.outer.min_quorum = 8, 2, 1
  rungs = quality.ladder(c)
  assert [name for name, _, _ in rungs] == ["exact, H = 1", "exact, H = 8", "synchronous", "K = all",
                                            "as configured"]
  first, drift, sync, k_all, shipped = (r[2] for r in rungs)
  assert (first.outer.sync_every, first.outer.num_fragments, first.outer.codec) == (1, 1, "fp32")
  assert (drift.outer.sync_every, drift.outer.lr, drift.outer.momentum, drift.outer.tau) == (8, 1.0, 0.0, 0)
  assert (sync.outer.codec, sync.outer.num_fragments, sync.outer.tau, sync.outer.min_quorum) == (
      c.outer.codec, c.outer.num_fragments, 0, 0)
  assert (k_all.outer.tau, k_all.outer.min_quorum) == (2, 0)
  assert shipped.to_dict() == c.to_dict()
  assert c.outer.sync_every == 8  # the rungs are copies
  c.outer.tau, c.outer.min_quorum = 0, 0  # synchronous K = all: no overlap or quorum rung
  assert [name for name, _, _ in quality.ladder(c)] == ["exact, H = 1", "exact, H = 8", "as configured"]

  argv = ["bench quality", "--config", "configs/tiny_cpu.py", "--config.train.steps=4",
          "--config.train.warmup_steps=1", "--config.train.eval_every=2", "--config.train.log_every=2",
          "--config.outer.sync_every=2", "--config.data.max_bytes=60000", "--config.data.eval_batches=1",
          *SMALL,
          f"--workdir={tmp_path / 'q'}", "--ladder", "--json"]
  assert quality.bench_quality(argv) == 0
  out = json.loads(capsys.readouterr().out)
  ladder = out["ladder"]
  assert [r["rung"] for r in ladder][-1] == "as configured"
  assert ladder[-1]["eval_loss"] == pytest.approx(out["diloco_eval_loss"])
  for r in ladder:
    assert r["loss_ratio"] == pytest.approx(r["eval_loss"] / out["dp_eval_loss"])
  # Exact averaging after every step moves fp32 both ways every step: the most bytes of any rung.
  assert ladder[0]["bytes_ratio"] < ladder[-1]["bytes_ratio"]


def test_seeds_change_the_runs_and_the_summary_is_theirs(tmp_path, capsys):
  """`--seeds 2`: two pairs on seeds 3 and 4 (other inits and tokens: other losses), every run listed, and
  the top-level figures and the spread computed from those runs."""
  argv = ["bench quality", "--config", "configs/tiny_cpu.py", "--config.train.steps=2", "--config.seed=3",
          "--config.train.warmup_steps=1", "--config.train.eval_every=2", "--config.train.log_every=2",
          "--config.outer.sync_every=2", "--config.data.max_bytes=60000", "--config.data.eval_batches=1",
          *SMALL, "--seeds=2", f"--workdir={tmp_path / 'q'}", "--json",
          f"--frontier={tmp_path / 'f.jsonl'}", "--label=tiny"]
  (tmp_path / "f.jsonl").write_text(json.dumps({"label": "earlier", "steps": 8, "budget": 1, "seeds": 3,
                                                "loss_ratio": 1.1, "loss_ratio_min": 1.05,
                                                "loss_ratio_max": 1.2, "bytes_ratio": 30.0}) + "\n")
  assert quality.bench_quality(argv) == 0
  out = json.loads(capsys.readouterr().out)
  runs = out["seeds"]
  assert [r["seed"] for r in runs] == [3, 4]
  assert runs[0]["dp_eval_loss"] != runs[1]["dp_eval_loss"]
  assert runs[0]["diloco_eval_loss"] != runs[1]["diloco_eval_loss"]
  for r in runs:
    assert r["loss_ratio"] == pytest.approx(r["diloco_eval_loss"] / r["dp_eval_loss"])
  ratios = [r["loss_ratio"] for r in runs]
  assert out["loss_ratio"] == pytest.approx(sum(ratios) / 2)
  assert out["spread"]["loss_ratio"]["min"] == min(ratios)
  assert out["spread"]["loss_ratio"]["max"] == max(ratios)
  assert out["spread"]["bytes_ratio"]["min"] == min(r["bytes_ratio"] for r in runs)
  assert out["dp_eval_loss"] == pytest.approx(sum(r["dp_eval_loss"] for r in runs) / 2)
  assert (tmp_path / "q" / "seed3" / "dp").is_dir() and (tmp_path / "q" / "seed4" / "diloco").is_dir()
  # The frontier: this run's point appended to the earlier one, and both drawn.
  points = [json.loads(line) for line in (tmp_path / "f.jsonl").read_text().splitlines()]
  assert [p["label"] for p in points] == ["earlier", "tiny"]
  assert points[1]["loss_ratio"] == pytest.approx(out["loss_ratio"]) and points[1]["seeds"] == 2
  assert (points[1]["loss_ratio_min"], points[1]["loss_ratio_max"]) == (min(ratios), max(ratios))
  with open(out["frontier"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_summarize_averages_ratios_per_seed_and_spreads_the_rungs():
  runs = [{**dict.fromkeys(seeds.SUMMARIZED, 1.0), "seed": s, "dp_eval_loss": dp, "diloco_eval_loss": dl,
           "loss_ratio": dl / dp, "steps": 8,
           "ladder": [{"rung": "exact", "eval_loss": dl, "loss_ratio": dl / dp, "bytes_ratio": 1.0,
                       "outer_rounds": 4, "wall_s": 1.0}]}
          for s, dp, dl in ((0, 2.0, 3.0), (1, 1.0, 1.0), (2, 4.0, 5.0))]
  out = seeds.summarize(runs)
  assert out["loss_ratio"] == pytest.approx((1.5 + 1.0 + 1.25) / 3)  # per seed, not 9 / 7
  assert out["spread"]["loss_ratio"] == {"mean": out["loss_ratio"], "min": 1.0, "median": 1.25, "max": 1.5}
  assert [r["seed"] for r in out["seeds"]] == [0, 1, 2] and out["steps"] == 8
  assert out["ladder"][0]["eval_loss"] == pytest.approx(3.0)
  assert out["ladder"][0]["loss_ratio_spread"]["median"] == 1.25
  with pytest.raises(ValueError):
    seeds.summarize([])

"""`bench suite` (`make bench`): the benches it runs, in order, and one JSON file of figures with the commit,
date, load and each figure's spread, from real child processes (a small `bench syncer`)."""

import json

import pytest

from diloco_jax.tools.bench import suite


def test_the_default_is_the_quick_benches_in_a_fixed_order():
  names = [b.name for b in suite.chosen([])]
  assert names == ["syncer", "syncer-int4", "transport", "overhead", "wan", "wan-paper"]
  assert [b.name for b in suite.chosen(["wan", "syncer"])] == ["syncer", "wan"]  # the suite's order
  assert [b.name for b in suite.chosen(["all"])][-2:] == ["hetero", "chaos"]
  with pytest.raises(SystemExit) as e:
    suite.chosen(["nope"])
  assert e.value.code == 2


def test_spread_is_min_median_max_over_the_runs_that_gave_the_figure():
  runs = [{"figures": {"a": 3.0, "b": 1.0}}, {"figures": {"a": 1.0}}, {"error": "x"}, {"figures": {"a": 2.0}}]
  assert suite.spread(runs) == {"a": {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3},
                                "b": {"min": 1.0, "median": 1.0, "max": 1.0, "n": 1}}


def test_a_run_writes_figures_with_commit_date_and_load(tmp_path, monkeypatch, capsys):
  small = suite.Bench("syncer", ("syncer", "--params=20000", "--rounds=1", "--threads=1"), suite._syncer)
  monkeypatch.setattr(suite, "BENCHES", (small,))
  out = tmp_path / "figures.json"
  assert suite.bench_suite(["bench suite", f"--out={out}", "--repeats=1"]) == 0
  doc = json.loads(out.read_text())
  assert len(doc["commit"]) == 40 and doc["date"].startswith("20") and len(doc["load_avg_start"]) == 3
  runs = doc["benches"]["syncer"]["runs"]
  assert len(runs) == 1 and all(r["rc"] == 0 and len(r["load_avg_before"]) == 3 for r in runs)
  spread = doc["benches"]["syncer"]["spread"]["fused_params_per_core_s"]
  assert spread["n"] == 1 and spread["min"] == spread["max"] == runs[0]["figures"]["fused_params_per_core_s"] > 0
  assert runs[0]["raw"]["params"] == 20000 and "fused_params_per_core_s" in capsys.readouterr().out


def test_seeded_benches_run_one_seed_per_repeat_and_chaos_reuses_its_first_reference(tmp_path, monkeypatch):
  monkeypatch.setattr(suite, "REPO", tmp_path)
  by_name = {b.name: b for b in suite.BENCHES}
  assert [by_name["hetero"].per_repeat(k) for k in range(3)] == [(f"--config.seed={k}",) for k in range(3)]
  chaos = by_name["chaos"]
  assert "--config.train.steps=1500" in chaos.argv
  assert chaos.per_repeat(0) == ("--seed=0", f"--workdir={suite.CHAOS_DIR}/seed0")
  assert chaos.per_repeat(1) == ("--seed=1", f"--workdir={suite.CHAOS_DIR}/seed1")  # no first run yet
  first = tmp_path / suite.CHAOS_DIR / "seed0" / "bench_chaos.json"
  first.parent.mkdir(parents=True)
  first.write_text("{}")
  assert chaos.per_repeat(2)[2] == f"--diloco-reference={first}"
  assert chaos.per_repeat(0) == ("--seed=0", f"--workdir={suite.CHAOS_DIR}/seed0")  # the first never reuses

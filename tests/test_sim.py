"""Scale simulator and bandwidth planner: closed forms, trends, determinism, policy reuse, CLI."""

import dataclasses
import json

import pytest

from diloco_jax.sim import bandwidth, cli, goodput
from diloco_jax.syncer import policy as syncer_policy

NEVER_FAILS = 1e12  # years


def _cfg(**kw):
  return dataclasses.replace(goodput.SimConfig(), **kw)


@pytest.mark.parametrize("strategy", ["dp", "elastic", "diloco"])
def test_no_failures_goodput_is_one_minus_overheads(strategy):
  cfg = _cfg(chips=100_000, strategy=strategy, learners=4, mtbi_chip_s=NEVER_FAILS * goodput.YEAR_S,
             horizon_s=20_000.0, ckpt_cost_s=0.1, snapshot_s=0.5)
  est = goodput.simulate(cfg, repeats=2, seed=1)
  expected = goodput.no_failure_goodput(cfg)
  assert expected < 1.0 or strategy == "elastic"
  # Blocking overheads only; push rounding at the horizon's end is the only slack.
  assert est.goodput == pytest.approx(expected, abs=2e-3)
  assert est.uptime == pytest.approx(1.0)


def test_dp_matches_renewal_expectation_within_2_percent():
  cfg = _cfg(chips=300_000, strategy="dp", restart_s=60.0, ckpt_every_steps=3, ckpt_cost_s=0.2,
             failures_per_job=3000)
  est = goodput.simulate(cfg, repeats=3, seed=7)
  analytic = goodput.analytic_dp_goodput(cfg)
  assert 0.3 < analytic < 0.9  # a regime where failures matter
  assert est.goodput == pytest.approx(analytic, rel=0.02)


def test_dp_goodput_falls_with_chips():
  values = [goodput.simulate(_cfg(chips=n, strategy="dp"), repeats=2).goodput
            for n in (150_000, 600_000, 2_400_000)]
  assert values[0] > values[1] > values[2]


def test_diloco_goodput_rises_with_learners_and_beats_dp():
  base = _cfg(chips=1_200_000, strategy="diloco", failures_per_job=100)
  g = [goodput.simulate(dataclasses.replace(base, learners=m), repeats=2).goodput for m in (2, 4, 8)]
  assert g[0] < g[1] < g[2]
  dp = goodput.simulate(dataclasses.replace(base, strategy="dp"), repeats=2).goodput
  elastic = goodput.simulate(dataclasses.replace(base, strategy="elastic"), repeats=2).goodput
  assert dp < elastic < g[0]


def test_one_learner_is_elastic_dp():
  base = _cfg(chips=600_000, failures_per_job=200)
  one = goodput.simulate(dataclasses.replace(base, strategy="diloco", learners=1), repeats=3)
  el = goodput.simulate(dataclasses.replace(base, strategy="elastic"), repeats=3)
  assert one.goodput == pytest.approx(el.goodput, abs=0.03)


def test_deterministic_under_seed():
  cfg = _cfg(chips=300_000, strategy="diloco", learners=4, failures_per_job=50)
  a, b = goodput.simulate(cfg, repeats=2, seed=3), goodput.simulate(cfg, repeats=2, seed=3)
  c = goodput.simulate(cfg, repeats=2, seed=4)
  assert a.to_dict() == b.to_dict()
  assert a.goodput != c.goodput


def test_syncer_rounds_use_the_project_policy(monkeypatch):
  calls = []
  real = syncer_policy.round_close_time

  def spy(*args, **kw):
    calls.append(args)
    return real(*args, **kw)

  monkeypatch.setattr(syncer_policy, "round_close_time", spy)
  cfg = _cfg(chips=80_000, strategy="diloco", learners=4, failures_per_job=20)
  est = goodput.simulate(cfg, repeats=1)
  assert calls and est.extra["rounds"] == len(calls)
  assert all(isinstance(c[0], syncer_policy.QuorumPolicy) for c in calls)


def test_quorum_and_grace_change_rounds():
  base = _cfg(chips=80_000, strategy="diloco", learners=4, failures_per_job=30, step_cv=0.05)
  no_grace = goodput.simulate(dataclasses.replace(base, min_quorum=1, max_grace_s=0.0), repeats=1)
  full = goodput.simulate(dataclasses.replace(base, min_quorum=4, max_grace_s=30.0), repeats=1)
  # Without a grace window each round closes at its first push; waiting for all merges more per round.
  assert no_grace.extra["mean_contributors"] < 1.5
  assert full.extra["mean_contributors"] > 2.5
  assert full.extra["mean_round_latency_s"] > no_grace.extra["mean_round_latency_s"]


def test_table_cells_near_published():
  rows = goodput.table(_cfg(failures_per_job=150), repeats=1, seed=0)
  assert len(rows) == 30
  worst = max(abs(r["diff_points"]) for r in rows)
  assert worst < 7.0  # the full run (more repeats, longer horizon) is within 5; see docs/simulator.md


def test_bad_values_name_the_flag():
  with pytest.raises(ValueError, match="--learners"):
    _cfg(learners=0).validate()
  with pytest.raises(ValueError, match="--chips"):
    _cfg(chips=-5).validate()
  with pytest.raises(ValueError, match="grace_gamma"):
    _cfg(grace_gamma=1.5).validate()
  with pytest.raises(ValueError, match="--tau"):
    bandwidth.BandwidthConfig(tau=50).validate()


def test_bandwidth_reproduces_published_dp_and_ordering():
  cfg = bandwidth.BandwidthConfig()
  g = {m: bandwidth.required_gbps(cfg, m, 0.95) for m in bandwidth.METHODS}
  assert g["dp"] == pytest.approx(268.3, rel=0.05)
  assert g["streaming_overlap_q"] == pytest.approx(1.4, rel=0.25)
  assert g["dp"] > g["diloco"] > g["streaming"] > g["streaming_overlap"] > g["streaming_overlap_q"]
  # Higher utilization targets need more bandwidth.
  assert bandwidth.required_gbps(cfg, "dp", 0.99) > g["dp"] > bandwidth.required_gbps(cfg, "dp", 0.5)


def test_dp_bandwidth_closed_form():
  cfg = bandwidth.BandwidthConfig(params=1e9, sites=4, step_s=1.0, fwd_fraction=0.0)
  # Ring 2*3/4 of 2 GB = 3 GB = 24 Gbit; at u=0.5 the whole 2 s wall time is the budget.
  assert bandwidth.required_gbps(cfg, "dp", 0.5) == pytest.approx(12.0)


def test_eight_datacenters_under_one_gbps_and_inverse():
  fig = bandwidth.eight_datacenter_figure(bandwidth.BandwidthConfig())
  assert fig["gbps"]["dp"] == pytest.approx(198.0)
  assert fig["gbps"]["streaming_overlap_q"] < 1.0
  cfg = bandwidth.BandwidthConfig()
  u = bandwidth.utilization_at(cfg, "streaming_overlap_q", bandwidth.required_gbps(cfg, "streaming_overlap_q", 0.9))
  assert u == pytest.approx(0.9, abs=1e-4)


def test_cli_json_and_errors(tmp_path, capsys):
  rc = cli.main(["sim", "goodput", "--chips", "150000,300000", "--strategy", "dp,diloco", "--learners", "4",
                 "--failures-per-job", "30", "--repeats", "2", "--json", "--out", str(tmp_path)])
  assert rc == 0
  out = json.loads(capsys.readouterr().out)
  assert len(out["rows"]) == 4 and (tmp_path / "goodput_vs_chips.png").stat().st_size > 1000
  rc = cli.main(["sim", "bandwidth", "--json", "--out", str(tmp_path)])
  out = json.loads(capsys.readouterr().out)
  assert rc == 0 and out["eight_datacenters"]["gbps"]["streaming_overlap_q"] < 1.0
  assert (tmp_path / "bandwidth_vs_utilization.png").exists()
  assert cli.main(["sim", "goodput", "--learners", "0", "--no-plot"]) == 2
  assert "--learners" in capsys.readouterr().err
  assert cli.main(["sim", "goodput", "--chips", "-3", "--no-plot"]) == 2
  assert "--chips" in capsys.readouterr().err
  assert cli.main(["sim", "bandwidth", "--sites", "1", "--no-plot"]) == 2
  assert "--sites" in capsys.readouterr().err

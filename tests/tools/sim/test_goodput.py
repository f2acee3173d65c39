"""Scale simulator and bandwidth planner: closed forms, trends, the learner's blocking rules, policy reuse,
published comparisons only where they apply, and the CLI."""

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import helpers
from diloco_jax import commands
from diloco_jax.syncer.rules import quorum as syncer_policy
from diloco_jax.tools.sim import bandwidth, failures, goodput, plots, rounds

NEVER_FAILS = 1e12  # years
REPO = str(helpers.REPO)
HALF_18_SLOWER_8 = ((1 / 1.18, 4), (1.0, 4))  # the paper's mixed hardware: 4 learners 18% slower


def _cfg(**kw):
  return dataclasses.replace(goodput.SimConfig(), **kw)


def _schedule(**kw):
  base = dict(inner_steps=10, fragments=2, tau=2, max_in_flight=2, step_s=1.0, step_cv=0.1, t_sync_s=0.1,
              policy=helpers.quorum_policy(min_quorum=1, tau=2, gamma=0.5, max_grace_s=0.5))
  base.update(kw)
  return rounds.Schedule(**base)


def _outer(schedule, speeds, window_s=3000.0, seed=0):
  learners = [rounds.Learner(v) for v in speeds]
  return rounds.simulate(schedule, learners, window_s, np.random.default_rng(seed), record=True)


# ---- goodput: closed forms and trends ----

@pytest.mark.parametrize("strategy", ["dp", "elastic", "diloco"])
def test_no_failures_goodput_is_one_minus_overheads(strategy):
  cfg = _cfg(chips=100_000, strategy=strategy, learners=4, mtbi_chip_s=NEVER_FAILS * goodput.YEAR_S,
             horizon_s=20_000.0, ckpt_cost_s=0.1, snapshot_s=0.5)
  est = goodput.simulate(cfg, repeats=2, seed=1)
  expected = failures.no_failure_goodput(cfg)
  assert expected < 1.0 or strategy == "elastic"
  # Blocking overheads only; push rounding at the horizon's end is the only slack.
  assert est.goodput == pytest.approx(expected, abs=2e-3)
  assert est.uptime == pytest.approx(1.0)


def test_dp_matches_renewal_expectation_within_2_percent():
  cfg = _cfg(chips=300_000, strategy="dp", restart_s=60.0, ckpt_every_steps=3, ckpt_cost_s=0.2,
             failures_per_job=3000)
  est = goodput.simulate(cfg, repeats=3, seed=7)
  analytic = failures.analytic_dp_goodput(cfg)
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


def test_table_cells_near_published():
  rows = goodput.table(_cfg(failures_per_job=150), repeats=1, seed=0)
  assert len(rows) == 30 and all(r["published"] is not None for r in rows)
  worst = max(abs(r["diff_points"]) for r in rows)
  assert worst < 7.0  # the full run (more repeats, longer horizon) is within 5; see docs/simulator.md


# ---- the outer loop: the learner's blocking rules and the syncer's rounds ----

def test_push_again_only_after_the_previous_sync_came_back():
  for k, speeds in ((4, (0.8, 0.8, 1.0, 1.0)), (1, (0.8, 0.8, 1.0, 1.0))):
    policy = helpers.quorum_policy(min_quorum=k, tau=2, gamma=0.5, max_grace_s=0.5)
    # max_in_flight above P: the same-fragment rule, not the in-flight bound, is what holds a learner back.
    out = _outer(_schedule(policy=policy, max_in_flight=4), speeds)
    pushes = out.records["pushes"]
    assert out.pushes == len(pushes) > 500
    by = {}
    for r in pushes:
      by.setdefault((r["learner"], r["fragment"]), []).append(r)
    for seq in by.values():
      for prev, nxt in zip(seq, seq[1:]):
        assert nxt["at"] >= prev["result_at"]  # fragment p again only once its last sync came back
        assert nxt["base"] == prev["result_version"]  # and against the version that sync returned
    # Never more than max_in_flight syncs of one learner outstanding at a push.
    for j in range(len(speeds)):
      mine = [r for r in pushes if r["learner"] == j]
      for i, r in enumerate(mine):
        pending = [x for x in mine[:i] if x["result_at"] is None or x["result_at"] > r["at"]]
        assert len(pending) < 4


def test_one_push_per_learner_per_round_and_every_push_merged_once():
  # The issue's scenario: fast learners used to push twice into a round (8.75 contributors of 8 learners).
  # A grace window longer than H steps (tau > H) lets a learner whose push was late (its sync came back at
  # once) push the same fragment again while that round is still open: it waits for the next round.
  long_grace = helpers.quorum_policy(min_quorum=1, tau=20, gamma=0.9, max_grace_s=50.0)
  cases = [(_schedule(policy=helpers.quorum_policy(min_quorum=k, tau=2, gamma=0.5, max_grace_s=5.0),
                      step_cv=0.3), (0.6, 0.8, 1.0, 1.0)) for k in (1, 4)]
  cases.append((_schedule(inner_steps=4, fragments=1, tau=20, step_cv=0.3, policy=long_grace), (1.0, 0.5, 0.35)))
  for schedule, speeds in cases:
    out = _outer(schedule, speeds)
    assert out.contributors.max() <= len(speeds)
    for rnd in out.records["rounds"]:
      assert len(rnd["arrivals"]) == len(rnd["members"]) == len(set(rnd["members"]))
    # Conservation: each push is merged in exactly one round (or still open when the window ends).
    assert out.contributors.sum() + out.unmerged_at_end == out.pushes
  assert out.deferred_pushes > 100  # the long-grace case did hold second pushes for the next round
  issue = _cfg(chips=1_200_000, learners=8, mtbi_chip_s=1e6 * goodput.YEAR_S, speed_spread=0.18, step_cv=0.1,
               min_quorum=8, max_pushes=4000)
  est = goodput.simulate(issue, repeats=2)
  assert est.extra["mean_contributors"] <= 8.0
  assert est.goodput < 0.95  # the fast learners wait for the slow ones (it reported 99.4%)


def test_rounds_close_by_the_project_policy():
  policy = helpers.quorum_policy(min_quorum=2, tau=2, gamma=0.5, max_grace_s=0.5)
  schedule = _schedule(policy=policy)
  speeds = (0.8, 1.0, 1.0)
  out = _outer(schedule, speeds)
  assert len(out.records["rounds"]) == out.contributors.size > 100
  for rnd in out.records["rounds"]:
    # Each arrival with its own learner's step time (the per-learner grace budget).
    assert sorted(rnd["step_times"]) == sorted(schedule.step_s / speeds[j] for j in rnd["members"])
    expected = syncer_policy.round_close_time(policy, rnd["arrivals"], rnd["alive"], rnd["step_times"],
                                              schedule.t_sync_s)
    assert rnd["closed"] == pytest.approx(max(expected, rnd["arrivals"][-1]))


def test_blocked_time_follows_the_slow_learner_exactly():
  # No noise: a speed-1 and a speed-0.5 learner, K = 2, one fragment every 10 s of the fast one. The fast
  # learner pushes at 10, 20 (its first sync came back at 20), then waits 10 s out of every 20 from t = 30.
  policy = helpers.quorum_policy(min_quorum=2, tau=2, gamma=0.5, max_grace_s=0.0)
  out = _outer(_schedule(fragments=1, step_cv=0.0, t_sync_s=0.0, policy=policy), (1.0, 0.5), window_s=1000.0)
  assert out.blocked_s[1] == 0.0
  assert out.blocked_s[0] == pytest.approx((1000 - 30) / 2, abs=10)
  assert rounds.lockstep_goodput((1.0, 0.5)) == pytest.approx(0.75)
  assert 1 - out.blocked_s.sum() / out.available_s.sum() == pytest.approx(0.75, abs=0.01)


def test_tau_zero_waits_for_every_sync():
  policy = helpers.quorum_policy(min_quorum=1, tau=0, gamma=0.5, max_grace_s=0.0)
  out = _outer(_schedule(tau=0, fragments=1, step_cv=0.0, t_sync_s=1.0, policy=policy), (1.0,), window_s=1100.0)
  # One sync every 10 s of compute, each blocking for t_sync = 1 s: 100 syncs, 100 s blocked.
  assert out.blocked_s[0] == pytest.approx(100.0, abs=1.0)


def test_k_equals_m_with_two_speed_groups_is_lockstep():
  cfg = _cfg(chips=8, slice_chips=1, learners=4, groups=((0.8, 2), (1.0, 2)), mtbi_chip_s=NEVER_FAILS * goodput.YEAR_S,
             step_cv=0.1, inner_steps=20, fragments=2, snapshot_s=0.0, max_pushes=6000)
  lockstep = goodput.lockstep_goodput(cfg)
  assert lockstep == pytest.approx(0.9)
  all_ = goodput.simulate(goodput.with_quorum_setting(cfg, "all"), repeats=2)
  assert all_.goodput == pytest.approx(lockstep, abs=0.015)
  assert all_.extra["mean_contributors"] == pytest.approx(4.0)
  for setting in ("k1", "k1grace"):
    est = goodput.simulate(goodput.with_quorum_setting(cfg, setting), repeats=2)
    assert est.goodput > 0.99  # nobody waits on a slower learner
    assert est.extra["mean_contributors"] < 2.0


def test_quorum_and_grace_change_rounds():
  base = _cfg(chips=80_000, strategy="diloco", learners=4, failures_per_job=30, step_cv=0.05)
  no_grace = goodput.simulate(dataclasses.replace(base, min_quorum=1, max_grace_s=0.0), repeats=1)
  full = goodput.simulate(dataclasses.replace(base, min_quorum=4, max_grace_s=30.0), repeats=1)
  # Without a grace window each round closes at its first push; waiting for all merges more per round.
  assert no_grace.extra["mean_contributors"] < 1.5
  assert full.extra["mean_contributors"] > 2.5
  assert full.extra["mean_round_latency_s"] > no_grace.extra["mean_round_latency_s"]


def test_cell_cost_is_bounded_at_any_mtbi():
  # Counted in simulated events, not seconds: the outer loop simulates at most ~max_pushes pushes, and the
  # failure model failures_per_job recoveries per learner, whatever the MTBI.
  counts = []
  for years in (1.0, 1e2, 1e6):
    cfg = _cfg(chips=1_200_000, learners=8, mtbi_chip_s=years * goodput.YEAR_S, failures_per_job=50,
               max_pushes=3000)
    est = goodput.simulate(cfg, repeats=1)
    assert est.extra["pushes"] <= 1.1 * cfg.max_pushes
    assert est.failures <= 1.5 * cfg.failures_per_job * cfg.learners
    counts.append(est.extra["pushes"])
  assert counts[2] <= 1.1 * 3000 and counts[2] >= 0.8 * 3000  # the cap binds at large MTBI


# ---- published comparisons only where they apply ----

def test_published_only_for_the_published_setting():
  one_year = _cfg()
  assert goodput.published_goodput("diloco", 8, 1_200_000, one_year) == 88
  assert goodput.published_goodput("dp", 1, 2_400_000, one_year) == 18
  assert goodput.published_goodput("diloco", 8, 1_000_000, one_year) is None  # not a published column
  assert goodput.published_goodput("diloco", 3, 1_200_000, one_year) is None  # not a published row
  assert goodput.published_goodput("diloco", 8, 1_200_000, _cfg(mtbi_chip_s=2 * goodput.YEAR_S)) is None
  paper = _cfg(learners=8, groups=HALF_18_SLOWER_8, step_cv=0.1, mtbi_chip_s=1e9 * goodput.YEAR_S)
  assert goodput.published_hetero_mismatch(paper) is None
  assert "4 learners" in goodput.published_hetero_mismatch(
      dataclasses.replace(paper, learners=4, groups=((0.847, 2), (1.0, 2))))
  assert "failures" in goodput.published_hetero_mismatch(dataclasses.replace(paper, mtbi_chip_s=goodput.YEAR_S))


def test_plot_labels_follow_the_options(tmp_path):
  xlabel, title = plots.goodput_labels(2.0, with_published=False)
  assert "MTBI 2 years" in xlabel and "published" not in title.replace("no published", "")
  xlabel, title = plots.goodput_labels(1.0, with_published=True)
  assert "MTBI 1 year" in xlabel and "published (dashed)" in title
  ylabel, title, markers = plots.bandwidth_labels(bandwidth.BandwidthConfig())
  assert "per site" in ylabel and markers == bandwidth.PUBLISHED_STREAMING and "published" in title
  ylabel, title, markers = plots.bandwidth_labels(bandwidth.BandwidthConfig(params=70e9))
  assert markers == {} and "published" not in title


# ---- bandwidth ----

def test_bad_values_name_the_flag():
  with pytest.raises(ValueError, match="--learners"):
    _cfg(learners=0).validate()
  with pytest.raises(ValueError, match="--chips"):
    _cfg(chips=-5).validate()
  with pytest.raises(ValueError, match="grace_gamma"):
    _cfg(grace_gamma=1.5).validate()
  with pytest.raises(ValueError, match="--groups"):
    _cfg(learners=8, groups=((0.8, 4), (1.0, 3))).validate()
  with pytest.raises(ValueError, match="--max-in-flight"):
    _cfg(max_in_flight=0).validate()
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


def test_every_published_bandwidth_cell_is_compared_in_its_setting_only():
  cells = bandwidth.published_cells(bandwidth.BandwidthConfig())
  assert {(c["method"], c["utilization"]) for c in cells} == set(bandwidth.PUBLISHED_STREAMING)
  for c in cells:
    assert c["diff_pct"] == pytest.approx(100 * (c["ours"] / c["published"] - 1))
  four = bandwidth.BandwidthConfig(sites=4)
  assert bandwidth.published_cells(four) == [] and "sites=4" in bandwidth.published_mismatch(four)


def test_bandwidth_report_follows_sites_and_shows_every_published_cell(capsys):
  rc, io = _main(["bandwidth", "--noplot"], capsys)
  assert rc == 0 and "2 sites at 95%" in io.out
  for (method, u), pub in bandwidth.PUBLISHED_STREAMING.items():
    line = next(x for x in io.out.splitlines() if bandwidth.LABELS[method] in x and f"published {pub:g}" in x)
    assert f"at {100 * u:g}%" in line and "difference" in line
  rc, io = _main(["bandwidth", "--sites", "4", "--noplot"], capsys)
  assert rc == 0 and "4 sites at 95%" in io.out and "none apply" in io.out and "sites=4" in io.out
  assert "always 8 datacenters" in io.out  # the published figure keeps its own 8 sites, and says so


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


# ---- CLI ----

def _main(args, capsys):
  rc = commands.main(["diloco_jax", "sim"] + args)
  return rc, capsys.readouterr()


def test_cli_json_and_plots(tmp_path, capsys):
  rc, io = _main(["goodput", "--chips", "150000,300000", "--strategy", "dp,diloco", "--learners", "4",
                  "--failures-per-job", "30", "--repeats", "2", "--json", "--out", str(tmp_path)], capsys)
  out = json.loads(io.out)
  assert rc == 0 and len(out["rows"]) == 4 and (tmp_path / "goodput_vs_chips.png").stat().st_size > 1000
  rc, io = _main(["bandwidth", "--json", "--out", str(tmp_path)], capsys)
  out = json.loads(io.out)
  assert rc == 0 and out["eight_datacenters"]["gbps"]["streaming_overlap_q"] < 1.0
  assert len(out["published"]) == len(bandwidth.PUBLISHED_STREAMING)
  assert (tmp_path / "bandwidth_vs_utilization.png").exists()


@pytest.mark.parametrize("args, names", [
    (["goodput", "--learners", "0", "--noplot"], "--learners"),
    (["goodput", "--chips", "-3", "--noplot"], "--chips"),
    (["goodput", "--chips", "1.5", "--noplot"], "--chips"),
    (["goodput", "--bogus"], "bogus"),
    (["goodput", "--table", "--quorum-settings", "all"], "--quorum-settings"),
    (["goodput", "--quorum-settings", "all", "--min-quorum", "3"], "--min-quorum"),
    (["goodput", "--quorum-settings", "all", "--strategy", "dp"], "--strategy"),
    (["goodput", "--quorum-settings", "everyone"], "--quorum-settings"),
    (["goodput", "--groups", "0.8:2,1:2", "--learners", "8"], "--groups"),
    (["goodput", "--groups", "fast"], "--groups"),
    (["goodput", "--table", "--groups", "0.8:4,1:4"], "--groups"),
    (["bandwidth", "--sites", "1", "--noplot"], "--sites"),
    (["bandwidth", "--utilization", "0.9,1.5", "--noplot"], "--utilization"),
])
def test_cli_errors_name_the_flag(args, names, capsys):
  with pytest.raises(SystemExit) as e:
    commands.main(["diloco_jax", "sim"] + args)
  assert e.value.code == 2 and names in capsys.readouterr().err


def test_table_differences_only_against_matching_published_values(capsys):
  rc, io = _main(["goodput", "--table", "--mtbi-years", "2", "--strategy", "diloco", "--learners", "8",
                  "--chips", "1200000", "--repeats", "1", "--failures-per-job", "30", "--noplot"], capsys)
  assert rc == 0 and " pub " not in io.out and "Largest difference" not in io.out
  assert "No differences shown" in io.out and "MTBI of 1 year" in io.out
  rc, io = _main(["goodput", "--table", "--strategy", "diloco", "--learners", "8", "--chips", "1200000,1000000",
                  "--repeats", "1", "--failures-per-job", "30", "--json", "--noplot"], capsys)
  rows = json.loads(io.out)["rows"]
  # --table honours --chips, --learners and --strategy: part of the grid, published where it exists.
  assert [(r["strategy"], r["learners"], r["chips"], r["published"]) for r in rows] == [
      ("diloco", 8, 1_200_000, 88), ("diloco", 8, 1_000_000, None)]


def test_quorum_settings_print_paper_and_lockstep(capsys):
  args = ["goodput", "--quorum-settings", "all,k1,k1grace", "--groups", f"{1 / 1.18}:4,1:4", "--step-cv", "0.1",
          "--mtbi-years", "1e9", "--max-pushes", "4000", "--repeats", "1"]
  rc, io = _main(args + ["--json"], capsys)
  out = json.loads(io.out)
  by = {r["setting"]: r for r in out["rows"]}
  assert rc == 0 and out["published_hetero_mismatch"] is None
  assert out["lockstep_goodput"] == pytest.approx(0.5 + 0.5 / 1.18)
  assert by["all"]["goodput"] == pytest.approx(out["lockstep_goodput"], abs=0.015)
  assert by["k1"]["goodput"] > 0.99 and by["k1grace"]["goodput"] > 0.99
  assert by["all"]["mean_contributors"] == pytest.approx(8.0)
  rc, io = _main(args, capsys)
  assert "K = M (wait for all)" in io.out and "Lockstep expectation" in io.out and "this is its setting" in io.out
  line = next(x for x in io.out.splitlines() if x.startswith("K = M"))
  assert "84" in line.split()[-2:]


def test_help_names_the_command():
  for args in (["sim", "--help"], ["sim", "goodput", "--help"], ["sim", "bandwidth", "--help"]):
    out = subprocess.run([sys.executable, "-m", "diloco_jax", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"python -m diloco_jax {' '.join(a for a in args if a != '--help')}" in out.stdout
    assert "__main__" not in out.stdout and ".py" not in out.stdout.split("\n")[0]
  assert "--quorum-settings" in subprocess.run([sys.executable, "-m", "diloco_jax", "sim", "goodput", "--help"],
                                               cwd=REPO, capture_output=True, text=True, timeout=60).stdout


def test_sim_does_not_import_jax():
  code = "import sys; from diloco_jax.tools.sim import args, goodput_cli, bandwidth_cli; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
  assert out.stdout.strip() == "False", out.stderr


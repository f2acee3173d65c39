"""Mixed-speed learners: emulated speeds, the per-learner grace window, the per-round decision record,
learners of different sizes, and a two-speed run where the fast learners never wait for the slow ones."""

import dataclasses
import json
import statistics
import time

import numpy as np
import pytest

import helpers
from diloco_jax import config as config_lib
from diloco_jax.runs import inprocess
from diloco_jax import metrics as metrics_lib
from diloco_jax.tools.bench import outer_reference
from diloco_jax.tools.bench import hetero as bench_hetero
from diloco_jax.learner import pace
from diloco_jax.syncer.rules import quorum as policy

FP = helpers.FP


# ---- the grace window (the paper's Eq. 3, per learner) ----------------------------------------------------


def test_grace_formula_single_step_time_is_eq3():
  p = helpers.quorum_policy(min_quorum=1, tau=5, gamma=0.5, max_grace_s=30.0)
  # gamma (tau * step - t_quorum - t_sync) = 0.5 (5 * 2 - 1 - 0.5)
  assert policy.grace_window_s(p, 2.0, 1.0, 0.5) == pytest.approx(4.25)
  # One contributor (the opener, offset 0): the per-learner form is the same number.
  assert policy.round_grace_s(p, [0.0], [2.0], 0.0, 0.5) == pytest.approx(0.5 * (10 - 0.5))
  # No slack left: the lower bound; a huge budget: the upper bound.
  assert policy.grace_window_s(p, 0.1, 5.0, 1.0) == 0.0
  assert policy.grace_window_s(dataclasses.replace(p, min_grace_s=0.2), 0.1, 5.0, 1.0) == 0.2
  assert policy.grace_window_s(p, 100.0, 0.0, 0.0) == 30.0
  # tau = 0 (synchronous adoption): nothing to spend.
  assert policy.round_grace_s(dataclasses.replace(p, tau=0), [0.0, 0.3], [2.0, 1.0], 0.3, 0.0) == 0.0


def test_grace_budget_is_the_first_contributor_to_need_the_result():
  p = helpers.quorum_policy(min_quorum=2, tau=4, gamma=0.5, max_grace_s=30.0)
  # The opener is slow (2 s/step, needs the result at 8 s); a fast learner (1 s/step) arrived 1 s later
  # and needs it at 1 + 4 = 5 s: the budget is 5 s, not the opener's 8 s.
  assert policy.adoption_budget_s(4, [0.0, 1.0], [2.0, 1.0]) == 5.0
  assert policy.round_grace_s(p, [0.0, 1.0], [2.0, 1.0], 1.0, 0.5) == pytest.approx(0.5 * (5.0 - 1.0 - 0.5))
  # The other way round the opener binds: 0 + 4 * 1 = 4 < 1 + 4 * 2.
  assert policy.adoption_budget_s(4, [0.0, 1.0], [1.0, 2.0]) == 4.0
  # round_close_time takes the step times per arrival, in any order of arrival.
  close = policy.round_close_time(p, [1.0, 0.0, 9.0], live_learners=4, step_time_s=[1.0, 2.0, 1.0],
                                  t_sync_s=0.5)
  assert close == pytest.approx(1.0 + 0.5 * (5.0 - 1.0 - 0.5))
  with pytest.raises(ValueError, match="step time"):
    policy.round_close_time(p, [0.0, 1.0], 4, [1.0], 0.0)


def test_core_uses_each_contributors_own_step_time():
  clock = helpers.FakeClock()
  c = helpers.make_core((8,), k=2, clock=clock, tau=4, gamma=0.5, max_grace_s=30.0, lease_s=100.0)
  for i, step in ((0, 2.0), (1, 1.0), (2, 1.0)):
    c.join(i, FP)
    c.heartbeat(i, step)
  clock.t = 10.0
  c.push(helpers.make_push(0, np.ones(8)))  # the slow opener
  clock.t = 11.0
  c.push(helpers.make_push(1, np.ones(8)))  # quorum: the fast learner binds
  assert c.next_deadline() == pytest.approx(11.0 + 0.5 * (5.0 - 1.0 - 0.0))
  # A learner that never reported a step time plans with the median of the live learners' reports.
  c2 = helpers.make_core((8,), k=1, clock=clock, tau=4, gamma=0.5, max_grace_s=30.0, lease_s=100.0)
  for i, step in ((0, 0.0), (1, 3.0), (2, 1.0), (3, 2.0)):
    c2.join(i, FP)
    c2.heartbeat(i, step)
  c2.push(helpers.make_push(0, np.ones(8)))
  assert c2.next_deadline() == pytest.approx(11.0 + 0.5 * 4 * 2.0)


# ---- the per-round decision record ------------------------------------------------------------------------


def test_decision_record_says_who_was_merged_waited_for_how_long_and_with_which_weights(tmp_path):
  clock = helpers.FakeClock()
  c = helpers.make_core((8,), k=2, clock=clock, tau=2, gamma=0.5, max_grace_s=30.0, lease_s=100.0,
                        scale_partial_rounds=True, staleness_beta=1.0)
  for i in range(4):
    c.join(i, FP)
    c.heartbeat(i, 10.0)
  log = metrics_lib.DrainLog(c.drain_decisions, tmp_path, "rounds", period_s=0.01)
  clock.t = 1.0
  c.push(helpers.make_push(0, np.ones(8), tokens=100))
  clock.t = 1.5
  c.push(helpers.make_push(1, np.ones(8), tokens=300))  # quorum at 0.5 s
  grace = 0.5 * (2 * 10.0 - 0.5 - 0.0)
  clock.t = 3.0
  c.push(helpers.make_push(2, np.ones(8), tokens=100))  # arrives inside the grace window
  clock.t = 1.5 + grace
  assert c.tick() == [0]  # learner 3 never came: closed by the deadline
  # Round 2: learner 3 alone pushes a stale push, then everyone else; it closes when all live are in.
  clock.t = 20.0
  c.push(helpers.make_push(3, np.ones(8), tokens=100, base_version=0))
  for i in range(3):
    c.push(helpers.make_push(i, np.ones(8), tokens=100, base_version=1))
  assert c.status()["versions"] == [2]
  time.sleep(0.05)
  log.close()
  first, second = metrics_lib.read_jsonl(tmp_path / "rounds.jsonl")
  assert (first["fragment"], first["version"], first["close"]) == (0, 1, "deadline")
  assert first["contributors"] == [0, 1, 2] and first["live"] == [0, 1, 2, 3]
  assert first["quorum_s"] == pytest.approx(0.5) and first["grace_s"] == pytest.approx(grace)
  assert first["step_times_s"] == [10.0, 10.0] and first["t_sync_s"] == 0.0
  assert first["waited_for"] == [2, 3] and first["arrived_in_grace"] == [2]
  assert first["open_s"] == pytest.approx(0.5 + grace)
  assert [x["learner"] for x in first["contributions"]] == [0, 1, 2]
  assert [x["arrived_s"] for x in first["contributions"]] == pytest.approx([0.0, 0.5, 2.0])
  # Coefficients: each push's tokens over one period of every live learner (learner 3 never pushed: it
  # counts as the mean of the others, 500 / 3), so this partial round moves by its share of the work.
  period = 100 + 300 + 100 + 500 / 3
  assert first["period_weight"] == pytest.approx(period) and first["answered_for"] == 4
  assert [x["coefficient"] for x in first["contributions"]] == pytest.approx([100 / period, 300 / period,
                                                                              100 / period])
  assert first["share"] == pytest.approx(500 / period) == first["moved"]
  assert second["close"] == "all_in" and second["contributors"] == [3, 0, 1, 2]
  stale = second["contributions"][0]
  assert (stale["learner"], stale["base_version"], stale["staleness"]) == (3, 0, 1)
  # Periods: learner 0 pushed 100, 1 pushed 100 now, 2 and 3: 100 -> 400; learner 3 discounted by 1/2.
  assert [x["coefficient"] for x in second["contributions"]] == pytest.approx([0.125, 0.25, 0.25, 0.25])
  assert second["share"] == pytest.approx(1.0) and second["moved"] == pytest.approx(0.875)
  assert second["waited_for"] == [1, 2] and second["arrived_in_grace"] == [1, 2]  # quorum: 3, then 0


def test_decision_queue_is_bounded():
  c = helpers.make_core((8,), k=1, clock=helpers.FakeClock())
  c.join(0, FP)
  c._machine.state.decisions = type(c._machine.state.decisions)(maxlen=3)  # a small bound, the same code path
  for v in range(5):
    c.push(helpers.make_push(0, np.ones(8), base_version=v))
  records = c.drain_decisions()
  assert [r["version"] for r in records] == [3, 4, 5] and c.decisions_dropped == 2
  assert c.drain_decisions() == []


# ---- emulated speeds ----------------------------------------------------------------------------------------


def test_pacer_stretches_each_step_to_its_speed(monkeypatch):
  slept = []
  monkeypatch.setattr(pace.time, "sleep", slept.append)
  p = pace.StepPacer(speed=0.5, step_cv=0.0, step_s=0.1)
  assert p.active
  assert p.stretch(0.05) == pytest.approx(0.15)  # the step takes 0.1 / 0.5 = 0.2 s in all
  assert p.stretch(0.3) == 0.0 and p.overruns == 1  # longer than its target: not shortened
  assert slept == [pytest.approx(0.15)]
  # step_s = 0: the median of the learner's own measured steps stands in for a speed-1 step.
  q = pace.StepPacer(speed=0.8, step_s=0.0)
  for measured in (1.0, 0.1, 0.1, 0.1):  # a first step that compiled, then 0.1 s steps
    q.stretch(measured)
  assert slept[-1] == pytest.approx(0.1 / 0.8 - 0.1)
  assert not pace.StepPacer().active and pace.StepPacer().stretch(1.0) == 0.0


def test_pacer_noise_has_mean_one_and_the_asked_cv():
  p = pace.StepPacer(speed=1.0, step_cv=0.1, step_s=1.0, seed=3)
  draws = np.array([p.noise() for _ in range(20_000)])
  assert abs(draws.mean() - 1.0) < 0.005 and abs(draws.std() - 0.1) < 0.005 and (draws > 0).all()
  # Seeded per learner: two learners draw different noise, the same learner the same noise.
  config = config_lib.base_config()
  config.emulation.step_cv = 0.1
  a, b, a2 = (pace.StepPacer.from_spec(config_lib.resolve(config), i) for i in (0, 1, 0))
  assert a.noise() == a2.noise() != b.noise()
  with pytest.raises(ValueError, match="speeds"):
    pace.StepPacer(speed=0.0)


def test_config_validates_speeds_and_device_counts(tiny_config):
  c = tiny_config
  c.emulation.speeds = (1.0, 1.0, 0.847, 0.847)
  c.emulation.step_cv = 0.1
  config_lib.validate(c, 8, learners=True)
  assert list(config_lib.resolve(c).emulation.speeds) == [1.0, 1.0, 0.847, 0.847]
  for field, value, match in (("emulation.speeds", (1.0, 0.5), "emulation.speeds"),
                              ("emulation.speeds", (1.0, 1.0, 1.0, -1.0), "emulation.speeds"),
                              ("emulation.step_cv", 1.5, "emulation.step_cv"),
                              ("emulation.step_s", -0.1, "emulation.step_s"),
                              ("learners.device_counts", (1, 2), "learners.device_counts")):
    bad = config_lib.base_config()
    section, name = field.split(".")
    bad[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.validate(bad, 8, learners=True)
  # Learners of different sizes: the global batch is split in proportion to their devices.
  d = config_lib.base_config()
  d.learners.num, d.learners.device_counts, d.data.global_batch = 2, (1, 3), 24
  config_lib.validate(d, 4, learners=True)
  assert list(config_lib.resolve(d).learners.batches) == [6, 18]
  assert list(config_lib.resolve(d).learners.device_counts) == [1, 3]
  with pytest.raises(config_lib.ConfigError, match="learners.device_counts"):
    config_lib.validate(d, 3, learners=True)  # 4 devices asked for
  d.data.global_batch = 16
  with pytest.raises(config_lib.ConfigError, match="eval batch 16"):
    config_lib.validate(d, 4, learners=True)  # 12 sequences split over 3 devices, the eval batch not


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
  assert [l["batch_size"] for l in summary["learners"]] == [6, 18]
  assert [l["devices"] for l in summary["learners"]] == [1, 3]
  assert summary["tokens"] == 10 * 24 * c.data.seq_len == summary["tokens_merged"]
  records = metrics_lib.read_jsonl(tmp_path / "syncer" / "rounds.jsonl")
  assert len(records) == summary["outer_rounds"] >= 4
  for r in records:
    weights = {x["learner"]: x["coefficient"] for x in r["contributions"]}
    assert weights[1] == pytest.approx(3 * weights[0]) and sum(weights.values()) == pytest.approx(1.0)


def test_fast_learners_never_wait_for_slow_ones_with_the_shipped_quorum(tiny_config, tmp_path):
  """Two fast learners (speed 1) and two slow ones (speed 0.4) under the shipped quorum setting (K = 1 +
  grace): the fast ones finish long before the slow ones and are never blocked by them. Under K = M the
  same learners would wait for the slow ones at every round."""
  c = _small(tiny_config, steps=30)
  assert c.outer.min_quorum == 1 and c.outer.max_grace_s > 0  # the shipped default: K = 1 + grace
  c.emulation.speeds = (1.0, 1.0, 0.4, 0.4)
  c.emulation.step_s = 0.1
  c.emulation.step_cv = 0.1
  summary = inprocess.run(c, str(tmp_path), quiet=True)
  fast, slow = summary["learners"][:2], summary["learners"][2:]
  records = metrics_lib.read_jsonl(tmp_path / "syncer" / "rounds.jsonl")
  # The slow learners take 2.5x as long per step (emulated): in lockstep (K = M) a fast learner would wait
  # about 30 x 0.1 x (1 / 0.4 - 1) = 4.5 s for them. It waited less than a tenth of that, in all.
  lockstep_wait = 30 * c.emulation.step_s * (1 / 0.4 - 1)
  for l in fast:
    assert l["steps"] == 30 and l["pace"]["speed"] == 1.0
    assert l["blocked_s"] < 0.1 * lockstep_wait, (l, lockstep_wait)
  # Rounds closed without the slow learners while they were still training.
  assert any(set(r["contributors"]) <= {0, 1} and set(r["live"]) >= {2, 3} for r in records)
  assert summary["tokens_merged"] == summary["tokens"]  # nothing lost
  assert statistics.fmean(l["compute_s"] / (l["compute_s"] + l["blocked_s"]) for l in fast) > 0.9


def test_bench_hetero_simulator_row_and_lockstep():
  """The simulator row `bench hetero` prints: for its default learner set, K = M runs at the slow
  learners' pace (the lockstep expectation) and K = 1 (+ grace) never blocks."""
  config = config_lib.base_config()
  config.outer.sync_every, config.outer.num_fragments, config.outer.max_grace_s = 10, 2, 0.5
  speeds = bench_hetero.learner_speeds((), 4)
  assert speeds == pytest.approx((1 / 1.18, 1 / 1.18, 1.0, 1.0))
  sim_all, lockstep = bench_hetero.simulated(config, "all", speeds, 0.1, 0.05, 0.005, repeats=1)
  assert lockstep == pytest.approx(statistics.fmean([min(speeds) / v for v in speeds]))
  assert abs(sim_all - lockstep) < 0.02
  sim_k1, _ = bench_hetero.simulated(config, "k1grace", speeds, 0.1, 0.05, 0.005, repeats=1)
  assert sim_k1 > 0.99
  assert bench_hetero.learner_speeds(((0.5, 1), (1.0, 3)), 4) == (0.5, 1.0, 1.0, 1.0)
  result = {"all": {"goodput": 0.92, "sim_goodput": 0.923, "eval_loss": 2.0, "rx_mib": 10.0},
            "k1grace": {"goodput": 0.99, "sim_goodput": 1.0, "eval_loss": 2.01, "rx_mib": 14.0}}
  assert all(bench_hetero.goals(result).values())
  result["k1grace"]["eval_loss"], result["k1grace"]["rx_mib"] = 2.03, 16.0
  goals = bench_hetero.goals(result)
  assert not goals["k1grace_loss_within_1pct_of_k_all"] and not goals["downlink_within_1.5x_of_k_all"]
  json.dumps(bench_hetero.goals(result))


def test_core_partial_rounds_move_the_momentum_once_per_full_share_across_a_restore():
  """K = 1, four equal learners: four single-learner rounds (a quarter share each) step the global like
  the optimizer's delayed Nesterov step (`outer_reference.outer_step` with the same shares), and a checkpoint taken
  mid-cycle (two quarters in) restores it exactly: the rest of the cycle lands the same globals."""
  size, lr, mu = 4096, 0.7, 0.9
  kw = dict(k=1, lr=lr, momentum=mu, initial="linspace", max_grace_s=0.0, lease_s=100.0,
            scale_partial_rounds=True, num_learners=4)
  core = helpers.make_core((size,), clock=helpers.FakeClock(), **kw)
  for i in range(4):
    core.join(i, helpers.FP)
  tx = outer_reference.make_outer_optimizer(lr, mu)
  theta = np.linspace(-1, 1, size, dtype=np.float32)
  state = outer_reference.init_outer_state(tx, theta)
  rng = np.random.default_rng(7)
  deltas = [rng.standard_normal(size).astype(np.float32) * 0.01 for _ in range(4)]
  restored = None
  for i, d in enumerate(deltas):
    core.push(helpers.make_push(i, d, core=core, base_version=0, tokens=100, steps=10))
    theta, state = outer_reference.outer_step(tx, theta, state, d * np.float32(0.25), 0.25)
    np.testing.assert_allclose(core.global_fragments()[0], theta, rtol=1e-5, atol=1e-6)
    if i == 1:
      restored = helpers.make_core((size,), clock=helpers.FakeClock(), **kw)
      restored.load_state_dict(core.state_dict())
      for j in range(4):
        restored.join(j, helpers.FP)
    elif i > 1:
      restored.push(helpers.make_push(i, d, core=restored, base_version=0, tokens=100, steps=10))
  np.testing.assert_array_equal(restored.global_fragments()[0], core.global_fragments()[0])
  np.testing.assert_array_equal(restored.state_dict()["opt_states"][0], core.state_dict()["opt_states"][0])
  # The cycle closed on the 4th quarter: the momentum vector is the optimizer's momentum again.
  np.testing.assert_allclose(core.state_dict()["opt_states"][0], state.trace, rtol=1e-5, atol=1e-7)
  records = core.drain_decisions()
  assert [r["share"] for r in records] == pytest.approx([0.25] * 4)

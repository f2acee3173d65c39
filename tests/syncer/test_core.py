"""The syncer core with a fake clock: quorum and grace, rejections, leases, checkpoints, transports."""

import functools
import json
import math
import threading
import time

import jax
import numpy as np
import pytest

import helpers
from diloco_jax.outer import codec
from diloco_jax.outer import merge as outer
from diloco_jax.tools.bench import outer_reference
from diloco_jax import config as config_lib
from diloco_jax.outer import fragments
from diloco_jax.protocol.interfaces import Transport
from diloco_jax.protocol.messages import Push, PushReceipt
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import core as core_lib
from diloco_jax.syncer import settings as settings_lib
from diloco_jax.syncer.rules.quorum import QuorumPolicy, grace_window_s, round_close_time
from diloco_jax.syncer.ticker import Ticker
from diloco_jax.transports.inprocess import InProcessTransport

FP = helpers.FP
make_push = functools.partial(helpers.make_push, block=4)


def make_core(num_learners=3, sizes=(8,), k=1, lr=1.0, momentum=0.0, lease_s=100.0, step_time=10.0, **kw):
  """lr 1 / momentum 0 (the new global is the old one minus the merged delta), every learner joined and
  reporting `step_time`; returns (core, its fake clock)."""
  clock = helpers.FakeClock()
  kw.setdefault("max_grace_s", 30.0)  # QuorumPolicy's own default
  c = helpers.make_core(sizes, k=k, lr=lr, momentum=momentum, block=4, initial="arange", clock=clock,
                        lease_s=lease_s, **kw)
  for i in range(num_learners):
    c.join(i, FP)
    c.heartbeat(i, step_time)
  return c, clock


def global_of(c, p=0):
  return c.state_dict()["fragments"][p]


def test_quorum_grace_straggler_late_and_everyone_in():
  # K=2 of 4 live learners; lr 1, momentum 0: new global = old global - merged delta (the plain weighted
  # mean of a round's contributors: not scaled to their share of the four learners' work).
  c, clock = make_core(num_learners=4, k=2, gamma=0.5, max_grace_s=30.0, scale_partial_rounds=False)
  deltas = {i: np.full(8, float(i + 1), np.float32) for i in range(4)}
  g0 = global_of(c)
  clock.t = 1.0
  r = c.push(make_push(0, deltas[0], tokens=100))
  assert r == PushReceipt(fragment=0, round=0, late=False, epoch=c.epoch, version=1)
  for t in (1.0, 1.2):  # one contribution: never commits, whatever the time (within the lease)
    clock.t = t
    assert c.tick() == []
  assert c.status()["versions"] == [0]
  clock.t = 1.5
  c.push(make_push(1, deltas[1], tokens=300))  # quorum: the grace window opens
  deadline = 1.5 + grace_window_s(c.settings.policy, 10.0, 0.5, 0.0)
  assert deadline == pytest.approx(1.5 + 0.5 * (2 * 10.0 - 0.5))
  assert c.next_deadline() == pytest.approx(deadline)
  assert c.status()["versions"] == [0]
  clock.t = 5.0
  c.push(make_push(2, deltas[2], tokens=600))  # a straggler inside the window
  clock.t = deadline - 1e-6
  assert c.tick() == []
  clock.t = deadline
  assert c.tick() == [0]
  w = np.array([100, 300, 600]) / 1000
  expected = g0 - (w[0] * deltas[0] + w[1] * deltas[1] + w[2] * deltas[2])
  np.testing.assert_allclose(global_of(c), expected, rtol=1e-6)
  assert c.status()["versions"] == [1]
  assert c.counters["contributions_merged"] == 3 and c.counters["tokens_merged"] == 1000

  # Learner 3 pushes after round 0's deadline: it goes into round 1, as a late contribution.
  c2, clock2 = make_core(num_learners=4, k=2, gamma=0.5, max_grace_s=30.0, scale_partial_rounds=False)
  clock2.t = 1.0
  c2.push(make_push(0, deltas[0], tokens=100))
  clock2.t = 1.5
  c2.push(make_push(1, deltas[1], tokens=300))
  clock2.t = 1.5 + 0.5 * (2 * 10.0 - 0.5) + 0.1  # past the deadline, and nobody ticked
  r = c2.push(make_push(3, deltas[3], tokens=200, base_version=0))
  assert r.round == 1 and r.late and r.version == 2  # merged by round 1, which publishes version 2
  assert c2.status()["versions"] == [1]
  w01 = np.array([100, 300]) / 400
  np.testing.assert_allclose(global_of(c2), g0 - (w01[0] * deltas[0] + w01[1] * deltas[1]), rtol=1e-6)
  # Everyone live contributes to round 1: it closes at once, no grace wait; learner 3's delta is in.
  g1 = global_of(c2)
  c2.push(make_push(0, deltas[0], tokens=100, base_version=1))
  c2.push(make_push(1, deltas[1], tokens=100, base_version=1))
  assert c2.status()["versions"] == [1]  # quorum reached, 2 live learners not in yet
  r = c2.push(make_push(2, deltas[2], tokens=100, base_version=1))
  assert r.round == 1 and not r.late
  assert c2.status()["versions"] == [2]
  w = np.array([200, 100, 100, 100]) / 500  # staleness_beta 0: no discount
  expected = g1 - (w[0] * deltas[3] + w[1] * deltas[0] + w[2] * deltas[1] + w[3] * deltas[2])
  np.testing.assert_allclose(global_of(c2), expected, rtol=1e-6)
  assert c2.counters["contributions_late"] == 1 and c2.counters["contributions_merged"] == 6


def test_staleness_discount_applied():
  # Deltas far above the fragment's norm: the outlier bound (test_merge_safety's subject) off.
  c, clock = make_core(num_learners=2, k=2, max_grace_s=0.0, staleness_beta=1.0, max_norm_ratio=0.0)
  d = np.ones(8, np.float32)
  c.push(make_push(0, d))
  c.push(make_push(1, d))
  assert c.status()["versions"] == [1]
  g1 = global_of(c)
  a, b = np.full(8, 2.0, np.float32), np.full(8, 8.0, np.float32)
  c.push(make_push(0, a, base_version=0, tokens=100))  # staleness 1 -> its share 1/2, halved
  c.push(make_push(1, b, base_version=1, tokens=100))
  w = np.array([0.5 / 2, 0.5])  # the discount is not renormalized away
  np.testing.assert_allclose(global_of(c), g1 - (w[0] * a + w[1] * b), rtol=1e-6)


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0, 4.0])
def test_lone_stale_push_keeps_its_discount(beta, partial):
  """K = 1, lr 1, momentum 0: a lone push with staleness 1 moves the global (1 + 1)^-beta as far as the
  same push when fresh (the discount used to be renormalized away within its one-push round)."""
  moved = {}
  for staleness in (0, 1):
    c, clock = make_core(num_learners=1, k=1, max_grace_s=0.0, staleness_beta=beta, scale_partial_rounds=partial)
    c.push(make_push(0, np.zeros(8)))  # version 1
    g = global_of(c)
    c.push(make_push(0, np.ones(8), base_version=1 - staleness))
    moved[staleness] = g - global_of(c)
  np.testing.assert_allclose(moved[0], np.ones(8), rtol=1e-6)
  np.testing.assert_allclose(moved[1], moved[0] * 2.0**-beta, rtol=1e-6)


def test_partial_rounds_move_the_model_by_their_share_of_the_work():
  """With scale_partial_rounds, a round moves the model by the share of one period of every live
  learner's work it holds: k/n for equal learners, by tokens for learners of different batch sizes, and a
  learner with two periods in one round has both counted in full."""
  c, clock = make_core(num_learners=4, k=1, max_grace_s=0.0, scale_partial_rounds=True)
  d = np.ones(8, np.float32)
  g = global_of(c)
  for i in range(4):  # four one-learner rounds of equal learners: each a quarter
    c.push(make_push(i, d, base_version=i))
  assert c.status()["versions"] == [4]
  np.testing.assert_allclose(g - global_of(c), 4 * 0.25 * d, rtol=1e-6)  # what one full round moves
  g = global_of(c)
  c.push(make_push(2, d, base_version=4))  # one of four equal learners: a quarter of a full round
  np.testing.assert_allclose(g - global_of(c), 0.25 * d, rtol=1e-6)
  # A learner with a 3x batch (300 tokens per period) among three of 100: its period is half the work.
  c2, _ = make_core(num_learners=4, k=1, max_grace_s=0.0, scale_partial_rounds=True)
  for i, tokens in enumerate((300, 100, 100, 100)):
    c2.push(make_push(i, d, tokens=tokens))
  g = global_of(c2)
  c2.push(make_push(0, d, tokens=300, base_version=4))
  np.testing.assert_allclose(g - global_of(c2), 0.5 * d, rtol=1e-6)
  g = global_of(c2)
  c2.push(make_push(1, d, tokens=100, base_version=4))
  np.testing.assert_allclose(g - global_of(c2), d / 6, rtol=1e-6)
  # Two periods of one learner in one round (K = 2 of 2, learner 0 pushes twice before learner 1): summed.
  c3, clock3 = make_core(num_learners=2, k=2, max_grace_s=0.0, scale_partial_rounds=True)
  c3.push(make_push(0, d, tokens=100))
  c3.push(make_push(0, 3 * d, tokens=100))
  g = global_of(c3)
  c3.push(make_push(1, 5 * d, tokens=100))
  assert c3.status()["versions"] == [1]
  np.testing.assert_allclose(g - global_of(c3), 0.5 * (d + 3 * d) + 0.5 * 5 * d, rtol=1e-6)


def test_k1_no_grace_commits_at_first_push_and_multiple_fragments_independent():
  c, clock = make_core(num_learners=3, sizes=(8, 5), k=1, max_grace_s=0.0)
  c.push(make_push(2, np.ones(5), fragment=1))
  assert c.status()["versions"] == [0, 1]
  assert c.next_deadline() is None


def test_single_learner_exact_overwrite():
  # M=1, K=1, lr 1, momentum 0, fp32: the new global is exactly the learner's local fragment.
  c, clock = make_core(num_learners=1, k=1, max_grace_s=0.0)
  base = global_of(c)
  local = base - np.arange(8, dtype=np.float32)[::-1] / 32
  c.push(make_push(0, outer.outer_gradient(base, local)))
  pub = c.pull(0, 1)
  assert pub.version == 1
  np.testing.assert_array_equal(codec.decode(pub.payload, pub.codec, 8, 4), local)
  assert codec.checksum(pub.payload) == pub.checksum
  np.testing.assert_array_equal(global_of(c), local)


def _assert_states_equal(a, b):
  assert a.keys() == b.keys()
  for key in a:
    if key in ("fragments", "opt_states"):
      la, lb = [[np.asarray(x) for x in jax.tree.leaves(s[key])] for s in (a, b)]
      assert len(la) == len(lb) > 0
      for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    else:
      assert a[key] == b[key], key


def _bad_pushes():
  good = np.ones(8, np.float32)
  nan, inf = good.copy(), good.copy()
  nan[3], inf[5] = np.nan, -np.inf
  p = make_push(0, good)
  return [
      ("unknown_learner", make_push(5, good)),  # a learner of the run that never joined
      ("learner_id", make_push(99, good)),  # not a learner of the run at all
      ("learner_id", make_push(-1, good)),
      ("learner_id", make_push(2**31 - 1, good)),
      ("fingerprint", make_push(0, good, fingerprint="other-run")),
      ("unknown_fragment", make_push(0, good, fragment=7)),
      ("unknown_fragment", make_push(0, good, fragment=-1)),
      ("codec", make_push(0, good, codec="bf16")),
      ("shape", make_push(0, np.ones(9, np.float32))),
      ("checksum", make_push(0, good, checksum=p.checksum ^ 1)),
      ("nonfinite", make_push(0, nan)),
      ("nonfinite", make_push(0, inf)),
      ("future_version", make_push(0, good, base_version=5)),
      ("metadata", make_push(0, good, tokens=-1)),
  ]


@pytest.mark.parametrize("reason,bad", _bad_pushes(), ids=[r for r, _ in _bad_pushes()])
def test_malformed_pushes_rejected_without_touching_state(reason, bad):
  c, clock = make_core(num_learners=3, k=2, sizes=(8, 4))
  c.push(make_push(1, np.full(8, 0.5, np.float32)))  # an open round that must stay as it is
  before, status_before = c.state_dict(), c.status()
  with pytest.raises(Rejected) as e:
    c.push(bad)
  assert e.value.reason == reason
  after, status_after = c.state_dict(), c.status()
  assert after["counters"]["rejected"][reason] == before["counters"]["rejected"][reason] + 1
  assert after["counters"]["contributions_rejected"] == before["counters"]["contributions_rejected"] + 1
  for s in (before, after, status_before, status_after):
    del s["counters"]
  _assert_states_equal(before, after)
  assert status_before == status_after  # open rounds, members, versions unchanged
  # The open round still holds only learner 1; learner 2's good push reaches the quorum and merges both.
  c.push(make_push(2, np.full(8, 1.5, np.float32)))
  clock.t = 100.0
  c.heartbeat(0, 10.0)
  c.tick()
  assert c.status()["versions"][0] == 1 and c.counters["contributions_merged"] == 2


def test_rejected_join_and_left_learner():
  c, clock = make_core(num_learners=2, k=1)
  with pytest.raises(Rejected) as e:
    c.join(5, "another-run")
  assert e.value.reason == "fingerprint" and 5 not in c.live_learners()
  c.leave(1)
  assert c.live_learners() == [0]
  with pytest.raises(Rejected) as e:
    c.push(make_push(1, np.ones(8)))
  assert e.value.reason == "not_member"
  assert c.join(1, FP).versions == {0: 0}  # rejoin after a crash
  assert c.live_learners() == [0, 1]


def test_lease_expiry_and_heartbeat_revival():
  c, clock = make_core(num_learners=3, k=3, lease_s=10.0, max_grace_s=30.0)
  clock.t = 5.0
  c.heartbeat(0, 10.0)
  c.heartbeat(1, 10.0)
  clock.t = 12.0  # learner 2 has been silent for 12 s > lease_s
  assert c.live_learners() == [0, 1]
  with pytest.raises(Rejected) as e:
    c.push(make_push(2, np.ones(8)))
  assert e.value.reason == "not_member"
  c.push(make_push(0, np.ones(8)))
  assert c.status()["versions"] == [0]
  c.push(make_push(1, np.ones(8)))  # K=3 but only 2 live, both in: closes
  assert c.status()["versions"] == [1]
  assert c.counters["leases_expired"] == 1
  clock.t = 13.0
  c.heartbeat(2, 10.0)  # back: counts toward the quorum again
  assert c.live_learners() == [0, 1, 2]
  c.push(make_push(0, np.ones(8), base_version=1))
  c.push(make_push(1, np.ones(8), base_version=1))
  clock.t = 14.0
  assert c.tick() == [] and c.status()["versions"] == [1]
  c.push(make_push(2, np.ones(8), base_version=1))
  assert c.status()["versions"] == [2]


def test_lease_expiry_during_open_round_closes_it():
  # An expiry is itself a deadline: learner 2 dies, the round no longer waits for it.
  c, clock = make_core(num_learners=3, k=3, lease_s=10.0, max_grace_s=30.0)
  clock.t = 5.0
  c.heartbeat(0, 10.0)
  c.heartbeat(1, 10.0)
  c.push(make_push(0, np.ones(8)))
  c.push(make_push(1, np.ones(8)))
  assert c.next_deadline() == pytest.approx(10.0)  # learner 2's lease
  clock.t = 10.5
  assert c.tick() == [0]


def test_state_dict_roundtrip():
  c, clock = make_core(num_learners=2, k=2, sizes=(8, 6), lr=0.7, momentum=0.9, max_grace_s=0.0)
  rng = np.random.default_rng(0)
  for v in range(3):
    for p, n in ((0, 8), (1, 6)):
      for i in range(2):
        c.push(make_push(i, rng.standard_normal(n), fragment=p, base_version=v))
  with pytest.raises(Rejected):
    c.push(make_push(5, np.ones(8)))
  state = c.state_dict()
  assert state["versions"] == [3, 3] and state["rounds"] == [3, 3]
  fresh, _ = make_core(num_learners=2, k=2, sizes=(8, 6), lr=0.7, momentum=0.9, max_grace_s=0.0)
  fresh.load_state_dict(state)
  restored = fresh.state_dict()
  # The restored core is a new lifetime of the same model: its history is the checkpoint's plus itself.
  assert restored.pop("history") == state.pop("history") + [[fresh.epoch, [3, 3], [0, 0]]]
  _assert_states_equal(restored, state)
  assert fresh.counters == c.counters and fresh.counters["rejected"]["unknown_learner"] == 1
  assert fresh.pull(1, 3).payload == c.pull(1, 3).payload
  # The momentum came back too: the same next round gives the same global.
  for core in (c, fresh):
    for i in range(2):
      core.push(make_push(i, np.full(8, 0.25 * (i + 1)), base_version=3))
  np.testing.assert_array_equal(global_of(c), global_of(fresh))


def test_pull_waits_and_times_out():
  c, clock = make_core(num_learners=2, k=2)
  assert c.pull(0, 1, timeout_s=0.0) is None
  assert c.pull(0, 0).version == 0
  with pytest.raises(Rejected):
    c.pull(3, 0)


def test_in_process_transport_two_threads():
  # Deltas far above the zero fragments' norm: the outlier bound (test_merge_safety's subject) off.
  settings = helpers.syncer_settings((40, 24), codec="int8", downlink_codec="bf16", block=8, min_quorum=2,
                                     max_grace_s=5.0, num_learners=2, max_norm_ratio=0.0)
  core = core_lib.SyncerCore(settings, [np.zeros(40, np.float32), np.zeros(24, np.float32)])
  results, errors = {}, []
  barrier = threading.Barrier(2)

  def learner(i):
    try:
      t = InProcessTransport(core)
      assert isinstance(t, Transport)
      assert t.join(i, FP).versions == {0: 0, 1: 0}
      barrier.wait()  # both joined: the round waits for both
      t.heartbeat(i, 0.1)
      sent = 0
      for p, n in ((0, 40), (1, 24)):
        payload = codec.encode(np.full(n, i + 1.0, np.float32), "int8", 8)
        t.push(Push(i, FP, p, 0, 5, 50, "int8", payload, codec.checksum(payload)))
        sent += len(payload)
      # Both hold the version-0 reference: the answers are bf16 deltas from it.
      pulled = [t.pull(p, 1, timeout_s=10.0, have_version=0) for p in range(2)]
      results[i] = (t.bytes_sent, sent, t.bytes_received, sum(len(x.payload) for x in pulled), pulled)
    except Exception as e:  # noqa: BLE001 - surfaced below
      errors.append(e)

  threads = [threading.Thread(target=learner, args=(i,)) for i in range(2)]
  for th in threads:
    th.start()
  for th in threads:
    th.join(30)
  assert not errors, errors
  for i in range(2):
    bytes_sent, sent, bytes_received, received, pulled = results[i]
    assert bytes_sent == sent == codec.encoded_size(40, "int8", 8) + codec.encoded_size(24, "int8", 8)
    assert bytes_received == received == 2 * 40 + 2 * 24
    assert [x.version for x in pulled] == [1, 1]
    assert [(x.kind, x.base_version) for x in pulled] == [("delta", 0), ("delta", 0)]
    # Both contributions merged (equal tokens): the mean delta is 1.5, lr 0.7 from zero momentum; the
    # initial fragment is zero, so the delta is the new fragment.
    got = codec.decode(pulled[0].payload, "bf16", 40)
    np.testing.assert_allclose(got, -0.7 * (1.5 + 0.9 * 1.5), rtol=1e-2)
  assert core.counters["bytes_in"] == 2 * results[0][1]
  assert core.counters["bytes_out"] == results[0][3] + results[1][3]


def test_ticker_closes_rounds_without_other_calls():
  settings = helpers.syncer_settings((4,), codec="fp32", min_quorum=1, min_grace_s=0.05, max_grace_s=0.05,
                                     num_learners=2)  # fp32: the payload pushed below
  core = core_lib.SyncerCore(settings, [np.zeros(4, np.float32)])
  core.join(0, FP)
  core.join(1, FP)
  with Ticker(core, period_s=0.01):
    payload = codec.encode(np.ones(4, np.float32), "fp32")
    core.push(Push(0, FP, 0, 0, 1, 1, "fp32", payload, codec.checksum(payload)))
    assert core.status()["versions"] == [0]  # learner 1 may still come, inside the 50 ms grace
    give_up = time.monotonic() + 5.0
    while core.status()["versions"] == [0] and time.monotonic() < give_up:
      time.sleep(0.01)
  assert core.status()["versions"] == [1]


def test_ticker_survives_exceptions_counts_and_logs_them(caplog):
  settings = helpers.syncer_settings((4,), codec="fp32", min_quorum=1, min_grace_s=0.3, max_grace_s=0.3,
                                     num_learners=2)  # fp32: the payload pushed below
  core = core_lib.SyncerCore(settings, [np.zeros(4, np.float32)])
  core.join(0, FP)
  core.join(1, FP)
  real_tick, failures = core.tick, [5]

  def flaky_tick():
    if failures[0] > 0:
      failures[0] -= 1
      raise RuntimeError("a bug in tick")
    return real_tick()

  core.tick = flaky_tick
  with caplog.at_level("ERROR", logger="diloco_jax.syncer.ticker"):
    with Ticker(core, period_s=0.01) as ticker:
      payload = codec.encode(np.ones(4, np.float32), "fp32")
      core.push(Push(0, FP, 0, 0, 1, 1, "fp32", payload, codec.checksum(payload)))
      give_up = time.monotonic() + 10.0
      while core.status()["versions"] == [0] and time.monotonic() < give_up:
        time.sleep(0.01)
      assert ticker.alive
  # The deadline-driven close still happened (nothing else ticks here), after five failed ticks.
  assert core.status()["versions"] == [1]
  assert core.status()["counters"]["tick_errors"] == 5
  tracebacks = [r for r in caplog.records if r.exc_info]
  assert len(tracebacks) == 1 and "a bug in tick" in caplog.text  # logged, at most once a minute


def test_settings_from_config_and_status_is_json():
  cfg = config_lib.base_config()
  cfg.outer.min_quorum, cfg.outer.codec, cfg.outer.merge = 2, "int8", "tokens_sq_per_step"
  params = {"embed": {"embedding": np.zeros((4, 3))}, "layers": {0: {"w": np.zeros((3, 3))},
                                                                  1: {"w": np.zeros((3, 3))}}}
  plan = fragments.make_plan(params, 2, cfg.outer.sync_every)
  s = settings_lib.SyncerSettings.from_spec(config_lib.resolve(cfg), plan, "fp")
  # The downlink defaults to fp32 (the weights themselves are never quantized for learners).
  assert s.sizes == (21, 9) and s.codec == "int8" and s.downlink_codec == "fp32" and s.block == 64
  assert s.policy == QuorumPolicy(min_quorum=2, tau=2, gamma=0.5, min_grace_s=0.0, max_grace_s=5.0)
  assert (s.merge_rule, s.outer_lr, s.outer_momentum, s.lease_s) == ("tokens_sq_per_step", 0.7, 0.9, 30.0)
  cfg.outer.downlink_codec = "int4"
  assert settings_lib.SyncerSettings.from_spec(config_lib.resolve(cfg), plan, "fp").downlink_codec == "int4"
  c, clock = make_core(num_learners=2, k=2)
  c.push(make_push(0, np.ones(8)))
  status = json.loads(json.dumps(c.status()))
  assert status["live"] == [0, 1] and status["open_rounds"]["0"]["contributors"] == [0]


@pytest.mark.parametrize("seed", range(12))
def test_core_closes_rounds_when_the_shared_policy_says(seed):
  """The simulator predicts round closes with `policy.round_close_time`; the core, driven by the same
  arrivals on a fake clock, must close at exactly those instants (or not at all when it says None)."""
  rng = np.random.default_rng(seed)
  live = int(rng.integers(1, 6))
  k = int(rng.integers(1, live + 1))
  step_time = float(rng.uniform(0.5, 3.0))
  policy = dict(tau=int(rng.integers(0, 4)), gamma=float(rng.uniform(0.0, 0.9)),
                max_grace_s=float(rng.uniform(0.0, 5.0)))
  arriving = sorted(rng.choice(live, size=int(rng.integers(1, live + 1)), replace=False).tolist(),
                    key=lambda _: rng.random())
  arrivals = np.cumsum(rng.exponential(1.0, len(arriving))).tolist()
  # The quorum rule alone: `round_close_time` knows no stalls, so no learner stops counting here.
  c, clock = make_core(num_learners=live, k=k, step_time=step_time, stall_s=math.inf, **policy)
  expected = round_close_time(helpers.quorum_policy(min_quorum=k, **policy), arrivals, live, step_time, t_sync_s=0.0)

  closed_at = None
  events = list(zip(arrivals, arriving))
  while closed_at is None:
    deadline = c.next_deadline()
    if deadline is not None and deadline >= clock.t + 50:
      deadline = None  # only the leases (100 s, renewed below): the quorum was never reached
    upcoming = [t for t, _ in events[:1]] + ([deadline] if deadline is not None else [])
    if not upcoming:
      break
    now = min(upcoming)
    clock.t = now
    for i in range(live):  # leases stay alive (lease 100 s, but keep it explicit)
      c.heartbeat(i, step_time)
    if events and events[0][0] == now:
      _, learner = events.pop(0)
      c.push(make_push(learner, np.ones(8)))
    c.tick()
    if c.status()["versions"] == [1]:
      closed_at = now
  if expected is None:
    assert closed_at is None
  else:
    assert closed_at == pytest.approx(expected, abs=1e-9), (closed_at, expected, arrivals, k, live, policy)


@pytest.mark.parametrize("rda", [False, True])
def test_core_rounds_match_the_unfused_outer_math(rda):
  """The core's fused close (payloads held as they arrived, decoded, weighed, summed and stepped in one
  chunked pass on 2 threads) against decode + `outer.merge` + optax's step, over two rounds."""
  size, lr, mu = 5000, 0.7, 0.9
  c = helpers.make_core((size,), codec="int4", k=3, lr=lr, momentum=mu, rda=rda, merge_threads=2,
                        initial="linspace", max_grace_s=0.0, lease_s=100.0)
  for i in range(3):
    c.join(i, FP)
  tx = outer_reference.make_outer_optimizer(lr, mu)
  theta = np.linspace(-1, 1, size, dtype=np.float32)
  state = outer_reference.init_outer_state(tx, theta)
  rng = np.random.default_rng(0)
  for version in range(2):
    pushes = [helpers.make_push(i, rng.standard_normal(size) * (i + 1) * 0.01, core=c, base_version=version,
                                tokens=100 * (i + 1), steps=10) for i in range(3)]
    for p in pushes:
      c.push(p)
    decoded = [codec.decode(p.payload, "int4", size) for p in pushes]
    raw = outer.raw_weights([p.tokens for p in pushes], [p.steps for p in pushes])
    theta, state = outer_reference.outer_step(tx, theta, state, outer.merge(decoded, raw / raw.sum(), rda=rda))
    assert c.status()["versions"] == [version + 1]
    np.testing.assert_allclose(global_of(c), theta, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(c.state_dict()["opt_states"][0], jax.tree.leaves(state)[0], rtol=1e-5, atol=1e-7)


def test_rounds_that_wait_on_each_other_close_after_the_stall_time():
  """K = all, tau = 0, two fragments, learners out of phase: learner 0 waits on fragment 0's round, which
  waits on learner 1, who waits on fragment 1's round, which waits on learner 0. No push can ever come;
  after `stall_s` the older round closes with what it holds, and the rest goes on as usual. A round that
  waits on a learner still stepping is never closed that way."""
  c, clock = make_core(num_learners=2, sizes=(8, 8), k=2, stall_s=2.0, max_grace_s=0.0)
  clock.t = 1.0
  c.push(make_push(0, np.ones(8), fragment=0))
  c.heartbeat(0, 10.0, step=5, blocked=True)
  clock.t = 1.5
  c.push(make_push(1, np.ones(8), fragment=1))
  c.heartbeat(1, 10.0, step=5, blocked=True)
  assert c.tick() == []
  assert c.next_deadline() == pytest.approx(1.5 + 2.0)  # both stuck since the second push
  clock.t = 3.49
  assert c.tick() == [] and c.status()["versions"] == [0, 0]
  clock.t = 3.5
  assert c.tick() == [0]  # the older round, with learner 0's push alone
  assert c.status()["versions"] == [1, 0] and c.counters["deadlocks_broken"] == 1
  (record,) = c.drain_decisions()
  assert record["close"] == "deadlock" and record["contributors"] == [0]
  c.heartbeat(0, 10.0, step=5, blocked=False)
  c.push(make_push(0, np.ones(8), fragment=1))  # learner 0 goes on: fragment 1's round is all in
  assert c.status()["versions"] == [1, 1] and c.counters["deadlocks_broken"] == 1

  # The same round waiting on a learner that steps (not blocked) waits for it, whatever the time.
  c, clock = make_core(num_learners=2, sizes=(8, 8), k=2, stall_s=2.0, max_grace_s=0.0)
  c.push(make_push(0, np.ones(8), fragment=0))
  c.heartbeat(0, 10.0, step=5, blocked=True)
  for step, t in enumerate((1.0, 5.0, 9.0, 13.0)):
    clock.t = t
    c.heartbeat(1, 10.0, step=step, blocked=False)
    c.heartbeat(0, 10.0, step=5, blocked=True)
    assert c.tick() == []
  assert c.status()["versions"] == [0, 0] and c.counters["deadlocks_broken"] == 0

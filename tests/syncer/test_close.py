"""A round's close (`syncer/close.py`): the fused merge and Nesterov step against the unfused math, an exact
overwrite, and rounds refused whole when they would publish non-finite values."""

import functools
import logging
import threading
import time

import jax
import numpy as np
import pytest

import helpers
from diloco_jax.outer import codec
from diloco_jax.outer import merge as outer
from diloco_jax.tools.bench import outer_reference

make_core = helpers.joined_core
global_of = helpers.global_of
make_push = functools.partial(helpers.make_push, block=4)
FP = helpers.FP
small = helpers.small_delta


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


@pytest.mark.parametrize("rda", [False, True])
def test_core_rounds_match_the_unfused_outer_math(rda):
  """The core's fused close (payloads held as they arrived, decoded, weighed, summed and stepped in one
  chunked pass on 2 threads) against decode + `outer.merge` + optax's step, over two rounds."""
  size, lr, mu = 5000, 0.7, 0.9
  # A clock that stands still: on the real one, a busy machine that took over stall_s (0.5 s) between the
  # joins and the pushes let the rules stop counting the learners not yet heard from, and the round closed
  # before all 3 pushes (a clean-clone CI run); what this test pins is the arithmetic.
  c = helpers.make_core((size,), codec="int4", k=3, lr=lr, momentum=mu, rda=rda, merge_threads=2,
                        initial="linspace", max_grace_s=0.0, lease_s=100.0, clock=helpers.FakeClock())
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


def test_a_round_that_would_publish_nonfinite_values_is_refused_whole(caplog):
  # With the outlier check off, the push (3e38 per element, finite) pushed alone reaches a round:
  # the Nesterov step would overflow to inf (and NaN next). The round is refused: nothing is published.
  # (Rounds unscaled: scaled to one learner's share of four, this step would stay finite.)
  clock = helpers.FakeClock()
  steps = helpers.StepLog()
  c = helpers.make_core((64,), k=1, lr=0.7, momentum=0.9, clock=clock, num_learners=4, lease_s=100.0,
                        max_grace_s=0.0, max_norm_ratio=0.0, scale_partial_rounds=False, tape=steps)
  for i in range(4):
    c.join(i, FP)
  c.push(helpers.make_push(0, small(), core=c))  # round 0 merges normally
  state0 = c.state_dict()
  waiting = []
  waiter = threading.Thread(target=lambda: waiting.append(c.pull(0, 2, timeout_s=30.0)))
  waiter.start()
  # Another learner's pull is waiting for version 2: it looked once and found version 1.
  helpers.wait_for(lambda: "poll" in steps.kinds(), "the pull to wait", timeout=10, poll=0.01)
  started = time.monotonic()
  with caplog.at_level(logging.ERROR, logger="diloco_jax.syncer.core"):
    receipt = c.push(helpers.make_push(2, np.full(64, 3e38, np.float32), core=c, base_version=1))
  assert receipt.round == 1
  after = c.state_dict()
  for k in ("fragments", "versions", "rounds"):
    assert repr(after[k]) == repr(state0[k]), k
  for x, y in zip(helpers_leaves(after["opt_states"]), helpers_leaves(state0["opt_states"])):
    np.testing.assert_array_equal(x, y)
  assert c.status()["versions"] == [1] and "0" not in c.status()["open_rounds"]
  assert c.counters["rounds_refused"] == 1 and c.counters["contributions_dropped"] == 1
  assert any("refused" in r.message and "non-finite" in r.message for r in caplog.records)
  # Waits for the version the refused round was to make are answered at once with the one that stays
  # (the learner whose push was dropped pulls right after its receipt).
  waiter.join(10)
  assert waiting and waiting[0].version == 1 and time.monotonic() - started < 10
  assert c.pull(0, 2, timeout_s=5.0).version == 1
  assert np.isfinite(c.global_fragments()[0]).all()
  # The next good round publishes version 2, and a wait for version 3 is a real wait again.
  c.push(helpers.make_push(1, small(seed=5), core=c, base_version=1))
  assert c.status()["versions"] == [2] and np.isfinite(c.global_fragments()[0]).all()
  assert c.pull(0, 3, timeout_s=0.2) is None


@pytest.mark.parametrize("codec,threads", [("fp32", 1), ("int4", 2)])
def test_a_refused_round_leaves_no_chunk_of_the_fragment_changed(codec, threads):
  # The close steps the global and momentum in place, chunk by chunk: a round whose overflow lies in its
  # last chunk must not have written the chunks before it. Two pushes, each finite and within its own
  # norm's bound of float32, whose sum (x 1.9, Nesterov's g + mu m) overflows at the fragment's end only.
  n = 5 * 65536 + 100
  clock = helpers.FakeClock()
  # The outlier check off (max_norm_ratio 0): the overflow must reach the round's close.
  c = helpers.make_core((n,), codec=codec, k=2, lr=0.7, momentum=0.9, clock=clock, num_learners=2,
                        lease_s=100.0, merge_threads=threads, max_norm_ratio=0.0)
  for i in range(2):
    c.join(i, FP)
  c.push(helpers.make_push(0, small(n), core=c))
  c.push(helpers.make_push(1, small(n, seed=1), core=c))  # round 0: momentum is non-zero from here
  state0 = c.state_dict()
  huge = small(n, seed=2)
  huge[-64:] = 3e38
  for i in range(2):
    c.push(helpers.make_push(i, huge, core=c, base_version=1))
  after = c.state_dict()
  assert c.counters["rounds_refused"] == 1 and after["versions"] == [1]
  np.testing.assert_array_equal(after["fragments"][0], state0["fragments"][0])
  np.testing.assert_array_equal(after["opt_states"][0], state0["opt_states"][0])
  # The next honest round steps from the untouched state, as a core that never saw the refused one does.
  twin = helpers.make_core((n,), codec=codec, k=2, lr=0.7, momentum=0.9, clock=clock, num_learners=2,
                           lease_s=100.0, merge_threads=threads, max_norm_ratio=0.0)
  twin.load_state_dict(state0)
  for i in range(2):
    twin.join(i, FP)
  for core in (c, twin):
    for i in range(2):
      core.push(helpers.make_push(i, small(n, seed=3 + i), core=core, base_version=1))
  np.testing.assert_array_equal(c.global_fragments()[0], twin.global_fragments()[0])
  assert c.status()["versions"] == [2]


def helpers_leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]

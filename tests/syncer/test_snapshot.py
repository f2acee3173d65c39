"""The core's state as a checkpoint holds it (`syncer/snapshot.py`): state_dict round trips, momentum and
partial-round cycles restored exactly."""

import functools

import numpy as np
import pytest

import helpers
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.tools.bench import outer_reference

make_core = helpers.joined_core
global_of = helpers.global_of
_assert_states_equal = helpers.assert_states_equal
make_push = functools.partial(helpers.make_push, block=4)
FP = helpers.FP


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

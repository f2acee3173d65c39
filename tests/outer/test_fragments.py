"""Fragment plans: every leaf exactly once, gather/scatter inverse, staggered schedule."""

import jax
import numpy as np
import pytest

from diloco_jax.outer import fragments
from diloco_jax.outer import schedule


def fake_params(num_layers=6, d=8, vocab=16, lm_head=False):
  rng = np.random.default_rng(0)
  arr = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  params = {
      "embed": {"embedding": arr(vocab, d)},
      "layers": {
          i: {
              "attn": {"q": {"kernel": arr(d, d)}, "k": {"kernel": arr(d, d)}, "o": {"kernel": arr(d, d)}},
              "mlp": {"up": {"kernel": arr(d, 2 * d)}, "down": {"kernel": arr(2 * d, d)}},
              "norm": {"scale": arr(d)},
          } for i in range(num_layers)
      },
      "final_norm": {"scale": arr(d)},
  }
  if lm_head:
    params["lm_head"] = {"kernel": arr(d, vocab)}
  return params


@pytest.mark.parametrize("kind", ["strided", "balanced"])
@pytest.mark.parametrize("num_fragments", [1, 2, 3, 4])
def test_every_leaf_exactly_once_and_roundtrip(kind, num_fragments):
  params = fake_params()
  plan = fragments.make_plan(params, num_fragments, sync_every=12, kind=kind)
  all_paths = [path for ps in plan.paths for path in ps]
  assert sorted(all_paths) == sorted(fragments.flatten(params))
  assert len(set(all_paths)) == len(all_paths)
  assert all(len(ps) > 0 for ps in plan.paths)
  flat = fragments.flatten(params)
  for p in range(num_fragments):
    assert list(plan.paths[p]) == sorted(plan.paths[p])
    vec = fragments.gather(plan, params, p)
    assert vec.dtype == np.float32 and vec.shape == (plan.size(p),)
    back = fragments.scatter(plan, p, vec)
    assert set(back) == set(plan.paths[p])
    for path, arr in back.items():
      np.testing.assert_array_equal(arr, flat[path])
  # A layer's leaves never straddle fragments.
  for i in range(6):
    owners = {plan.fragment_of(path) for path in all_paths if path.startswith(f"layers/{i}/")}
    assert len(owners) == 1


def test_strided_assignment():
  plan = fragments.make_plan(fake_params(lm_head=True), 4, sync_every=8, kind="strided")
  assert plan.fragment_of("embed/embedding") == 0
  assert plan.fragment_of("final_norm/scale") == 3
  assert plan.fragment_of("lm_head/kernel") == 3
  for i in range(6):
    assert plan.fragment_of(f"layers/{i}/attn/q/kernel") == i % 4


def test_balanced_evens_bytes():
  # A big embedding: strided puts it with layers 0 and 2; balanced gives it its own fragment.
  params = fake_params(num_layers=4, vocab=512)
  plan = fragments.make_plan(params, 2, sync_every=8, kind="balanced")
  assert plan.paths[0] == ("embed/embedding",)
  sizes = [plan.size(p) for p in range(2)]
  strided = fragments.make_plan(params, 2, sync_every=8, kind="strided")
  strided_sizes = [strided.size(p) for p in range(2)]
  assert max(sizes) - min(sizes) < max(strided_sizes) - min(strided_sizes)


def test_abstract_params_and_jax_arrays():
  params = fake_params()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  assert fragments.make_plan(abstract, 3, 9) == fragments.make_plan(params, 3, 9)
  plan = fragments.make_plan(params, 2, 4)
  on_device = jax.tree.map(jax.numpy.asarray, params)
  np.testing.assert_array_equal(fragments.gather(plan, on_device, 1), fragments.gather(plan, params, 1))


def _numbered(params):
  """params with every element replaced by its global index (as float32), so a gather shows which
  elements a fragment holds."""
  leaves = fragments.flatten(params)
  out, start = {}, 0
  for path in sorted(leaves):
    n = np.asarray(leaves[path]).size
    out[path] = np.arange(start, start + n, dtype=np.float32).reshape(np.shape(leaves[path]))
    start += n
  return out, start


def _check_exact_cover(plan, params):
  """Every element of every leaf in exactly one fragment, each fragment non-empty, and assemble(gather)
  gives back every leaf."""
  numbered, total = _numbered(params)
  vectors = [fragments.gather(plan, numbered, p) for p in range(plan.num_fragments)]
  assert all(v.size > 0 for v in vectors)
  np.testing.assert_array_equal(np.sort(np.concatenate(vectors)), np.arange(total, dtype=np.float32))
  back = fragments.flatten(fragments.assemble(plan, [fragments.gather(plan, params, p)
                                                     for p in range(plan.num_fragments)], params))
  flat = fragments.flatten(params)
  assert set(back) == set(flat)
  for path, arr in back.items():
    np.testing.assert_array_equal(arr, flat[path])
  for p in range(plan.num_fragments):
    assert list(plan.paths[p]) == sorted(plan.paths[p]) and len(set(plan.paths[p])) == len(plan.paths[p])


@pytest.mark.parametrize("kind", ["strided", "balanced"])
@pytest.mark.parametrize("num_layers,num_fragments,sync_every", [(2, 5, 8), (6, 9, 12), (6, 12, 12), (1, 30, 30)])
def test_plans_split_large_tensors_when_groups_run_out(kind, num_layers, num_fragments, sync_every):
  params = fake_params(num_layers=num_layers, vocab=64)
  plan = fragments.make_plan(params, num_fragments, sync_every, kind=kind)
  assert plan.num_fragments == num_fragments and len(set(plan.offsets)) == num_fragments
  _check_exact_cover(plan, params)
  split = [(p, path, a, b) for p in range(num_fragments) for path, shape, a, b in plan.pieces(p)
           if b - a != np.prod(shape)]
  assert split  # some leaf was cut
  sizes = [plan.size(p) for p in range(num_fragments)]
  assert max(sizes) <= 2 * sum(sizes) / num_fragments + 2 * 16  # halving the largest keeps them even
  # A cut falls on a row boundary of a 2-D leaf when it can: the embedding's pieces are whole rows.
  for p, path, a, b in split:
    if path == "embed/embedding" and b - a >= 8:
      assert a % 8 == 0 and b % 8 == 0
  # A fragment of pieces has no leaves of its own to scatter into.
  with pytest.raises(ValueError, match="assemble"):
    fragments.scatter(plan, split[0][0], np.zeros(plan.size(split[0][0]), np.float32))


def test_plans_without_splitting_are_unchanged():
  """Up to the number of groups, the plans are the whole-group plans (no piece of any leaf)."""
  params = fake_params()
  for kind, P in (("strided", 6), ("balanced", 8)):
    plan = fragments.make_plan(params, P, 12, kind=kind)
    assert all(b - a == np.prod(s) for p in range(P) for _, s, a, b in plan.pieces(p))
    if kind == "strided":
      assert plan.fragment_of("layers/5/attn/q/kernel") == 5


def test_impossible_plans_raise_naming_the_field():
  with pytest.raises(ValueError, match="outer.num_fragments"):
    fragments.make_plan({"w": np.zeros(3, np.float32)}, 4, 8)  # more fragments than elements
  with pytest.raises(ValueError, match="outer.num_fragments"):
    fragments.make_plan(fake_params(), 5, 4)  # P > H
  plan = fragments.make_plan({"w": np.zeros(3, np.float32)}, 3, 8)  # one element each
  assert [plan.size(p) for p in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("num_fragments,sync_every", [(1, 5), (2, 8), (3, 10), (4, 4), (4, 13)])
def test_due_each_fragment_once_per_period(num_fragments, sync_every):
  plan = fragments.make_plan(fake_params(), num_fragments, sync_every)
  assert plan.offsets == tuple(round(p * sync_every / num_fragments) for p in range(num_fragments))
  assert len(set(plan.offsets)) == num_fragments and all(0 <= o < sync_every for o in plan.offsets)
  assert schedule.due_fragments(plan, 0) == []
  for start in (1, 1 + sync_every, 7 * sync_every + 3):
    seen = []
    for step in range(start, start + sync_every):
      due = schedule.due_fragments(plan, step)
      seen += due
      for p in due:
        assert step % sync_every == plan.offsets[p]
    assert sorted(seen) == list(range(num_fragments))


def test_scatter_rejects_wrong_size_and_replace_leaves():
  params = fake_params()
  plan = fragments.make_plan(params, 2, 4)
  with pytest.raises(ValueError):
    fragments.scatter(plan, 0, np.zeros(plan.size(0) + 1, np.float32))
  vec = fragments.gather(plan, params, 1) + 1.0
  new = fragments.replace_leaves(params, fragments.scatter(plan, 1, vec))
  np.testing.assert_array_equal(fragments.gather(plan, new, 1), vec)
  np.testing.assert_array_equal(fragments.gather(plan, new, 0), fragments.gather(plan, params, 0))


def test_get_and_set_leaves_copy_only_the_way_to_them():
  params = fake_params()
  params["tup"] = (np.zeros(2, np.float32), {"x": np.ones(3, np.float32)})
  keys = fragments.leaf_keys(params)
  want = (keys["layers/2/attn/q/kernel"], keys["tup/1/x"], keys["embed/embedding"])
  got = fragments.get_leaves(params, want)
  assert got[1] is params["tup"][1]["x"] and got[0] is params["layers"][2]["attn"]["q"]["kernel"]
  new = fragments.set_leaves(params, want, ("a", "b", "c"))
  assert new["layers"][2]["attn"]["q"]["kernel"] == "a" and new["tup"][1]["x"] == "b"
  assert new["embed"]["embedding"] == "c" and isinstance(new["tup"], tuple)
  assert new["layers"][1] is params["layers"][1] and new["final_norm"] is params["final_norm"]  # shared
  assert params["layers"][2]["attn"]["q"]["kernel"] is got[0]  # the original is untouched
  assert new == fragments.replace_leaves(params, {"layers/2/attn/q/kernel": "a", "tup/1/x": "b",
                                                  "embed/embedding": "c"})


def test_in_flight_limit_follows_the_schedule():
  assert schedule.in_flight_limit(0, 2, 20, 2) == 2  # the default schedule: what max_in_flight was
  assert schedule.in_flight_limit(0, 24, 24, 2) == 3  # P = H: a snapshot every step, adopted tau later
  assert schedule.in_flight_limit(0, 4, 4, 0) == 1  # synchronous
  assert schedule.in_flight_limit(5, 24, 24, 2) == 5  # a set value is kept


@pytest.mark.parametrize("steps,sync_every,num_fragments,power,tau", [
    (160, 20, 2, 2.0, 2), (480, 20, 2, 2.0, 2), (480, 20, 2, 3.0, 2), (200, 10, 2, 3.0, 0),
    (100_000, 100, 4, 2.0, 2), (61, 7, 3, 1.5, 1), (40, 20, 2, 2.0, 2), (200, 20, 20, 2.0, 2)])
def test_front_loaded_keeps_the_periodic_sync_count_with_growing_gaps(steps, sync_every, num_fragments, power,
                                                                      tau):
  offsets = fragments.make_plan(fake_params(), num_fragments, sync_every).offsets
  min_gap = schedule.min_spacing("front_loaded", sync_every, tau)
  table = schedule.schedule_steps("front_loaded", steps, sync_every, offsets, power, min_gap)
  assert table == schedule.schedule_steps("front_loaded", steps, sync_every, offsets, power, min_gap)  # pure
  for p, o in enumerate(offsets):
    periodic = schedule.periodic_steps(steps, sync_every, o)
    assert periodic == tuple(s for s in range(1, steps + 1) if s % sync_every == o)  # due_fragments' rule
    due = table[p]
    assert len(due) == len(periodic) >= 1  # the same syncs, so the same bytes; every fragment synced
    assert 1 <= due[0] and due[-1] <= steps and list(due) == sorted(set(due))
    gaps = np.diff((0,) + due)
    assert (np.diff(gaps) >= 0).all() and gaps.min() >= max(1, tau)  # never shrinking, never due in flight
    if len(due) >= 4:  # dense early, sparse late
      assert gaps[0] < sync_every < gaps[-1]
  if steps % sync_every == 0:
    assert table[0][-1] == steps  # fragment 0's last sync still lands on the last step


def test_front_loaded_power_one_is_periodic_and_too_much_front_loading_is_refused():
  for o in (0, 3, 7):
    assert schedule.front_loaded_steps(100, 10, o, 1.0) == schedule.periodic_steps(100, 10, o)
  assert schedule.schedule_steps("periodic", 100, 10, (0, 5)) == ()
  with pytest.raises(ValueError, match="outer.schedule_power"):
    schedule.front_loaded_steps(20, 2, 0, 4.0, min_gap=3)  # 10 syncs at least 3 apart need 30 steps
  with pytest.raises(ValueError, match="outer.sync_schedule"):
    schedule.schedule_steps("cosine", 100, 10, (0,))


def test_due_fragments_follow_the_configured_schedule():
  from diloco_jax import config as config_lib
  c = config_lib.base_config()
  c.train.steps, c.outer.sync_every, c.outer.num_fragments, c.outer.tau = 160, 20, 2, 2
  periodic = fragments.plan_for_config(fake_params(), c)
  assert periodic.sync_steps == () and periodic.longest_gap == 20
  c.outer.sync_schedule = "front_loaded"
  plan = fragments.plan_for_config(fake_params(), c)
  assert plan.paths == periodic.paths and plan.offsets == periodic.offsets
  seen = [[], []]
  for step in range(0, 200):
    for p in schedule.due_fragments(plan, step):
      seen[p].append(step)
  assert tuple(map(tuple, seen)) == plan.sync_steps
  assert [len(s) for s in seen] == [8, 8]  # as periodic: 160 / 20 syncs each
  assert seen[0][:3] == [2, 10, 22] and seen[0][-1] == 160
  assert plan.longest_gap == max(np.diff([0] + seen[0]).max(), np.diff([0] + seen[1]).max()) == 38
  # A fragment is never due again before its sync, adopted tau steps later, came back: P + 1 in flight.
  assert schedule.in_flight_limit(0, 2, schedule.min_spacing("front_loaded", 20, 2), 2) == 3
  assert schedule.min_spacing("periodic", 20, 2) == 20

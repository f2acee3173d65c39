"""Fragment plans: every leaf exactly once, gather/scatter inverse, split tensors."""

import jax
import numpy as np
import pytest

import helpers
from diloco_jax.outer import fragments

fake_params = helpers.fake_params


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
  for _, path, a, b in split:
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

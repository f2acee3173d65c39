"""Placement of fragments on syncer shards."""


import pytest

import helpers
from diloco_jax.outer import placement

SIZES = helpers.SHARDED_SIZES


def test_placement_is_balanced_deterministic_and_total():
  assert placement.assign_shards(SIZES, 2) == [[2, 3], [0, 1]]  # 56 | 40, 24 | then 16 to the lighter
  assert placement.shard_of(SIZES, 2) == [1, 1, 0, 0]
  assert placement.shard_of(SIZES, 1) == [0, 0, 0, 0]
  assert sorted(p for s in placement.assign_shards(SIZES, 3) for p in s) == [0, 1, 2, 3]
  with pytest.raises(ValueError, match="shards must be in"):
    placement.assign_shards(SIZES, 5)

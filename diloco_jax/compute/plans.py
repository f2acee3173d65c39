"""The run's fragment plan and shard placement from its config, via the model's abstract shapes.

Every process of a run (each syncer shard, each learner, the evaluator, `status`) computes these from the
config alone, so nothing about them travels on the wire. Nothing is compiled or allocated: the shapes come
from `model.abstract_params`. The pure rules are in `outer/fragments.py` and `outer/placement.py`.
"""

from __future__ import annotations

from diloco_jax.compute import model
from diloco_jax.outer import fragments, placement


def run_plan(config) -> fragments.FragmentPlan:
  """The run's fragment plan (`fragments.plan_for_config`) for the model `config.model` describes.
  Raises ValueError naming the field when the plan cannot be made."""
  return fragments.plan_for_config(model.abstract_params(config.model), config)


def fragment_sizes(config) -> list[int]:
  """Elements per fragment of the run's fragment plan (the sizes alone: the sync schedule does not enter)."""
  o = config.outer
  plan = fragments.make_plan(model.abstract_params(config.model), o.num_fragments, o.sync_every, o.fragment_plan)
  return [plan.size(p) for p in range(plan.num_fragments)]


def config_owners(config, shards: int) -> list[int]:
  """The shard owning each fragment of `config`'s run with `shards` syncer shards."""
  return placement.shard_of(fragment_sizes(config), shards)

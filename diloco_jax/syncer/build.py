"""Between the model and the syncer: the core a run starts from, and the global model it holds.

Kept apart from `syncer/app.py` (the gRPC process) so that the in-process run builds the same core
without importing the gRPC service, and apart from `syncer/core.py`, which knows nothing of models.
"""

from __future__ import annotations

from typing import Any

from diloco_jax import config as config_lib
from diloco_jax.compute import model
from diloco_jax.outer import fragments, placement
from diloco_jax.syncer.core import SyncerCore
from diloco_jax.syncer.settings import SyncerSettings


def fragment_plan(config, params: Any) -> fragments.FragmentPlan:
  """The run's fragment plan for `params` (arrays or abstract shapes) from `config.outer`."""
  return fragments.plan_for_config(params, config)


def build_core(config, run_id: str = "", shard: int = 0, shards: int = 1, tape=None) -> tuple[SyncerCore, str]:
  """A fresh SyncerCore for `config` (the run's RunSpec; a config is resolved here) and its fingerprint:
  the global fragments start from the learners' initial params (the same values every learner creates from
  `config.seed`). With `shards` > 1, the core of shard `shard`: it owns and holds only that shard's
  fragments (`placement.assign_shards` of the plan's fragment sizes). `tape`: a `syncer.tape.Tape` the core
  records its steps on."""
  config = config_lib.resolve(config)
  params = model.init_params_host(config)
  plan = fragment_plan(config, params)
  sizes = [plan.size(p) for p in range(plan.num_fragments)]
  owned = None
  if shards > 1 or shard != 0:
    if not 0 <= shard < shards:
      raise ValueError(f"shard must be in [0, shards={shards}), got {shard}")
    owned = tuple(placement.assign_shards(sizes, shards)[shard])
  initial = [fragments.gather(plan, params, p) if owned is None or p in owned else None
             for p in range(plan.num_fragments)]
  fingerprint = config_lib.fingerprint(config, run_id)
  settings = SyncerSettings.from_spec(config, plan, fingerprint, owned=owned)
  return SyncerCore(settings, initial, tape=tape), fingerprint


def global_params(core: SyncerCore, plan: fragments.FragmentPlan, template: Any) -> Any:
  """The syncer's global model as a nested dict of host arrays shaped like `template`."""
  return fragments.assemble(plan, core.global_fragments(), template)


def global_params_from_state(config, state: dict, run_id: str, template: Any) -> Any:
  """The global model held in a syncer state dict (`SyncerCore.state_dict()`, as a syncer checkpoint
  restores it) of the run `config` + `run_id`, shaped like `template` (abstract shapes suffice: no core and
  no initial parameters are built, so exporting a big model costs only its fragments in host memory).

  Raises ValueError when the state belongs to another run (its fingerprint differs)."""
  fingerprint = config_lib.fingerprint(config, run_id)
  if state["fingerprint"] != fingerprint:
    raise ValueError(f"the syncer checkpoint is of another run (fingerprint {state['fingerprint']!r}, this config "
                     f"and run id {run_id!r} give {fingerprint!r}): pass the run's config overrides and run id")
  return fragments.assemble(fragment_plan(config, template), state["fragments"], template)

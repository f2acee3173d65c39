"""SyncerSettings from the resolved spec."""

import functools
import json

import numpy as np

import helpers
from diloco_jax import config as config_lib
from diloco_jax.outer import fragments
from diloco_jax.syncer import settings as settings_lib
from diloco_jax.syncer.rules.quorum import QuorumPolicy

make_core = helpers.joined_core
make_push = functools.partial(helpers.make_push, block=4)


def test_settings_from_config_and_status_is_json():
  cfg = config_lib.base_config()
  cfg.outer.min_quorum, cfg.outer.codec, cfg.outer.merge = 2, "int8", "tokens_sq_per_step"
  params = {"embed": {"embedding": np.zeros((4, 3))}, "layers": {0: {"w": np.zeros((3, 3))},
                                                                  1: {"w": np.zeros((3, 3))}}}
  plan = fragments.make_plan(params, 2, cfg.outer.sync_every)
  s = settings_lib.SyncerSettings.from_spec(config_lib.resolve(cfg), plan, "fp")
  # The downlink defaults to fp32 (the weights themselves are never quantized for learners).
  assert s.sizes == (21, 9) and s.codec == "int8" and s.downlink_codec == "fp32" and s.block == 64
  assert s.policy == QuorumPolicy(min_quorum=2, tau=2, gamma=0.9, min_grace_s=0.0, max_grace_s=5.0)
  assert (s.merge_rule, s.outer_lr, s.outer_momentum, s.lease_s) == ("tokens_sq_per_step", 0.7, 0.9, 30.0)
  cfg.outer.downlink_codec = "int4"
  assert settings_lib.SyncerSettings.from_spec(config_lib.resolve(cfg), plan, "fp").downlink_codec == "int4"
  c, clock = make_core(num_learners=2, k=2)
  c.push(make_push(0, np.ones(8)))
  status = json.loads(json.dumps(c.status()))
  assert status["live"] == [0, 1] and status["open_rounds"]["0"]["contributors"] == [0]

"""The ticker thread: rounds close on time with no other call, and a failing tick is counted, logged and survived."""


import numpy as np

import helpers
from diloco_jax.outer import codec
from diloco_jax.protocol.messages import Push
from diloco_jax.syncer import core as core_lib
from diloco_jax.syncer.ticker import Ticker

FP = helpers.FP


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
    helpers.wait_for(lambda: core.status()["versions"] != [0], "the ticker to close the round", timeout=5.0,
                     poll=0.01)
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
      helpers.wait_for(lambda: core.status()["versions"] != [0], "the ticker to close the round", timeout=10.0,
                       poll=0.01)
      assert ticker.alive
  # The deadline-driven close still happened (nothing else ticks here), after five failed ticks.
  assert core.status()["versions"] == [1]
  assert core.status()["counters"]["tick_errors"] == 5
  tracebacks = [r for r in caplog.records if r.exc_info]
  assert len(tracebacks) == 1 and "a bug in tick" in caplog.text  # logged, at most once a minute

"""The learner's network worker (learner/comms.py) against a real syncer core, in process: pushes and the
merged result coming back, rejoining a syncer that forgot the learner, refused pushes, epochs, heartbeats
and byte counts."""

import dataclasses
import time

import numpy as np
import pytest

import helpers
from diloco_jax.learner.comms import Comms
from diloco_jax.outer import codec
from diloco_jax.transports.inprocess import InProcessTransport

FP = helpers.FP
N = 300
BLOCK = 16


def make_comms(core, transport=None, learner_id=0, downlink="fp32", heartbeat_s=60.0):
  return Comms(transport or InProcessTransport(core), learner_id, FP, codec=core.settings.codec,
               downlink_codec=downlink, block=core.settings.block, sizes=core.settings.sizes, max_in_flight=2,
               heartbeat_s=heartbeat_s, pull_timeout_s=0.2)


def test_sync_pushes_and_returns_the_merged_global():
  core = helpers.make_core((N,), k=1, lr=1.0, momentum=0.0)  # one learner: the new global = base - delta
  comms = make_comms(core)
  try:
    assert comms.join().versions == {0: 0}
    base = core.global_fragments()[0]
    delta = np.linspace(-1, 1, N).astype(np.float32)
    result = comms.sync(0, delta, base_version=0, steps=5, tokens=320).result(timeout=30)
    assert (result.fragment, result.version, result.kind, result.late) == (0, 1, "full", False)
    np.testing.assert_allclose(result.global_vec, base - delta, rtol=1e-6)
    traffic = comms.traffic()
    assert traffic["payload_bytes_sent"] == 4 * N == core.counters["bytes_in"] and traffic["pushes"] == 1
    assert traffic["payload_bytes_received"] == 4 * N == core.counters["bytes_out"]
    assert core.counters["tokens_merged"] == 320
  finally:
    comms.close(leave=True)
  assert core.live_learners() == []  # it left


def test_a_forgotten_learner_rejoins_and_its_push_is_merged():
  core = helpers.make_core((N,), k=1)
  comms = make_comms(core)
  try:
    comms.join()
    core.leave(0)  # the syncer forgot it (a restart, a lapsed lease)
    result = comms.sync(0, np.ones(N, np.float32), base_version=0, steps=1, tokens=1).result(timeout=30)
    assert result.version == 1 and comms.rejected == []
    assert core.counters["joins"] == 2 and core.counters["contributions_merged"] == 1
  finally:
    comms.close(leave=False)


def test_a_refused_push_is_recorded_and_the_learner_gets_the_current_global():
  core = helpers.make_core((N,), k=1)
  comms = make_comms(core)
  try:
    comms.join()
    bad = np.ones(N, np.float32)
    bad[7] = np.nan
    result = comms.sync(0, bad, base_version=0, steps=1, tokens=1).result(timeout=30)
    assert comms.rejected == ["nonfinite"] and core.counters["rejected"]["nonfinite"] == 1
    assert result.version == 0  # nothing merged: it adopts the current global and goes on
    np.testing.assert_array_equal(result.global_vec, core.global_fragments()[0])
    assert comms.traffic()["pushes"] == 0  # only accepted pushes count
  finally:
    comms.close(leave=False)


def test_heartbeats_carry_a_robust_step_time():
  core = helpers.make_core((N,), k=1)
  comms = make_comms(core, heartbeat_s=0.05)
  try:
    comms.join()
    assert comms.step_time_s == 0.0  # nothing reported yet
    comms.report_step_time(30.0, step=1)  # the first step compiled: not timed
    assert comms.step_time_s == 0.0
    comms.report_step_time(0.3, step=2)
    assert comms.step_time_s == pytest.approx(0.3)  # before a whole group: the steps so far
    # Asynchronous dispatch: 7 steps that only enqueue (5 ms), then one that waits for the device to run
    # all 8 (0.5 s each). The median of single steps would say 5 ms; the groups' means say 0.5 s.
    for step in range(3, 3 + 7 * 8):
      comms.report_step_time(4.0 - 7 * 0.005 if step % 8 == 2 else 0.005, step=step)
    assert comms.step_time_s == pytest.approx(0.5, rel=0.05)
    # A stall of 20 s puts one group's mean at 3 s: the median across groups ignores it.
    for step in range(100, 108):
      comms.report_step_time(20.0 if step == 103 else 0.5, step=step)
    assert comms.step_time_s == pytest.approx(0.5, rel=0.05)
    for step in range(200, 200 + 8 * 8):  # only the last 8 groups count: the learner slowed down
      comms.report_step_time(0.6, step=step)
    assert comms.step_time_s == pytest.approx(0.6)
    helpers.wait_for(lambda: core.status()["members"]["0"]["step_time_s"] > 0.55, "a heartbeat", timeout=10)
    assert core.status()["members"]["0"]["step_time_s"] == pytest.approx(0.6)
  finally:
    comms.close(leave=False)


class RecordingTransport(InProcessTransport):
  """The real in-process transport, recording what each pull said it holds; `forged` replaces answers."""

  def __init__(self, core):
    super().__init__(core)
    self.forged = None
    self.asked = []

  def pull(self, fragment, min_version, timeout_s=0.0, have_version=-1, have_epoch=0):
    self.asked.append((have_version, have_epoch))
    return self.forged or super().pull(fragment, min_version, timeout_s, have_version, have_epoch)


def test_fetch_passes_the_epoch_and_refuses_a_delta_from_another():
  core = helpers.make_core((N,), downlink="int4", block=BLOCK, clock=helpers.FakeClock())
  core.join(0, FP)
  for seed in (13, 14):
    version = core.status()["versions"][0]
    delta = 0.05 * np.random.default_rng(seed).standard_normal(N)
    core.push(helpers.make_push(0, delta, core=core, base_version=version))
  transport = RecordingTransport(core)
  comms = make_comms(core, transport, downlink="int4")
  try:
    published, _ = comms.fetch(0, 2, have_version=1, have_epoch=core.epoch)
    assert (published.kind, published.epoch) == ("delta", core.epoch)
    published, _ = comms.fetch(0, 2, have_version=1, have_epoch=core.epoch + 1)
    assert (published.kind, published.epoch) == ("full", core.epoch)
    assert transport.asked == [(1, core.epoch), (1, core.epoch + 1)]
    # A delta that claims our version but another epoch (a confused or old syncer) must not be added.
    transport.forged = dataclasses.replace(core.pull(0, 2, have_version=1, have_epoch=core.epoch),
                                           epoch=core.epoch + 1)
    with pytest.raises(codec.CodecError, match="epoch"):
      comms.fetch(0, 2, have_version=1, have_epoch=core.epoch)
    # Nor one from another base version, nor a corrupted payload.
    transport.forged = dataclasses.replace(core.pull(0, 2, have_version=1, have_epoch=core.epoch), base_version=0)
    with pytest.raises(codec.CodecError, match="version"):
      comms.fetch(0, 2, have_version=1, have_epoch=core.epoch)
    good = core.pull(0, 2)
    transport.forged = dataclasses.replace(good, checksum=good.checksum ^ 1)
    with pytest.raises(codec.CodecError, match="checksum"):
      comms.fetch(0, 2)
  finally:
    comms.close(leave=False)


def test_fetch_keeps_polling_until_the_version_arrives():
  core = helpers.make_core((N,), k=1)
  comms = make_comms(core)
  try:
    comms.join()
    future = comms._pool.submit(comms.fetch, 0, 1)
    time.sleep(0.5)  # two pull timeouts of 0.2 s pass with nothing newer
    assert not future.done()
    core.push(helpers.make_push(0, np.ones(N), core=core))
    published, vec = future.result(timeout=30)
    assert published.version == 1 and vec.shape == (N,)
  finally:
    comms.close(leave=False)


@pytest.mark.parametrize("feedback", [False, True])
def test_int2_pushes_with_error_feedback_carry_what_the_codec_rounds_away(feedback):
  """One learner pushes the same outer gradient g 20 times into a core that applies it as it comes (lr 1, no
  momentum). Ternary int2 errs the same way on every push: without error feedback the global model drifts
  from base - 20 g by 20 times that error; with it, by at most one residual (<= the block's absmax of g)."""
  core = helpers.make_core((N,), codec="int2", block=BLOCK, k=1, lr=1.0, momentum=0.0)
  comms = Comms(InProcessTransport(core), 0, FP, codec="int2", downlink_codec="fp32", block=BLOCK,
                sizes=core.settings.sizes, max_in_flight=2, heartbeat_s=60.0, pull_timeout_s=0.2,
                error_feedback=feedback)
  base = core.global_fragments()[0].copy()
  g = (np.random.default_rng(4).standard_normal(N) * 0.01).astype(np.float32)
  try:
    comms.join()
    version = 0
    for _ in range(20):
      version = comms.sync(0, g, base_version=version, steps=10, tokens=640).result(timeout=30).version
    assert version == 20 and comms.rejected == []
  finally:
    comms.close(leave=True)
  drift = np.abs(core.global_fragments()[0].astype(np.float64) - (base - 20 * g.astype(np.float64))).max()
  absmax = float(np.abs(g).max())
  if feedback:
    assert drift <= absmax * 1.001 + 1e-6
    assert comms.feedback.residual_norm(0) > 0
  else:
    assert drift > 3 * absmax

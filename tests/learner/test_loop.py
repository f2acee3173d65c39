"""The learner's outer schedule (learner/loop.py) on real devices and a real in-process syncer core:
when fragments are snapshotted and adopted, what adoption does to the parameters, and when the inner
loop has to wait."""

import time

import jax
import numpy as np
import pytest

from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner import recovery as recovery_lib
from diloco_jax.runs import inprocess


def _identity_outer_loop(c, tau, keep_local_progress):
  """One learner, K = 1, outer lr 1, momentum 0, fp32: every merge sets the global fragment to the
  learner's parameters at its snapshot."""
  c.learners.num, c.learners.devices = 1, 2
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 1, 4, tau
  c.outer.lr, c.outer.momentum = 1.0, 0.0
  c.outer.codec = c.outer.downlink_codec = "fp32"
  c.outer.min_quorum, c.outer.max_grace_s = 1, 0.0
  c.outer.keep_local_progress = keep_local_progress
  return c


def _params_close(a, b):
  return all(np.allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("keep_local_progress", [True, False])
def test_adoption_waits_tau_steps_and_keeps_the_local_progress(tiny_config, keep_local_progress):
  c = _identity_outer_loop(tiny_config, tau=2, keep_local_progress=keep_local_progress)
  steps = 10
  devices = jax.devices()[:2]
  plain = trainer_lib.MeshTrainer(c, devices, None, batch_size=c.data.global_batch)
  job = inprocess.InProcessRun(c, None, devices=devices)
  learner = job.learners[0]
  try:
    learner.join()
    adopted_at = []
    for step in range(1, steps + 1):
      plain.train_step()
      before = learner.stats.adopted
      learner.train_step()
      if learner.stats.adopted > before:
        adopted_at.append(step)
    lag = learner.stats.adopt_lag_steps
    learner.flush()
  finally:
    job.close()
  # Snapshots at steps 4 and 8 (s mod H == 0); each adoption at least tau = 2 steps later.
  assert learner.stats.syncs == 3 and len(adopted_at) >= 1  # the flush adds one sync
  assert all(step >= 6 for step in adopted_at) and (len(adopted_at) < 2 or adopted_at[1] >= 10)
  assert lag == sum(step - snapshot for step, snapshot in zip(adopted_at, (4, 8)))  # the overlap it had
  # With the identity outer step, keeping the local progress makes the outer loop invisible: the learner
  # follows plain training exactly. Overwriting instead throws away the steps taken since the snapshot.
  assert _params_close(learner.trainer.state.params, plain.state.params) == keep_local_progress


def test_a_fragment_due_again_waits_for_its_sync_and_counts_the_wait(tiny_config):
  """K = 2 with a second learner that joined but never makes progress: the round waits for it until the
  stall bound (outer.stall_s, long before its lease lapses), and the first learner, whose fragment falls
  due again meanwhile, blocks (counted)."""
  c = tiny_config
  c.learners.num, c.learners.devices = 2, 2
  c.outer.num_fragments, c.outer.sync_every, c.outer.tau = 1, 2, 1
  # The stall bound must outlast steps 2 and 3 (they compile the snapshot and the step after it): at 1.5 s
  # a loaded machine (4 steps in 10.7 s) passed it before step 4, and the learner hardly blocked.
  c.outer.min_quorum, c.outer.lease_s, c.outer.stall_s = 2, 30.0, 4.0
  job = inprocess.InProcessRun(c, None, learner_ids=[0])
  learner = job.learners[0]
  try:
    learner.join()
    learner.train_step()  # step 1 (compiles)
    job.core.join(1, job.fingerprint)  # the silent learner: it stops counting 4 s from now
    learner.train_step()  # step 2: snapshot; the round waits for learner 1
    learner.train_step()  # step 3: nothing has come back, nothing to adopt
    assert learner.stats.adopted == 0 and learner.stats.blocked_s == 0.0
    learner.train_step()  # step 4: due again -> waits until the round closes without learner 1
    assert learner.stats.adopted == 1 and learner.base_version == [1]
    assert learner.stats.blocked_s > 0.3
    # Learner 1 stopped counting (learner 0 may have too, for a moment, while it compiled on a busy machine).
    status = job.core.status()
    assert 1 not in status["counted"] and not status["members"]["1"]["progressing"]
    assert job.core.counters["learner_stalls"] >= 1 and job.core.counters["leases_expired"] == 0
  finally:
    learner.flush()
    job.close()


def test_split_fragments_one_due_every_step_keep_the_outer_loop_invisible(tiny_config):
  """P = H: one fragment due at every step, more fragments than the model has layer groups, so the plan
  cuts leaves into pieces. With the identity outer step and the local progress kept, the learner still
  follows plain training: every piece is snapshotted, merged and adopted in place of its leaf range."""
  c = _identity_outer_loop(tiny_config, tau=1, keep_local_progress=True)
  c.outer.num_fragments = c.outer.sync_every = 6
  devices = jax.devices()[:2]
  plain = trainer_lib.MeshTrainer(c, devices, None, batch_size=c.data.global_batch)
  job = inprocess.InProcessRun(c, None, devices=devices)
  learner = job.learners[0]
  try:
    plan = learner.plan
    assert any(b - a != np.prod(shape) for p in range(6) for _, shape, a, b in plan.pieces(p))
    learner.join()
    for _ in range(13):
      plain.train_step()
      learner.train_step()
    learner.flush()
  finally:
    job.close()
  assert learner.stats.syncs >= 13 and learner.stats.adopted == learner.stats.syncs
  assert _params_close(learner.trainer.state.params, plain.state.params)
  assert job.core.status()["versions"] == [learner.base_version[p] for p in range(6)]


def test_a_learner_back_from_an_absence_catches_up_on_every_fragment(tiny_config):
  """Shipped quorum (K = 1 + grace, tiny_cpu), two learners: learner 0 stops stepping while learner 1
  trains many periods. When a fragment of learner 0 comes back that many rounds ahead of its base, it
  syncs every fragment and adopts them all at once: it resumes on the current global model, not on a mix
  of fresh and stale fragments. Learners that step alike never do."""
  c = tiny_config
  c.learners.num, c.learners.devices = 2, 2
  job = inprocess.InProcessRun(c, None)
  away, steady = job.learners
  H = c.outer.sync_every
  try:
    away.join()
    steady.join()
    for _ in range(5 * H):
      away.train_step()
      steady.train_step()
    assert away.stats.catch_ups == steady.stats.catch_ups == 0  # stepping alike: usual jumps only
    for _ in range(4 * recovery_lib.CATCH_UP_PERIODS * H):  # learner 0 is away for many of its periods
      steady.train_step()
    syncs = away.stats.syncs
    for _ in range(4 * H):  # back: the next fragment it syncs comes back far ahead of its base
      away.train_step()
      if away.stats.catch_ups:
        break
      time.sleep(0.02)  # a step's time, for the round its push opened to close (the grace window)
    assert away.stats.catch_ups == 1 and not away.in_flight and away.stats.syncs >= syncs + 2
    # Every fragment is the current global one (nobody else pushed meanwhile).
    assert away.base_version == job.core.status()["versions"], (away.base_version, job.core.status()["versions"])
    before = away.stats.catch_ups
    for _ in range(3 * H):
      away.train_step()
      steady.train_step()
    assert away.stats.catch_ups == before  # once caught up, its jumps are usual again
  finally:
    away.flush()
    steady.flush()
    job.close()

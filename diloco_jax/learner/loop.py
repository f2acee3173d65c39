"""One Decoupled DiLoCo learner: the inner loop on its mesh slice, plus the outer schedule around it.

Between two inner steps the loop never waits on the network: it adopts the merged global fragments that
came back and are at least tau steps past their snapshot, and for each fragment due at this step it computes
the outer gradient on the device and hands it to the comms worker (`learner/comms.py`), which pushes it and
fetches the merged result in the background (docs/algorithm.md, "Learner"). It waits only when
`outer.max_in_flight` syncs are in flight or a fragment falls due again before its last sync came back
(blocked time). The base (the global fragments last adopted) lives on the device, sharded like the
parameters. A learner back from an absence catches up (`recovery.is_absence`); after a syncer restart it
recovers (`recovery.plan_recovery`, docs/operations.md "The recovery protocol (learner side)"). Where the
network decides, the learner asks its `Strategy` (`learner/strategy.py`; `learner/group.py` for a learner
spanning several processes), at the same points in the same order on every process.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner import device as device_lib
from diloco_jax.learner import pace as pace_lib
from diloco_jax.learner import phase as phase_lib
from diloco_jax.learner import recovery as recovery_lib
from diloco_jax.learner import strategy as strategy_lib
from diloco_jax.learner import summary as summary_lib
from diloco_jax.learner.comms import Comms, SyncResult
from diloco_jax.learner.recovery import Action, RecoveryPlan
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.protocol import messages as protocol

log = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlight:
  fragment: int
  snapshot_step: int
  # The outer gradient pushed (its pieces on the devices, sharded like the parameters): locates theta at
  # the snapshot.
  snapshot: tuple[jax.Array, ...]
  future: object  # concurrent.futures.Future[SyncResult]; None on a process that pushes none (group.py)
  steps: int = 0  # the inner steps and tokens the push carries
  tokens: int = 0


@dataclasses.dataclass
class LearnerStats:
  syncs: int = 0
  adopted: int = 0
  late_merges: int = 0
  blocked_s: float = 0.0
  compute_s: float = 0.0  # wall time of the inner loop outside blocked waits
  outer_cpu_s: float = 0.0  # host CPU time of the outer loop's work at step boundaries (this thread)
  recoveries: int = 0  # syncer restarts recovered from
  steps_taken_back: int = 0  # steps (summed over fragments) pushed again after a restart lost them
  rebased: int = 0  # fragments rebased onto a restored global
  catch_ups: int = 0  # absences after which every fragment was synced at once (`recovery.is_absence`)
  # Inner steps between a sync's snapshot and the adoption of its merged result, summed over adoptions:
  # the overlap a run actually had (at least tau; more when merges come back later).
  adopt_lag_steps: int = 0


class Learner:
  """A learner unit: a `MeshTrainer` on its device slice and the outer loop around it. `strategy` decides
  at the network's decision points (default `SingleProcess`; `group.ProcessGroup` for one process of a
  learner spanning several, where only process 0 has a `transport`)."""

  def __init__(self, config, learner_id: int, devices: Sequence[jax.Device], transport, fingerprint: str,
               workdir: str | None, *, metrics_log=None, async_checkpoints: bool = True,
               checkpoint_dir: str | None = None, strategy: strategy_lib.Strategy | None = None):
    self.strategy = strategy_lib.SingleProcess() if strategy is None else strategy
    if self.strategy.leader != (transport is not None):
      raise ValueError("process 0 of a learner needs the transport, and only process 0")
    config = config_lib.resolve(config)  # the run's RunSpec passes as it is; a config (tests, tools) resolves here
    self.config, self.learner_id = config, learner_id
    outer = config.outer
    num_learners = config.learners.num
    self.trainer = trainer_lib.MeshTrainer(
        config, devices, workdir, batch_size=config.learners.batches[learner_id % num_learners],
        num_shards=num_learners, shard_index=learner_id % num_learners, async_checkpoints=async_checkpoints,
        checkpoint_dir=checkpoint_dir, train_cfg=config.learners.inner)
    self.pacer = pace_lib.StepPacer.from_spec(config, learner_id % num_learners)
    self.restored = self.trainer.restore()
    self.plan = fragments_lib.plan_for_config(self.trainer.state.params, config)
    self.max_in_flight = config.outer.max_in_flight
    n = self.plan.num_fragments
    self.fragments = device_lib.DeviceFragments(self.plan, self.trainer)
    # No transport: a process of a multi-host learner other than process 0 (learner/group.py).
    self.comms = None if transport is None else Comms(
        transport, learner_id, fingerprint, codec=outer.codec, downlink_codec=outer.downlink_codec,
        block=outer.codec_block, sizes=tuple(self.plan.size(p) for p in range(n)),
        max_in_flight=self.max_in_flight, heartbeat_s=config.outer.heartbeat_s,
        step_group=max(8, config.train.log_every), error_feedback=outer.error_feedback)
    self.step_clock = pace_lib.StepClock()  # the step time reported to the syncer
    # The steps dispatched but maybe not run yet: at most max(1, tau) (`train_step`).
    self._dispatched: collections.deque = collections.deque()
    self.base_version = [0] * n
    # The syncer epoch each base came from (0: none yet; version 0 is the seed's, the same in every epoch).
    self.base_epoch = [0] * n
    self.steps_since = [0] * n
    self.tokens_since = [0] * n
    self.in_flight: collections.deque[InFlight] = collections.deque()
    self._merged = [collections.deque(maxlen=recovery_lib.RECEIPT_LOG) for _ in range(n)]
    self._blocked_depth = 0
    self.stats = LearnerStats()
    self.log = metrics_log
    self.tau = outer.tau
    self._alpha = float(outer.alpha)
    self._keep_progress = bool(outer.keep_local_progress)
    self._absence = recovery_lib.AbsenceWatch(config.learners.num)
    self.phase = phase_lib.PhaseShift(self.plan, outer.phase_gain)  # syncs moved toward the other learners'
    self.strategy.attach(self)

  @property
  def base(self):
    """The global fragments last adopted, on the devices (a pytree like the parameters)."""
    return self.fragments.base

  def join(self) -> None:
    """Joins the syncer; a learner that resumes or rejoins a run in progress adopts every current global
    fragment first, so its next pushes are outer gradients against the global model."""
    self.strategy.join()

  # -- adopting ------------------------------------------------------------------------------------

  def adopt(self, result: SyncResult, snapshot: tuple[jax.Array, ...] | None) -> None:
    """Adopt a merged global fragment. With a `snapshot` and `outer.keep_local_progress`, the inner steps
    taken since the snapshot are kept on top of it; without one (joining), the global overwrites."""
    p = result.fragment
    if result.kind == protocol.Kind.DELTA and result.base_version != self.base_version[p]:
      # Adding a delta to another base would silently corrupt the model for good.
      raise RuntimeError(f"learner {self.learner_id}: fragment {p} delta from v{result.base_version}, "
                         f"but the base is v{self.base_version[p]}")
    if result.kind == protocol.Kind.DELTA and result.base_version > 0 and result.epoch != self.base_epoch[p]:
      # The same version number from a restarted syncer names another reference.
      raise RuntimeError(f"learner {self.learner_id}: fragment {p} delta from syncer epoch {result.epoch}, "
                         f"but the base is from epoch {self.base_epoch[p]}")
    keep = float(self._keep_progress and snapshot is not None)
    self.fragments.adopt(p, result.kind, result.global_vec, snapshot, self._alpha, keep)
    self.base_version[p] = result.version
    self.base_epoch[p] = result.epoch
    self.stats.adopted += 1
    self.stats.late_merges += int(result.late)

  def adopt_result(self, item: InFlight, result: SyncResult) -> None:
    """Adopt the merged fragment of a sync in flight, remembering its receipt (a later restart may lose
    that merge; its work is then pushed again)."""
    self._note_jump(item.fragment, result)
    self.adopt(result, item.snapshot)
    self.stats.adopt_lag_steps += self.trainer.step - item.snapshot_step
    if result.receipt is not None:
      r = result.receipt
      self._merged[item.fragment].append(recovery_lib.MergedReceipt(r.epoch, r.round, item.steps, item.tokens))
    self.phase.advise(item.fragment, item.snapshot_step, self.trainer.step, result.phase_steps)

  @contextlib.contextmanager
  def blocked(self):
    """The inner loop waits on the syncer: counted as blocked time, and heartbeats say so (a learner
    blocked on a round is not a stopped one)."""
    self._blocked_depth += 1
    if self.comms is not None:
      self.comms.set_blocked(True)
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self._blocked_depth -= 1
      if self._blocked_depth == 0:
        self.stats.blocked_s += time.perf_counter() - t0
        if self.comms is not None:
          self.comms.set_blocked(False)

  def _note_jump(self, p: int, result: SyncResult) -> None:
    """Before adopting a sync's result: how many rounds fragment p moved since its base; a jump far beyond
    the usual one means the learner was away (`recovery.is_absence`)."""
    if result.epoch != self.base_epoch[p] or self.base_epoch[p] == 0:
      return  # another numbering (a syncer restart: recovery settles it), or no base yet
    self._absence.note(result.version - self.base_version[p])

  # -- the outer schedule --------------------------------------------------------------------------

  def _snapshot(self, p: int, step: int) -> None:
    while True:
      same = [item for item in self.in_flight if item.fragment == p]
      if same:  # due again before its last sync came back
        self.strategy.wait(same[0])
      elif len(self.in_flight) >= self.max_in_flight:
        self.strategy.wait(self.in_flight[0])
      else:
        break
    delta = self.fragments.outer_gradient(p)
    self.in_flight.append(InFlight(p, step, delta, self._start_sync(p, delta), self.steps_since[p],
                                   self.tokens_since[p]))
    self.steps_since[p] = self.tokens_since[p] = 0
    self.stats.syncs += 1
    if self.tau == 0:
      self.strategy.wait(self.in_flight[-1])

  def _start_sync(self, p: int, delta: tuple[jax.Array, ...]):
    """Hands fragment p's outer gradient to the comms worker; returns the future of its merged result (None
    on a process that pushes none)."""
    pushed = self.strategy.pushed(delta)
    if pushed is None:
      return None
    if isinstance(pushed, tuple):  # pieces on the devices (a host vector is already there)
      for piece in pushed:
        piece.copy_to_host_async()
    return self.comms.sync(p, pushed, self.base_version[p], self.steps_since[p], self.tokens_since[p],
                           base_epoch=self.base_epoch[p])

  def after_step(self, tokens: int) -> None:
    """The outer loop's work at a step boundary (after the inner step that just ran)."""
    cpu0 = time.thread_time()
    step = self.trainer.step
    for p in range(self.plan.num_fragments):
      self.steps_since[p] += 1
      self.tokens_since[p] += tokens
    self.strategy.check_syncer()
    self.strategy.adopt_ready(step)
    due = self.phase.due(step)
    for p in due:
      self._snapshot(p, step)
    if self._absence.absent:
      # Syncs still in flight may have been merged before or during the absence: settle them first, then
      # sync every fragment holding work, and adopt them all now rather than tau steps later (no more steps
      # on the stale mix).
      self._settle_in_flight()
      caught = [p for p in range(self.plan.num_fragments) if self.steps_since[p] > 0]
      log.warning("learner %d: back after an absence at step %d; syncing fragments %s now to catch up with the "
                  "global model", self.learner_id, step, caught)
      for p in caught:
        self._snapshot(p, step)
      self._settle_in_flight()
      self._absence.absent = False  # the catch-up's own adoptions jump too
      self.stats.catch_ups += 1
    self.stats.outer_cpu_s += time.thread_time() - cpu0

  def _settle_in_flight(self) -> None:
    while self.in_flight:
      self.strategy.wait(self.in_flight[0])

  # -- syncer restarts -----------------------------------------------------------------------------

  def recover(self) -> None:
    """The syncer restarted: settle every sync in flight and every base against the restored model
    (`recovery.plan_recovery`). The process that talks to the syncer plans; every process of the learner
    applies the same plan (`Strategy.decide`). Blocks the inner loop (counted); the network calls are
    bounded like every other (a syncer unreachable past `comms.unreachable_deadline_s` fails the learner)."""
    with self.blocked():
      items = list(self.in_flight)
      vectors = {}  # where the syncer is reached: the fetched global fragments, by fragment (host vectors)

      def message():
        plan, fetched = self._plan_recovery(items)
        vectors.update(fetched)
        return {"recover": plan.to_json()}

      plan = RecoveryPlan.from_json(self.strategy.decide(message)["recover"])
      self._apply_recovery(plan, items, vectors)

  def _plan_recovery(self, items: list[InFlight]) -> tuple[RecoveryPlan, dict[int, np.ndarray]]:
    """Rejoin and plan the recovery, fetching the global fragments it adopts or rebases onto (again, if the
    syncer restarts once more meanwhile)."""
    # Every sync in flight ends promptly once the comms saw the new epoch (abandoned, or merged before).
    syncs = [recovery_lib.SettledSync(item.fragment, item.steps, item.tokens, item.future.result())
             for item in items]
    while True:
      plan = recovery_lib.plan_recovery(self.comms.join(), syncs, self.base_version, self.base_epoch, self._merged,
                                        recovery_lib.Claims(int(self.plan.longest_gap), int(self.config.train.steps)))
      named, vectors = {}, {}
      for p in plan.to_fetch():
        published, vectors[p] = self.comms.fetch(p, 0, have_version=-1)
        if published.epoch != plan.epoch:
          break
        named[p] = (published.version, published.epoch)
      else:
        return plan.with_fetched(named), vectors
      log.warning("learner %d: the syncer restarted again during recovery; recovering again", self.learner_id)

  def _apply_recovery(self, plan: RecoveryPlan, items: list[InFlight], vectors: dict) -> None:
    """Apply a recovery plan; every process of a learner applies the same one."""
    taken_back = 0
    for f in plan.fragments:
      p, item = f.fragment, items[f.sync_index] if f.sync_index >= 0 else None
      if f.action == Action.RESULT:
        result = item.future.result() if item.future is not None else None
        vec = self.strategy.share(result.global_vec if result is not None else None, p)
        self.adopt_result(item, SyncResult(p, f.version, vec, late=f.late, kind=f.kind, base_version=f.base_version,
                                           epoch=f.epoch, receipt=result.receipt if result is not None else None))
        continue
      vec = self.strategy.share(vectors.get(p), p) if f.action in (Action.ADOPT, Action.REBASE) else None
      if f.action == Action.ADOPT:
        self.adopt(SyncResult(p, f.version, vec, late=False, epoch=f.epoch), item.snapshot)
      elif f.action == Action.KEEP:
        self.base_version[p], self.base_epoch[p] = f.version, plan.epoch
      else:
        self.fragments.rebase(p, vec)
        self.base_version[p], self.base_epoch[p] = f.version, f.epoch
        self.stats.rebased += 1
      self._merged[p].clear()
      self.steps_since[p] += f.steps
      self.tokens_since[p] += f.tokens
      taken_back += f.steps
    self.in_flight.clear()
    if self.comms is not None:
      self.comms.set_epoch(plan.epoch)
    self.stats.recoveries += 1
    self.stats.steps_taken_back += taken_back
    log.warning("learner %d: syncer restarted (epoch %d); %s; %d steps to push again", self.learner_id, plan.epoch,
                ", ".join(f"fragment {f.fragment}: {f.action.value} v{self.base_version[f.fragment]}"
                          for f in plan.fragments), taken_back)

  # -- steps and the end ---------------------------------------------------------------------------

  def train_step(self) -> None:
    t0 = time.perf_counter()
    tokens_before = self.trainer.tokens
    metrics = self.trainer.train_step()
    # Bound how far the host runs ahead of the device. Unbounded, asynchronous dispatch let the host loop
    # run up to a metrics fetch (train.log_every steps) ahead: a sync snapshotted at step s then came back
    # when the host was ten steps further on small_cpu, so tau = 2 overlapped half a period, and every
    # push was that much staler. max(1, tau) steps in the queue keep the device busy and tau meaningful.
    self._dispatched.append(metrics)
    if len(self._dispatched) > max(1, self.tau):
      jax.block_until_ready(self._dispatched.popleft())
    if self.pacer.active:
      # Emulated speed: the step must have finished on the device before its wall time is stretched.
      jax.block_until_ready(metrics)
      self.pacer.stretch(time.perf_counter() - t0)
    blocked_before = self.stats.blocked_s
    self.after_step(self.trainer.tokens - tokens_before)
    end = time.perf_counter()
    elapsed = end - t0 - (self.stats.blocked_s - blocked_before)
    self.stats.compute_s += elapsed
    pace = self.step_clock.lap(t0, end, self.stats.blocked_s)
    if self.comms is not None:
      self.comms.report_step_time(pace, self.trainer.step)

  def flush(self) -> None:
    """At the end of training: sync every fragment once more so the global model holds all local work,
    then wait for and adopt every result. A syncer restart meanwhile sends the lost work again."""
    while True:
      self.strategy.check_syncer()
      step = self.trainer.step
      for p in range(self.plan.num_fragments):
        if self.steps_since[p] > 0 and not any(item.fragment == p for item in self.in_flight):
          self._snapshot(p, step)
      if not self.in_flight:
        if not any(self.steps_since):
          return
        continue
      self.strategy.wait(self.in_flight[0])

  def close(self, leave: bool = True) -> None:
    if self.comms is not None:
      self.comms.close(leave=leave)
    self.trainer.close()


def run_learner(learner: Learner, *, on_step=None, should_stop=None) -> dict:
  """Join, train to `train.steps` with the outer loop, flush, checkpoint; returns this learner's summary.

  `on_step()` is called after every step (progress bars); `should_stop()` ends training early (a signal).
  Metrics go to `learner.log` (`trainer.run_loop`), with the learner's local eval loss.
  """
  config, trainer = learner.config, learner.trainer
  t0 = time.perf_counter()
  learner.join()
  eval_loss = trainer_lib.run_loop(
      trainer, learner.log, steps=config.train.steps, step_fn=learner.train_step,
      record_fields=lambda: {"learner": learner.learner_id, "blocked_s": learner.stats.blocked_s,
                             "versions": list(learner.base_version), "comm_bytes": summary_lib.wire_bytes(learner)},
      on_step=on_step, should_stop=learner.strategy.stop_predicate(should_stop),
      checkpoint_meta={"learner": learner.learner_id})
  learner.flush()
  trainer.save({"learner": learner.learner_id})
  return summary_lib.learner_summary(learner, time.perf_counter() - t0, eval_loss)

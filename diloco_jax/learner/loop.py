"""One Decoupled DiLoCo learner: the inner loop on its mesh slice, plus the outer schedule.

Between two inner steps the loop (never waiting on the network):
  1. adopts every merged global fragment that has arrived and is at least tau steps past its snapshot:
     theta_p <- alpha * theta_p + (1 - alpha) * (Theta_p + progress_p), and base_p <- Theta_p, where
     progress_p = theta_p - theta_p(snapshot) are the inner steps taken since the snapshot when
     `outer.keep_local_progress` (the default; without it those tau steps of work are overwritten, as in
     Streaming DiLoCo with alpha = 0). AdamW state is kept;
  2. for each fragment due at this step (`schedule.due_fragments`: s mod H == offset(p) when periodic),
     computes the outer gradient
     base_p - theta_p on the device into one flat vector, starts its copy to the host, and hands it to
     the comms worker, which encodes, pushes and fetches the merged result in the background.
It waits only when `outer.max_in_flight` fragments are already in flight, or when a fragment falls due
again before its previous sync came back; that wait is counted as blocked time. With tau = 0 the learner
adopts at the snapshot's own step boundary (synchronous DiLoCo), so it waits for every merge.

Catching up. A learner that was away (stopped, swapped out, starved of its host) while the others trained
finds the global model moved on without it: every fragment it did not sync meanwhile is many rounds
behind the ones it adopts as their syncs come back. Training on such a mix of fresh and stale fragments
(until each falls due) makes outer gradients that mostly fit the fresh fragments to the stale ones:
large, wrong, and refused as outliers. The learner sees it in the versions, not on a clock: when an
adopted fragment jumped more than `CATCH_UP_PERIODS` times the rounds a sync of its usually spans (the
median of its recent jumps; before it has a few, the number of learners: K = 1 closes about one round
per learner and period), the others did several of its periods' work meanwhile. Then, at that same step
boundary, it settles its syncs in flight, syncs every fragment it holds work for, and adopts them all at
once (its work from before the absence goes out as usual). Versions, unlike wall time, are not fooled by
asynchronous dispatch, evals, compilations or a busy host that slows everyone alike, and a slow learner's
jumps are its usual ones. Every process of a multi-host learner adopts the same versions, so each
reaches the same decision by itself.

The base (the global fragments last adopted) lives on the device, sharded like the parameters: the host
only ever holds the fragments in flight.

Syncer restarts (docs/operations.md, "Recovery"). When the comms see another syncer epoch, the learner
recovers at the next step boundary (`_recover`): it rejoins, learns the lifetimes the restored global
model went through, and for each fragment
  * adopts the restored global fragment (keeping its steps since the snapshot) if its push in flight is
    in the restored model (merged before the checkpoint the syncer restored);
  * else takes back that push's steps and tokens, to push them again, and
      - keeps its base if the restored model's history still holds it (renamed in the new numbering): its
        next outer gradient carries all its work since that base;
      - rebases onto the restored global fragment otherwise (its base came from merges the crash lost):
        base_p <- Theta_p with theta_p unchanged, so its next outer gradient Theta_p - theta_p carries its
        own unmerged work and the lost merges it had adopted, whose steps and tokens it takes back too.
Nothing waits on an event that may never come: a sync in flight gives up on a merged fragment from a dead
syncer as soon as another epoch shows up. Work pushed again goes out as a new push (a new idempotency
sequence, `learner/comms.py`): to the restored syncer it is new work, never a duplicate of the lost push.
The process that talks to the syncer decides the recovery (`_recovery_decision`); every process of a
multi-host learner applies the same decision (`_apply_recovery`, learner/group.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import statistics
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from diloco_jax import config as config_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.outer import schedule as schedule_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.protocol import messages as protocol
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.learner.comms import Comms, SyncResult
from diloco_jax.learner.pace import StepPacer

log = logging.getLogger(__name__)

RECEIPT_LOG = 64  # accepted pushes remembered per fragment (their work is pushed again if a crash lost it)
CATCH_UP_PERIODS = 5  # a version jump this many times the usual one means the learner was away (docstring)
_JUMP_HISTORY = 16  # recent version jumps of adopted fragments; their median is the usual jump
_JUMP_WARMUP = 3  # jumps needed before their median is trusted (before: learners.num)


@dataclasses.dataclass
class InFlight:
  fragment: int
  snapshot_step: int
  snapshot: jax.Array  # the outer gradient pushed (on the device): locates theta at the snapshot
  future: object  # concurrent.futures.Future[SyncResult]
  steps: int = 0  # the inner steps and tokens the push carries
  tokens: int = 0


@dataclasses.dataclass(frozen=True)
class _Merged:
  """An accepted push whose merged fragment the learner adopted."""

  epoch: int
  round: int
  steps: int
  tokens: int


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
  catch_ups: int = 0  # absences after which every fragment was synced at once (module docstring)
  # Inner steps between a sync's snapshot and the adoption of its merged result, summed over adoptions:
  # the overlap a run actually had (at least tau; more when merges come back later).
  adopt_lag_steps: int = 0


def _take(leaf, shape, a: int, b: int):
  """The piece [a, b) of a leaf's flattened elements as a flat vector (whole rows sliced as rows)."""
  row = math.prod(shape[1:]) if len(shape) > 1 else 1
  if a == 0 and b == math.prod(shape):
    return leaf.reshape(-1)
  if a % row == 0 and b % row == 0:
    return leaf[a // row:b // row].reshape(-1)
  return leaf.reshape(-1)[a:b]


def _put(leaf, shape, a: int, b: int, values):
  """`leaf` with the piece [a, b) of its flattened elements replaced by the flat `values`."""
  row = math.prod(shape[1:]) if len(shape) > 1 else 1
  if a == 0 and b == math.prod(shape):
    return values.reshape(shape)
  if a % row == 0 and b % row == 0:
    return leaf.at[a // row:b // row].set(values.reshape((b - a) // row, *shape[1:]))
  return leaf.reshape(-1).at[a:b].set(values).reshape(shape)


def _fragment_fns(plan: fragments_lib.FragmentPlan, p: int, mesh, param_shardings):
  """Jitted (outer_gradient, {"full": adopt, "delta": adopt_delta}) for fragment p, on the leaves that
  hold its pieces only (`fragment_leaves`: a tuple in plan order; the rest of the state is not passed,
  so a call costs the fragment's leaves, not the model's).

  `outer_gradient(base, params)` -> the flat float32 vector base - params over the fragment's pieces.
  `adopt(params, base, global_vec, snapshot_vec, alpha, keep_progress)` -> (params, base) takes the new
  global fragment; `adopt_delta` takes the syncer's delta and rebuilds the global fragment as base + delta,
  one float32 add per element: the same IEEE operation as the syncer's numpy reference update, so the base
  stays bitwise equal to its reference. A fragment is a list of pieces of leaves (whole leaves unless the
  plan split them, `fragments.py`): each function reads and writes only its fragment's pieces.
  """
  pieces = plan.pieces(p)
  sizes = [b - a for _, _, a, b in pieces]
  replicated = mesh_lib.replicated(mesh)
  shardings = tuple(fragments_lib.flatten(param_shardings)[k] for k, *_ in pieces)

  def outer_gradient(base, params):
    return jnp.concatenate([(_take(b, shape, lo, hi) - _take(t, shape, lo, hi)).astype(jnp.float32)
                            for b, t, (_, shape, lo, hi) in zip(base, params, pieces)])

  def split(vec):
    return jnp.split(vec, np.cumsum(sizes)[:-1])

  def mix(params, base, new_global, snapshot_vec, alpha, keep_progress):
    # progress = theta - theta_snapshot, with theta_snapshot = base - snapshot_delta (old base).
    out_params, out_base = [], []
    for theta, old_base, (_, shape, lo, hi), v, snap in zip(params, base, pieces, new_global, split(snapshot_vec)):
      th, ob = _take(theta, shape, lo, hi), _take(old_base, shape, lo, hi)
      mixed = (alpha * th + (1.0 - alpha) * (v + keep_progress * (th - ob + snap))).astype(th.dtype)
      out_params.append(_put(theta, shape, lo, hi, mixed))
      out_base.append(_put(old_base, shape, lo, hi, v.astype(ob.dtype)))
    return tuple(out_params), tuple(out_base)

  def adopt(params, base, global_vec, snapshot_vec, alpha, keep_progress):
    return mix(params, base, split(global_vec), snapshot_vec, alpha, keep_progress)

  def adopt_delta(params, base, delta_vec, snapshot_vec, alpha, keep_progress):
    new_global = [_take(b, shape, lo, hi).astype(jnp.float32) + d
                  for b, (_, shape, lo, hi), d in zip(base, pieces, split(delta_vec))]
    return mix(params, base, new_global, snapshot_vec, alpha, keep_progress)

  grad_fn = jax.jit(outer_gradient, in_shardings=(shardings, shardings), out_shardings=replicated)
  adopt_fns = {
      kind: jax.jit(fn, in_shardings=(shardings, shardings, replicated, replicated, None, None),
                    out_shardings=(shardings, shardings), donate_argnums=(0, 1))
      for kind, fn in ((protocol.Kind.FULL, adopt), (protocol.Kind.DELTA, adopt_delta))
  }
  return grad_fn, adopt_fns


class Learner:
  """A learner unit: a `MeshTrainer` on its device slice and the outer loop around it."""

  def __init__(self, config, learner_id: int, devices: Sequence[jax.Device], transport, fingerprint: str,
               workdir: str | None, *, metrics_log=None, async_checkpoints: bool = True,
               checkpoint_dir: str | None = None):
    config = config_lib.resolve(config)  # the run's RunSpec passes as it is; a config (tests, tools) resolves here
    self.config, self.learner_id = config, learner_id
    outer = config.outer
    num_learners = config.learners.num
    self.trainer = trainer_lib.MeshTrainer(
        config, devices, workdir, batch_size=config.learners.batches[learner_id % num_learners],
        num_shards=num_learners, shard_index=learner_id % num_learners, async_checkpoints=async_checkpoints,
        checkpoint_dir=checkpoint_dir, train_cfg=config.learners.inner)
    self.pacer = StepPacer.from_spec(config, learner_id % num_learners)
    self.restored = self.trainer.restore()
    self.plan = fragments_lib.plan_for_config(self.trainer.state.params, config)
    self.max_in_flight = config.outer.max_in_flight
    mesh, sh = self.trainer.mesh, self.trainer.shardings
    self._fns = [_fragment_fns(self.plan, p, mesh, sh.params) for p in range(self.plan.num_fragments)]
    keys = fragments_lib.leaf_keys(self.trainer.state.params)
    self._keys = [tuple(keys[k] for k in self.plan.paths[p]) for p in range(self.plan.num_fragments)]
    self._replicated = mesh_lib.replicated(mesh)
    # The base starts as a device copy of the initial parameters; the syncer starts from the same ones.
    self.base = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=sh.params)(self.trainer.state.params)
    # No transport: a process of a multi-host learner other than process 0 (learner/group.py).
    self.comms = None if transport is None else Comms(
        transport, learner_id, fingerprint, codec=outer.codec, downlink_codec=outer.downlink_codec,
        block=outer.codec_block, sizes=tuple(self.plan.size(p) for p in range(self.plan.num_fragments)),
        max_in_flight=self.max_in_flight, heartbeat_s=config.outer.heartbeat_s,
        step_group=max(8, config.train.log_every))
    # The end of the previous step and the blocked time by then: a step's reported time runs from there
    # (the loop's metrics fetches and evals between steps are part of its pace; `Comms.report_step_time`).
    self._last_step_end: float | None = None
    self._blocked_by_last_end = 0.0
    # The steps dispatched but maybe not run yet: at most max(1, tau) (`train_step`).
    self._dispatched: collections.deque = collections.deque()
    self.base_version = [0] * self.plan.num_fragments
    # The syncer epoch each base came from (0: none yet; version 0 is the seed's, the same in every epoch).
    self.base_epoch = [0] * self.plan.num_fragments
    self.steps_since = [0] * self.plan.num_fragments
    self.tokens_since = [0] * self.plan.num_fragments
    self.in_flight: collections.deque[InFlight] = collections.deque()
    self._merged = [collections.deque(maxlen=RECEIPT_LOG) for _ in range(self.plan.num_fragments)]
    self._blocked_depth = 0
    self.stats = LearnerStats()
    self.log = metrics_log
    self._tau = outer.tau
    self._alpha = float(outer.alpha)
    self._keep_progress = bool(outer.keep_local_progress)
    self._zeros = [jax.device_put(np.zeros(self.plan.size(p), np.float32), self._replicated)
                   for p in range(self.plan.num_fragments)]
    self._absent = False  # an absence seen and not yet caught up with
    self._jumps: collections.deque[int] = collections.deque(maxlen=_JUMP_HISTORY)

  # -- joining -------------------------------------------------------------------------------------

  def join(self) -> None:
    """Joins the syncer; a learner that resumes or rejoins a run in progress adopts every current global
    fragment first, so its next pushes are outer gradients against the global model."""
    self.comms.report_step(self.trainer.step)
    versions = self.comms.join()
    self.comms.set_epoch(versions.epoch)
    # The seed's fragments (version 0), named in this syncer's numbering.
    self.base_epoch = [versions.epoch] * self.plan.num_fragments
    if self.restored or any(v > 0 for v in versions.versions.values()):
      for p in range(self.plan.num_fragments):
        # have_version -1: whatever base this process holds (restored, or the seed's) may not be the
        # syncer's reference of any version, so take the full fragment.
        published, vec = self.comms.fetch(p, 0, have_version=-1)
        self._adopt(SyncResult(p, published.version, vec, late=False, epoch=published.epoch), snapshot=None)

  # -- the outer schedule --------------------------------------------------------------------------

  def _adopt(self, result: SyncResult, snapshot: jax.Array | None) -> None:
    """Adopt a merged global fragment. With a `snapshot` and `outer.keep_local_progress`, the inner steps
    taken since the snapshot are kept on top of it; without one (joining), the global overwrites."""
    p = result.fragment
    _, adopt_fns = self._fns[p]
    if result.kind == protocol.Kind.DELTA and result.base_version != self.base_version[p]:
      # Adding a delta to another base would silently corrupt the model for good.
      raise RuntimeError(f"learner {self.learner_id}: fragment {p} delta from v{result.base_version}, "
                         f"but the base is v{self.base_version[p]}")
    if result.kind == protocol.Kind.DELTA and result.base_version > 0 and result.epoch != self.base_epoch[p]:
      # The same version number from a restarted syncer names another reference.
      raise RuntimeError(f"learner {self.learner_id}: fragment {p} delta from syncer epoch {result.epoch}, "
                         f"but the base is from epoch {self.base_epoch[p]}")
    adopt_fn = adopt_fns[result.kind]
    vec = result.global_vec  # to the devices as the jitted function's replicated argument
    keep = float(self._keep_progress and snapshot is not None)
    if snapshot is None:
      snapshot = self._zeros[p]
    state, keys = self.trainer.state, self._keys[p]
    params, base = adopt_fn(fragments_lib.get_leaves(state.params, keys), fragments_lib.get_leaves(self.base, keys),
                            vec, snapshot, self._alpha, keep)
    self.base = fragments_lib.set_leaves(self.base, keys, base)
    self.trainer.set_state(dataclasses.replace(state, params=fragments_lib.set_leaves(state.params, keys, params)))
    self.base_version[p] = result.version
    self.base_epoch[p] = result.epoch
    self.stats.adopted += 1
    self.stats.late_merges += int(result.late)

  def _adopt_result(self, item: InFlight, result: SyncResult) -> None:
    """Adopt the merged fragment of a sync in flight, remembering its receipt (a later restart may lose
    that merge; its work is then pushed again)."""
    self._note_jump(item.fragment, result)
    self._adopt(result, item.snapshot)
    self.stats.adopt_lag_steps += self.trainer.step - item.snapshot_step
    if result.receipt is not None:
      r = result.receipt
      self._merged[item.fragment].append(_Merged(r.epoch, r.round, item.steps, item.tokens))

  @contextlib.contextmanager
  def _blocked(self):
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

  def _wait(self, item: InFlight) -> None:
    """Wait for a sync in flight and adopt its result (or recover, if the syncer restarted meanwhile).
    The wait is bounded by the comms: a merged fragment, an abandoned sync (another epoch), or an error
    (the syncer unreachable past `comms.unreachable_deadline_s`)."""
    if item not in self.in_flight:
      return  # a recovery already settled it
    if not item.future.done():
      # Steps already dispatched are compute, not waiting: let the device finish them before the clock
      # starts (the comms thread's host copy of the snapshot waits for them too).
      jax.block_until_ready(self.trainer.state.params)
    with self._blocked():
      result = item.future.result()
      if result.abandoned:
        self._recover()
        return
    self.in_flight.remove(item)
    self._adopt_result(item, result)

  def _adopt_ready(self, step: int) -> None:
    for item in list(self.in_flight):
      if item not in self.in_flight or not item.future.done():
        continue
      result = item.future.result()
      if result.abandoned:
        self._recover()
        return
      if step >= item.snapshot_step + self._tau:
        self.in_flight.remove(item)
        self._adopt_result(item, result)

  def _snapshot(self, p: int, step: int) -> None:
    while True:
      same = [item for item in self.in_flight if item.fragment == p]
      if same:  # due again before its last sync came back
        self._wait(same[0])
      elif len(self.in_flight) >= self.max_in_flight:
        self._wait(self.in_flight[0])
      else:
        break
    grad_fn, _ = self._fns[p]
    keys = self._keys[p]
    delta = grad_fn(fragments_lib.get_leaves(self.base, keys), fragments_lib.get_leaves(self.trainer.state.params, keys))
    self.in_flight.append(InFlight(p, step, delta, self._start_sync(p, delta), self.steps_since[p],
                                   self.tokens_since[p]))
    self.steps_since[p] = self.tokens_since[p] = 0
    self.stats.syncs += 1
    if self._tau == 0:
      self._wait(self.in_flight[-1])

  def _start_sync(self, p: int, delta: jax.Array):
    """Hands fragment p's outer gradient to the comms worker; returns the future of its merged result."""
    delta.copy_to_host_async()
    return self.comms.sync(p, delta, self.base_version[p], self.steps_since[p], self.tokens_since[p],
                           base_epoch=self.base_epoch[p])

  def stop_predicate(self, should_stop):
    """The `should_stop` the loop polls between steps (a multi-host learner's is agreed by its processes)."""
    return should_stop

  # -- syncer restarts -----------------------------------------------------------------------------

  def _recover(self) -> None:
    """The syncer restarted: settle every sync in flight and every base against the restored model (module
    docstring, "Syncer restarts"). Blocks the inner loop (counted); the network calls are bounded like
    every other (a syncer unreachable past `comms.unreachable_deadline_s` fails the learner)."""
    with self._blocked():
      items = list(self.in_flight)
      decision, vectors = self._recovery_decision(items)
      self._apply_recovery(decision, items, vectors)

  def _recovery_decision(self, items: list[InFlight]) -> tuple[dict, dict[int, np.ndarray]]:
    """What the recovery does (the process that talks to the syncer decides; a multi-host learner hands
    the decision to its other processes, learner/group.py): a JSON-able decision and the fetched global
    fragments by fragment (host vectors)."""
    # Every sync in flight ends promptly once the comms saw the new epoch (abandoned, or merged before).
    results = [item.future.result() for item in items]
    while True:
      versions = self.comms.join()
      planned = self._plan_recovery(versions, items, results)
      if planned is not None:
        return planned
      log.warning("learner %d: the syncer restarted again during recovery; recovering again", self.learner_id)

  def _plan_recovery(self, versions, items: list[InFlight], results: list) -> tuple[dict, dict] | None:
    """The recovery against `versions` (a join's answer), per fragment [p, action, index of its sync in
    flight (-1: none), version, epoch, steps and tokens to push again, kind, base_version, late]; None if
    an answer meanwhile came from yet another epoch."""
    epoch, history = versions.epoch, versions.history
    n = self.plan.num_fragments
    in_flight = {item.fragment: (i, result) for i, (item, result) in enumerate(zip(items, results))}
    plan, fetch = {}, []
    for p in range(n):
      index, result = in_flight.get(p, (-1, None))
      if result is not None:
        if not result.abandoned and result.epoch == epoch:
          plan[p] = ["result", index, result.version, result.epoch, 0, 0, result.kind, result.base_version,
                     bool(result.late)]  # merged by the current syncer itself
          continue
        receipt = result.receipt
        if receipt is not None and protocol.merged_for_good(history, receipt.epoch, receipt.round, p):
          plan[p] = ["adopt", index, None, None, 0, 0]  # the restored model holds this push: adopt it
          fetch.append(p)
          continue
      # Its push (if any) is not in the restored model: push that work again.
      steps, tokens = (items[index].steps, items[index].tokens) if index >= 0 else (0, 0)
      renamed = protocol.current_version(history, self.base_epoch[p], self.base_version[p], p)
      if renamed is None and self.base_epoch[p] == 0 and self.base_version[p] == 0 and history:
        renamed = history[-1].version_offsets[p]  # the seed: the same in every lifetime
      if renamed is not None:
        plan[p] = ["keep", index, renamed, epoch, steps, tokens]
      else:
        # Adopted merges the crash lost are in theta but not in the restored global: rebasing makes the
        # next outer gradient carry them, so their steps and tokens count again.
        for m in self._merged[p]:
          if not protocol.merged_for_good(history, m.epoch, m.round, p):
            steps, tokens = steps + m.steps, tokens + m.tokens
        plan[p] = ["rebase", index, None, epoch, steps, tokens]
        fetch.append(p)
    vectors = {}
    for p in fetch:
      published, vec = self.comms.fetch(p, 0, have_version=-1)
      if published.epoch != epoch:
        return None
      plan[p][2:4] = [published.version, published.epoch]
      vectors[p] = vec
    return {"epoch": epoch, "fragments": [[p, *plan[p]] for p in range(n)]}, vectors

  def _recovery_vector(self, vec: np.ndarray | None, p: int):
    """A fetched global fragment on this learner's devices (a multi-host learner broadcasts it)."""
    return vec

  def _apply_recovery(self, decision: dict, items: list[InFlight], vectors: dict) -> None:
    """Apply a recovery decision (`_plan_recovery`); every process of a learner applies the same one."""
    epoch, taken_back = int(decision["epoch"]), 0
    for p, action, index, *rest in decision["fragments"]:
      item = items[index] if index >= 0 else None
      if action == "result":
        version, result_epoch, _, _, kind, base_version, late = rest
        result = item.future.result() if item.future is not None else None
        vec = self._recovery_vector(result.global_vec if result is not None else None, p)
        self._adopt_result(item, SyncResult(p, int(version), vec, late=bool(late), kind=str(kind),
                                            base_version=int(base_version), epoch=int(result_epoch),
                                            receipt=result.receipt if result is not None else None))
        continue
      version, version_epoch, steps, tokens = rest
      vec = self._recovery_vector(vectors.get(p), p) if action in ("adopt", "rebase") else None
      if action == "adopt":
        self._adopt(SyncResult(p, int(version), vec, late=False, epoch=int(version_epoch)), item.snapshot)
      elif action == "keep":
        self.base_version[p], self.base_epoch[p] = int(version), epoch
      else:
        self._rebase(p, vec)
        self.base_version[p], self.base_epoch[p] = int(version), int(version_epoch)
        self.stats.rebased += 1
      self._merged[p].clear()
      self.steps_since[p] += int(steps)
      self.tokens_since[p] += int(tokens)
      taken_back += int(steps)
    self.in_flight.clear()
    if self.comms is not None:
      self.comms.set_epoch(epoch)
    self.stats.recoveries += 1
    self.stats.steps_taken_back += taken_back
    log.warning("learner %d: syncer restarted (epoch %d); %s; %d steps to push again", self.learner_id, epoch,
                ", ".join(f"fragment {f[0]}: {f[1]} v{self.base_version[f[0]]}" for f in decision["fragments"]),
                taken_back)

  def _rebase(self, p: int, vec) -> None:
    """base_p <- vec, theta unchanged: the fragment's full adopt with alpha = 1 (theta exactly kept), a
    function already compiled (a restart must not wait for a compilation while others may wait for us)."""
    _, adopt_fns = self._fns[p]
    state, keys = self.trainer.state, self._keys[p]
    params, base = adopt_fns[protocol.Kind.FULL](fragments_lib.get_leaves(state.params, keys),
                                     fragments_lib.get_leaves(self.base, keys), vec, self._zeros[p], 1.0, 0.0)
    self.base = fragments_lib.set_leaves(self.base, keys, base)
    self.trainer.set_state(dataclasses.replace(state, params=fragments_lib.set_leaves(state.params, keys, params)))

  def check_syncer(self) -> None:
    """Recover now if the comms saw the syncer restart (called at every step boundary)."""
    if self.comms.epoch_changed():
      self._recover()

  def after_step(self, tokens: int) -> None:
    """The outer loop's work at a step boundary (after the inner step that just ran)."""
    cpu0 = time.thread_time()
    step = self.trainer.step
    for p in range(self.plan.num_fragments):
      self.steps_since[p] += 1
      self.tokens_since[p] += tokens
    self.check_syncer()
    self._adopt_ready(step)
    due = schedule_lib.due_fragments(self.plan, step)
    for p in due:
      self._snapshot(p, step)
    if self._absent:
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
      self._absent = False  # the catch-up's own adoptions jump too
      self.stats.catch_ups += 1
    self.stats.outer_cpu_s += time.thread_time() - cpu0

  def _settle_in_flight(self) -> None:
    while self.in_flight:
      self._wait(self.in_flight[0])

  def _note_jump(self, p: int, result: SyncResult) -> None:
    """Before adopting a sync's result: how many rounds fragment p moved since its base; a jump far beyond
    the usual one means the learner was away (module docstring, "Catching up")."""
    if result.epoch != self.base_epoch[p] or self.base_epoch[p] == 0:
      return  # another numbering (a syncer restart: recovery settles it), or no base yet
    jump = result.version - self.base_version[p]
    usual = statistics.median(self._jumps) if len(self._jumps) >= _JUMP_WARMUP else self.config.learners.num
    if jump > CATCH_UP_PERIODS * max(1.0, usual):
      self._absent = True
    else:
      self._jumps.append(jump)  # an absence's jump is not a usual one


  def train_step(self) -> None:
    t0 = time.perf_counter()
    tokens_before = self.trainer.tokens
    metrics = self.trainer.train_step()
    # Bound how far the host runs ahead of the device. Unbounded, asynchronous dispatch let the host loop
    # run up to a metrics fetch (train.log_every steps) ahead: a sync snapshotted at step s then came back
    # when the host was ten steps further on small_cpu, so tau = 2 overlapped half a period, and every
    # push was that much staler. max(1, tau) steps in the queue keep the device busy and tau meaningful.
    self._dispatched.append(metrics)
    if len(self._dispatched) > max(1, self._tau):
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
    since = t0 if self._last_step_end is None else self._last_step_end
    pace = end - since - (self.stats.blocked_s - self._blocked_by_last_end)
    self._last_step_end, self._blocked_by_last_end = end, self.stats.blocked_s
    if self.comms is not None:
      self.comms.report_step_time(pace, self.trainer.step)

  def flush(self) -> None:
    """At the end of training: sync every fragment once more so the global model holds all local work,
    then wait for and adopt every result. A syncer restart meanwhile sends the lost work again."""
    while True:
      self.check_syncer()
      step = self.trainer.step
      for p in range(self.plan.num_fragments):
        if self.steps_since[p] > 0 and not any(item.fragment == p for item in self.in_flight):
          self._snapshot(p, step)
      if not self.in_flight:
        if not any(self.steps_since):
          return
        continue
      self._wait(self.in_flight[0])

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
                             "versions": list(learner.base_version), "comm_bytes": _wire_bytes(learner)},
      on_step=on_step, should_stop=learner.stop_predicate(should_stop),
      checkpoint_meta={"learner": learner.learner_id})
  learner.flush()
  trainer.save({"learner": learner.learner_id})
  return learner_summary(learner, time.perf_counter() - t0, eval_loss)


def learner_summary(learner: Learner, wall_s: float, eval_loss: float | None) -> dict:
  """What `run_learner` returns: steps, tokens, time, syncs, traffic and the local eval loss."""
  stats, trainer = learner.stats, learner.trainer
  return {
      "learner": learner.learner_id, "steps": trainer.step, "tokens": trainer.tokens, "wall_s": wall_s,
      "blocked_s": stats.blocked_s, "compute_s": stats.compute_s,
      "compute_utilization": stats.compute_s / wall_s if wall_s > 0 else 0.0,
      "syncs": stats.syncs, "adopted": stats.adopted, "late_merges": stats.late_merges,
      "recoveries": stats.recoveries, "steps_taken_back": stats.steps_taken_back, "rebased": stats.rebased,
      "catch_ups": stats.catch_ups, "adopt_lag_steps": stats.adopt_lag_steps,
      **({"rejected_pushes": list(learner.comms.rejected), **learner.comms.traffic()} if learner.comms else {}),
      "local_eval_loss": eval_loss, "params": trainer.num_params, "batch_size": trainer.batch_size,
      "devices": len(trainer.mesh.devices.flat),
      **({"pace": learner.pacer.stats()} if learner.pacer.active else {}),
  }


def _wire_bytes(learner: Learner) -> int:
  """Bytes this learner has moved on the wire so far, both ways (its transport's count; 0 for a process
  of a multi-host learner that does not talk to the syncer)."""
  if learner.comms is None:
    return 0
  traffic = learner.comms.traffic()
  return traffic["bytes_sent"] + traffic["bytes_received"]

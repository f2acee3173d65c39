"""A learner whose mesh spans several processes (a TPU slice of several hosts): one learner, H processes.

Every process runs the same `Learner` loop on the same global mesh, so they dispatch the same jitted
computations in the same order. What depends on the network is decided by process 0, the only one with a
transport (it alone joins, pushes, pulls and heartbeats), and handed to the others at step boundaries:

* **where**: the points of the loop where a merged fragment may be adopted follow from state every process
  shares (the fragments in flight, their snapshot steps, tau), so all processes reach the same decision
  points in the same order and number them alike. Between them nothing is exchanged: a step with no
  fragment waiting to be adopted costs nothing. Every `train.log_every` steps a decision point also
  carries the stop flag (a signal on any process stops the learner at the same step everywhere). Catching
  up after an absence needs no message: it follows from the versions adopted, the same on every process.
* **what**: at a decision point process 0 looks at its futures and publishes one small message (which
  fragments in flight to adopt, their versions, kinds and epochs; or stop; or the error that ended it)
  through `multihost.HostChannel`; the others read it. Process 0 never waits for them.
* **the values**: each adopted fragment's vector goes from process 0's devices to every device of the
  learner in one collective (`multihost.Broadcaster`), not through N syncer connections.
* **syncer restarts**: process 0 alone sees another syncer epoch (its comms). It says so at the next
  decision point (an adoption, a blocked wait, or the stop check every `train.log_every` steps), and then
  decides the recovery (`Learner._recovery_decision`: adopt, keep or rebase per fragment, the work to push
  again) in one more decision that every process applies alike (`Learner._apply_recovery`), the fetched
  fragments broadcast like merged ones.

The outer gradient that process 0 pushes is its local copy of a replicated array (the whole vector). Data
(`MeshTrainer`) and checkpoints (orbax) are already per process.
"""

from __future__ import annotations

import concurrent.futures
import time

import jax

from diloco_jax.compute import multihost
from diloco_jax.learner import loop as loop_lib
from diloco_jax.learner.comms import SyncResult


class GroupLearner(loop_lib.Learner):
  """`Learner` on a mesh over the devices of several processes. Process 0 gets the transport; the others
  pass `transport=None` and follow process 0's decisions, read from `channel`."""

  def __init__(self, config, learner_id: int, devices, transport, fingerprint: str, workdir, *,
               channel: multihost.HostChannel, metrics_log=None, checkpoint_dir=None):
    self.channel = channel
    self.leader = channel.leader
    if self.leader != (transport is not None):
      raise ValueError("process 0 of a learner needs the transport, and only process 0")
    super().__init__(config, learner_id, devices, transport, fingerprint, workdir, metrics_log=metrics_log,
                     checkpoint_dir=checkpoint_dir)
    self._broadcast = multihost.Broadcaster(self.trainer.mesh)
    self._seq = 0
    self._local_stop = lambda: False
    self.stop_agreed = False
    self.decisions = 0
    # Host time in decisions: publishing them (process 0, whose waits for the syncer count as blocked_s
    # only), or waiting for and reading them (the others: this includes process 0's waits).
    self.decision_s = 0.0
    self.broadcasts = 0
    self.broadcast_s = 0.0  # host time spent dispatching the broadcasts of merged fragments

  # -- decisions -------------------------------------------------------------------------------------

  def _decide(self, make_message) -> dict:
    """One decision point: process 0 publishes `make_message()`, the others read it. If making it fails
    (process 0's syncer calls failed), the others are told before the error propagates."""
    seq, self._seq = self._seq, self._seq + 1
    t0 = time.perf_counter()
    if self.leader:
      try:
        message = make_message()
      except BaseException as e:
        self.channel.publish(seq, {"error": f"{type(e).__name__}: {e}"[:2000]})
        raise
      self.channel.publish(seq, message)
    else:
      message = self.channel.receive(seq)
    self.decisions += 1
    self.decision_s += time.perf_counter() - t0
    if "error" in message:
      raise RuntimeError(f"learner {self.learner_id}: process 0 failed: {message['error']}")
    return message

  def _vector(self, vec, fragment: int) -> jax.Array:
    """A merged fragment's vector (process 0 has it on its host; the others pass None), on every device
    of the learner."""
    t0 = time.perf_counter()
    out = self._broadcast(vec if self.leader else None, self.plan.size(fragment))
    self.broadcasts += 1
    self.broadcast_s += time.perf_counter() - t0
    return out

  def _adopt_decided(self, entries, items) -> None:
    """Adopt the results a decision names: entries [index into `items`, version, kind, base_version, epoch,
    late]; process 0 takes the vectors from its futures."""
    chosen = [items[int(entry[0])] for entry in entries]
    for entry, item in zip(entries, chosen):
      self.in_flight.remove(item)
      _, version, kind, base_version, epoch, late = entry
      local = item.future.result() if self.leader else None
      result = SyncResult(item.fragment, int(version),
                          self._vector(local.global_vec if local else None, item.fragment), late=bool(late),
                          kind=str(kind), base_version=int(base_version), epoch=int(epoch),
                          receipt=local.receipt if local else None)
      self._adopt_result(item, result)  # process 0 remembers the receipt (a restart may lose that merge)

  @staticmethod
  def _entry(index: int, result: SyncResult) -> list:
    return [index, result.version, result.kind, result.base_version, result.epoch, bool(result.late)]

  # -- the Learner's decision points ---------------------------------------------------------------

  def join(self) -> None:
    fetched = {}  # on process 0: fragment -> (published header, vector)

    def message():
      self.comms.report_step(self.trainer.step)
      versions = self.comms.join()
      self.comms.set_epoch(versions.epoch)
      if self.restored or any(v > 0 for v in versions.versions.values()):
        for p in range(self.plan.num_fragments):
          fetched[p] = self.comms.fetch(p, 0, have_version=-1)
      return {"epoch": versions.epoch,
              "join": [[p, published.version, published.epoch] for p, (published, _) in fetched.items()]}

    decided = self._decide(message)
    # The seed's fragments (version 0), named in this syncer's numbering.
    self.base_epoch = [int(decided["epoch"])] * self.plan.num_fragments
    for p, version, epoch in decided["join"]:
      vec = self._vector(fetched[p][1] if self.leader else None, p)
      self._adopt(SyncResult(p, version, vec, late=False, epoch=epoch), snapshot=None)

  def stop_predicate(self, should_stop):
    self._local_stop = should_stop or (lambda: False)
    return lambda: self.stop_agreed

  def _adopt_ready(self, step: int) -> None:
    items = list(self.in_flight)
    candidates = [i for i, item in enumerate(items) if step >= item.snapshot_step + self._tau]
    check_stop = step % self.config.train.log_every == 0
    if not candidates and not check_stop:
      return
    if check_stop and not self.leader and self._local_stop():
      self.channel.request_stop()

    def message():
      stop = check_stop and (self._local_stop() or self.channel.stop_requested())
      if self._restarted(items):
        return {"adopt": [], "stop": stop, "recover": True}
      ready = [i for i in candidates if items[i].future.done()]
      return {"adopt": [self._entry(i, items[i].future.result()) for i in ready], "stop": stop}

    decided = self._decide(message)
    self.stop_agreed = self.stop_agreed or bool(decided.get("stop"))
    if decided.get("recover"):
      self._recover()
      return
    self._adopt_decided(decided["adopt"], items)

  def _wait(self, item: loop_lib.InFlight) -> None:
    if item not in self.in_flight:
      return  # a recovery already settled it (the same on every process)
    items = list(self.in_flight)
    if self.leader and not item.future.done():
      jax.block_until_ready(self.trainer.state.params)  # as Learner._wait: dispatched steps are compute
    with self._blocked():
      if self.leader:  # the blocked wait; an error it ends in goes to the others with the decision
        concurrent.futures.wait([item.future])

      def message():
        if item.future.result().abandoned:
          return {"adopt": [], "recover": True}
        return {"adopt": [self._entry(items.index(item), item.future.result())]}

      decided = self._decide(message)
      if decided.get("recover"):
        self._recover()
        return
    self._adopt_decided(decided["adopt"], items)

  # -- syncer restarts (process 0 decides, every process applies) ---------------------------------------

  def _restarted(self, items) -> bool:
    """On process 0: the syncer restarted (another epoch seen, or a sync in flight abandoned)."""
    return self.comms.epoch_changed() or any(
        item.future.done() and item.future.result().abandoned for item in items)

  def check_syncer(self) -> None:
    """Restarts are noticed at decision points (`_adopt_ready`, `_wait`): no extra decision per step."""

  def _recover(self) -> None:
    with self._blocked():
      items = list(self.in_flight)
      vectors = {}  # on process 0: the fetched fragments

      def message():
        decision, fetched = self._recovery_decision(items)
        vectors.update(fetched)
        return {"recover": decision}

      decision = self._decide(message)["recover"]
      self._apply_recovery(decision, items, vectors)

  def _recovery_vector(self, vec, p: int):
    return self._vector(vec if self.leader else None, p)

  def _start_sync(self, p: int, delta: jax.Array):
    if not self.leader:
      return None
    # The snapshot is replicated: process 0's own copy is the whole vector, and only it goes to the host.
    return super()._start_sync(p, multihost.local_replica(delta))

  def group_stats(self) -> dict:
    return {"processes": self.channel.num_processes, "decisions": self.decisions,
            "decision_s": self.decision_s, "broadcasts": self.broadcasts, "broadcast_s": self.broadcast_s}

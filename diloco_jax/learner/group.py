"""The strategy of a learner whose mesh spans several processes (a TPU slice of several hosts): one learner,
H processes, each running the same `Learner` loop on the same global mesh. Process 0 alone has a transport
and decides what depends on the network; the others follow (docs/architecture.md, "Processes and threads of
a multi-host learner"):

* where: the decision points follow from state every process shares (the syncs in flight, their snapshot
  steps, tau), so all reach them in the same order and number them alike; a step with no fragment to adopt
  exchanges only the stop flag (every step: a stop is agreed within a step, well inside the shutdown grace).
* what: process 0 publishes one small message per decision (`multihost.HostChannel`); the others read it.
  A syncer restart is said at the next decision point, then the recovery plan is one more decision.
* the values: each adopted fragment goes from process 0's host to every device of the learner, and each
  outer gradient pushed from the devices to process 0's host, chunk by chunk, never whole on one device
  (`multihost.Broadcaster`).
Catching up after an absence needs no message: it follows from the versions adopted, the same everywhere.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import TYPE_CHECKING

import jax
import numpy as np

from diloco_jax.compute import multihost
from diloco_jax.learner.comms import SyncResult
from diloco_jax.protocol.messages import Kind

if TYPE_CHECKING:
  from diloco_jax.learner.loop import InFlight, Learner


class ProcessGroup:
  """The `Strategy` of one process of a multi-host learner: process 0 (which has the transport) decides and
  publishes through `channel`, the others read its decisions there."""

  def __init__(self, channel: multihost.HostChannel):
    self.channel = channel
    self.leader = channel.leader
    self._learner: Learner | None = None
    self._broadcast: multihost.Broadcaster | None = None
    self._seq = 0
    self._local_stop = lambda: False
    self.stop_agreed = False
    self.decisions = 0
    # Host time in decisions: publishing them (process 0, whose waits for the syncer count as blocked_s
    # only), or waiting for and reading them (the others: this includes process 0's waits).
    self.decision_s = 0.0
    self.broadcasts = 0
    self.broadcast_s = 0.0  # host time spent dispatching the broadcasts of merged fragments

  def attach(self, learner: Learner) -> None:
    self._learner = learner
    self._broadcast = multihost.Broadcaster(learner.trainer.mesh)

  # -- decisions and values --------------------------------------------------------------------------

  def decide(self, make_message) -> dict:
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
      raise RuntimeError(f"learner {self._learner.learner_id}: process 0 failed: {message['error']}")
    return message

  def share(self, vec, fragment: int) -> tuple[jax.Array, ...]:
    """A fragment's vector (process 0 has it on its host; the others pass None), on every device of the
    learner: its pieces, sharded like the parameters (`Broadcaster.pieces`)."""
    t0 = time.perf_counter()
    fragments = self._learner.fragments
    out = self._broadcast.pieces(vec if self.leader else None, fragments.shapes[fragment],
                                 fragments.shardings[fragment])
    self.broadcasts += 1
    self.broadcast_s += time.perf_counter() - t0
    return out

  def pushed(self, delta: tuple[jax.Array, ...]) -> np.ndarray | None:
    # The snapshot is sharded over every process's devices: process 0 gathers it to its host chunk by chunk,
    # and every process takes part in the same transfers (`Broadcaster.gather`).
    return self._broadcast.gather(delta)

  def _adopt_decided(self, entries, items) -> None:
    """Adopt the results a decision names: entries [index into `items`, version, kind, base_version, epoch,
    late, phase_steps]; process 0 takes the vectors from its futures."""
    learner = self._learner
    chosen = [items[int(entry[0])] for entry in entries]
    for entry, item in zip(entries, chosen):
      learner.in_flight.remove(item)
      _, version, kind, base_version, epoch, late, phase_steps = entry
      local = item.future.result() if self.leader else None
      result = SyncResult(item.fragment, int(version),
                          self.share(local.global_vec if local else None, item.fragment), late=bool(late),
                          kind=Kind(kind), base_version=int(base_version), epoch=int(epoch),
                          receipt=local.receipt if local else None, phase_steps=float(phase_steps))
      learner.adopt_result(item, result)  # process 0 remembers the receipt (a restart may lose that merge)

  @staticmethod
  def _entry(index: int, result: SyncResult) -> list:
    return [index, result.version, result.kind, result.base_version, result.epoch, bool(result.late),
            float(result.phase_steps)]

  # -- the decision points ---------------------------------------------------------------------------

  def join(self) -> None:
    learner = self._learner
    fetched = {}  # on process 0: fragment -> (published header, vector)

    def message():
      comms = learner.comms
      comms.report_step(learner.trainer.step)
      versions = comms.join()
      comms.set_epoch(versions.epoch)
      if learner.restored or any(v > 0 for v in versions.versions.values()):
        for p in range(learner.plan.num_fragments):
          fetched[p] = comms.fetch(p, 0, have_version=-1)
      return {"epoch": versions.epoch,
              "join": [[p, published.version, published.epoch] for p, (published, _) in fetched.items()]}

    decided = self.decide(message)
    # The seed's fragments (version 0), named in this syncer's numbering.
    learner.base_epoch = [int(decided["epoch"])] * learner.plan.num_fragments
    for p, version, epoch in decided["join"]:
      vec = self.share(fetched[p][1] if self.leader else None, p)
      learner.adopt(SyncResult(p, version, vec, late=False, epoch=epoch), snapshot=None)

  def stop_predicate(self, should_stop):
    self._local_stop = should_stop or (lambda: False)
    return lambda: self.stop_agreed

  def adopt_ready(self, step: int) -> None:
    learner = self._learner
    items = list(learner.in_flight)
    candidates = [i for i, item in enumerate(items) if step >= item.snapshot_step + learner.tau]
    # A decision at every step, for the stop flag: agreed every `log_every` steps instead, a stop took ~88 s
    # on b12, against a 30 s shutdown grace.
    if not self.leader and self._local_stop():
      self.channel.request_stop()

    def message():
      stop = self._local_stop() or self.channel.stop_requested()
      if self._restarted(items):
        return {"adopt": [], "stop": stop, "recover": True}
      ready = [i for i in candidates if items[i].future.done()]
      return {"adopt": [self._entry(i, items[i].future.result()) for i in ready], "stop": stop}

    decided = self.decide(message)
    self.stop_agreed = self.stop_agreed or bool(decided.get("stop"))
    if decided.get("recover"):
      learner.recover()
      return
    self._adopt_decided(decided["adopt"], items)

  def wait(self, item: InFlight) -> None:
    learner = self._learner
    if item not in learner.in_flight:
      return  # a recovery already settled it (the same on every process)
    items = list(learner.in_flight)
    if self.leader and not item.future.done():
      jax.block_until_ready(learner.trainer.state.params)  # as SingleProcess.wait: dispatched steps are compute
    with learner.blocked():
      if self.leader:  # the blocked wait; an error it ends in goes to the others with the decision
        concurrent.futures.wait([item.future])

      def message():
        if item.future.result().abandoned:
          return {"adopt": [], "recover": True}
        return {"adopt": [self._entry(items.index(item), item.future.result())]}

      decided = self.decide(message)
      if decided.get("recover"):
        learner.recover()
        return
    self._adopt_decided(decided["adopt"], items)

  def _restarted(self, items) -> bool:
    """On process 0: the syncer restarted (another epoch seen, or a sync in flight abandoned)."""
    return self._learner.comms.epoch_changed() or any(
        item.future.done() and item.future.result().abandoned for item in items)

  def check_syncer(self) -> None:
    """Restarts are noticed at decision points (`adopt_ready`, `wait`): no extra decision per step."""

  def stats(self) -> dict:
    return {"processes": self.channel.num_processes, "decisions": self.decisions,
            "decision_s": self.decision_s, "broadcasts": self.broadcasts, "broadcast_s": self.broadcast_s}

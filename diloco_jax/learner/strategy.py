"""Who decides what a learner does at the points of its loop that depend on the network: the `Strategy` a
`Learner` is given. `SingleProcess` (the default): the learner's one process talks to the syncer and
decides alone. `group.ProcessGroup`: a learner spanning several processes, where process 0 decides and the
others follow. The `Learner` calls its strategy at the same points in the same order on every process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import jax
import numpy as np

from diloco_jax.learner.comms import SyncResult

if TYPE_CHECKING:
  from diloco_jax.learner.loop import InFlight, Learner


class Strategy(Protocol):
  """The decision points of a `Learner` (it calls `attach(self)` once built)."""

  leader: bool  # this process talks to the syncer (it has the transport)
  stop_agreed: bool  # the learner's processes agreed to stop (a stop asked on any of them)

  def attach(self, learner: Learner) -> None:
    """The learner this strategy decides for (once its trainer is built)."""

  def join(self) -> None:
    """Join the syncer; adopt every current global fragment first when resuming or rejoining."""

  def stop_predicate(self, should_stop: Callable[[], bool] | None) -> Callable[[], bool] | None:
    """The `should_stop` the training loop polls between steps, from the caller's."""

  def check_syncer(self) -> None:
    """At every step boundary: recover now if the syncer restarted (where this strategy notices it)."""

  def adopt_ready(self, step: int) -> None:
    """At a step boundary: adopt the syncs in flight that came back and are at least tau steps old."""

  def wait(self, item: InFlight) -> None:
    """Wait for a sync in flight and adopt its result (or recover, if the syncer restarted meanwhile)."""

  def decide(self, make_message: Callable[[], dict]) -> dict:
    """A decision every process of the learner takes alike: `make_message()` where the syncer is reached."""

  def share(self, vec: np.ndarray | None, fragment: int):
    """A fetched global fragment's vector (this process's, if it reached the syncer), for adoption: a host
    vector, or the fragment's pieces on the devices (`device.DeviceFragments.adopt` takes either)."""

  def pushed(self, delta: tuple[jax.Array, ...]) -> tuple[jax.Array, ...] | np.ndarray | None:
    """What this process pushes of a fragment's outer gradient (its pieces on the devices, sharded like the
    parameters): the pieces, or their flat host vector; None: it pushes none."""

  def stats(self) -> dict:
    """Counters for the learner's summary."""


class SingleProcess:
  """A learner in one process: it talks to the syncer and decides alone."""

  leader = True
  stop_agreed = False

  def __init__(self):
    self._learner: Learner | None = None

  def attach(self, learner: Learner) -> None:
    self._learner = learner

  def join(self) -> None:
    learner = self._learner
    comms, n = learner.comms, learner.plan.num_fragments
    comms.report_step(learner.trainer.step)
    versions = comms.join()
    comms.set_epoch(versions.epoch)
    # The seed's fragments (version 0), named in this syncer's numbering.
    learner.base_epoch = [versions.epoch] * n
    if learner.restored or any(v > 0 for v in versions.versions.values()):
      for p in range(n):
        # have_version -1: whatever base this process holds (restored, or the seed's) may not be the
        # syncer's reference of any version, so take the full fragment.
        published, vec = comms.fetch(p, 0, have_version=-1)
        learner.adopt(SyncResult(p, published.version, vec, late=False, epoch=published.epoch), snapshot=None)

  def stop_predicate(self, should_stop):
    return should_stop

  def check_syncer(self) -> None:
    if self._learner.comms.epoch_changed():
      self._learner.recover()

  def adopt_ready(self, step: int) -> None:
    learner = self._learner
    for item in list(learner.in_flight):
      if item not in learner.in_flight or not item.future.done():
        continue
      result = item.future.result()
      if result.abandoned:
        learner.recover()
        return
      if step >= item.snapshot_step + learner.tau:
        learner.in_flight.remove(item)
        learner.adopt_result(item, result)

  def wait(self, item: InFlight) -> None:
    """The wait is bounded by the comms: a merged fragment, an abandoned sync (another epoch), or an error
    (the syncer unreachable past `comms.unreachable_deadline_s`)."""
    learner = self._learner
    if item not in learner.in_flight:
      return  # a recovery already settled it
    if not item.future.done():
      # Steps already dispatched are compute, not waiting: let the device finish them before the clock
      # starts (the comms thread's host copy of the snapshot waits for them too).
      jax.block_until_ready(learner.trainer.state.params)
    with learner.blocked():
      result = item.future.result()
      if result.abandoned:
        learner.recover()
        return
    learner.in_flight.remove(item)
    learner.adopt_result(item, result)

  def decide(self, make_message: Callable[[], dict]) -> dict:
    return make_message()

  def share(self, vec: np.ndarray | None, fragment: int):
    return vec  # each device receives its shards of it as the jitted adoption's argument

  def pushed(self, delta: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    return delta  # this process addresses every shard: the comms worker copies them to the host

  def stats(self) -> dict:
    return {}

"""A learner's transport to a `SyncerCore` in the same process (tests, `train`, benchmarks).

It implements `protocol.Transport` by calling the core directly; the gRPC client implements the same
interface over the network, and the learner does not know which one it has.
"""

from __future__ import annotations

from diloco_jax.protocol.interfaces import SyncerAPI
from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions
from diloco_jax.transports.traffic import Traffic


class InProcessTransport:
  """One learner's transport to a core shared in-process. Counts payload bytes both ways; a refused push
  still counts as sent (it crossed the "wire")."""

  def __init__(self, core: SyncerAPI):
    self.core = core
    self._traffic = Traffic()  # updated from a learner's several threads
    self._learner_id: int | None = None  # set by `join`: names the reference a pull holds (syncer/downlink.py)

  @property
  def bytes_sent(self) -> int:
    return self._traffic.bytes_sent

  @property
  def bytes_received(self) -> int:
    return self._traffic.bytes_received

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    self._learner_id = learner_id
    return self.core.join(learner_id, fingerprint)

  def leave(self, learner_id: int) -> None:
    self.core.leave(learner_id)

  def push(self, push: Push) -> PushReceipt:
    self._traffic.sent(len(push.payload), first=True)
    return self.core.push(push)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    published = self.core.pull(fragment, min_version, timeout_s, have_version=have_version, have_epoch=have_epoch,
                               learner_id=self._learner_id)
    if published is not None:
      self._traffic.received(len(published.payload), first=True)
    return published

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None, blocked: bool = False) -> int:
    return self.core.heartbeat(learner_id, step_time_s, step=step, blocked=blocked)

  def status(self) -> dict:
    return self.core.status()

  def close(self) -> None:
    pass

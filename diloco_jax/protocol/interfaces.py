"""The two interfaces of the learner/syncer line: `Transport`, what a learner's comms worker calls (served in one
process by `transports.inprocess`, over the network by `transports.grpc_client`, over shards by
`transports.sharded`), and `SyncerAPI`, what a transport or the service calls on the syncer's side
(implemented by `syncer.core.SyncerCore`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions


@runtime_checkable
class Transport(Protocol):
  """A learner's connection to the syncer. Refusals raise `Rejected`. `bytes_sent` / `bytes_received`
  count this client's traffic (payload bytes in process; the gRPC client adds its framing)."""

  @property
  def bytes_sent(self) -> int:
    ...

  @property
  def bytes_received(self) -> int:
    ...

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Enter the quorum; returns the version of every fragment of the global model, with the syncer's epoch
    and history (0 and () when the syncer sends none)."""
    ...

  def leave(self, learner_id: int) -> None:
    ...

  def push(self, push: Push) -> PushReceipt:
    ...

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    """The fragment once its version >= min_version (None after `timeout_s`). `have_version`, `have_epoch`:
    the version whose reference the learner holds (-1: none) and the syncer epoch it came from; the answer
    is a delta from it when the syncer can serve one, else the full fragment."""
    ...

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease; `step_time_s`: recent inner-step time (0: unknown); `step` (the learner's
    inner-step counter, None: unknown) and `blocked` (waiting on the syncer) tell the syncer whether the
    learner makes progress. Returns the syncer's epoch."""
    ...

  def status(self) -> dict:
    ...

  def close(self) -> None:
    ...


@runtime_checkable
class SyncerAPI(Protocol):
  """What a transport calls on the syncer's side; `syncer.core.SyncerCore` implements it."""

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    ...

  def leave(self, learner_id: int) -> None:
    ...

  def push(self, push: Push) -> PushReceipt:
    ...

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0, learner_id: int | None = None) -> Published | None:
    ...

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None,
                blocked: bool = False) -> int:
    """Renew the lease; `step_time_s`: recent inner-step time (0: unknown); `step`: the inner step
    (None: unknown); `blocked`: waiting on the syncer. Returns the syncer's epoch."""
    ...

  def status(self) -> dict:
    ...

  def max_payload_bytes(self) -> int:
    """The largest payload a valid push can carry: the service never buffers more for one push."""
    ...

  @property
  def epoch(self) -> int:
    """The syncer's epoch (random per lifetime)."""
    ...

  def check_learner_id(self, learner_id: int) -> None:
    """Raise `Rejected(Reason.LEARNER_ID)` unless the id is one of this run's learners (calls whose core
    method takes no learner id, such as `pull`, are checked with it by the transport)."""
    ...

"""The syncer service's one gate: every call from the network reaches the core through `SyncerGate`, whichever
front-end received it (gRPC, `grpc_frontend.py`; the raw-TCP data plane, `dataplane.py`). The front-ends
only translate their wire to the gate's calls (`protocol.convert`) and its answers and refusals back.

The gate decides as the service: a caller over its call rate, a declared payload over the largest valid
one, a Pull, Heartbeat or Leave of another run (with `fingerprint`), a malformed field are refused here
(`GateRefusal`, whose `Reason` names the status code) and never reach, so never change, the core; the core's
own refusals (`protocol.Rejected`) pass through. It keeps the service's counters (`status()["server"]`).

Callers: (source, claimed id). The source is what the transport and authentication say, never the request:
the identity (`auth.identity_of`) with the gRPC connection's peer, or with the data plane's peer host and a
valid id. Rate limits and slots are keyed by it: other ids claimed on one connection spend one budget, a
flood from another connection spends its own. Ids outside the run are refused here, after their call was
counted against the source, without reaching the core (docs/operations.md, "Identity").
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from diloco_jax.protocol.interfaces import SyncerAPI
from diloco_jax.protocol.messages import OBSERVER_ID, HeartbeatCall, Published, PullCall, Push, PushReceipt, Versions
from diloco_jax.protocol.ratelimit import RateLimiter
from diloco_jax.protocol.reasons import Reason, shorten
from diloco_jax.syncer.server.limits import Limits
from diloco_jax.syncer.server.slots import Slots

MAX_STEP = 1 << 53  # a reported inner step beyond this is garbage (and would lose precision as JSON)
CONNECTION = "on this connection"  # where a gRPC caller's calls come from, as a rate-limit refusal says


class GateRefusal(Exception):
  """A refusal decided by the gate: the core never sees the call. `reason` names the status code."""

  def __init__(self, reason: Reason, message: str):
    super().__init__(message)
    self.reason, self.message = reason, message


class SyncerGate:
  """The core behind the service's limits, rate limits, slots and counters (module docstring). Thread-safe.

  Args:
    core: the `SyncerAPI` served (a `SyncerCore`).
    limits: what one call may ask.
    fingerprint: the run fingerprint; if set, Pull, Heartbeat and Leave of another run are refused too
      (Join and Push are checked by the core).
    max_workers: the gRPC server's threads: a quarter may serve Pushes and a half Pulls.
  """

  def __init__(self, core: SyncerAPI, limits: Limits | None = None, fingerprint: str | None = None,
               max_workers: int = 32):
    self.core = core
    limits = limits or Limits.defaults()
    self.limits = limits
    self.fingerprint = fingerprint
    self.data_port = 0  # the data plane's port, told to learners at Join (0: none)
    # No valid push is larger than the core's largest payload: never accept a declaration beyond it.
    self.max_push_bytes = min(limits.max_push_bytes, core.max_payload_bytes())
    self.push_slots = Slots("pushes", max_workers // 4, limits.pushes_per_caller)
    self.pull_slots = Slots("pulls", max_workers // 2, limits.pulls_per_caller)
    self._rate = RateLimiter(limits.rate_per_s, limits.rate_burst)
    settings = getattr(core, "settings", None)  # ids are checked here when the core says how many there are
    self.num_learners: int | None = getattr(settings, "num_learners", None)
    self._counters: dict[str, int] = {}
    self._lock = threading.Lock()

  @property
  def epoch(self) -> int:
    """The core's epoch (random per syncer lifetime)."""
    return self.core.epoch

  def count(self, name: str, n: int = 1) -> None:
    """Add `n` to the service counter `name`."""
    with self._lock:
      self._counters[name] = self._counters.get(name, 0) + n

  def counters(self) -> dict[str, int]:
    """The service's counters (calls served, refusals by status or reason, bytes)."""
    with self._lock:
      return dict(self._counters)

  # ---- checks ----

  def admit(self, caller: tuple[Any, Any], where: str = CONNECTION) -> None:
    """Spend one call of the caller's source's rate, or refuse ("rate_limit"); `where` says where it calls
    from."""
    if not self._rate.allow(caller[0]):
      raise GateRefusal(Reason.RATE_LIMIT, f"learner {caller[1]} {where} exceeds {self.limits.rate_per_s:g} calls/s")

  def valid_id(self, learner_id) -> bool:
    """Whether `learner_id` may be one of this run's learners (always, when the core did not say how many)."""
    return self.num_learners is None or (isinstance(learner_id, int) and 0 <= learner_id < self.num_learners)

  def check_id(self, learner_id) -> None:
    """Refuse ("learner_id") an id outside [0, learners.num): the core never sees it (no lock, no write)."""
    if not self.valid_id(learner_id):
      self.count("ids_refused")
      raise GateRefusal(Reason.LEARNER_ID, f"rejected (learner_id): learner id {shorten(learner_id)} is not one "
                        f"of this run's learners [0, learners.num={self.num_learners})")

  def check_fingerprint(self, fingerprint: str) -> None:
    """Refuse ("fingerprint") a call of another run, when the service knows the run's fingerprint."""
    if self.fingerprint is not None and not hmac.compare_digest(fingerprint.encode(), self.fingerprint.encode()):
      raise GateRefusal(Reason.FINGERPRINT,
                        f"rejected (fingerprint): run/config fingerprint {shorten(fingerprint)} is not this run's")

  # ---- control calls ----

  def join(self, caller, learner_id: int, fingerprint: str) -> Versions:
    self.admit(caller)
    self.check_id(learner_id)
    versions = self.core.join(learner_id, fingerprint)
    self.count("joins")
    return versions

  def leave(self, caller, learner_id: int, fingerprint: str) -> None:
    self.admit(caller)
    self.check_id(learner_id)
    self.check_fingerprint(fingerprint)
    self.core.leave(learner_id)

  def heartbeat(self, caller, call: HeartbeatCall) -> int:
    """Renew a lease; the step time must be finite and >= 0, the step in [0, MAX_STEP). The core's epoch."""
    self.admit(caller)
    self.check_id(call.learner_id)
    self.check_fingerprint(call.fingerprint)
    step_time = call.step_time_s
    if not (step_time >= 0 and step_time < math.inf):  # also refuses NaN
      raise GateRefusal(Reason.PROTOCOL, f"step_time_s must be finite and >= 0, got {step_time}")
    if call.step is not None and not 0 <= call.step < MAX_STEP:
      raise GateRefusal(Reason.PROTOCOL, f"step must be in [0, {MAX_STEP}), got {call.step}")
    return self.core.heartbeat(call.learner_id, step_time, step=call.step, blocked=call.blocked)

  def status(self, caller) -> dict:
    """The core's status, with the service's counters and the gRPC long calls in flight as `server`; the ids
    the gate refused count in `counters.rejected.learner_id` with the core's own."""
    self.admit(caller)
    status = dict(self.core.status())
    refused = self.counters().get("ids_refused", 0)
    if refused:  # the ids this gate refused count with the core's own, as if the core had refused them
      counters = status["counters"] = dict(status["counters"])
      rejected = counters["rejected"] = dict(counters["rejected"])
      rejected[Reason.LEARNER_ID] = rejected.get(Reason.LEARNER_ID, 0) + refused
    status["server"] = {**self.counters(), "pushes_in_flight": self.push_slots.in_use,
                        "pulls_in_flight": self.pull_slots.in_use}
    return status

  # ---- pushes ----

  def check_push(self, caller, total_size: int, where: str = CONNECTION) -> None:
    """Admit a push's header: the caller's rate, and a declared payload no larger than a valid push's."""
    self.admit(caller, where)
    self.check_id(caller[1])
    if total_size > self.max_push_bytes:
      raise GateRefusal(Reason.OVERSIZE, f"declared payload of {total_size} bytes exceeds the limit of "
                        f"{self.max_push_bytes}")

  def push(self, push: Push) -> PushReceipt:
    """The core's receipt for a push whose header `check_push` admitted (counted as served)."""
    receipt = self.core.push(push)
    self.count("pushes")
    self.count("push_bytes", len(push.payload))
    return receipt

  # ---- pulls ----

  def open_pull(self, caller, call: PullCall, where: str = CONNECTION) -> float:
    """Admit a Pull (rate, run, learner id; observers, `OBSERVER_ID`, pull without joining); the seconds
    it may long-poll (its own timeout, capped by `Limits.max_pull_wait_s`)."""
    self.admit(caller, where)
    self.check_fingerprint(call.fingerprint)
    if call.learner_id != OBSERVER_ID:  # observers (the global model's evaluator) pull, never join
      self.check_id(call.learner_id)
      if self.num_learners is None:
        self.core.check_learner_id(call.learner_id)
    timeout = call.timeout_s
    if not (timeout >= 0 and timeout < math.inf):
      raise GateRefusal(Reason.PROTOCOL, f"timeout_s must be finite and >= 0, got {timeout}")
    return min(timeout, self.limits.max_pull_wait_s)

  def pull(self, call: PullCall, wait_s: float = 0.0) -> Published | None:
    """One look at the core (waiting up to `wait_s`)."""
    return self.core.pull(call.fragment, call.min_version, wait_s, call.have_version, call.have_epoch,
                          learner_id=call.learner_id)

  def long_poll(self, call: PullCall, deadline: float, slice_s: float, gone: Callable[[], bool]) -> Published | None:
    """Wait for the answer until `deadline` (monotonic) in slices of `slice_s`, so that a caller that went
    away (`gone()`) frees its thread within a slice; None if it did not come."""
    while True:
      left = deadline - time.monotonic()
      if left <= 0 or gone():
        return None
      published = self.pull(call, min(left, slice_s))
      if published is not None:
        return published

  def pulled(self, published: Published) -> None:
    """Count a found fragment as served."""
    self.count("pulls")
    self.count("pull_bytes", len(published.payload))

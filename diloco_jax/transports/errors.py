"""How a call to the syncer fails, on either plane, as the learner's transports raise it.

* `CallFailed`: the syncer (or the network) answered a call with a failure: its status code (by name, as
  `protocol.Reason.status`), its reason (the `diloco-reason`, when it sent one) and details. The gRPC
  client reads one from a failed gRPC call, the data-plane client from a refusal; `retry.py` decides from
  it whether to retry, and what to raise if not.
* `LinkDown`: an emulated WAN link that is cut off (`wan.WanLink.check_link`): retried like an unreachable
  syncer.
* What a caller sees: `SyncerUnreachable` (no answer within the retry deadline, or the transport was
  closed), `AuthError` (the run token refused), `protocol.Rejected` (a refusal of the core) and
  `SyncerError` (any other failure).
"""

from __future__ import annotations


class SyncerUnreachable(ConnectionError):
  """The syncer did not answer within the retry deadline."""


class AuthError(PermissionError):
  """The syncer refused the run token."""


class SyncerError(RuntimeError):
  """Any other failure of a syncer call; `code`: its status code's name (e.g. "INTERNAL")."""

  def __init__(self, code: str, message: str):
    super().__init__(f"{code}: {message}")
    self.code = code


class LinkDown(ConnectionError):
  """The emulated link is cut off (its cut-off file exists)."""


class CallFailed(Exception):
  """A call the syncer answered with a failure (module docstring): `status` (a status code's name),
  `reason` (None: none sent) and `details`."""

  def __init__(self, status: str, reason: str | None, details: str):
    super().__init__(f"{status}: {details}")
    self.status, self.reason, self.details = status, reason, details

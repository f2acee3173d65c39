"""Why the syncer refuses a request: one `Reason` enum, each reason with the gRPC status code it travels as.

Reasons are `str` values (`Rejected(...).reason == "outlier"`, counters keyed by reason strings, the
`diloco-reason` trailing metadata and the data plane's refusals carry the string). The core's refusals
(`Rejected`, one counter each in the syncer's status) are `REASONS`; the others are the service's own
(rate limits, slots, sizes, streams, authentication). The status code is named by its `grpc.StatusCode`
name, so this module (and the in-process run) imports no grpc. `shorten` is how any string that came off the
wire is quoted in a refusal or a log line.
"""

from __future__ import annotations

import enum

REASON_METADATA_KEY = "diloco-reason"  # gRPC trailing metadata: the machine-readable reason of a refusal
ECHO_CHARS = 64  # at most this much of a wire string is quoted back in a message or a log line


class Reason(enum.StrEnum):
  """A refusal's reason; `status`: the name of the `grpc.StatusCode` it travels as; `by_core`: a refusal
  of the core (`Rejected`, in `REASONS`) rather than of the service around it.

  FAILED_PRECONDITION: the learner must (re)join first; PERMISSION_DENIED: it belongs to another run;
  INVALID_ARGUMENT: the request itself is malformed; RESOURCE_EXHAUSTED: busy or over a limit (a client
  retries, unless the limit is a size: "oversize").
  """

  def __new__(cls, value: str, status: str, by_core: bool = True):
    member = str.__new__(cls, value)
    member._value_ = value
    member.status = status
    member.by_core = by_core
    return member

  # The core's (`Rejected`):
  UNKNOWN_LEARNER = "unknown_learner", "FAILED_PRECONDITION"  # never joined, or pruned: join again
  FINGERPRINT = "fingerprint", "PERMISSION_DENIED"  # another run or config
  NOT_MEMBER = "not_member", "FAILED_PRECONDITION"  # left, or its lease lapsed: join again
  UNKNOWN_FRAGMENT = "unknown_fragment", "INVALID_ARGUMENT"
  CODEC = "codec", "INVALID_ARGUMENT"
  SHAPE = "shape", "INVALID_ARGUMENT"
  CHECKSUM = "checksum", "INVALID_ARGUMENT"
  METADATA = "metadata", "INVALID_ARGUMENT"
  NONFINITE = "nonfinite", "INVALID_ARGUMENT"
  FUTURE_VERSION = "future_version", "FAILED_PRECONDITION"
  LEARNER_ID = "learner_id", "PERMISSION_DENIED"  # the id is outside [0, learners.num)
  OVERCLAIM = "overclaim", "INVALID_ARGUMENT"  # steps or tokens the schedule cannot give
  OUTLIER = "outlier", "INVALID_ARGUMENT"  # the norm is far above the fragment's recent ones
  KEY_CONFLICT = "key_conflict", "INVALID_ARGUMENT"  # an idempotency key seen before, on another payload
  EPOCH = "epoch", "INVALID_ARGUMENT"  # base_version of another syncer lifetime: the learner recovers first
  WRONG_SHARD = "wrong_shard", "INVALID_ARGUMENT"  # the fragment belongs to another shard
  ROUND_SHARE = "round_share", "INVALID_ARGUMENT"  # the learner's pushes into this round are at their limit
  # The service's:
  RATE_LIMIT = "rate_limit", "RESOURCE_EXHAUSTED", False  # calls per second of one caller
  BUSY = "busy", "RESOURCE_EXHAUSTED", False  # the long-call slots are full
  OVERSIZE = "oversize", "RESOURCE_EXHAUSTED", False  # a declared payload over the limit (not retried)
  STALLED = "stalled", "DEADLINE_EXCEEDED", False  # a stream cut by the stream watch
  PROTOCOL = "protocol", "INVALID_ARGUMENT", False  # a malformed request
  SEQUENCE = "sequence", "INVALID_ARGUMENT", False  # a chunk out of order (`ProtocolError`)
  TRUNCATED = "truncated", "INVALID_ARGUMENT", False  # fewer bytes than declared (`ProtocolError`)
  UNAUTHENTICATED = "unauthenticated", "UNAUTHENTICATED", False  # no or a wrong run token
  INTERNAL = "internal", "INTERNAL", False  # a bug in the service: answered, logged
  CANCELLED = "cancelled", "CANCELLED", False  # the client went away


# The core's refusal reasons (a counter each in the syncer's status), as plain strings.
REASONS = tuple(r.value for r in Reason if r.by_core)
# Rejections that mean "the syncer forgot this learner" (it restarted, or the lease lapsed): join again.
REJOIN_REASONS = (Reason.NOT_MEMBER, Reason.UNKNOWN_LEARNER)


def status_of(reason: str) -> str:
  """The status code name a reason string from the wire travels as (an unknown one: INVALID_ARGUMENT)."""
  try:
    return Reason(reason).status
  except ValueError:
    return "INVALID_ARGUMENT"


def shorten(value, limit: int = ECHO_CHARS) -> str:
  """`repr(value)` cut to about `limit` characters, saying how long it was: how a string from the wire
  (a fingerprint, a codec name...) is quoted in a reply or a log line, so a hostile 1 MiB field is never
  echoed whole."""
  text = repr(value)
  if len(text) <= limit:
    return text
  size = f" ({len(value)} chars)" if isinstance(value, (str, bytes)) else ""
  return f"{text[:limit]}...{size}"


class Rejected(Exception):
  """A request the core refuses: `reason` (one of `REASONS`) and a message saying why."""

  def __init__(self, reason: Reason | str, message: str):
    super().__init__(f"{reason}: {message}")
    self.reason = Reason(reason)
    self.message = message

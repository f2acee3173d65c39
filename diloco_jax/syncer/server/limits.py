"""What one call may ask of the syncer's service (`Limits`), and how many threads serve a run's learners."""

from __future__ import annotations

import dataclasses

from diloco_jax import config as config_lib


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one call may ask of the server."""

  chunk_bytes: int  # Pull chunk size
  max_message_bytes: int  # per gRPC message, both directions
  max_push_bytes: int  # declared payload size of one Push (also capped by the core's largest)
  rate_per_s: float  # calls per second per caller (sustained)
  rate_burst: float  # calls a caller may make at once
  max_pull_wait_s: float  # long-poll cap: a Pull holds a worker thread at most this long
  stream_stall_s: float  # a stream that moves no payload bytes this long is cut
  stream_deadline_s: float  # no stream lasts longer (a Pull's long-poll wait not counted)
  pushes_per_caller: int  # Push streams one connection may have in flight
  pulls_per_caller: int  # Pulls one caller may have in flight

  @classmethod
  def defaults(cls, **overrides) -> Limits:
    """The limits of the base config (the one source of defaults), with `overrides` on top."""
    return dataclasses.replace(cls.from_config(config_lib.base_config()), **overrides)

  @classmethod
  def from_config(cls, config) -> Limits:
    """The limits of a run's config (`syncer.*`, and the learners' comms workers)."""
    config = config_lib.resolve(config)
    s = config.syncer
    in_flight = 2 * learner_in_flight(config)  # a learner's comms workers, and a retry of each
    return cls(
        chunk_bytes=int(s.chunk_kb) * 1024,
        max_message_bytes=int(s.max_message_mb) << 20,
        max_push_bytes=int(s.max_push_mb) << 20,
        rate_per_s=float(s.rate_limit_per_s),
        rate_burst=float(s.rate_limit_burst),
        max_pull_wait_s=float(s.max_pull_wait_s),
        stream_stall_s=float(s.stream_stall_s),
        stream_deadline_s=float(s.stream_deadline_s),
        pushes_per_caller=in_flight,
        pulls_per_caller=in_flight,
    )


def workers_for(config) -> int:
  """Worker threads for a run: a Pull and a Push slot for each comms worker of every learner (twice, for
  retries), plus as many for the control calls; at least 32."""
  return max(32, 4 * int(config.learners.num) * learner_in_flight(config))


def learner_in_flight(config) -> int:
  """A learner's comms workers: its fragments in flight (`outer.max_in_flight` as the run resolves it)."""
  return int(config_lib.resolve(config).outer.max_in_flight)

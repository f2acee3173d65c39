"""What one call may ask of the syncer's service (`Limits`), and how many threads serve a run's learners."""

from __future__ import annotations

import dataclasses

from diloco_jax import config as config_lib

DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # gRPC's default receive limit


@dataclasses.dataclass(frozen=True)
class Limits:
  """What one call may ask of the server."""

  chunk_bytes: int = DEFAULT_CHUNK_BYTES  # Pull chunk size
  max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES  # per gRPC message, both directions
  max_push_bytes: int = 2 << 30  # declared payload size of one Push (also capped by the core's largest)
  rate_per_s: float = 50.0  # calls per second per caller (sustained)
  rate_burst: float = 200.0  # calls a caller may make at once
  max_pull_wait_s: float = 60.0  # long-poll cap: a Pull holds a worker thread at most this long
  stream_stall_s: float = 10.0  # a stream that moves no payload bytes this long is cut
  stream_deadline_s: float = 600.0  # no stream lasts longer (a Pull's long-poll wait not counted)
  pushes_per_caller: int = 4  # Push streams one connection may have in flight
  pulls_per_caller: int = 4  # Pulls one caller may have in flight

  @classmethod
  def from_config(cls, config) -> "Limits":
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

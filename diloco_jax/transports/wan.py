"""WAN emulation inside the client: a bandwidth cap and a one-way latency, with no root and no tc/netem.

A learner's link to the syncer is two independent directions (up: learner -> syncer, down: syncer ->
learner), each a token bucket of `bandwidth` bytes/s with a burst of `burst_s` of the rate, and a one-way
latency L paid once by every message that crosses (a request, a reply, a hello): a message of n bytes costs
about `L + n / bandwidth`, a call with a reply 2 L plus both messages, and a new connection its set-up
(`connect`: TCP 1 round trip, TLS `tls_round_trips` more, the leg before the server speaks). Checked against
a kernel-shaped link; what it does not model (loss, congestion control...): docs/benchmarks.md.

The arithmetic (`ratelimit.TokenBucket.reserve`, shared with the syncer's rate limits) is a pure function
of a clock; `WanLink` only adds the sleeps, so tests drive it with a fake clock or measure it with the real
one.

Cut-off (chaos testing): with `cutoff_file`, the link is down while that file exists (`check_link`), and
the client retries as if the syncer were unreachable.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

from diloco_jax.protocol.ratelimit import TokenBucket
from diloco_jax.transports.errors import LinkDown

# Each TCP segment of 1448 payload bytes (1500-byte MTU, TCP timestamps) carries 66 bytes of Ethernet, IP
# and TCP headers, which a link's rate pays too.
TCP_HEADER_OVERHEAD = 66 / 1448
PIECE_S = 0.05  # a send is paced in pieces of this much link time at most (`piece_bytes`)
SPIN_S = 2e-4  # the end of each wait is spun, not slept: a sleep overshoots by about this much


def precise_sleep(seconds: float) -> None:
  """Wait `seconds`: sleep all but the last `SPIN_S`, spin that (sub-millisecond waits stay exact)."""
  end = time.perf_counter() + seconds
  if seconds > SPIN_S:
    time.sleep(seconds - SPIN_S)
  while time.perf_counter() < end:
    pass


@dataclasses.dataclass(frozen=True)
class WanSpec:
  """An emulated link. bandwidth in bytes/s (0 = unlimited), latency one-way in seconds, a burst of
  `burst_s` seconds of the rate (a few ms, as a shaper's bucket), TLS set-up in round trips (1: TLS 1.3),
  and the headers each payload byte brings along on the link (`header_overhead`: TCP/IP over Ethernet)."""

  up_bytes_per_s: float = 0.0
  down_bytes_per_s: float = 0.0
  latency_s: float = 0.0
  burst_s: float = 0.002
  tls_round_trips: int = 1
  header_overhead: float = TCP_HEADER_OVERHEAD  # link bytes per payload byte beyond the payload itself
  cutoff_file: str = ""  # the link is down while this file exists ("" = never)

  @classmethod
  def from_gbps(cls, gbps: float, latency_ms: float = 0.0, **kw) -> WanSpec:
    """A symmetric link of `gbps` gigabits/s (0 = unlimited) and `latency_ms` one-way."""
    rate = gbps * 1e9 / 8
    return cls(up_bytes_per_s=rate, down_bytes_per_s=rate, latency_s=latency_ms / 1e3, **kw)


class WanLink:
  """Applies a WanSpec to a client's chunks. Thread-safe; share one per learner (one physical link).

  Per direction, a token bucket of the spec's bytes/s (burst: `burst_s` of the rate, starting full): every
  chunk waits until the bucket has paid for its bytes, so a transfer of n bytes takes about n / bandwidth
  seconds, and concurrent transfers of one learner share the cap (the bucket is thread-safe). The one-way
  latency is paid once per message, on its first chunk: chunks of one message are pipelined on a real
  link."""

  def __init__(self, spec: WanSpec, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = precise_sleep):
    self.spec = spec
    self._sleep = sleep
    bucket = lambda rate: TokenBucket(rate, rate * spec.burst_s, clock) if rate > 0 else None
    self._up, self._down = bucket(spec.up_bytes_per_s), bucket(spec.down_bytes_per_s)
    self._lock = threading.Lock()
    self.delay_s = 0.0  # total emulated delay applied so far (diagnostics)

  def _apply(self, bucket: TokenBucket | None, nbytes: int, first: bool, extra_s: float = 0.0) -> None:
    wait = extra_s + (self.spec.latency_s if first else 0.0)
    if bucket is not None:
      wait += bucket.reserve(nbytes * (1.0 + self.spec.header_overhead))
    if wait > 0:
      with self._lock:
        self.delay_s += wait
      self._sleep(wait)

  def check_link(self) -> None:
    """Raise `LinkDown` while the link is cut off: while `cutoff_file` exists, whichever process creates it
    (`python -m diloco_jax chaos` touches one per learner).

    The client calls it before a call and on an answer: a call that starts while the link is down, and an
    idempotent answer (pull, heartbeat, join) that arrives while it is down, are lost, which the client
    treats like an unreachable syncer (it retries with backoff). A push receipt is not dropped: a push lost
    after the syncer accepted it would be retried and merged twice, which is the duplicate-push problem and
    not what a cut-off is meant to exercise."""
    if self.spec.cutoff_file and os.path.exists(self.spec.cutoff_file):
      raise LinkDown(f"emulated link cut off ({self.spec.cutoff_file} exists)")

  def connect(self, tls: bool = False) -> None:
    """Call once a new connection is up (and its TLS handshake done), before the server's first message is
    read: TCP's handshake (1 round trip), TLS's (`tls_round_trips`), and the one-way leg of the client's
    last handshake message, which the server waits for before it speaks (its message then pays its own
    latency). A data-plane connection costs 4 one-way latencies before its first request, 6 with TLS 1.3."""
    legs = 2 * (1 + (self.spec.tls_round_trips if tls else 0)) + 1
    self._apply(None, 0, False, legs * self.spec.latency_s)

  def piece_bytes(self, default: int) -> int:
    """At most `PIECE_S` of the uplink's rate (at least 1 KiB), and at most `default`."""
    rate = self.spec.up_bytes_per_s
    return default if rate <= 0 else max(1024, min(default, int(rate * PIECE_S)))

  def send(self, nbytes: int, first: bool = False) -> None:
    """Call before a chunk of `nbytes` leaves (first=True on a stream's first message: pays the latency)."""
    self._apply(self._up, nbytes, first)

  def receive(self, nbytes: int, first: bool = False) -> None:
    """Call after a chunk of `nbytes` arrived, before it is used."""
    self._apply(self._down, nbytes, first)

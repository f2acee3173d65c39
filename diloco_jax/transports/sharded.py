"""One `protocol.Transport` over the S shards of a sharded syncer (one transport per shard).

A sharded syncer is S syncer processes, shard I owning the fragments `placement.assign_shards` gives it.
This transport routes a push or pull of fragment p to the shard that owns it (`owners[p]`, computed from the
config by every process alike) and fans membership out to every shard:

* `join` and `leave` go to every shard, concurrently, and return when all answered; `join` merges the
  versions each shard answers for its own fragments, and refuses ("wrong_shard") a shard that answers for
  other fragments than `owners` gives it (addresses in the wrong order, another shard count).
* `heartbeat` renews the lease on every shard, each on its own thread, at most one beat in flight per shard,
  so a shard that is down (its call retrying) never delays the beats the other shards need to keep the
  learner's leases. A shard that forgot the learner (it restarted, or the lease lapsed) is joined again on
  that thread, that shard only.
* `status` asks every shard and combines the answers (`combine_status`); `shards` holds each one's.

Each shard keeps its own leases from the heartbeats that reach it, and quorums are per fragment, so a shard
needs only its own view of who is live; docs/architecture.md ("Sharded syncer").
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, Sequence

from diloco_jax.protocol import REJOIN_REASONS, Published, Push, PushReceipt, Rejected, Transport

log = logging.getLogger(__name__)

BEAT_WAIT_S = 2.0  # a heartbeat waits this long for the shards' answers (a down shard's beat goes on alone)


def parse_targets(text: str) -> list[str]:
  """`host:port[,host:port...]` (one address per syncer shard, in shard order), each checked."""
  targets = [t.strip() for t in text.split(",")]
  for t in targets:
    host, _, port = t.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(f"--syncer must be host:port[,host:port...] (one per syncer shard), got {text!r}")
  if len(set(targets)) != len(targets):
    raise ValueError(f"--syncer lists an address twice: {text!r}")
  return targets


def connect(targets: Sequence[str], make: Callable[[str], Transport],
            owners: Callable[[int], Sequence[int]] | None = None) -> Transport:
  """`make(target)` for one syncer; for several, a ShardedTransport over them, routed by `owners(S)` (the
  shard of each fragment: `placement.config_owners`; None for clients that only read the status)."""
  if len(targets) == 1:
    return make(targets[0])
  return ShardedTransport([make(t) for t in targets], None if owners is None else owners(len(targets)))


def _add(a, b):
  """Counters summed: numbers add, dicts by key, lists of equal length element by element."""
  if isinstance(a, bool) or isinstance(b, bool):
    return a
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a + b
  if isinstance(a, dict) and isinstance(b, dict):
    return {k: _add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
  if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
    return [_add(x, y) for x, y in zip(a, b)]
  return a


def combine_status(statuses: Sequence[dict]) -> dict:
  """One status for the whole syncer from its shards' (each as `SyncerCore.status` with the service's
  `server` counters): versions, rounds, sync times and open rounds from each fragment's owner; counters
  summed; live learners those live on every shard; members as shard 0 sees them; the goodput estimate the
  mean of the shards'; `shards`: every shard's own status."""
  first = statuses[0]
  out = dict(first)
  n = len(first["versions"])
  for key in ("versions", "rounds", "t_sync_s"):
    if key in first:
      out[key] = list(first[key])
  out["open_rounds"] = {}
  for s in statuses:
    for p in s.get("owned", range(n)):
      for key in ("versions", "rounds", "t_sync_s"):
        if key in s:
          out[key][p] = s[key][p]
    out["open_rounds"].update(s.get("open_rounds", {}))
  for key in ("counters", "server", "since_start"):
    if key in first:
      total = first[key]
      for s in statuses[1:]:
        total = _add(total, s.get(key, {}))
      out[key] = total
  out["live"] = sorted(set.intersection(*(set(s["live"]) for s in statuses)))
  out["owned"] = list(range(n))
  out["goodput_estimate"] = sum(s.get("goodput_estimate", 0.0) for s in statuses) / len(statuses)
  out["uptime_s"] = min(s.get("uptime_s", 0.0) for s in statuses)
  out["shards"] = list(statuses)
  return out


class ShardedTransport:
  """A `protocol.Transport` over one transport per syncer shard (module docstring). Thread-safe."""

  def __init__(self, shards: Sequence[Transport], owners: Sequence[int] | None):
    if len(shards) < 2:
      raise ValueError(f"a sharded transport needs at least 2 shards, got {len(shards)}")
    if owners is not None and (set(owners) != set(range(len(shards)))):
      raise ValueError(f"fragment owners {list(owners)} must name every shard in [0, {len(shards)})")
    self.shards = list(shards)
    self.owners = None if owners is None else list(owners)
    self._fingerprint: str | None = None  # from `join`: a shard that forgot the learner is joined again
    self._lock = threading.Lock()
    self._beats: list[concurrent.futures.Future | None] = [None] * len(shards)
    self._beats_reported: set[int] = set()  # shards whose latest beat's error the caller got
    self._beat_pool = concurrent.futures.ThreadPoolExecutor(len(shards), thread_name_prefix="shard-heartbeat")
    self._calls = concurrent.futures.ThreadPoolExecutor(len(shards), thread_name_prefix="shard-call")

  # ---- traffic ----

  @property
  def bytes_sent(self) -> int:
    return sum(t.bytes_sent for t in self.shards)

  @property
  def bytes_received(self) -> int:
    return sum(t.bytes_received for t in self.shards)

  @property
  def retries(self) -> int:
    """Retries of the shards' clients, summed (0 for transports that do not retry)."""
    return sum(getattr(t, "retries", 0) for t in self.shards)

  # ---- fan-out ----

  def _all(self, call: Callable[[Transport], object]) -> list:
    """`call` on every shard at once; their answers in shard order, or the first shard's error once all
    have answered."""
    futures = [self._calls.submit(call, t) for t in self.shards]
    concurrent.futures.wait(futures)
    for f in futures:
      if f.exception() is not None:
        raise f.exception()
    return [f.result() for f in futures]

  def _shard(self, fragment: int) -> Transport:
    if self.owners is None:
      raise ValueError("this sharded transport has no fragment owners: it can only read the status")
    if not 0 <= fragment < len(self.owners):
      raise Rejected("unknown_fragment", f"fragment {fragment} not in [0, {len(self.owners)})")
    return self.shards[self.owners[fragment]]

  # ---- membership ----

  def join(self, learner_id: int, fingerprint: str) -> dict[int, int]:
    """Join every shard; {fragment: version} of the whole model."""
    with self._lock:
      self._fingerprint = fingerprint
    answers = self._all(lambda t: t.join(learner_id, fingerprint))
    versions: dict[int, int] = {}
    for s, answer in enumerate(answers):
      if self.owners is not None:
        expected = {p for p, owner in enumerate(self.owners) if owner == s}
        if set(answer) != expected:
          raise Rejected("wrong_shard", f"syncer shard {s} serves fragments {sorted(answer)}, this learner "
                         f"expects {sorted(expected)} there: list the shards' addresses in shard order, as "
                         f"many as the syncer has")
      versions.update(answer)
    return versions

  def leave(self, learner_id: int) -> None:
    self._all(lambda t: t.leave(learner_id))

  def _beat(self, shard: Transport, learner_id: int, step_time_s: float, step: int | None) -> None:
    try:
      shard.heartbeat(learner_id, step_time_s, step=step)
    except Rejected as e:
      with self._lock:
        fingerprint = self._fingerprint
      if e.reason not in REJOIN_REASONS or fingerprint is None:
        raise
      shard.join(learner_id, fingerprint)  # this shard forgot the learner (restarted, lease lapsed)

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None) -> None:
    """Renew the lease on every shard whose previous beat has finished (module docstring); waits up to
    `BEAT_WAIT_S` for the beats it started and raises the first error among those that finished."""
    started = {}
    with self._lock:
      for s, shard in enumerate(self.shards):
        previous = self._beats[s]
        if previous is not None and not previous.done():
          continue  # still retrying a shard that is down: the other shards' beats go on
        if previous is not None and previous.exception() is not None and s not in self._beats_reported:
          log.warning("heartbeat to syncer shard %d failed: %s", s, previous.exception())  # after the wait
        self._beats[s] = self._beat_pool.submit(self._beat, shard, learner_id, step_time_s, step)
        started[s] = self._beats[s]
      self._beats_reported = set()
    done, _ = concurrent.futures.wait(started.values(), timeout=BEAT_WAIT_S)
    for s, f in started.items():
      if f in done and f.exception() is not None:
        with self._lock:
          self._beats_reported.add(s)
        raise f.exception()

  # ---- fragments ----

  def push(self, push: Push) -> PushReceipt:
    return self._shard(push.fragment).push(push)

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    return self._shard(fragment).pull(fragment, min_version, timeout_s, have_version=have_version,
                                      have_epoch=have_epoch)

  # ---- status ----

  def shard_statuses(self) -> list[dict]:
    """Every shard's own status, in shard order."""
    return self._all(lambda t: t.status())

  def status(self) -> dict:
    return combine_status(self.shard_statuses())

  def close(self) -> None:
    for t in self.shards:
      t.close()
    self._beat_pool.shutdown(wait=False, cancel_futures=True)
    self._calls.shutdown(wait=False, cancel_futures=True)

  def __enter__(self) -> "ShardedTransport":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

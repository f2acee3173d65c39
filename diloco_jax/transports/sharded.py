"""One `protocol.Transport` over the S shards of a sharded syncer (one transport per shard).

A sharded syncer is S syncer processes, shard I owning the fragments `placement.assign_shards` gives it.
This transport routes a push or pull of fragment p to the shard that owns it (`owners[p]`, computed from the
config by every process alike) and fans membership out to every shard: `join` and `leave` go to every shard
concurrently, `heartbeat` renews the lease on every shard without a shard that is down delaying the others,
and `status` combines the shards' answers (`combine_status`).

Epochs. Each shard has its own epoch and lifetime history (it restarts alone). The learner's recovery knows
one syncer epoch and one history, so this transport shows it one (`_Epochs`), and translates the epochs the
learner sends back (`have_epoch`, `base_epoch`) to the shard's own.

Each shard keeps its own leases from the heartbeats that reach it, and quorums are per fragment, so a shard
needs only its own view of who is live; docs/architecture.md ("Sharded syncer").
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Sequence

from diloco_jax.protocol.interfaces import Transport
from diloco_jax.protocol.messages import EpochRecord, Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import REJOIN_REASONS, Reason, Rejected

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
  shard of each fragment: `plans.config_owners`; None for clients that only read the status)."""
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


KEPT_ALL = 2**62  # in a combined history: every round of that lifetime is still held (see `_Epochs`)
EPOCHS_KEPT = 64  # combined epochs remembered (as many lifetimes as a syncer's history keeps)


def combined_epoch(shard_epochs: Sequence[int]) -> int:
  """One nonzero 63-bit epoch naming a combination of the shards' epochs (the same in every process)."""
  digest = hashlib.blake2b(repr(tuple(shard_epochs)).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "big") % (2**63 - 1) + 1


class _Epochs:
  """The shards' epochs seen as one syncer's, so that the learner's recovery (one epoch, one history)
  works unchanged: the combined epoch changes when any shard's does (a shard restarted), and the combined
  history says, per fragment, what the fragment's own shard's history says.

  Each combined epoch names a tuple of shard epochs. A shard epoch seen for the first time is a restart
  of that shard: the combined epoch moves on; one seen before is an older answer, named by the newest
  combined epoch that held it. Thread-safe."""

  def __init__(self, owners: Sequence[int] | None, shards: int):
    self._owners = list(owners or ())  # none: a status-only client, no history
    self._lock = threading.Lock()
    self._current = [0] * shards  # the latest epoch of each shard (0: none yet)
    self._seen = [set() for _ in range(shards)]
    self._combined: collections.OrderedDict[int, tuple[int, ...]] = collections.OrderedDict()
    self._histories: list[tuple[EpochRecord, ...]] = [()] * shards

  def _now_locked(self) -> int:
    if not all(self._current):
      return 0
    shard_epochs = tuple(self._current)
    epoch = combined_epoch(shard_epochs)
    if epoch not in self._combined:
      self._combined[epoch] = shard_epochs
      while len(self._combined) > EPOCHS_KEPT:
        self._combined.popitem(last=False)
    return epoch

  def see(self, shard: int, epoch: int) -> int:
    """The combined epoch of an answer from `shard` stamped with its `epoch` (0: unknown, stays 0)."""
    if not epoch:
      return 0
    with self._lock:
      if epoch != self._current[shard] and epoch in self._seen[shard]:
        older = [c for c, es in self._combined.items() if es[shard] == epoch]
        return older[-1] if older else 0
      self._seen[shard].add(epoch)
      self._current[shard] = epoch
      return self._now_locked()

  def current(self) -> int:
    with self._lock:
      return self._now_locked()

  def shard_epoch(self, shard: int, epoch: int) -> int:
    """The epoch of `shard` that the combined `epoch` names (0 stays 0; an unknown one is passed on, and
    the shard refuses it as another lifetime's)."""
    with self._lock:
      shard_epochs = self._combined.get(epoch)
      return epoch if shard_epochs is None else shard_epochs[shard]

  def joined(self, answers: Sequence[Versions]) -> Versions:
    """Every shard's join answer as one: the versions, the combined epoch and the combined history."""
    with self._lock:
      for s, answer in enumerate(answers):
        self._histories[s] = tuple(answer.history)
        if answer.epoch:
          self._seen[s].add(answer.epoch)
          self._current[s] = answer.epoch
      epoch = self._now_locked()
      history = self._history_locked()
    versions = {}
    for answer in answers:
      versions.update(answer.versions)
    return Versions(versions, epoch=epoch, history=history)

  def _history_locked(self) -> tuple[EpochRecord, ...]:
    """The combined lifetimes, oldest first, the current one last: for fragment p of shard s, the version
    offsets of the lifetime of s each names, and the rounds `protocol.kept_rounds` finds (the next record's
    start_rounds) = those the next lifetime of s began from, or KEPT_ALL while s has not restarted since."""
    if not self._owners or not all(self._histories) or not self._combined:
      return ()
    index = [{r.epoch: k for k, r in enumerate(h)} for h in self._histories]
    records, previous = [], None
    for epoch, shard_epochs in self._combined.items():
      starts, offsets = [], []
      for p, s in enumerate(self._owners):
        h, k = self._histories[s], index[s].get(shard_epochs[s])
        offsets.append(0 if k is None else h[k].version_offsets[p])
        if previous is None:
          starts.append(0 if k is None else h[k].start_rounds[p])
        else:
          j = index[s].get(previous[s])
          starts.append(0 if j is None else h[j + 1].start_rounds[p] if j + 1 < len(h) else KEPT_ALL)
      records.append(EpochRecord(epoch, tuple(starts), tuple(offsets)))
      previous = shard_epochs
    return tuple(records)


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
    self._epochs = _Epochs(self.owners, len(shards))
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

  def _shard(self, fragment: int) -> int:
    if self.owners is None:
      raise ValueError("this sharded transport has no fragment owners: it can only read the status")
    if not 0 <= fragment < len(self.owners):
      raise Rejected(Reason.UNKNOWN_FRAGMENT, f"fragment {fragment} not in [0, {len(self.owners)})")
    return self.owners[fragment]

  # ---- membership ----

  def join(self, learner_id: int, fingerprint: str) -> Versions:
    """Join every shard, concurrently, and return when all answered: {fragment: version} of the whole
    model (the versions each shard answers for its own fragments, merged), with the combined epoch and
    history. Refuses (`Reason.WRONG_SHARD`) a shard that answers for other fragments than `owners` gives it
    (addresses in the wrong order, another shard count)."""
    with self._lock:
      self._fingerprint = fingerprint
    answers = self._all(lambda t: t.join(learner_id, fingerprint))
    for s, answer in enumerate(answers):
      if self.owners is not None:
        expected = {p for p, owner in enumerate(self.owners) if owner == s}
        if set(answer.versions) != expected:
          raise Rejected(Reason.WRONG_SHARD, f"syncer shard {s} serves fragments {sorted(answer.versions)}, this "
                         f"learner expects {sorted(expected)} there: list the shards' addresses in shard order, "
                         f"as many as the syncer has")
    return self._epochs.joined(answers)

  def leave(self, learner_id: int) -> None:
    self._all(lambda t: t.leave(learner_id))

  def _beat(self, s: int, learner_id: int, step_time_s: float, step: int | None, blocked: bool) -> None:
    shard = self.shards[s]
    try:
      epoch = shard.heartbeat(learner_id, step_time_s, step=step, blocked=blocked)
    except Rejected as e:
      with self._lock:
        fingerprint = self._fingerprint
      if e.reason not in REJOIN_REASONS or fingerprint is None:
        raise
      # This shard forgot the learner (it restarted, or the lease lapsed): join it again.
      epoch = shard.join(learner_id, fingerprint).epoch
    self._epochs.see(s, epoch or 0)

  def heartbeat(self, learner_id: int, step_time_s: float, step: int | None = None, blocked: bool = False) -> int:
    """Renew the lease on every shard whose previous beat has finished; waits up to `BEAT_WAIT_S` for the
    beats it started, raises the first error among those that finished, and returns the combined epoch (a
    shard that restarted changes it).

    Each shard's beat runs on its own thread, at most one in flight per shard, so a shard that is down (its
    call retrying) never delays the beats the other shards need to keep the learner's leases. A shard that
    forgot the learner (it restarted, or the lease lapsed) is joined again on that thread, that shard
    only."""
    started = {}
    with self._lock:
      for s in range(len(self.shards)):
        previous = self._beats[s]
        if previous is not None and not previous.done():
          continue  # still retrying a shard that is down: the other shards' beats go on
        if previous is not None and previous.exception() is not None and s not in self._beats_reported:
          log.warning("heartbeat to syncer shard %d failed: %s", s, previous.exception())  # after the wait
        self._beats[s] = self._beat_pool.submit(self._beat, s, learner_id, step_time_s, step, blocked)
        started[s] = self._beats[s]
      self._beats_reported = set()
    done, _ = concurrent.futures.wait(started.values(), timeout=BEAT_WAIT_S)
    for s, f in started.items():
      if f in done and f.exception() is not None:
        with self._lock:
          self._beats_reported.add(s)
        raise f.exception()
    return self._epochs.current()

  # ---- fragments ----

  def push(self, push: Push) -> PushReceipt:
    s = self._shard(push.fragment)
    push = dataclasses.replace(push, base_epoch=self._epochs.shard_epoch(s, push.base_epoch))
    receipt = self.shards[s].push(push)
    return dataclasses.replace(receipt, epoch=self._epochs.see(s, receipt.epoch))

  def pull(self, fragment: int, min_version: int, timeout_s: float = 0.0, have_version: int = -1,
           have_epoch: int = 0) -> Published | None:
    s = self._shard(fragment)
    published = self.shards[s].pull(fragment, min_version, timeout_s, have_version=have_version,
                                    have_epoch=self._epochs.shard_epoch(s, have_epoch))
    if published is None:
      return None
    return dataclasses.replace(published, epoch=self._epochs.see(s, published.epoch))

  # ---- status ----

  def shard_statuses(self) -> list[dict]:
    """Every shard's own status, in shard order."""
    return self._all(lambda t: t.status())

  def status(self) -> dict:
    """Every shard's status combined (`combine_status`), with the combined epoch; the combined status's
    `shards` holds each shard's own."""
    statuses = self.shard_statuses()
    for s, status in enumerate(statuses):
      self._epochs.see(s, int(status.get("epoch", 0)))
    return {**combine_status(statuses), "epoch": self._epochs.current()}

  def close(self) -> None:
    for t in self.shards:
      t.close()
    self._beat_pool.shutdown(wait=False, cancel_futures=True)
    self._calls.shutdown(wait=False, cancel_futures=True)

  def __enter__(self) -> ShardedTransport:
    return self

  def __exit__(self, *exc) -> None:
    self.close()

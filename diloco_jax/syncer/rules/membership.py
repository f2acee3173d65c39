"""Membership and liveness: who is a member, who is live, who counts toward quorums. Pure.

A learner joins with the run's fingerprint and holds a lease of `lease_s` seconds, renewed by every join
and heartbeat. A learner whose lease ran out, or that left, is not live: it does not count toward quorums
and its pushes are refused until it heartbeats (lapsed lease) or joins again (left). A live learner counts
only while it makes progress: its step counter moved, it said it was blocked on the syncer, or it pushed,
within the last `stall_s` seconds plus one of its own step times; so a stopped learner stops gating rounds
long before its lease lapses. Members gone for more than a lease are pruned (they join again).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from diloco_jax.protocol.reasons import Reason, shorten
from diloco_jax.syncer.rules.quorum import estimate_step_time
from diloco_jax.syncer.state import Member


def live(m: Member, now: float) -> bool:
  return not m.left and now <= m.lease_until


def progressing(m: Member, now: float, stall_s: float) -> bool:
  return now - m.progress_at <= stall_s + m.step_time_s


def counted(m: Member, now: float, stall_s: float) -> bool:
  """Whether the member counts toward quorums: live and making progress."""
  return live(m, now) and progressing(m, now, stall_s)


def live_ids(members: Mapping[int, Member], now: float) -> list[int]:
  return sorted(i for i, m in members.items() if live(m, now))


def counted_ids(members: Mapping[int, Member], now: float, stall_s: float) -> list[int]:
  return sorted(i for i, m in members.items() if counted(m, now, stall_s))


def id_problem(learner_id, num_learners: int) -> str | None:
  """Why `learner_id` is not one of this run's learners, or None if it is."""
  if isinstance(learner_id, int) and 0 <= learner_id < num_learners:
    return None
  return (f"learner id {shorten(learner_id)} is not one of this run's learners "
          f"[0, learners.num={num_learners})")


def joined(old: Member | None, now: float, lease_s: float) -> Member:
  """The member record of a learner that (re)joins now: a fresh lease; what it told before is kept."""
  if old is None:
    return Member(lease_until=now + lease_s, progress_at=now, step=None)
  return Member(lease_until=now + lease_s, progress_at=now, step_time_s=old.step_time_s, step=old.step,
                step_at=old.step_at, last_push=old.last_push, steps_merged=old.steps_merged,
                period_weights=old.period_weights, norms=old.norms, refused_in_row=old.refused_in_row,
                refused_total=old.refused_total)


def heartbeat_problem(m: Member | None, learner_id: int) -> tuple[str, str] | None:
  """(reason, message) when a heartbeat cannot renew a lease: the learner must join again."""
  if m is None:
    return (Reason.UNKNOWN_LEARNER, f"learner {learner_id} is not a member of this syncer (never joined, or "
            "pruned after its lease lapsed): join again")
  if m.left:
    return (Reason.NOT_MEMBER, f"learner {learner_id} left; join again")
  return None


def renewed(m: Member, now: float, lease_s: float, step_time_s: float, step: int | None,
            blocked: bool) -> Member:
  """The member after a heartbeat: lease renewed; `step_time_s` > 0 updates its step time, at most the
  lease (a larger claim would keep a stopped learner counted for as long: it counts as a lease); a moved
  step counter (or no counter at all, or `blocked`) is progress."""
  out = dataclasses.replace(m, lease_until=now + lease_s, expiry_counted=False, blocked=bool(blocked))
  if step_time_s > 0:
    out.step_time_s = min(float(step_time_s), lease_s)
  if step is None or step != m.step or blocked:
    out.progress_at, out.stall_counted = now, False
  if step is not None:
    out.step, out.step_at = int(step), now
  return out


@dataclasses.dataclass(frozen=True)
class Lapses:
  """What a tick notes about members: leases that ran out and stalls (each counted once), and the members
  to forget (gone for more than a lease)."""

  expired: tuple[int, ...]
  stalled: tuple[int, ...]
  pruned: tuple[int, ...]


def lapses(members: Mapping[int, Member], now: float, stall_s: float, lease_s: float) -> Lapses:
  expired = tuple(i for i, m in members.items() if not m.left and not live(m, now) and not m.expiry_counted)
  stalled = tuple(i for i, m in members.items()
                  if live(m, now) and not progressing(m, now, stall_s) and not m.stall_counted)
  pruned = tuple(i for i, m in members.items() if not live(m, now) and now > m.lease_until + lease_s)
  return Lapses(expired, stalled, pruned)


def step_time(members: Mapping[int, Member], now: float, stall_s: float) -> float:
  """The counted learners' typical step time (their reports' median; 0 before any report)."""
  return estimate_step_time([members[i].step_time_s for i in counted_ids(members, now, stall_s)])


def learner_step_time(members: Mapping[int, Member], learner_id: int, fallback: float) -> float:
  """A learner's reported step time, or `fallback` if it never reported one."""
  m = members.get(learner_id)
  return m.step_time_s if m is not None and m.step_time_s > 0 else fallback


def next_changes(members: Mapping[int, Member], now: float, stall_s: float) -> list[float]:
  """When a live member's lease lapses or its progress goes stale: either can lower an effective quorum or
  complete "everyone counted"."""
  times = []
  for m in members.values():
    if live(m, now):
      times.append(m.lease_until)
      if progressing(m, now, stall_s) and math.isfinite(stall_s):
        times.append(m.progress_at + stall_s + m.step_time_s)
  return times

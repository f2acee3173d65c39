"""Read-only views of the syncer state: the `status` reply and the journal record. Pure."""

from __future__ import annotations

import copy
import dataclasses

from diloco_jax.syncer.rules import admission, membership
from diloco_jax.syncer.rules.rounds import STATUS_IDS
from diloco_jax.syncer.state import SyncerState

STATUS_MEMBERS = 64  # members shown in detail by `status` (all are counted)


def journal_record(state: SyncerState, settings) -> dict:
  """What the journal holds: versions, rounds, epoch and counters, as JSON values."""
  return {"fingerprint": settings.fingerprint, "epoch": state.epoch, "versions": state.versions,
          "rounds": state.rounds, "counters": copy.deepcopy(state.counters),
          "open_contributions": sum(len(f.open.contributions) for f in state.fragments if f.open is not None)}


def status(state: SyncerState, settings, now: float) -> dict:
  """Members, versions, open rounds and counters, as plain JSON values. Bounded whatever the membership: at
  most `STATUS_MEMBERS` members in detail (live ones first) and `STATUS_IDS` ids per list, with counts of all.

  `since_start`: rounds closed since this core started, with their distinct contributors and grace waits
  summed. `goodput_estimate`: the syncer's view of goodput since it started, sum over members of (steps
  merged / P) x step time, over (learners provisioned x uptime): compute whose tokens reached the global
  model, as a fraction of the time the run held its learners.
  """
  s, members, stall_s = settings, state.members, settings.stall_s
  uptime = now - state.started
  provisioned = max(s.num_learners, len(members)) * uptime
  useful = sum(m.steps_merged * m.step_time_s for m in members.values()) / s.num_owned
  live = membership.live_ids(members, now)
  shown = live[:STATUS_MEMBERS]
  if len(shown) < STATUS_MEMBERS:
    shown += sorted(i for i in members if i not in set(live))[:STATUS_MEMBERS - len(shown)]
  return {
      "fingerprint": s.fingerprint,
      "epoch": state.epoch,
      "uptime_s": uptime,
      "since_start": dataclasses.asdict(state.since_start),
      "num_learners": s.num_learners,
      "goodput_estimate": useful / provisioned if provisioned > 0 else 0.0,
      "live": live[:STATUS_IDS],
      "counted": membership.counted_ids(members, now, stall_s)[:STATUS_IDS],
      "member_count": {"total": len(members), "live": len(live), "shown": len(shown)},
      "members": {str(i): _member(members[i], now, stall_s, s.num_owned) for i in sorted(shown)},
      "versions": state.versions,
      "owned": [p for p in range(s.num_fragments) if s.owns(p)],
      "rounds": state.rounds,
      "open_rounds": {str(p): {"contributors": f.open.contributors()[:STATUS_IDS],
                               "contributor_count": len(f.open.contributors()),
                               "contributions": len(f.open.contributions),
                               "deadline_in_s": None if f.open.deadline is None else f.open.deadline - now}
                      for p, f in enumerate(state.fragments) if f.open is not None},
      "step_time_s": membership.step_time(members, now, stall_s),
      "t_sync_s": [f.t_sync for f in state.fragments],
      "history": [dataclasses.asdict(h) for h in state.history[-8:]],
      "refused_repeatedly": admission.refused_repeatedly(members)[:STATUS_IDS],
      "counters": copy.deepcopy(state.counters),
  }


def _member(m, now: float, stall_s: float, num_owned: int) -> dict:
  return {"live": membership.live(m, now), "left": m.left, "step_time_s": m.step_time_s,
          "lease_left_s": max(m.lease_until - now, 0.0), "step": m.step,
          "step_ago_s": None if m.step_at is None else now - m.step_at, "blocked": m.blocked,
          "progressing": membership.progressing(m, now, stall_s),
          "last_push_ago_s": None if m.last_push is None else now - m.last_push,
          "steps_merged": m.steps_merged / num_owned, "refused_in_row": m.refused_in_row,
          "refused_total": m.refused_total}

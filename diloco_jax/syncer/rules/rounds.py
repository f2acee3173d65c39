"""Rounds: when a fragment's open round reaches its quorum, when it closes, and with what weights. Pure.

A round opens with its first contribution. With L counted learners it may close once
`effective_quorum(policy, L)` distinct learners contributed; it then stays open for the grace window
(`quorum.round_grace_s`, per learner: the contributors' arrival offsets and step times, and t_sync, the
fragment's close time) and closes at that deadline, or early once every counted learner contributed. A
round that waits only on learners blocked on other such rounds is a deadlock (`deadlocked`): after
`stall_s` it closes with what it holds. Closing weighs each push by `outer.merge_coefficients`: its raw
weight over W, the raw weight of one period of every learner the round answers for (with
`scale_partial_rounds` every counted learner), discounted by staleness (rounds closed since its base). A
learner's pushes in one round weigh together at most its largest one (`per_learner_capped`): one period.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence

import numpy as np

from diloco_jax.outer import merge as outer
from diloco_jax.syncer.rules import membership
from diloco_jax.syncer.rules.quorum import QuorumPolicy, effective_quorum, round_grace_s
from diloco_jax.syncer.state import FragmentState, Member, Round

STATUS_IDS = 1024  # ids listed per list in status replies and decision records; all are counted


@dataclasses.dataclass(frozen=True)
class Quorum:
  """What reaching the quorum fixes on a round: the deadline and the grace window's inputs."""

  quorum_at: float
  step_times_s: tuple[float, ...]
  t_sync_s: float
  grace_s: float
  deadline: float
  waited_for: tuple[int, ...]


def quorum_reached(rnd: Round, counted: set[int], policy: QuorumPolicy, members: Mapping[int, Member],
                   t_sync_s: float, now: float, stall_s: float) -> Quorum | None:
  """The round's quorum, once `effective_quorum` distinct learners contributed (else None). A contributor
  that never reported its step time gets the counted learners' typical one."""
  contributors = rnd.contributors()
  k = effective_quorum(policy, len(counted))
  if len(contributors) < k:
    return None
  quorum = contributors[:k]
  fallback_step_s = membership.step_time(members, now, stall_s)
  first = rnd.first_arrivals()
  quorum_at = first[quorum[-1]]
  step_times = tuple(membership.learner_step_time(members, i, fallback_step_s) for i in quorum)
  grace = round_grace_s(policy, [first[i] - rnd.opened for i in quorum], step_times, quorum_at - rnd.opened,
                        t_sync_s)
  return Quorum(quorum_at, step_times, t_sync_s, grace, quorum_at + grace,
                tuple(sorted(counted - set(contributors))))


def close_reason(rnd: Round, counted: set[int], now: float) -> str | None:
  """Why a round with a fixed deadline closes now ("all_in": every counted learner is in; "deadline"), or
  None while it stays open."""
  if rnd.deadline is None:
    return None
  if counted <= set(rnd.contributors()):
    return "all_in"
  return "deadline" if now >= rnd.deadline else None


def stuck_rounds(open_rounds: Mapping[int, Round], counted: set[int], members: Mapping[int, Member]) -> set[int]:
  """The fragments whose rounds no push can ever complete: each waits (short of its quorum) only on counted
  learners that are blocked on the syncer with all their work in rounds of that set. The largest such set.

  With tau = 0 (or a full in-flight limit) and K above 1, learners out of phase (one joined late, or came
  back) each wait for a round of one fragment that waits for the others' push of another."""
  contributors = {p: set(rnd.contributors()) for p, rnd in open_rounds.items()}
  holding: dict[int, set[int]] = collections.defaultdict(set)  # learner -> the open rounds with its work
  for p, ids in contributors.items():
    for i in ids:
      holding[i].add(p)
  missing = {p: counted - contributors[p] for p, rnd in open_rounds.items() if rnd.deadline is None}
  stuck = {p for p, waits in missing.items() if waits}

  def waits_on_stuck(i: int) -> bool:
    member = members.get(i)
    return member is not None and member.blocked and bool(holding[i]) and holding[i] <= stuck

  while True:
    free = {p for p in stuck if not all(waits_on_stuck(i) for i in missing[p])}
    if not free:
      return stuck
    stuck -= free


def deadlock_due(open_rounds: Mapping[int, Round], stall_s: float, now: float) -> int | None:
  """The fragment of the oldest round stuck for `stall_s` (heartbeats come at least every third of it, so no
  learner's blocked flag is stale by then), to close with what it holds."""
  due = [p for p, rnd in open_rounds.items() if rnd.stuck_since is not None and now - rnd.stuck_since >= stall_s]
  return min(due, key=lambda p: open_rounds[p].opened) if due else None


def staleness(fragment: FragmentState, base_version: int) -> int:
  """Rounds of the fragment closed since `base_version` was published (the version difference, an upper
  bound, for a version older than the ones remembered)."""
  published_at = fragment.version_round.get(base_version)
  if published_at is None:
    return max(fragment.version - base_version, 0)
  return fragment.rounds - published_at


def period_weight(rnd: Round, p: int, members: Mapping[int, Member], counted: Sequence[int],
                  scale_partial: bool) -> tuple[float, int]:
  """(W, learners answered for): one period weight per contributor and, with `scale_partial`, per counted
  learner (its latest push of this fragment's; one that never pushed it counts as the mean of the others)."""
  answered = set(rnd.contributors()) | (set(counted) if scale_partial else set())
  weights = {i: members[i].period_weights.get(p, 0.0) if i in members else 0.0 for i in answered}
  known = [w for w in weights.values() if w > 0]
  typical = statistics.fmean(known) if known else 0.0
  return sum(w if w > 0 else typical for w in weights.values()), len(answered)


@dataclasses.dataclass(frozen=True)
class Weights:
  """A round's merge weights: each push's coefficient (discounted), the share of a full round it holds."""

  coefficients: np.ndarray
  staleness: tuple[int, ...]
  period_weight: float
  answered: int
  share: float  # of a full round's work, before the staleness discount


def per_learner_capped(raw: np.ndarray, learner_ids: Sequence[int]) -> np.ndarray:
  """Raw weights with each learner's pushes scaled so that together they weigh at most its largest push
  (itself at most one period): copies of one period, under any keys, never add up to more than one."""
  out = np.asarray(raw, np.float64).copy()
  ids = np.asarray(learner_ids)
  for i in set(learner_ids):
    mine = ids == i
    total = float(out[mine].sum())
    largest = float(out[mine].max())
    if total > largest > 0:
      out[mine] *= largest / total
  return out


def capped_tokens(contributions) -> int:
  """The tokens a round's pushes add to `tokens_merged`: each learner's largest claim in the round."""
  most: dict[int, int] = {}
  for c in contributions:
    most[c.learner_id] = max(most.get(c.learner_id, 0), int(c.tokens))
  return sum(most.values())


def round_weights(rnd: Round, p: int, fragment: FragmentState, settings, members: Mapping[int, Member],
                  counted: Sequence[int]) -> Weights:
  """The coefficients `outer.merge_coefficients` gives the round's pushes."""
  cs = rnd.contributions
  raw = per_learner_capped(
      outer.raw_weights([c.weight_tokens for c in cs], [c.weight_steps for c in cs], settings.merge_rule),
      [c.learner_id for c in cs])
  period, answered = period_weight(rnd, p, members, counted, settings.scale_partial_rounds)
  stale = tuple(staleness(fragment, c.base_version) for c in cs)
  coefficients = outer.merge_coefficients(raw, period, answered, stale, settings.staleness_beta)
  share = float(np.sum(outer.merge_coefficients(raw, period, answered)))
  return Weights(coefficients, stale, period, answered, share)


def next_deadline(fragments: Sequence[FragmentState], members: Mapping[int, Member], now: float,
                  stall_s: float) -> float | None:
  """When the next tick is due, or None if no round is open: a round's deadline, a deadlock's bound, or
  (while a round waits for its quorum) a member's lease or progress running out."""
  rounds = [f.open for f in fragments if f.open is not None]
  times = [r.deadline for r in rounds if r.deadline is not None]
  if math.isfinite(stall_s):
    times += [r.stuck_since + stall_s for r in rounds if r.stuck_since is not None]
  if any(r.deadline is None for r in rounds):
    times += membership.next_changes(members, now, stall_s)
  return min(times) if times else None


def decision_record(fragment: int, version: int, rnd: Round, closed: float, why: str, counted: Sequence[int],
                    weights: Weights, t_sync_s: float, refused_repeatedly: Sequence[int] = ()) -> dict:
  """What a round decided, as plain JSON values (times in seconds from the round's opening).

  `contributions`: one entry per push in arrival order (learner, base version, staleness, steps, tokens,
  arrival, coefficient); `quorum_s`, `grace_s`, `step_times_s`, `t_sync_s`: the grace window and its inputs;
  `waited_for`: the counted learners not yet in at the quorum, `arrived_in_grace`: those that made it;
  `open_s`; `close`: "all_in", "deadline", "deadlock" or "stop"; `period_weight` and `answered_for`: W and
  the learners it sums over; `share`: the share of a full round the round held (before the discount);
  `moved`: the sum of the coefficients; `refused_repeatedly`: the learners whose latest pushes were all
  refused for merge safety (`admission.refused_repeatedly`).
  """
  first = rnd.first_arrivals()
  quorum_at = rnd.quorum_at if rnd.quorum_at is not None else rnd.opened
  return {
      "fragment": fragment, "version": version, "close": why,
      "contributors": list(first)[:STATUS_IDS], "live": list(counted)[:STATUS_IDS],
      "contributions": [
          {"learner": c.learner_id, "base_version": c.base_version, "staleness": int(s), "steps": c.steps,
           "tokens": c.tokens, "arrived_s": c.arrived - rnd.opened, "coefficient": float(w)}
          for c, s, w in zip(rnd.contributions, weights.staleness, weights.coefficients)],
      "quorum_s": quorum_at - rnd.opened, "grace_s": rnd.grace_s, "step_times_s": list(rnd.step_times_s),
      "t_sync_s": rnd.t_sync_s, "waited_for": list(rnd.waited_for)[:STATUS_IDS],
      "arrived_in_grace": [i for i in rnd.waited_for if i in first][:STATUS_IDS],
      "open_s": closed - rnd.opened, "merge_s": t_sync_s,
      "period_weight": float(weights.period_weight), "answered_for": weights.answered, "share": weights.share,
      "moved": float(np.sum(weights.coefficients)),
      "refused_repeatedly": list(refused_repeatedly)[:STATUS_IDS],
  }

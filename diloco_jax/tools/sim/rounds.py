"""Decoupled DiLoCo's outer loop, event by event: M learners pushing P staggered fragments to a syncer.

The learners follow the real learner's rules (`diloco_jax/learner/loop.py`): staggered fragments, a wait
for a fragment's previous sync and for the in-flight bound, blocked time while they wait. The syncer keeps
one open round per fragment, closed by `syncer.rules.quorum.round_close_time` (the project's own quorum
and grace rule, not a copy). Each learner computes only outside its failure stalls (from
`failures.simulate_job`), at its own speed, with Gamma-distributed step times. The rules in full:
`simulate`, and docs/simulator.md, "1. Goodput model" ("The outer loop").

Cost: O(pushes) heap events in Python. Only numpy: this module must import fast and never touch jax.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

from diloco_jax.syncer.rules import quorum as syncer_policy

# Event kinds; at equal times a round closes before a push (the core closes what is due before accepting:
# a push at a round's deadline belongs to the next round), and wake-ups come last.
_CLOSE, _PUSH, _WAKE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Schedule:
  """The outer loop's settings (the learner's `outer.*` fields and the syncer's policy)."""

  inner_steps: int  # H
  fragments: int  # P
  tau: int
  max_in_flight: int
  step_s: float  # a speed-1 learner's mean inner-step time
  step_cv: float
  t_sync_s: float
  policy: syncer_policy.QuorumPolicy

  def segment_steps(self) -> list[int]:
    """Inner steps between consecutive pushes over one period of H steps (they sum to H).

    The fragment offsets are `fragments.make_plan`'s: round(p H / P)."""
    offsets = sorted({int(round(p * self.inner_steps / self.fragments)) for p in range(self.fragments)})
    due = [o if o > 0 else self.inner_steps for o in offsets]  # step 0 is never due: offset 0 is due at H
    due.sort()
    return [b - a for a, b in zip([0] + due[:-1], due)]

  def fragment_order(self) -> list[int]:
    """Fragments in the order they fall due within a period (the one with offset 0 last, at step H)."""
    offsets = [int(round(p * self.inner_steps / self.fragments)) for p in range(self.fragments)]
    return sorted(range(self.fragments), key=lambda p: offsets[p] if offsets[p] > 0 else self.inner_steps)


@dataclasses.dataclass
class Learner:
  """One learner: its speed and the wall-time intervals when it computes nothing (failures)."""

  speed: float
  stall_starts: Sequence[float] = ()
  stall_ends: Sequence[float] = ()


@dataclasses.dataclass
class RoundsResult:
  """What the outer loop did over the window."""

  window_s: float
  blocked_s: np.ndarray  # per learner: compute time lost waiting on the outer loop (not inside stalls)
  available_s: np.ndarray  # per learner: wall time not stalled (the compute time it could have had)
  pushes: int
  late_pushes: int  # base behind the global at push time (the core's `late`)
  deferred_pushes: int  # a second push of a learner into one round, held for the next round
  contributors: np.ndarray  # distinct learners per closed round
  latency_s: np.ndarray  # close - open per round
  max_update_gap_s: float  # longest wall time without a round close of fragment 0
  unmerged_at_end: int  # pushes still in an open round (or held for the next) when the window ends
  records: dict | None = None  # with record=True: "pushes" and "rounds" (see `simulate`)

  @property
  def blocked_fraction(self) -> np.ndarray:
    """Per learner: blocked / available compute time."""
    return np.divide(self.blocked_s, self.available_s, out=np.zeros_like(self.blocked_s),
                     where=self.available_s > 0)


class _Clock:
  """Maps one learner's wall time to its compute capacity (wall time outside its stalls) and back."""

  def __init__(self, starts: Sequence[float], ends: Sequence[float]):
    self.starts, self.ends = list(starts), list(ends)
    cum = [0.0]
    for a, b in zip(self.starts, self.ends):
      cum.append(cum[-1] + (b - a))
    self.cum = cum  # stalled time before stall k
    self.compute_at_stall = [a - c for a, c in zip(self.starts, cum)]

  def capacity(self, wall: float) -> float:
    """Compute time available in [0, wall)."""
    i = bisect.bisect_right(self.starts, wall)
    if i and wall < self.ends[i - 1]:
      return self.compute_at_stall[i - 1]
    return wall - self.cum[i]

  def wall(self, capacity: float) -> float:
    """The wall time at which `capacity` seconds of compute are done (after any stall that starts there)."""
    return capacity + self.cum[bisect.bisect_right(self.compute_at_stall, capacity)]

  def stall_end(self, wall: float) -> float:
    """`wall`, or the end of the stall it falls in."""
    i = bisect.bisect_right(self.starts, wall)
    return self.ends[i - 1] if i and wall < self.ends[i - 1] else wall


class _Sync:
  """One push in flight: the learner waits on it (`result_at` None until its round closes)."""

  __slots__ = ("learner", "fragment", "pushed_at", "work_at", "result_at", "version", "waiting")

  def __init__(self, learner, fragment, pushed_at, work_at):
    self.learner, self.fragment, self.pushed_at, self.work_at = learner, fragment, pushed_at, work_at
    self.result_at = None
    self.version = None
    self.waiting = False  # the learner is blocked on this sync


class _Round:
  __slots__ = ("opened", "arrivals", "step_times", "members", "results", "gen")

  def __init__(self, opened):
    self.opened = opened
    self.arrivals: list[float] = []
    self.step_times: list[float] = []  # the arriving learner's mean step time, one per arrival
    self.members: set[int] = set()
    self.results: list[_Sync] = []  # syncs whose result is this round's publish
    self.gen = 0


def simulate(schedule: Schedule, learners: Sequence[Learner], window_s: float, rng: np.random.Generator,
             record: bool = False) -> RoundsResult:
  """Run the outer loop of `learners` for `window_s` seconds of wall time (with `record`: every push and
  round in `RoundsResult.records`).

  The learners:
    * fragment p is due every H inner steps, at steps s with s mod H == round(p H / P) (as `fragments.py`
      staggers them), so a learner pushes one fragment every H/P steps of its own compute;
    * before pushing fragment p it waits until its previous sync of p came back, and while `max_in_flight`
      fragments are pushed but not yet adopted it waits for the oldest; with tau = 0 it waits for every
      sync right after pushing. That wait is blocked time: the learner computes nothing;
    * a sync "comes back" as the learner's pull does: with the first published version after the
      learner's base. A push whose base is already behind the global (late) gets the current version at
      once; a fresh one waits for the close of the round it joined, plus t_sync (merge and publish).

  The syncer keeps one open round per fragment. A push joins the open round (or opens one); a learner is
  in a round at most once: a second push of the same learner waits for the next round (it is merged there,
  as a late contribution). The round closes when `syncer.rules.quorum.round_close_time` says so, evaluated
  on the round's arrivals (and their learners' step times) after each of them, with the learners alive at
  that moment.

  Each learner's wall time runs through its failure stalls: it computes only outside them. Inner steps
  vary with coefficient of variation `step_cv` (a segment of n steps takes a Gamma-distributed time, the
  exact sum of n Gamma steps), at the learner's own speed.
  """
  return _OuterLoop(schedule, learners, window_s, rng, record).run()


class _OuterLoop:
  """The event loop of `simulate`: the learners' and the syncer's state, and one method per event."""

  def __init__(self, schedule: Schedule, learners: Sequence[Learner], window_s: float, rng: np.random.Generator,
               record: bool):
    s = self.s = schedule
    m = self.m = len(learners)
    self.learners, self.window_s, self.rng, self.record = learners, window_s, rng, record
    self.segs = s.segment_steps()
    self.order = s.fragment_order()
    self.n_seg = len(self.segs)
    self.clocks = [_Clock(lr.stall_starts, lr.stall_ends) for lr in learners]
    self.step_times = [s.step_s / lr.speed for lr in learners]  # what each learner reports to the syncer
    self.tau_work = [s.tau * s.step_s / lr.speed for lr in learners]
    # Alive learners over time (stalled = not alive), for the policy's effective quorum.
    edges, deltas = [], []
    for c in self.clocks:
      edges += c.starts + c.ends
      deltas += [-1] * len(c.starts) + [1] * len(c.ends)
    eorder = sorted(range(len(edges)), key=edges.__getitem__)
    self.edge_t = [edges[i] for i in eorder]
    self.alive_after = list(np.cumsum([deltas[i] for i in eorder]) + m) if edges else []
    # Work (compute seconds) at which each learner's pushes fall due, drawn in chunks as needed.
    self.targets: list[list[float]] = [[] for _ in range(m)]
    self.heap: list = []
    self.seq = 0
    # Learner state.
    self.k_next = [0] * m  # index of the learner's next push
    self.blocked_c = [0.0] * m  # compute capacity lost to blocking so far
    self.block_from: list[float | None] = [None] * m
    self.after_push = [False] * m  # blocked right after a push (tau = 0) rather than before one
    self.in_flight: list[list[_Sync]] = [[] for _ in range(m)]  # oldest first
    self.base = [[0] * s.fragments for _ in range(m)]
    # Syncer state.
    self.version = [0] * s.fragments
    self.open_round: list[_Round | None] = [None] * s.fragments
    self.deferred: list[list[tuple[int, float]]] = [[] for _ in range(s.fragments)]
    self.contributors, self.latency, self.closes0 = [], [], [0.0]
    self.pushes = self.late = self.deferred_n = 0
    self.push_records, self.round_records = [], []

  def alive(self, t: float) -> int:
    i = bisect.bisect_right(self.edge_t, t)
    return int(self.alive_after[i - 1]) if i else self.m

  def target(self, j: int, k: int) -> float:
    s, tj = self.s, self.targets[j]
    while k >= len(tj):
      n = max(256, len(tj))
      steps = np.array([self.segs[(len(tj) + i) % self.n_seg] for i in range(n)], np.float64)
      mean = steps * s.step_s / self.learners[j].speed
      dur = self.rng.gamma(steps / s.step_cv ** 2, mean / steps * s.step_cv ** 2) if s.step_cv > 0 else mean
      start = tj[-1] if tj else 0.0
      tj.extend((start + np.cumsum(dur)).tolist())
    return tj[k]

  def schedule_event(self, t: float, kind: int, a: int, b: int = 0) -> None:
    if t <= self.window_s:
      heapq.heappush(self.heap, (t, kind, self.seq, a, b))
      self.seq += 1

  def evaluate(self, p: int, rnd: _Round, now: float) -> None:
    close = syncer_policy.round_close_time(self.s.policy, rnd.arrivals, max(self.alive(now), 1), rnd.step_times,
                                           self.s.t_sync_s)
    if close is not None:
      rnd.gen += 1
      self.schedule_event(max(close, now), _CLOSE, p, rnd.gen)

  def join_round(self, p: int, j: int, now: float, sync: _Sync | None) -> None:
    rnd = self.open_round[p]
    if rnd is None:
      rnd = self.open_round[p] = _Round(now)
    if j in rnd.members:
      # One push per learner per round: this one is merged in the next round.
      self.deferred[p].append((j, now))
      self.deferred_n += 1
    else:
      rnd.members.add(j)
      rnd.arrivals.append(now)
      rnd.step_times.append(self.step_times[j])
      self.evaluate(p, rnd, now)
    if sync is not None:
      rnd.results.append(sync)

  def block(self, j: int, now: float, until: float | None, sync: _Sync | None) -> None:
    """Learner j waits: until a known time, or until `sync`'s round publishes."""
    if self.block_from[j] is None:
      self.block_from[j] = now
    if until is not None:
      self.schedule_event(until, _WAKE, j)
    else:
      sync.waiting = True

  def unblock(self, j: int, now: float) -> None:
    if self.block_from[j] is not None:
      self.blocked_c[j] += self.clocks[j].capacity(now) - self.clocks[j].capacity(self.block_from[j])
      self.block_from[j] = None

  def next_push(self, j: int) -> None:
    self.k_next[j] += 1
    self.schedule_event(self.clocks[j].wall(self.target(j, self.k_next[j]) + self.blocked_c[j]), _PUSH, j)

  def try_push(self, j: int, now: float) -> None:
    s = self.s
    p = self.order[self.k_next[j] % self.n_seg]
    flight = self.in_flight[j]
    # Work done so far: frozen while the learner waits.
    work = self.clocks[j].capacity(now if self.block_from[j] is None else self.block_from[j]) - self.blocked_c[j]
    # Adopt what came back at least tau steps after its snapshot (the learner's `adopt_ready`).
    flight[:] = [x for x in flight if not (x.result_at is not None and x.result_at <= now
                                             and work >= x.work_at + self.tau_work[j])]
    # Due again before its previous sync came back: wait for it (then adopt it).
    mine = next((x for x in flight if x.fragment == p), None)
    while True:
      wait_on = mine if mine is not None else (flight[0] if len(flight) >= s.max_in_flight else None)
      if wait_on is None:
        break
      if wait_on.result_at is None or wait_on.result_at > now:
        self.block(j, now, wait_on.result_at, wait_on)
        return
      flight.remove(wait_on)  # done: adopted at once
      mine = None
    self.unblock(j, now)
    v, b = self.version[p], self.base[j][p]
    sync = _Sync(j, p, now, work)
    self.pushes += 1
    if b < v:
      # Late: the pull for a version after the base returns the current one at once.
      self.late += 1
      sync.result_at, sync.version = now, v
      self.base[j][p] = v
      self.join_round(p, j, now, None)
    else:
      self.join_round(p, j, now, sync)
    flight.append(sync)
    if self.record:
      self.push_records.append({"learner": j, "fragment": p, "at": now, "base": b, "late": b < v, "sync": sync})
    if s.tau == 0 and sync.result_at is None:
      self.after_push[j] = True
      self.block(j, now, None, sync)
      return
    self.next_push(j)

  def close(self, p: int, now: float) -> None:
    rnd = self.open_round[p]
    self.open_round[p] = None
    self.version[p] += 1
    published = now + self.s.t_sync_s
    self.contributors.append(len(rnd.members))
    self.latency.append(now - rnd.opened)
    if p == 0:
      self.closes0.append(now)
    if self.record:
      self.round_records.append({"fragment": p, "opened": rnd.opened, "arrivals": list(rnd.arrivals),
                                 "step_times": list(rnd.step_times),
                                 "members": sorted(rnd.members), "alive": self.alive(rnd.arrivals[-1]),
                                 "closed": now, "version": self.version[p]})
    for sync in rnd.results:
      sync.result_at, sync.version = published, self.version[p]
      self.base[sync.learner][p] = self.version[p]
      if sync.waiting:
        sync.waiting = False
        self.schedule_event(published, _WAKE, sync.learner)
    if self.deferred[p]:
      held, self.deferred[p] = self.deferred[p], []
      nxt = self.open_round[p] = _Round(now)
      for j, _ in held:
        if j not in nxt.members:
          nxt.members.add(j)
          nxt.arrivals.append(now)
          nxt.step_times.append(self.step_times[j])
      self.evaluate(p, nxt, now)

  def run(self) -> RoundsResult:
    """Every event up to the window's end, in time order; then the result."""
    for j in range(self.m):
      self.schedule_event(self.clocks[j].wall(self.target(j, 0)), _PUSH, j)
    heap, open_round, clocks, after_push = self.heap, self.open_round, self.clocks, self.after_push
    while heap:
      now, kind, _, a, b = heapq.heappop(heap)
      if kind == _CLOSE:
        rnd = open_round[a]
        if rnd is not None and rnd.gen == b:
          self.close(a, now)
        continue
      j = a
      if kind == _WAKE:
        resume = clocks[j].stall_end(now)
        if resume > now:  # woken inside a failure stall: go on when it ends
          self.schedule_event(resume, _WAKE, j)
          continue
        if after_push[j]:
          after_push[j] = False
          self.unblock(j, now)
          self.next_push(j)
          continue
      self.try_push(j, now)
    return self.result()

  def result(self) -> RoundsResult:
    window_s = self.window_s
    for j in range(self.m):
      self.unblock(j, window_s)
    available = np.array([c.capacity(window_s) for c in self.clocks])
    self.closes0.append(window_s)
    records = None
    if self.record:
      records = {"pushes": [{**r, "result_at": r["sync"].result_at, "result_version": r["sync"].version}
                            for r in self.push_records], "rounds": self.round_records}
      for r in records["pushes"]:
        del r["sync"]
    return RoundsResult(
        window_s=window_s, blocked_s=np.array(self.blocked_c), available_s=available, pushes=self.pushes,
        late_pushes=self.late, deferred_pushes=self.deferred_n, contributors=np.array(self.contributors, np.int64),
        latency_s=np.array(self.latency), max_update_gap_s=float(np.max(np.diff(self.closes0))),
        unmerged_at_end=sum(len(r.members) for r in self.open_round if r is not None)
        + sum(map(len, self.deferred)),
        records=records)


def lockstep_goodput(speeds: Sequence[float]) -> float:
  """Goodput if every learner ran at the slowest one's pace (K = M with no slack to absorb the gap): the
  mean over learners of slowest speed / own speed."""
  slowest = min(speeds)
  return float(np.mean([slowest / v for v in speeds]))


def pushes_per_second(schedule: Schedule, speed: float = 1.0) -> float:
  """Pushes per wall second of one learner at `speed` that never waits (cost planning)."""
  return len(schedule.segment_steps()) * speed / (schedule.inner_steps * schedule.step_s)

"""A round's close, applied to the syncer state: weigh, merge and step in place, publish one version.

The weights come from `rules/rounds.py`; the arithmetic is `outer.apply_round` (one chunked pass that
decodes, weighs, sums and takes the Nesterov step, all or nothing: a round whose result would hold a
non-finite value writes nothing and is refused whole); the publication is the downlink's
(`syncer/downlink.py`). The core calls `close_round` under its lock and journals what changed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np

from diloco_jax.outer import merge as outer
from diloco_jax.syncer.downlink import Downlink
from diloco_jax.syncer.rules import admission, membership, rounds
from diloco_jax.syncer.state import FragmentState, SyncerState

log = logging.getLogger(__name__)

T_SYNC_EMA = 0.2  # weight of the newest close time in t_sync
VERSIONS_REMEMBERED = 4096  # per fragment, the round and outlier reference of each recent version


def close_round(state: SyncerState, p: int, why: str, settings, downlink: Downlink,
                clock: Callable[[], float]) -> dict | None:
  """Merge and publish fragment p's open round; returns its decision record, or None if the round was
  refused (its result would hold a non-finite value: nothing changes but the counters, its contributions
  are dropped, and pulls waiting for the version it was to make get the current one)."""
  s, fragment = settings, state.fragments[p]
  rnd, fragment.open = fragment.open, None
  started = clock()
  cs = rnd.contributions
  for c in cs:
    record = state.keys.get(c.learner_id, {}).get(c.key) if c.key is not None else None
    if record is not None:
      record.settled = True
  counted = membership.counted_ids(state.members, started, s.stall_s)
  weights = rounds.round_weights(rnd, p, fragment, s, state.members, counted)
  full, pending_share = outer.share_after(fragment.pending_share, weights.share)
  # The fused pass normalizes its weights; the scale restores the coefficients' sum (0 for a round whose
  # pushes all claim no tokens: it moves nothing).
  moved = float(np.sum(weights.coefficients))
  result = outer.apply_round(
      fragment.global_vec, fragment.momentum, [c.encoded for c in cs],
      weights.coefficients if moved > 0 else np.ones_like(weights.coefficients), codec_name=s.codec,
      block=s.block, lr=s.outer_lr, mu=s.outer_momentum, rda=s.rda, norms=[c.norm for c in cs], scale=moved,
      threads=s.merge_threads, state_norms=(fragment.global_norm, fragment.momentum_norm),
      opened=fragment.cycle_open, full=full)
  if not result.applied:
    _refuse(state, p, rnd, result.nonfinite)
    return None
  fragment.global_norm, fragment.momentum_norm = result.global_norm, result.momentum_norm
  fragment.pending_share, fragment.cycle_open = pending_share, not full
  first = fragment.version + 1
  _publish(fragment, downlink.commit(p, first, fragment.global_vec, held=[c.base_version for c in cs],
                                           learners=[c.learner_id for c in cs]),
           s.sizes[p], state.members, p, started)
  took = clock() - started
  fragment.t_sync = took if fragment.t_sync == 0.0 else (1 - T_SYNC_EMA) * fragment.t_sync + T_SYNC_EMA * took
  _count(state, p, rnd, started)
  record = rounds.decision_record(p, first, rnd, started, why, counted, weights, took,
                                  admission.refused_repeatedly(state.members))
  if math.isfinite(result.coherence):  # RDA: how far the round's outer gradients point one way
    record["coherence"] = result.coherence
  if len(state.decisions) == state.decisions.maxlen:
    state.decisions_dropped += 1
  state.decisions.append(record)
  return record


def _publish(fragment: FragmentState, published: int, size: int, members, p: int, now: float) -> None:
  """The round is in the model: `published` new versions, each remembering its round and outlier reference."""
  first = fragment.version + 1
  fragment.rounds += 1
  fragment.version += published
  # Only references after warm-up are remembered: a push on a warm-up version gets today's (no base
  # version keeps the warm-up's looser bound).
  reference = admission.norm_reference(fragment, size, members, p, now)[0] if admission.warmed_up(fragment) else None
  for v in range(first, first + published):
    fragment.version_round[v] = fragment.rounds
    if reference is not None:
      fragment.version_reference[v] = reference
  for remembered in (fragment.version_round, fragment.version_reference):
    while len(remembered) > VERSIONS_REMEMBERED:
      del remembered[next(iter(remembered))]  # the oldest: versions are inserted in increasing order


def _count(state: SyncerState, p: int, rnd, started: float) -> None:
  cs, c = rnd.contributions, state.counters
  tokens = rounds.capped_tokens(cs)
  c["rounds"] += 1
  c["contributions_merged"] += len(cs)
  c["tokens_merged"] += tokens
  c["tokens_merged_by_fragment"][p] += tokens
  state.since_start.rounds += 1
  state.since_start.contributors += len(rnd.contributors())
  if rnd.quorum_at is not None:  # a round closed at a stop may not have reached its quorum
    state.since_start.grace_wait_s += max(started - rnd.quorum_at, 0.0)
  for x in cs:
    if x.learner_id in state.members:
      state.members[x.learner_id].steps_merged += x.steps


def _refuse(state: SyncerState, p: int, rnd, nonfinite) -> None:
  fragment = state.fragments[p]
  fragment.refused_at = fragment.version
  state.counters["rounds_refused"] += 1
  state.counters["contributions_dropped"] += len(rnd.contributions)
  log.error("fragment %d: round %d refused, its %s would hold non-finite values; dropped %d contributions "
            "from learners %s; version stays %d", p, fragment.rounds, " and ".join(nonfinite),
            len(rnd.contributions), rnd.contributors()[:rounds.STATUS_IDS], fragment.version)

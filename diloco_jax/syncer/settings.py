"""What a syncer core is fixed to for a run: `SyncerSettings`, built from the run's resolved spec (`from_spec`).

No defaults and no field checks here: every value comes from `config.resolve` (the one source of
defaults), after `config.validate` (the one check). Tests build settings the same way
(`tests/helpers.py:syncer_settings`), overriding only what a test is about.
"""

from __future__ import annotations

import dataclasses

from diloco_jax.syncer.rules.quorum import QuorumPolicy


@dataclasses.dataclass(frozen=True)
class SyncerSettings:
  """Everything the core needs, fixed for a run."""

  num_fragments: int
  sizes: tuple[int, ...]  # elements per fragment
  codec: str  # uplink (pushes)
  downlink_codec: str  # published global fragments
  block: int
  merge_rule: str
  rda: bool
  staleness_beta: float
  outer_lr: float
  outer_momentum: float
  policy: QuorumPolicy
  lease_s: float
  fingerprint: str
  scale_partial_rounds: bool
  # A learner without progress for this long (plus one of its steps) stops counting toward quorums.
  stall_s: float
  merge_threads: int  # threads of the chunked merge, outer step and downlink encode (`chunked`)
  num_learners: int  # learner ids lie in [0, num_learners)
  # Merge safety (module docstring of syncer/core.py); 0 = no bound (only tests and benchmarks).
  tokens_per_step: int  # the largest learner's tokens per inner step (its share of global_batch x seq_len)
  # The schedule's longest gap between two syncs of a fragment (H when periodic: `FragmentPlan.longest_gap`):
  # a merge weight counts at most this many steps (and their tokens).
  period_steps: int
  max_push_steps: int  # train.steps: no push may claim more
  max_norm_ratio: float  # outer.max_norm_ratio: the outlier bound k
  owned: tuple[int, ...] | None  # the fragments this core (one shard) serves; None: all of them
  downlink_history: int  # references kept per fragment (`syncer/downlink.py`); 1 = only the latest

  def __post_init__(self):
    assert len(self.sizes) == self.num_fragments, (self.sizes, self.num_fragments)

  def owns(self, p: int) -> bool:
    """Whether this core serves fragment p (every fragment, unsharded)."""
    return self.owned is None or p in self.owned

  @property
  def held_sizes(self) -> tuple[int, ...]:
    """Elements this core holds per fragment: the size of an owned fragment, 0 for another shard's."""
    return tuple(n if self.owns(p) else 0 for p, n in enumerate(self.sizes))

  @property
  def num_owned(self) -> int:
    return self.num_fragments if self.owned is None else len(self.owned)

  @classmethod
  def from_spec(cls, spec, plan, fingerprint: str, owned: tuple[int, ...] | None = None) -> SyncerSettings:
    """Settings from a resolved `config.RunSpec` and the run's `fragments.FragmentPlan` (its fragment sizes
    and longest gap); `owned`: a shard's fragments (`placement.assign_shards`)."""
    sizes = tuple(plan.size(p) for p in range(plan.num_fragments))
    return cls.for_fragments(spec, sizes, int(plan.longest_gap), fingerprint, owned)

  @classmethod
  def for_fragments(cls, spec, sizes: tuple[int, ...], period_steps: int, fingerprint: str,
                    owned: tuple[int, ...] | None = None) -> SyncerSettings:
    """`from_spec` with the plan's two contributions given: the fragment sizes and the schedule's longest gap
    (benchmarks and tests of synthetic fragments)."""
    o = spec.outer
    return cls(
        num_fragments=len(sizes),
        sizes=tuple(sizes),
        codec=o.codec,
        downlink_codec=o.downlink_codec,
        block=o.codec_block,
        merge_rule=o.merge,
        rda=bool(o.rda),
        staleness_beta=float(o.staleness_beta),
        outer_lr=float(o.lr),
        outer_momentum=float(o.momentum),
        policy=QuorumPolicy(min_quorum=o.min_quorum, tau=o.tau, gamma=o.grace_gamma, min_grace_s=o.min_grace_s,
                            max_grace_s=o.max_grace_s),
        lease_s=float(o.lease_s),
        fingerprint=fingerprint,
        scale_partial_rounds=bool(o.scale_partial_rounds),
        stall_s=float(o.stall_s),
        merge_threads=int(spec.syncer.merge_threads),
        num_learners=int(spec.learners.num),
        # The largest learner's batch: learners with more devices take more tokens per step.
        tokens_per_step=int(max(spec.learners.batches) * spec.data.seq_len),
        period_steps=int(period_steps),
        max_push_steps=int(spec.train.steps),
        max_norm_ratio=float(o.max_norm_ratio),
        owned=owned,
        downlink_history=int(o.downlink_history),
    )

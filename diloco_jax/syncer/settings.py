"""What a syncer core is fixed to for a run: `SyncerSettings`, built from the config (`from_config`)."""

from __future__ import annotations

import dataclasses
import math

from diloco_jax.config import schema as config_lib
from diloco_jax.outer import chunked
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import merge as outer
from diloco_jax.syncer.rules.quorum import QuorumPolicy


@dataclasses.dataclass(frozen=True)
class SyncerSettings:
  """Everything the core needs, fixed for a run."""

  num_fragments: int
  sizes: tuple[int, ...]  # elements per fragment
  codec: str = "fp32"  # uplink (pushes)
  downlink_codec: str = "fp32"  # published global fragments
  block: int = 64
  merge_rule: str = "tokens"
  rda: bool = False
  staleness_beta: float = 0.0
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  policy: QuorumPolicy = QuorumPolicy()
  lease_s: float = 30.0
  fingerprint: str = ""
  scale_partial_rounds: bool = False
  # A learner without progress for this long (plus one of its steps) stops counting toward quorums.
  stall_s: float = math.inf
  merge_threads: int = 1  # threads of the chunked merge, outer step and downlink encode (`chunked`)
  num_learners: int = 1  # learner ids lie in [0, num_learners)
  # Merge safety (module docstring); 0 = no bound (only tests build a core without them).
  tokens_per_step: int = 0  # the largest learner's tokens per inner step (its share of global_batch x seq_len)
  # H (periodic; else the schedule's longest gap): a merge weight counts at most this many steps (and their tokens)
  sync_every: int = 0
  max_push_steps: int = 0  # train.steps: no push may claim more
  max_norm_ratio: float = 0.0  # outer.max_norm_ratio: the outlier bound k
  owned: tuple[int, ...] | None = None  # the fragments this core (one shard) serves; None: all of them
  downlink_history: int = 1  # references kept per fragment (`syncer/downlink.py`); 1 = only the latest

  def __post_init__(self):
    if self.num_fragments < 1 or len(self.sizes) != self.num_fragments:
      raise ValueError(f"outer.num_fragments ({self.num_fragments}) must be >= 1 and match the "
                       f"{len(self.sizes)} fragment sizes")
    if any(s < 1 for s in self.sizes):
      raise ValueError(f"fragment sizes must be >= 1, got {self.sizes}")
    for field, name in (("outer.codec", self.codec), ("outer.downlink_codec", self.downlink_codec)):
      if name not in codec_lib.CODECS:
        raise ValueError(f"{field} must be one of {codec_lib.CODECS}, got {name!r}")
    if self.block < 1:
      raise ValueError(f"outer.codec_block must be >= 1, got {self.block}")
    if self.merge_rule not in outer.MERGE_RULES:
      raise ValueError(f"outer.merge must be one of {outer.MERGE_RULES}, got {self.merge_rule!r}")
    if self.staleness_beta < 0:
      raise ValueError(f"outer.staleness_beta must be >= 0, got {self.staleness_beta}")
    if self.lease_s <= 0:
      raise ValueError(f"outer.lease_s must be > 0, got {self.lease_s}")
    if not self.stall_s > 0:
      raise ValueError(f"outer.stall_s must be > 0, got {self.stall_s}")
    if self.merge_threads < 1:
      raise ValueError(f"syncer.merge_threads must be >= 1 (0 in a config: this host's cores), got "
                       f"{self.merge_threads}")
    if self.num_learners < 1:
      raise ValueError(f"learners.num must be >= 1, got {self.num_learners}")
    for field, value in (("tokens_per_step", self.tokens_per_step), ("sync_every", self.sync_every),
                         ("max_push_steps", self.max_push_steps)):
      if value < 0:
        raise ValueError(f"{field} must be >= 0 (0: no bound), got {value}")
    if not self.max_norm_ratio >= 0:
      raise ValueError(f"outer.max_norm_ratio must be >= 0 (0: off), got {self.max_norm_ratio}")
    if self.owned is not None and (not self.owned or list(self.owned) != sorted(set(self.owned))
                                   or not all(0 <= p < self.num_fragments for p in self.owned)):
      raise ValueError(f"owned fragments must be a sorted, non-empty set of fragments in "
                       f"[0, {self.num_fragments}), got {self.owned}")
    if self.downlink_history < 1:
      raise ValueError(f"outer.downlink_history must be >= 1, got {self.downlink_history}")

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
  def from_config(cls, config, plan, fingerprint: str, owned: tuple[int, ...] | None = None) -> "SyncerSettings":
    """Settings from `config.outer` and a `fragments.FragmentPlan`; `owned`: a shard's fragments."""
    o = config.outer
    return cls(
        num_fragments=plan.num_fragments,
        sizes=tuple(plan.size(p) for p in range(plan.num_fragments)),
        codec=o.codec,
        downlink_codec=o.downlink_codec,
        block=o.codec_block,
        merge_rule=o.merge,
        rda=bool(o.rda),
        staleness_beta=float(o.staleness_beta),
        outer_lr=float(o.lr),
        outer_momentum=float(o.momentum),
        policy=QuorumPolicy(min_quorum=o.min_quorum or config.learners.num, tau=o.tau, gamma=o.grace_gamma,
                            min_grace_s=o.min_grace_s, max_grace_s=o.max_grace_s),
        lease_s=float(o.lease_s),
        fingerprint=fingerprint,
        scale_partial_rounds=bool(o.scale_partial_rounds),
        stall_s=config_lib.stall_bound_s(config),
        merge_threads=int(config.syncer.merge_threads) or chunked.default_threads(),
        num_learners=int(config.learners.num),
        # The largest learner's batch: learners with more devices take more tokens per step.
        tokens_per_step=int(max(config_lib.learner_batch(config, i) for i in range(config.learners.num))
                            * config.data.seq_len),
        sync_every=int(plan.longest_gap),
        max_push_steps=int(config.train.steps),
        max_norm_ratio=float(o.max_norm_ratio),
        owned=owned,
        downlink_history=int(o.downlink_history or 2 * config.learners.num),
    )

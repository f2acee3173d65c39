"""What the syncer sends back: the reference-tracking downlink, per fragment.

With `downlink_codec` "fp32" every pull is answered with the global fragment Theta_v itself (kind "full").
With a lossy downlink codec the syncer never quantizes the weights: it publishes the quantized *change* of
what learners hold, from references R_v (exactly, bitwise, what a learner holds after adopting version v;
R_0 = Theta_0, which learners build bitwise-identically from the seed):

    payload_v = encode(Theta_v - R_u, downlink_codec),   R_v = R_u + decode(payload_v)

with u = parent(v), the version the round's contributors hold (`Downlink.parents`). The quantization
residual Theta_v - R_v is part of the next delta (error feedback), so R trails Theta by at most one
quantization error of one delta instead of drifting. A pull holding R_u of this syncer's epoch gets a
delta from u; any other gets the latest R in fp32 (`Downlink.answer`). The whole rule: docs/algorithm.md,
"Syncer", 7. Downlink; epochs: docs/operations.md, "Lifetimes, epochs and versions".
"""

from __future__ import annotations

import collections
import secrets
from collections.abc import Sequence

import numpy as np

from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.chunking import BufferPool
from diloco_jax.protocol.messages import Kind, Published

ANSWER_POOL_BYTES = 1 << 30  # full answers' buffers kept for reuse (a fresh one costs its page faults)


def new_epoch() -> int:
  """A random nonzero 63-bit syncer epoch (0 means "unknown" on the wire; 63 bits fit signed int64 too).

  A version number names a reference only within one syncer lifetime: a syncer restored from an older
  checkpoint counts its versions up again from there, and its new R_v is not the R_v a learner may still hold
  from before the crash. So the core draws a new epoch when it is created and again on every restore (never
  checkpointed), stamps it on every `Published`, and a puller names the epoch of its reference
  (`have_epoch`): a delta is served only to `have_epoch == epoch` (the one exception: `Downlink.answer`)."""
  return secrets.randbelow(2**63 - 1) + 1


class Downlink:
  """The references R of the last `history` versions, their deltas and the cached full answer of every
  fragment. Not thread-safe: the core calls it under its lock.

  R_v = R_u + decode(payload_v) is one float32 add, which the learner repeats on its device with the same
  IEEE rounding; the syncer does the subtraction, encode and add in one chunked pass
  (`codec.encode_residual`) into a reused buffer. Memory: `history` + 1 fragments per fragment, one of them
  a spare reused by the next commit; with `history` 1 only the latest reference is kept, updated in place,
  and every round is one delta from it. With fp32 the reference is the global fragment itself."""

  def __init__(self, sizes: Sequence[int], codec: str, block: int, initial: Sequence[np.ndarray], epoch: int,
               threads: int = 1, history: int = 1):
    if history < 1:
      raise ValueError(f"outer.downlink_history must be >= 1, got {history}")
    self.sizes, self.codec, self.block = tuple(sizes), codec, block
    self.is_delta = codec != "fp32"
    self.epoch = epoch
    self.threads = threads
    self.history = history
    # With fp32 the reference is the core's global array itself (shared: the core updates it in place,
    # under its lock, and commits before anyone reads it); with a delta codec they are this class's own
    # arrays, one per version kept.
    self._refs: list[dict[int, np.ndarray]] = [
        {0: np.array(f, np.float32).reshape(-1) if self.is_delta else np.asarray(f, np.float32).reshape(-1)}
        for f in initial]
    self._spare: list[np.ndarray | None] = [None] * len(self.sizes)  # an evicted reference, reused
    self._versions = [0] * len(self.sizes)
    self._deltas: list[dict[int, Published]] = [{} for _ in self.sizes]  # version -> delta from its parent
    self._full: list[Published | None] = [None] * len(self.sizes)  # built lazily: joins and laggards
    self._answers = BufferPool(ANSWER_POOL_BYTES)

  def parents(self, p: int, held: Sequence[int] = ()) -> list[int]:
    """The version a round's publication starts from: the one of `held` (its pushes' base versions) whose
    reference is kept that most of them hold (ties: the newest); else the latest. One per round: a
    syncer's versions are its rounds plus an offset fixed per lifetime (`protocol.EpochRecord`).

    Why the held version: with every learner in every round (K = M) each learner holds R_{v-1} when it
    waits for v, and the parent is v - 1. With a smaller quorum the global moves several times between two
    syncs of one learner, and a learner waits for the version that merges its own push while holding the
    version it last adopted, several behind. Publishing from the version the contributors hold gives each
    of them one delta per sync, as under K = M, not the full fragment or a chain; a contributor holding
    another version gets the full fragment."""
    counts = collections.Counter(v for v in held if v in self._refs[p])
    return sorted(counts, key=lambda v: (counts[v], v))[-1:] or [self._versions[p]]

  def commit(self, p: int, version: int, theta: np.ndarray, held: Sequence[int] = ()) -> int:
    """Publish fragment p's new global `theta` from `version` on; `held`: the base versions of the round's
    pushes (what its contributors hold while they wait for it). Returns how many versions that took: one
    (`parents` picks one base)."""
    self._full[p] = None
    refs = self._refs[p]
    if not self.is_delta:
      refs.clear()
      refs[version] = theta
      self._versions[p] = version
      return 1
    parents = self.parents(p, held)
    for i, parent in enumerate(parents):
      if self.history == 1:
        ref = refs.pop(parent)  # the only reference kept: updated in place (its version is gone)
        self._deltas[p].pop(parent, None)
      else:
        ref = self._spare[p] if self._spare[p] is not None else np.empty(self.sizes[p], np.float32)
        self._spare[p] = None
        np.copyto(ref, refs[parent])
      payload = codec_lib.encode_residual(theta, ref, self.codec, self.block, threads=self.threads)
      refs[version + i] = ref
      self._deltas[p][version + i] = Published(
          fragment=p, version=version + i, codec=self.codec, payload=payload,
          checksum=codec_lib.checksum(payload), kind=Kind.DELTA, base_version=parent, epoch=self.epoch)
    self._versions[p] = version + len(parents) - 1
    while len(refs) > self.history:
      oldest = min(refs)
      self._spare[p] = refs.pop(oldest)
      self._deltas[p].pop(oldest, None)
    return len(parents)

  def answer(self, p: int, min_version: int, have_version: int, have_epoch: int) -> Published:
    """The newest delta to a version >= `min_version` from the reference the puller holds, if one was
    published, else the full latest R.

    A pull holding R_u (`have_version == u`, `have_epoch` this syncer's epoch) gets the newest version >=
    `min_version` published as a delta from u (kind "delta", `base_version` u); any other gets the latest R
    in fp32 (kind "full": joins, restarts, learners further behind than the references kept). The one
    exception to the epoch match is `have_version == 0`: R_0 is the seed's initial fragment in every epoch
    of a run (a checkpoint at version 0 holds it unchanged), so fresh learners, which hold R_0 before they
    ever heard of an epoch, still get their first delta."""
    # R_0 is the same in every epoch; any later reference only matches ours if it came from this epoch.
    if self.is_delta and have_version >= 0 and (have_epoch == self.epoch or have_version == 0):
      for version in sorted(self._deltas[p], reverse=True):
        if version < min_version:
          break
        delta = self._deltas[p][version]
        if delta.base_version == have_version:
          return delta
    if self._full[p] is None:
      # R's bytes, in a buffer no earlier answer still being sent holds (reused, see BufferPool).
      payload = self._answers.take(4 * self.sizes[p]) or bytearray(4 * self.sizes[p])
      np.copyto(np.frombuffer(payload, "<f4"), self._refs[p][self._versions[p]])
      self._answers.adopt(payload)
      self._full[p] = Published(fragment=p, version=self._versions[p], codec="fp32", payload=payload,
                                checksum=codec_lib.checksum(payload), epoch=self.epoch)
    return self._full[p]

  def reference(self, p: int) -> np.ndarray:
    """A copy of the latest R: exactly what a learner that adopted the current version holds."""
    return self._refs[p][self._versions[p]].copy()

  # ---- checkpoints ----

  def state_dict(self) -> dict:
    """The latest references (with a delta codec; with fp32 R is Theta, not stored twice) and their deltas.
    Older references are not kept: after a restore, learners are in another epoch anyway."""
    latest = [self._deltas[p].get(v) for p, v in enumerate(self._versions)]
    return {
        "downlink_codec": self.codec,
        "references": [self.reference(p) for p in range(len(self.sizes))] if self.is_delta else None,
        "deltas": [None if d is None else {"version": d.version, "base_version": d.base_version,
                                           "payload": np.frombuffer(d.payload, np.uint8).copy()}
                   for d in latest],
    }

  @classmethod
  def renumbered(cls, old: Downlink, versions: Sequence[int]) -> Downlink:
    """`old`'s references, epoch and codec, published under new `versions` (a restored syncer raised to
    the versions its previous lifetime published). Its deltas are dropped: they name the old numbers."""
    out = cls.__new__(cls)
    out.__dict__.update(old.__dict__)  # the same arrays (`old` is dropped): no second copy of the references
    n = len(old.sizes)
    out._refs = [{int(v): old._refs[p][old._versions[p]]} for p, v in enumerate(versions)]
    out._versions = [int(v) for v in versions]
    out._deltas, out._full, out._spare = [{} for _ in range(n)], [None] * n, [None] * n
    return out

  @classmethod
  def restore(cls, state: dict, sizes: Sequence[int], codec: str, block: int, fragments: list[np.ndarray],
              versions: list[int], epoch: int, threads: int = 1, history: int = 1) -> Downlink:
    """The downlink of a checkpoint, under a new `epoch`. A checkpoint without references (an fp32 downlink
    run) gives R = Theta, which is what its learners were served; deltas of another codec are dropped."""
    out = cls(sizes, codec, block, fragments, epoch, threads, history)
    out._versions = list(versions)
    out._refs = [{v: refs[0]} for v, refs in zip(versions, out._refs)]  # R = Theta at the restored versions
    saved = state["references"]
    if not out.is_delta or saved is None:
      return out
    refs = [np.array(r, np.float32).reshape(-1) for r in saved]
    if [r.size for r in refs] != list(sizes):
      raise ValueError(f"checkpoint reference sizes {[r.size for r in refs]} != {list(sizes)}")
    out._refs = [{v: r} for v, r in zip(versions, refs)]
    if state["downlink_codec"] != codec:
      return out
    for p, d in enumerate(state["deltas"]):
      if d is None or int(d["version"]) != versions[p]:
        continue
      payload = np.asarray(d["payload"], np.uint8).tobytes()
      if len(payload) != codec_lib.encoded_size(sizes[p], codec, block):
        continue
      out._deltas[p][versions[p]] = Published(fragment=p, version=versions[p], codec=codec, payload=payload,
                                              checksum=codec_lib.checksum(payload), kind=Kind.DELTA,
                                              base_version=int(d["base_version"]), epoch=epoch)
    return out

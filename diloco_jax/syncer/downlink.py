"""What the syncer sends back: the reference-tracking downlink, per fragment.

With `downlink_codec` "fp32" every pull is answered with the global fragment Theta_v itself (kind "full").
With a lossy downlink codec the syncer never quantizes the weights: it publishes the quantized *change* of
what learners hold, from references R (exactly, bitwise, what a learner holds after adopting a version;
R_0 = Theta_0, which learners build bitwise-identically from the seed):

    payload = encode(Theta_v - R_b, downlink_codec),   R_(v, t) = R_b + decode(payload)

from the reference R_b each of the round's contributors holds: one version per round, one reference (tag t)
per base its contributors hold (`Downlink.commit`). The quantization residual is part of the next delta from
R_(v, t) (error feedback). A pull gets the delta to its version from the reference its learner holds, which
the downlink remembers per learner (`held_key`); any other gets the main R in fp32 (`Downlink.answer`).
docs/algorithm.md, "Syncer", 7. Downlink; epochs: docs/operations.md, "Lifetimes, epochs and versions".
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


Key = tuple[int, int]  # a reference: (version, tag); tag 0 is the version's main reference
MAIN = 0


class Downlink:
  """The references R of the last `history` versions (per version, one per base its round's contributors
  held), their deltas and the cached full answer of every fragment, and which reference each learner was
  served of each version kept. Not thread-safe: the core calls it under its lock.

  R_(v, t) = R_b + decode(payload) is one float32 add, which the learner repeats on its device with the
  same IEEE rounding; the syncer does the subtraction, encode and add in one chunked pass
  (`codec.encode_residual`) into a reused buffer. Memory: `history` + 1 fragments per fragment (references
  of every tag count), one of them a spare reused by the next commit; with `history` 1 only the latest
  reference is kept, updated in place, and every round is one delta from it (a contributor on another base
  gets the full fragment). With fp32 the reference is the global fragment itself."""

  def __init__(self, sizes: Sequence[int], codec: str, block: int, initial: Sequence[np.ndarray], epoch: int,
               threads: int = 1, history: int = 1):
    if history < 1:
      raise ValueError(f"outer.downlink_history must be >= 1, got {history}")
    self.sizes, self.codec, self.block = tuple(sizes), codec, block
    self.is_delta = codec != "fp32"
    self.epoch = epoch
    self.threads = threads
    self.history = history
    n = len(self.sizes)
    # With fp32 the reference is the core's global array itself (shared: the core updates it in place,
    # under its lock, and commits before anyone reads it); with a delta codec they are this class's own
    # arrays, one per reference kept.
    self._refs: list[dict[Key, np.ndarray]] = [
        {(0, MAIN): np.array(f, np.float32).reshape(-1) if self.is_delta else np.asarray(f, np.float32).reshape(-1)}
        for f in initial]
    self._spare: list[np.ndarray | None] = [None] * n  # an evicted reference, reused
    self._versions = [0] * n
    self._deltas: list[dict[Key, Published]] = [{} for _ in range(n)]  # reference -> its delta from its parent
    self._parent: list[dict[Key, Key]] = [{} for _ in range(n)]
    self._held: list[dict[int, dict[int, int]]] = [{} for _ in range(n)]  # learner -> {version: tag served}
    self._full: list[Published | None] = [None] * n  # built lazily: joins and laggards
    self._answers = BufferPool(ANSWER_POOL_BYTES)

  def held_key(self, p: int, learner: int | None, version: int) -> Key:
    """The reference `learner` holds when it holds `version`: the one it was served of that version (its
    first answer for it fixes it), else the main one (also for an unknown learner, None)."""
    tags = self._held[p].get(learner, {}) if learner is not None else {}
    return version, tags.get(version, MAIN)

  def parents(self, p: int, held: Sequence[int] = (), learners: Sequence[int] | None = None) -> list[Key]:
    """The references a round's publication starts from, the main one first: of the references its
    contributors hold (`held`: their pushes' base versions, `learners`: who pushed them; `held_key`) those
    kept, the one most of them hold first (ties: the newest), then one per other such reference (with
    `history` 1 only the first); none kept: the latest.

    Why the held references: with every learner in every round (K = M) each learner holds R_{v-1} when it
    waits for v, and the parent is v - 1. With a smaller quorum the global moves several times between two
    syncs of one learner, and a round's contributors may hold different versions. Publishing from each
    reference a contributor holds gives each of them one delta per sync, as under K = M, not the full
    fragment or a chain, under one version number per round (recovery numbers versions as rounds + an
    offset per lifetime, `protocol.EpochRecord`)."""
    learners = list(learners) if learners is not None else [None] * len(held)
    keys = [self.held_key(p, i, v) for v, i in zip(held, learners)]
    counts = collections.Counter(k for k in keys if k in self._refs[p])
    order = sorted(counts, key=lambda k: (-counts[k], -k[0], k[1]))
    return order[: 1 if self.history == 1 else self.history] or [(self._versions[p], MAIN)]

  def commit(self, p: int, version: int, theta: np.ndarray, held: Sequence[int] = (),
             learners: Sequence[int] | None = None) -> int:
    """Publish fragment p's new global `theta` as `version`, from every reference in `parents` (`held`: the
    base versions of the round's pushes, `learners` their senders'). Returns how many versions that took:
    one, whatever the references (recovery's numbering)."""
    self._full[p] = None
    refs = self._refs[p]
    if not self.is_delta:
      refs.clear()
      refs[(version, MAIN)] = theta
      self._versions[p] = version
      return 1
    for tag, parent in enumerate(self.parents(p, held, learners)):
      if self.history == 1:
        ref = refs.pop(parent)  # the only reference kept: updated in place (its version is gone)
        self._forget(p, parent)
      else:
        ref = self._spare[p] if self._spare[p] is not None else np.empty(self.sizes[p], np.float32)
        self._spare[p] = None
        np.copyto(ref, refs[parent])
      payload = codec_lib.encode_residual(theta, ref, self.codec, self.block, threads=self.threads)
      refs[(version, tag)] = ref
      self._parent[p][(version, tag)] = parent
      self._deltas[p][(version, tag)] = Published(
          fragment=p, version=version, codec=self.codec, payload=payload,
          checksum=codec_lib.checksum(payload), kind=Kind.DELTA, base_version=parent[0], epoch=self.epoch)
    self._versions[p] = version
    while len(refs) > self.history:
      oldest = min(refs)
      self._spare[p] = refs.pop(oldest)
      self._forget(p, oldest)
    return 1

  def _forget(self, p: int, key: Key) -> None:
    """A reference no longer kept: its delta, its parent, and the learners' records of its version."""
    self._deltas[p].pop(key, None)
    self._parent[p].pop(key, None)
    if not any(k[0] == key[0] for k in self._refs[p]):
      for tags in self._held[p].values():
        tags.pop(key[0], None)

  def answer(self, p: int, min_version: int, have_version: int, have_epoch: int,
             learner: int | None = None) -> Published:
    """The newest delta to a version >= `min_version` from the reference the puller holds, if one was
    published, else the full latest R.

    A pull holding R_u (`have_version == u`, `have_epoch` this syncer's epoch; which of u's references:
    `held_key` of `learner`) gets the newest version >= `min_version` published as a delta from it (kind
    "delta", `base_version` u); any other gets the latest R in fp32 (kind "full": joins, restarts, learners
    further behind than the references kept). The one exception to the epoch match is `have_version == 0`:
    R_0 is the seed's initial fragment in every epoch of a run (a checkpoint at version 0 holds it
    unchanged), so fresh learners, which hold R_0 before they ever heard of an epoch, still get their first
    delta. A learner's first answer for a version fixes which of its references it holds: any later answer
    of that version to it (a retry, a full fetch) lands on the same one, so a pull under its id, whatever it
    claims, can cost it bytes but never desynchronize it."""
    # R_0 is the same in every epoch; any later reference only matches ours if it came from this epoch.
    if self.is_delta and have_version >= 0 and (have_epoch == self.epoch or have_version == 0):
      have = self.held_key(p, learner, have_version)
      for key in sorted(self._deltas[p], reverse=True):
        if key[0] < min_version:
          break
        if self._parent[p].get(key) == have and self._fixed(p, learner, key):
          return self._served(p, learner, key, self._deltas[p][key])
    key = self.held_key(p, learner, self._versions[p])
    if key[1] != MAIN and key in self._refs[p]:  # this learner holds another reference of the latest version
      return self._served(p, learner, key, self._full_answer(p, key, pooled=False))
    if self._full[p] is None:
      self._full[p] = self._full_answer(p, (self._versions[p], MAIN), pooled=True)
    return self._served(p, learner, (self._versions[p], MAIN), self._full[p])

  def _fixed(self, p: int, learner: int | None, key: Key) -> bool:
    """Whether `learner` may be served reference `key`: it holds no other reference of that version (an
    unknown one, which nothing is remembered of, only main references)."""
    if learner is None:
      return key[1] == MAIN
    return self._held[p].get(learner, {}).get(key[0], key[1]) == key[1]

  def _served(self, p: int, learner: int | None, key: Key, published: Published) -> Published:
    if learner is not None and self.is_delta:
      self._held[p].setdefault(learner, {}).setdefault(key[0], key[1])
    return published

  def _full_answer(self, p: int, key: Key, pooled: bool) -> Published:
    """Reference `key` in fp32; `pooled`: in a buffer no earlier answer still being sent holds (reused, see
    BufferPool)."""
    size = 4 * self.sizes[p]
    payload = (self._answers.take(size) if pooled else None) or bytearray(size)
    np.copyto(np.frombuffer(payload, "<f4"), self._refs[p][key])
    if pooled:
      self._answers.adopt(payload)
    return Published(fragment=p, version=key[0], codec="fp32", payload=payload,
                     checksum=codec_lib.checksum(payload), epoch=self.epoch)

  def reference(self, p: int) -> np.ndarray:
    """A copy of the latest R: exactly what a learner that adopted the current version holds."""
    return self._refs[p][(self._versions[p], MAIN)].copy()

  # ---- checkpoints ----

  def state_dict(self) -> dict:
    """The latest references (with a delta codec; with fp32 R is Theta, not stored twice) and their deltas.
    Older references are not kept: after a restore, learners are in another epoch anyway."""
    latest = [self._deltas[p].get((v, MAIN)) for p, v in enumerate(self._versions)]
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
    out._refs = [{(int(v), MAIN): old._refs[p][(old._versions[p], MAIN)]} for p, v in enumerate(versions)]
    out._versions = [int(v) for v in versions]
    out._deltas, out._full, out._spare = [{} for _ in range(n)], [None] * n, [None] * n
    out._parent, out._held = [{} for _ in range(n)], [{} for _ in range(n)]
    return out

  @classmethod
  def restore(cls, state: dict, sizes: Sequence[int], codec: str, block: int, fragments: list[np.ndarray],
              versions: list[int], epoch: int, threads: int = 1, history: int = 1) -> Downlink:
    """The downlink of a checkpoint, under a new `epoch`. A checkpoint without references (an fp32 downlink
    run) gives R = Theta, which is what its learners were served; deltas of another codec are dropped."""
    out = cls(sizes, codec, block, fragments, epoch, threads, history)
    out._versions = list(versions)
    # R = Theta at the restored versions
    out._refs = [{(v, MAIN): refs[(0, MAIN)]} for v, refs in zip(versions, out._refs)]
    saved = state["references"]
    if not out.is_delta or saved is None:
      return out
    refs = [np.array(r, np.float32).reshape(-1) for r in saved]
    if [r.size for r in refs] != list(sizes):
      raise ValueError(f"checkpoint reference sizes {[r.size for r in refs]} != {list(sizes)}")
    out._refs = [{(v, MAIN): r} for v, r in zip(versions, refs)]
    if state["downlink_codec"] != codec:
      return out
    for p, d in enumerate(state["deltas"]):
      if d is None or int(d["version"]) != versions[p]:
        continue
      payload = np.asarray(d["payload"], np.uint8).tobytes()
      if len(payload) != codec_lib.encoded_size(sizes[p], codec, block):
        continue
      # Served only from R_0 (the seed's, the same in every epoch); any other parent is another epoch's.
      out._parent[p][(versions[p], MAIN)] = (int(d["base_version"]), MAIN)
      out._deltas[p][(versions[p], MAIN)] = Published(fragment=p, version=versions[p], codec=codec, payload=payload,
                                              checksum=codec_lib.checksum(payload), kind=Kind.DELTA,
                                              base_version=int(d["base_version"]), epoch=epoch)
    return out

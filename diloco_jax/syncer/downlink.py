"""What the syncer sends back: the reference-tracking downlink, per fragment.

With `downlink_codec` "fp32" every pull is answered with the global fragment Theta_v itself (kind "full").
With a lossy downlink codec the syncer never quantizes the weights: it publishes the quantized *change* of
what learners hold. It keeps, per fragment, the reference R_v: exactly (bitwise, float32) what a learner
holds after adopting version v, with R_0 = Theta_0 (learners build the initial fragment bitwise-identically
from the seed). On each commit

    payload_v = encode(Theta_v - R_{v-1}, downlink_codec),   R_v = R_{v-1} + decode(payload_v)

(one float32 add, which the learner repeats on its device with the same IEEE rounding; the syncer does
both steps in place in one chunked pass, `codec.encode_residual`). The
quantization residual Theta_v - R_v is part of the next delta (error feedback), so R trails Theta by at most
one quantization error of one delta instead of drifting. A pull that says it holds R_{v-1}
(`have_version == v - 1`) gets the delta (kind "delta", `base_version` v - 1); any other gets R_v in fp32
(kind "full": joins, restarts, learners that fell more than one version behind). Only the latest delta is
kept, so the syncer holds about Theta, momentum, R and a cached full payload per fragment.

Epochs. A version number names a reference only within one syncer lifetime: a syncer restored from an
older checkpoint counts its versions up again from there, and its new R_v is not the R_v a learner may
still hold from before the crash. So the core draws a random nonzero 63-bit epoch when it is created and
again on every restore (never checkpointed), stamps it on every `Published`, and a puller names the epoch of
its reference too (`have_epoch`): the delta is served only to `have_version == v - 1` with
`have_epoch == epoch`. The one exception is `have_version == 0`: R_0 is the seed's initial fragment in
every epoch of a run (a checkpoint at version 0 holds it unchanged), so fresh learners, which hold R_0
before they ever heard of an epoch, still get their first delta.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import numpy as np

from diloco_jax import codec as codec_lib
from diloco_jax.protocol import BufferPool, Published

ANSWER_POOL_BYTES = 1 << 30  # full answers' buffers kept for reuse (a fresh one costs its page faults)


def new_epoch() -> int:
  """A random nonzero 63-bit syncer epoch (0 means "unknown" on the wire; 63 bits fit signed int64 too)."""
  return secrets.randbelow(2**63 - 1) + 1


class Downlink:
  """The references R, the latest delta and the cached full answer of every fragment. Not thread-safe:
  the core calls it under its lock."""

  def __init__(self, sizes: Sequence[int], codec: str, block: int, initial: Sequence[np.ndarray], epoch: int,
               threads: int = 1):
    self.sizes, self.codec, self.block = tuple(sizes), codec, block
    self.is_delta = codec != "fp32"
    self.epoch = epoch
    self.threads = threads
    # With fp32 the reference is the core's global array itself (shared: the core updates it in place,
    # under its lock, and commits before anyone reads it); with a delta codec it is this class's own copy,
    # updated in place by `commit`.
    self._refs = [np.array(f, np.float32).reshape(-1) if self.is_delta else np.asarray(f, np.float32).reshape(-1)
                  for f in initial]
    self._versions = [0] * len(self.sizes)
    self._deltas: list[Published | None] = [None] * len(self.sizes)  # the latest version's delta
    self._full: list[Published | None] = [None] * len(self.sizes)  # built lazily: joins and laggards
    self._answers = BufferPool(ANSWER_POOL_BYTES)

  def commit(self, p: int, version: int, theta: np.ndarray) -> None:
    """Publish fragment p's new global `theta` at `version`."""
    self._versions[p] = version
    self._full[p] = None
    if not self.is_delta:
      self._refs[p] = theta
      return
    payload = codec_lib.encode_residual(theta, self._refs[p], self.codec, self.block, threads=self.threads)
    self._deltas[p] = Published(fragment=p, version=version, codec=self.codec, payload=payload,
                                checksum=codec_lib.checksum(payload), kind="delta", base_version=version - 1,
                                epoch=self.epoch)

  def answer(self, p: int, have_version: int, have_epoch: int) -> Published:
    """The delta if the puller holds this epoch's R_{v-1} and we have that delta, else the full R_v."""
    delta = self._deltas[p]
    # R_0 is the same in every epoch; any later reference only matches ours if it came from this epoch.
    same_reference = have_epoch == self.epoch or have_version == 0
    if (delta is not None and delta.version == self._versions[p] and have_version >= 0
        and have_version == delta.base_version and same_reference):
      return delta
    if self._full[p] is None:
      # R_v's bytes, in a buffer no earlier answer still being sent holds (reused, see BufferPool).
      payload = self._answers.take(4 * self.sizes[p]) or bytearray(4 * self.sizes[p])
      np.copyto(np.frombuffer(payload, "<f4"), self._refs[p])
      self._answers.adopt(payload)
      self._full[p] = Published(fragment=p, version=self._versions[p], codec="fp32", payload=payload,
                                checksum=codec_lib.checksum(payload), epoch=self.epoch)
    return self._full[p]

  def reference(self, p: int) -> np.ndarray:
    """A copy of R_v: exactly what a learner that adopted the current version holds."""
    return self._refs[p].copy()

  # ---- checkpoints ----

  def state_dict(self) -> dict:
    """References (with a delta codec; with fp32 R is Theta, not stored twice) and the latest deltas."""
    return {
        "downlink_codec": self.codec,
        "references": [r.copy() for r in self._refs] if self.is_delta else None,
        "deltas": [None if d is None else {"version": d.version, "base_version": d.base_version,
                                           "payload": np.frombuffer(d.payload, np.uint8).copy()}
                   for d in self._deltas],
    }

  @classmethod
  def renumbered(cls, old: "Downlink", versions: Sequence[int]) -> "Downlink":
    """`old`'s references, epoch and codec, published under new `versions` (a restored syncer raised to
    the versions its previous lifetime published). Its deltas are dropped: they name the old numbers."""
    out = cls(old.sizes, old.codec, old.block, old._refs, old.epoch, old.threads)
    out._refs = old._refs  # the same arrays (`old` is dropped): no second copy of the references
    out._versions = [int(v) for v in versions]
    return out

  @classmethod
  def restore(cls, state: dict, sizes: Sequence[int], codec: str, block: int, fragments: list[np.ndarray],
              versions: list[int], epoch: int, threads: int = 1) -> "Downlink":
    """The downlink of a checkpoint, under a new `epoch`. A checkpoint without references (an fp32 downlink
    run) gives R = Theta, which is what its learners were served; deltas of another codec are dropped."""
    out = cls(sizes, codec, block, fragments, epoch, threads)
    out._versions = list(versions)
    saved = state["references"]
    if not out.is_delta or saved is None:
      return out
    refs = [np.array(r, np.float32).reshape(-1) for r in saved]
    if [r.size for r in refs] != list(sizes):
      raise ValueError(f"checkpoint reference sizes {[r.size for r in refs]} != {list(sizes)}")
    out._refs = refs
    if state["downlink_codec"] != codec:
      return out
    for p, d in enumerate(state["deltas"]):
      if d is None or int(d["version"]) != versions[p]:
        continue
      payload = np.asarray(d["payload"], np.uint8).tobytes()
      if len(payload) != codec_lib.encoded_size(sizes[p], codec, block):
        continue
      out._deltas[p] = Published(fragment=p, version=versions[p], codec=codec, payload=payload,
                                 checksum=codec_lib.checksum(payload), kind="delta",
                                 base_version=int(d["base_version"]), epoch=epoch)
    return out

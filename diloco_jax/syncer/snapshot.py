"""The syncer state as a checkpoint holds it (`state_dict`), and back (`restore`).

A checkpoint holds the global fragments, their Nesterov momenta (and an open cycle of partial rounds),
versions, rounds, t_sync, counters, the lifetime history, the idempotency keys of settled pushes (and the
sequence below which each learner process's keys are refused), and with
a delta downlink its references and latest deltas. Not held: membership (learners rejoin) and open rounds
(a restore drops them; a stopping syncer closes them first; their learners push that work again). Another
shard's fragments are `None` (orbax saves no zero-size array).
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import numpy as np

from diloco_jax.outer import chunked
from diloco_jax.outer import merge as outer
from diloco_jax.protocol.messages import PushReceipt
from diloco_jax.syncer.downlink import Downlink
from diloco_jax.syncer.rules import recovery
from diloco_jax.syncer.state import FragmentState, KeyRecord, SyncerState, merge_counters


def state_dict(state: SyncerState, downlink: Downlink, settings) -> dict:
  """What a syncer checkpoint holds (copies; see the module docstring)."""
  held = settings.owns
  refs = downlink.state_dict()
  if refs["references"] is not None:
    refs = {**refs, "references": [r if held(p) else None for p, r in enumerate(refs["references"])]}
  fragments = state.fragments
  return {
      "fragments": [f.global_vec.copy() if held(p) else None for p, f in enumerate(fragments)],
      "opt_states": [f.momentum.copy() if held(p) else None for p, f in enumerate(fragments)],
      "cycle_open": [f.cycle_open for f in fragments],
      "pending_shares": [f.pending_share for f in fragments],
      "versions": state.versions,
      "rounds": state.rounds,
      "t_sync": [f.t_sync for f in fragments],
      "counters": copy.deepcopy(state.counters),
      "fingerprint": settings.fingerprint,
      "owned": None if settings.owned is None else list(settings.owned),
      "history": [[h.epoch, list(h.start_rounds), list(h.version_offsets)] for h in state.history],
      # [learner, incarnation, sequence, checksum, fragment, round, late, epoch that accepted it, version]
      "push_keys": [[i, *key, r.checksum, r.receipt.fragment, r.receipt.round, r.receipt.late, r.receipt.epoch,
                     r.receipt.version]
                    for i, keys in sorted(state.keys.items()) for key, r in keys.items() if r.settled],
      # [learner, incarnation, the highest sequence whose key was dropped]: older keys stay refused
      "push_key_floors": [[i, incarnation, floor] for i, floors in sorted(state.key_floors.items())
                          for incarnation, floor in floors.items()],
      **refs,
  }


def _check(saved: dict, settings) -> None:
  if saved["fingerprint"] != settings.fingerprint:
    raise ValueError(f"checkpoint fingerprint {saved['fingerprint']!r} != run {settings.fingerprint!r}")
  owned = saved.get("owned")
  if (None if owned is None else tuple(int(p) for p in owned)) != settings.owned:
    raise ValueError(f"checkpoint of a syncer owning fragments {'all' if owned is None else list(owned)}, this "
                     f"one owns {'all' if settings.owned is None else list(settings.owned)} (another shard's "
                     f"workdir, or another shard count)")


def restore(saved: dict, settings, epoch: int, started: float) -> tuple[SyncerState, Downlink]:
  """A state (without members) and downlink from a checkpoint's `state_dict`, in the new lifetime `epoch`.
  Raises ValueError when the checkpoint is of another run or shard, or its shapes do not fit."""
  s, n = settings, settings.num_fragments
  _check(saved, s)
  empty = np.zeros(0, np.float32)  # what a shard's checkpoint holds (None) for another shard's fragment
  held = lambda xs: None if xs is None else [empty if x is None else x for x in xs]  # noqa: E731
  saved = {**saved, "fragments": held(saved["fragments"]), "opt_states": held(saved["opt_states"]),
           "references": held(saved.get("references"))}
  globals_ = [np.array(f, np.float32).reshape(-1) for f in saved["fragments"]]
  if [f.size for f in globals_] != list(s.held_sizes):
    raise ValueError(f"checkpoint fragment sizes {[f.size for f in globals_]} != {list(s.held_sizes)}")
  momenta = [outer.momentum_from_state(st, f.size) for f, st in zip(globals_, saved["opt_states"])]
  cycle_open = [bool(x) for x in saved.get("cycle_open", [False] * n)]  # older checkpoints: no open cycle
  pending = [float(x) for x in saved.get("pending_shares", [0.0] * n)]
  if len(cycle_open) != n or len(pending) != n:
    raise ValueError(f"checkpoint cycle state has {len(cycle_open)} / {len(pending)} entries for {n} fragments")
  versions = [int(v) for v in saved["versions"]]
  rounds = [int(r) for r in saved["rounds"]]
  fragments = []
  for p in range(n):
    norm = chunked.norm(globals_[p], s.merge_threads)
    fragments.append(FragmentState(
        globals_[p], momenta[p], norm, chunked.norm(momenta[p], s.merge_threads), seed_norm=norm,
        version=versions[p], rounds=rounds[p], cycle_open=cycle_open[p], pending_share=pending[p],
        version_round={versions[p]: rounds[p]}, t_sync=float(saved["t_sync"][p])))
  downlink = Downlink.restore(saved, s.held_sizes, s.downlink_codec, s.block, globals_, versions, epoch,
                              threads=s.merge_threads, history=s.downlink_history)
  state = SyncerState(fragments, recovery.restored_history(saved.get("history"), epoch, versions, rounds),
                      started, counters=merge_counters(n, saved["counters"]), keys=_keys(saved))
  for i, incarnation, floor in saved.get("push_key_floors", []):  # older checkpoints: none
    state.key_floors.setdefault(int(i), {})[int(incarnation)] = int(floor)
  return state, downlink


def _keys(saved: dict) -> dict[int, collections.OrderedDict]:
  keys: dict[int, collections.OrderedDict] = {}
  for row in saved.get("push_keys", []):
    i, incarnation, sequence, checksum, fragment, rnd, late = row[:7]
    receipt = PushReceipt(fragment=int(fragment), round=int(rnd), late=bool(late),
                          epoch=int(row[7]) if len(row) > 7 else 0, version=int(row[8]) if len(row) > 8 else -1)
    keys.setdefault(int(i), collections.OrderedDict())[(int(incarnation), int(sequence))] = (
        KeyRecord(int(checksum), receipt, settled=True))
  return keys


# ---- a state dict as arrays and a JSON skeleton (checkpoints and tapes) ----

ARRAY_KEY = "__array__"
_TUPLE = "__tuple__"
_DICT = "__dict__"  # a dict whose keys are not all strings: stored as a list of [key, value] pairs


def split_state(state: Any, *, copy: bool = True) -> tuple[dict[str, np.ndarray], Any]:
  """(arrays, skeleton): the arrays of a state dict by generated key, and a JSON-able skeleton.

  `copy=False` when the state's arrays are already private copies (`SyncerCore.state_dict()` takes them
  under the core's lock): the arrays are then passed on as they are, one fragment-sized copy fewer."""
  arrays: dict[str, np.ndarray] = {}

  def walk(node):
    if isinstance(node, (np.ndarray, np.generic)) or _is_jax_array(node):
      key = f"a{len(arrays)}"
      # Copy (unless the caller's arrays are private already): an async save must not see the array change.
      arrays[key] = np.array(node, copy=True) if copy or not isinstance(node, np.ndarray) else node
      return {ARRAY_KEY: key, "scalar": isinstance(node, np.generic)}
    if isinstance(node, dict):
      if all(isinstance(k, str) for k in node):
        return {k: walk(v) for k, v in node.items()}
      return {_DICT: [[_key_to_json(k), walk(v)] for k, v in node.items()]}
    if isinstance(node, tuple):
      return {_TUPLE: [walk(v) for v in node]}
    if isinstance(node, list):
      return [walk(v) for v in node]
    if node is None or isinstance(node, (bool, int, float, str)):
      return node
    raise TypeError(f"cannot checkpoint a {type(node).__name__} in the syncer state: {node!r:.80}")

  skeleton = walk(state)
  return arrays, skeleton


def join_state(arrays: dict[str, np.ndarray], skeleton: Any) -> Any:
  """The inverse of `split_state`."""

  def walk(node):
    if isinstance(node, dict):
      if ARRAY_KEY in node:
        value = np.asarray(arrays[node[ARRAY_KEY]])
        return value[()] if node.get("scalar") else value
      if _TUPLE in node:
        return tuple(walk(v) for v in node[_TUPLE])
      if _DICT in node:
        return {k: walk(v) for k, v in node[_DICT]}
      return {k: walk(v) for k, v in node.items()}
    if isinstance(node, list):
      return [walk(v) for v in node]
    return node

  return walk(skeleton)


def _is_jax_array(x) -> bool:
  return type(x).__module__.startswith("jax") and hasattr(x, "__array__") and hasattr(x, "shape")


def _key_to_json(k):
  if isinstance(k, bool) or not isinstance(k, (int, str)):
    raise TypeError(f"syncer state dict keys must be str or int, got {k!r}")
  return k

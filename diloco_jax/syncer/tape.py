"""The syncer's input tape: every step of a core's state machine with its inputs, clock readings and outcome.

A core given a `Tape` (`syncer --record-tape PATH`) writes one segment per lifetime: a "begin" record (its
settings, epoch, start time and initial fragments), one record per step (`SyncerCore._step`: its kind, its
arguments, push payloads and restored checkpoints included, the clock readings it took, and its outcome:
its result or refusal and the rounds it closed, with each decision record and the CRC-32 of the new global
fragment), and at a clean stop an "end" record with a digest of the global fragments and momenta. A
restarted syncer appends its segment to the same file. `python -m diloco_jax replay --tape PATH` feeds each
segment through a fresh core (`tools/replay.py`) and checks every outcome and the digest bit for bit.

Format: frames of a 4-byte little-endian header length, the header (JSON: the record, and the lengths of
its blobs), then the blobs (payloads; arrays as .npy). A frame cut short by a kill -9 ends the tape.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pathlib
import struct
import threading
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from diloco_jax.protocol.messages import Published, Push, PushReceipt, Versions
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.syncer import snapshot
from diloco_jax.syncer.rules.quorum import QuorumPolicy
from diloco_jax.syncer.settings import SyncerSettings

_LENGTH = struct.Struct("<I")


def _json(value) -> str:
  return json.dumps(value, sort_keys=True, default=_plain)


def _plain(x):
  if isinstance(x, (np.integer, np.floating, np.bool_)):
    return x.item()
  raise TypeError(f"cannot put a {type(x).__name__} on the tape")


def _npy(array: np.ndarray) -> bytes:
  out = io.BytesIO()
  np.save(out, np.asarray(array), allow_pickle=False)
  return out.getvalue()


def _from_npy(blob: bytes) -> np.ndarray:
  return np.load(io.BytesIO(blob), allow_pickle=False)


def summary(result) -> Any:
  """A step's result as JSON values: what replay compares (refusals and errors included)."""
  if isinstance(result, Rejected):
    return {"rejected": result.reason, "message": result.message}
  if isinstance(result, Exception):
    return {"error": f"{type(result).__name__}: {result}"}
  if isinstance(result, Versions):
    return {"versions": sorted(result.versions.items()), "epoch": result.epoch,
            "history": [dataclasses.astuple(h) for h in result.history]}
  if isinstance(result, PushReceipt):
    return {"receipt": dataclasses.asdict(result)}
  if isinstance(result, Published):
    return {"published": {**{k: v for k, v in dataclasses.asdict(result).items() if k != "payload"},
                          "size": len(result.payload)}}
  if isinstance(result, tuple):
    return [summary(x) for x in result]
  return result


def same(a: Any, b: Any) -> bool:
  """Whether two outcomes are the same, bit for bit (as JSON text: exact for floats, NaN included)."""
  return _json(a) == _json(b)


class Tape:
  """Appends a core's steps to a tape file (thread-safe; the core calls it under its lock)."""

  def __init__(self, path: str | pathlib.Path):
    self.path = pathlib.Path(path)
    self._file = open(self.path, "ab")
    self._lock = threading.Lock()

  def _write(self, record: dict, blobs: Sequence[bytes] = ()) -> None:
    header = _json({**record, "blobs": [len(b) for b in blobs]}).encode()
    with self._lock:
      self._file.write(_LENGTH.pack(len(header)) + header + b"".join(blobs))
      self._file.flush()  # a kill -9 loses at most the step in progress

  def begin(self, settings: SyncerSettings, fragments: Sequence[np.ndarray], epoch: int, started: float) -> None:
    """Start a segment: what a fresh core is built from."""
    self._write({"kind": "begin", "settings": dataclasses.asdict(settings), "epoch": epoch, "started": started},
                [_npy(f) for f in fragments])

  def event(self, kind: str, args: dict, reads: Sequence[float], outcome: dict) -> None:
    """One step: its kind, arguments, clock readings and outcome."""
    blobs: list[bytes] = []
    self._write({"kind": kind, "args": _encode_args(args, blobs), "reads": list(reads), "outcome": outcome}, blobs)

  def end(self, state) -> None:
    """End the segment with a digest of the global fragments and momenta (a clean stop)."""
    self._write({"kind": "end", "digest": digest(state)})

  def close(self) -> None:
    with self._lock:
      self._file.close()


def digest(state) -> list:
  """Per fragment: version, rounds, and the CRC-32 of its global vector and of its momentum."""
  return [[f.version, f.rounds, zlib.crc32(f.global_vec.tobytes()), zlib.crc32(f.momentum.tobytes())]
          for f in state.fragments]


def _encode_args(args: dict, blobs: list[bytes]) -> dict:
  out = {}
  for name, value in args.items():
    if name == "check":
      continue  # a push's payload check: replay derives it from the payload again
    if isinstance(value, Push):
      fields = {k: v for k, v in dataclasses.asdict(value).items() if k != "payload"}
      out[name] = {"push": fields, "payload": len(blobs)}
      blobs.append(bytes(value.payload))
    elif name == "saved":  # a checkpoint's state dict: its arrays as blobs
      arrays, skeleton = snapshot.split_state(value)
      out[name] = {"skeleton": skeleton, "arrays": {k: len(blobs) + i for i, k in enumerate(arrays)}}
      blobs.extend(_npy(a) for a in arrays.values())
    else:
      out[name] = value
  return out


def _decode_args(args: dict, blobs: Sequence[bytes]) -> dict:
  out = {}
  for name, value in args.items():
    if isinstance(value, dict) and "push" in value and "payload" in value:
      out[name] = Push(**value["push"], payload=blobs[value["payload"]])
    elif name == "saved":
      arrays = {k: _from_npy(blobs[i]) for k, i in value["arrays"].items()}
      out[name] = snapshot.join_state(arrays, value["skeleton"])
    else:
      out[name] = value
  return out


def settings_from(record: dict) -> SyncerSettings:
  """The `SyncerSettings` a "begin" record was written from."""
  fields = {}
  for f in dataclasses.fields(SyncerSettings):
    value = record["settings"][f.name]
    if f.name == "policy":
      value = QuorumPolicy(**value)
    elif isinstance(value, list):
      value = tuple(value)
    fields[f.name] = value
  return SyncerSettings(**fields)


@dataclasses.dataclass(frozen=True)
class Step:
  """One record of a tape, decoded: `kind`, its arguments (for "begin": the initial fragments), its clock
  readings and its recorded outcome."""

  kind: str
  record: dict
  args: dict
  reads: tuple[float, ...] = ()


def read(path: str | pathlib.Path) -> Iterator[Step]:
  """The records of a tape in order; a last frame cut short (a kill -9 mid-write) ends it."""
  data = pathlib.Path(path).read_bytes()
  at = 0
  while at + _LENGTH.size <= len(data):
    (size,) = _LENGTH.unpack_from(data, at)
    start = at + _LENGTH.size
    if start + size > len(data):
      return
    record = json.loads(data[start:start + size])
    at = start + size
    blobs = []
    for n in record["blobs"]:
      blobs.append(data[at:at + n])
      at += n
    if at > len(data):
      return
    if record["kind"] == "begin":
      yield Step("begin", record, {"fragments": [_from_npy(b) for b in blobs]})
    elif record["kind"] == "end":
      yield Step("end", record, {})
    else:
      yield Step(record["kind"], record, _decode_args(record["args"], blobs), tuple(record["reads"]))


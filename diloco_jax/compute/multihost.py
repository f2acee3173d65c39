"""Several processes, one learner: `jax.distributed` set-up, a host channel from process 0 to the others,
broadcasts from process 0 over the mesh, and a heartbeat that takes the learner out when one of its
processes dies or hangs.

A learner on a TPU slice of several hosts is one JAX program run by one process per host. Every process
must dispatch the same jitted computations in the same order, so whatever depends on the network (has a
merged fragment arrived? which version?) is decided by process 0 alone and handed to the others: the
decisions, a few hundred bytes of JSON, host to host through the coordination service's key-value store
(`HostChannel`), never waiting for the devices; the merged fragments over the mesh (`Broadcaster`), as
raw bits, so every process adopts the very same values. `PeerWatch` takes the learner out when a process
goes silent (exit status `EXIT_PEER_LOST`). docs/architecture.md, "Processes and threads of a multi-host
learner"; docs/operations.md, "A learner spanning several processes (multi-host)".
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# jax has no public key-value API for the coordination service; orbax's multihost utilities reach the
# same client this way.
from jax._src import distributed as jax_distributed
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3  # exit status of a process whose learner lost one of its processes
# The most elements of a fragment one transfer between process 0 and the devices moves at once (64 MiB of
# float32): what a device holds of a fragment in transit, per transfer (`Broadcaster.pieces`, `.gather`).
CHUNK_ELEMENTS = 1 << 24
CHUNKS_IN_FLIGHT = 2  # transfers dispatched and not yet done, at most
_PREFIX = "diloco"  # namespace of this package's keys in the coordination service


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """How a learner process joins its learner's other processes.

  auto: let `jax.distributed.initialize()` find everything (Cloud TPU VMs, Slurm, Open MPI);
  otherwise all three of coordinator ("host:port" of process 0's coordination service), num_processes and
  process_id are given (locally: `python -m diloco_jax local --hosts-per-learner H` sets them).
  """

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  auto: bool = False

  @property
  def enabled(self) -> bool:
    return self.auto or (self.num_processes or 1) > 1

  def validate(self) -> None:
    """Raises ValueError naming the bad field."""
    if self.auto:
      return
    if self.num_processes is None or self.num_processes < 1:
      raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
    if self.num_processes > 1:
      if not self.coordinator or ":" not in self.coordinator:
        raise ValueError(f"--coordinator must be host:port of process 0 when --num-processes > 1, got "
                         f"{self.coordinator!r}")
      if self.process_id is None or not 0 <= self.process_id < self.num_processes:
        raise ValueError(f"--process-id must be in [0, --num-processes={self.num_processes}), got "
                         f"{self.process_id}")


def initialize(spec: DistributedSpec, *, peer_timeout_s: float, init_timeout_s: int = 300) -> None:
  """`jax.distributed.initialize` for `spec`; call before anything touches a jax backend.

  jax's own heartbeat (which ends every process when one is lost) is set well above `peer_timeout_s`, so
  that `PeerWatch` notices a silent process first and the survivors exit with a clear message.
  """
  heartbeat = max(100, int(3 * peer_timeout_s))
  if spec.auto:
    jax.distributed.initialize(initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat)
  else:
    jax.distributed.initialize(spec.coordinator, spec.num_processes, spec.process_id,
                               initialization_timeout=init_timeout_s, heartbeat_timeout_seconds=heartbeat)


def _client():
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("jax.distributed is not initialized")
  return client


def _is_timeout(error: Exception) -> bool:
  return "DEADLINE_EXCEEDED" in str(error)


class PeerLost(RuntimeError):
  """Another process of this learner went silent: the learner is out."""


class PeerWatch:
  """Heartbeats between the processes of one learner, through the coordination service's key-value store.

  Every `beat_s` each process writes its beat counter and reads everyone's. A peer whose counter has not
  moved for `timeout_s` (and that has not said it finished), or a store unreachable for `timeout_s`
  (process 0, which hosts it, is gone), is lost: `on_lost(message)` runs once, on this thread; by
  default it prints the message and ends the process with `EXIT_PEER_LOST` (the main thread may be stuck
  in a collective that will never complete, so nothing short of ending the process gets it out): the
  survivors print which process went silent (killed, wedged, its host gone) and exit instead of waiting
  forever in a collective with a dead peer.

  When process 0 itself dies, the coordination service dies with it, and jax's runtime ends the other
  processes at once with its own message ("Terminating process because the JAX distributed service
  detected fatal errors"): that exit is jax's and cannot be made quieter from Python.
  """

  def __init__(self, process_id: int, num_processes: int, *, timeout_s: float, beat_s: float = 1.0,
               on_lost: Callable[[str], None] | None = None, client=None):
    self.process_id, self.num_processes = process_id, num_processes
    self.timeout_s, self.beat_s = timeout_s, min(beat_s, timeout_s / 4)
    self._client = client or _client()
    self._on_lost = on_lost or exit_peer_lost
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="peer-watch", daemon=True)
    self.lost: str | None = None

  def start(self) -> PeerWatch:
    self._thread.start()
    return self

  def _read(self, kind: str) -> dict[int, str]:
    out = {}
    for key, value in self._client.key_value_dir_get(f"{_PREFIX}/{kind}"):
      try:
        out[int(key.rsplit("/", 1)[1])] = value
      except ValueError:
        continue
    return out

  def _run(self) -> None:
    now = time.monotonic()
    seen = {p: (None, now) for p in range(self.num_processes) if p != self.process_id}
    store_ok = now
    beat = 0
    while not self._stop.wait(self.beat_s):
      now = time.monotonic()
      beat += 1
      try:
        self._client.key_value_set(f"{_PREFIX}/alive/{self.process_id}", str(beat), allow_overwrite=True)
        alive, done = self._read("alive"), self._read("done")
        store_ok = now
      except Exception as e:  # noqa: BLE001 - the store lives in process 0: unreachable means it is gone
        if now - store_ok > self.timeout_s:
          self._lose(f"process 0 (the coordinator) unreachable for {now - store_ok:.0f}s: {str(e)[:200]}")
          return
        continue
      for p, (value, since) in seen.items():
        if p in done:
          continue
        if alive.get(p) != value:
          seen[p] = (alive.get(p), now)
        elif now - since > self.timeout_s:
          self._lose(f"process {p} silent for {now - since:.0f}s (killed, hung, or its host is gone)")
          return

  def _lose(self, message: str) -> None:
    self.lost = message
    self._on_lost(message)

  def wait_for_verdict(self) -> str | None:
    """After an error on the main thread (a collective that failed because a peer died): wait until the
    watch could have found a lost peer (it then ends the process); returns None if it found none."""
    deadline = time.monotonic() + self.timeout_s + 3 * self.beat_s
    while self.lost is None and self._thread.is_alive() and time.monotonic() < deadline:
      time.sleep(self.beat_s / 4)
    return self.lost

  def stop(self, done: bool = True) -> None:
    """Stop beating; `done`: this process finished normally (the others must not take it for lost)."""
    if done:
      try:
        self._client.key_value_set(f"{_PREFIX}/done/{self.process_id}", "1", allow_overwrite=True)
      except Exception as e:  # noqa: BLE001 - at exit the store may be gone already
        log.warning("could not mark process %d done: %s", self.process_id, e)
    self._stop.set()
    if self._thread.is_alive() and threading.current_thread() is not self._thread:
      self._thread.join(self.beat_s + 5.0)


def exit_peer_lost(message: str, hooks: Sequence[Callable[[], None]] = (), hook_timeout_s: float = 10.0) -> None:
  """Print `message`, run `hooks` (each for at most `hook_timeout_s`, e.g. leaving the syncer), and end the
  process with `EXIT_PEER_LOST` without running atexit handlers (they would wait on the lost peer)."""
  where = f"process {jax.process_index()}" if jax.distributed.is_initialized() else "process"
  print(f"learner {where}: {message}: this learner is out; exiting with status {EXIT_PEER_LOST}",
        file=sys.stderr, flush=True)
  for hook in hooks:
    t = threading.Thread(target=hook, daemon=True)
    t.start()
    t.join(hook_timeout_s)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(EXIT_PEER_LOST)


class HostChannel:
  """Numbered messages from process 0 to the other processes of a learner, through the coordination
  service's key-value store: `publish(seq, msg)` on process 0, `receive(seq)` on the others.

  The last reader of a message deletes it, so the store holds only messages some process has yet to read.
  Receiving waits in slices of `poll_s` and, between slices, raises `PeerLost` if the watch has found a
  peer lost: no wait is unbounded while process 0 is gone.
  """

  def __init__(self, process_id: int, num_processes: int, *, watch: PeerWatch | None = None,
               poll_s: float = 1.0, client=None):
    self.process_id, self.num_processes = process_id, num_processes
    self._client = client or _client()
    self._watch = watch
    self._poll_ms = max(1, int(poll_s * 1000))
    self._stop_requested = False

  @property
  def leader(self) -> bool:
    return self.process_id == 0

  def publish(self, seq: int, message: dict) -> None:
    self._client.key_value_set(f"{_PREFIX}/msg/{seq}/body", json.dumps(message))

  def receive(self, seq: int) -> dict:
    key = f"{_PREFIX}/msg/{seq}"
    while True:
      try:
        body = self._client.blocking_key_value_get(f"{key}/body", self._poll_ms)
        break
      except Exception as e:  # noqa: BLE001 - a slice ran out; anything else is the store going away
        if self._watch is not None and self._watch.lost:
          raise PeerLost(self._watch.lost) from e
        if not _is_timeout(e):
          raise
    if self._client.key_value_increment(f"{key}/reads", 1) == self.num_processes - 1:
      self._client.key_value_delete(key)
    return json.loads(body)

  def request_stop(self) -> None:
    """On any process: ask process 0 to stop the learner (a signal reached this host)."""
    if not self._stop_requested:
      self._stop_requested = True
      self._client.key_value_set(f"{_PREFIX}/stop/{self.process_id}", "1", allow_overwrite=True)

  def stop_requested(self) -> bool:
    """On process 0: whether another process asked to stop."""
    return bool(self._client.key_value_dir_get(f"{_PREFIX}/stop"))


def local_replica(x: jax.Array) -> jax.Array:
  """This process's copy of a replicated array (on its first device): the whole value, fully addressable,
  so it can go to the host without asking the other processes."""
  if not x.is_fully_replicated:
    raise ValueError(f"expected a replicated array, got sharding {x.sharding}")
  shard = x.addressable_shards[0].data
  if shard.shape != x.shape:
    raise AssertionError(f"the local shard {shard.shape} of a replicated array is not the whole {x.shape}")
  return shard


class Broadcaster:
  """Moves float32 vectors between process 0's host and every device of a learner's mesh.

  `__call__`: process 0 passes a vector, the others `None`; every process gets it back replicated on
  `mesh`. The vector travels as its raw 32-bit patterns in one jitted collective on the learner's own mesh:
  an input with one row per device (process 0's rows hold the vector, the others' zeros) from which every
  device takes one of process 0's rows (an integer all-reduce of one row and zeros: exact, signed zeros and
  NaN payloads included). Staying on the learner's mesh matters: moving the result between two meshes would
  wait for every step already queued on the devices.

  `pieces` does that for a fragment, chunk by chunk (`CHUNK_ELEMENTS`, at most `CHUNKS_IN_FLIGHT` in
  transit): every process copies each chunk to its host, and its devices receive only their shards of the
  fragment's pieces. `gather`, the way back: each process contributes the elements its devices own (one
  replica of each), an integer sum of one value and zeros per element, chunk by chunk, to process 0's host.
  """

  def __init__(self, mesh):
    self._mesh = mesh
    self._leader = jax.process_index() == 0
    self._in = NamedSharding(mesh, P(mesh.axis_names))  # dimension 0: one row per device
    rows = self._in.devices_indices_map((mesh.size,))
    source = min(idx[0].indices(mesh.size)[0] for d, idx in rows.items() if d.process_index == 0)
    self._local_rows = len(self._in.addressable_devices)
    replicated = NamedSharding(mesh, P())
    self._fn = jax.jit(lambda bits: jax.lax.bitcast_convert_type(bits[source], jnp.float32),
                       out_shardings=replicated)
    # The chunks of `gather`: every device's row holds what its process owns (one row per process, the
    # others zeros); their sum is the chunk, bit for bit.
    self._sum = jax.jit(lambda bits: jax.lax.bitcast_convert_type(jnp.sum(bits, axis=0, dtype=jnp.uint32),
                                                                  jnp.float32), out_shardings=replicated)

  def __call__(self, vec: np.ndarray | None, size: int) -> jax.Array:
    if self._leader:
      vec = np.ascontiguousarray(vec, dtype=np.float32)
      if vec.shape != (size,):
        raise ValueError(f"broadcast of a vector of shape {vec.shape}, expected ({size},)")
      bits = vec.view(np.uint32)
    else:
      bits = np.zeros(size, np.uint32)
    # Every local row is the same vector: a read-only view, not copies.
    local = np.broadcast_to(bits, (self._local_rows, size))
    return self._fn(jax.make_array_from_process_local_data(self._in, local, (self._mesh.size, size)))

  def _chunks(self, total: int, transfer, copy: bool) -> np.ndarray | None:
    """`transfer(a, b)` (a jitted transfer of elements [a, b), replicated) chunk by chunk, each chunk copied
    into one host vector if `copy`, with at most `CHUNKS_IN_FLIGHT` chunks in transit."""
    out = np.empty(total, np.float32) if copy else None
    pending = collections.deque()
    for a in range(0, total, CHUNK_ELEMENTS):
      chunk = transfer(a, min(a + CHUNK_ELEMENTS, total))
      if copy:
        chunk = local_replica(chunk)
        chunk.copy_to_host_async()
      pending.append((a, chunk))
      while pending and (len(pending) > CHUNKS_IN_FLIGHT or a + CHUNK_ELEMENTS >= total):
        start, done = pending.popleft()
        if copy:
          out[start:start + done.size] = np.asarray(done)
        else:
          jax.block_until_ready(done)
    return out

  def pieces(self, vec: np.ndarray | None, shapes: Sequence[tuple[int, ...]],
             shardings: Sequence[NamedSharding]) -> tuple[jax.Array, ...]:
    """A fragment's flat vector (process 0 passes it, the others `None`) as its pieces of `shapes` on
    every device of the learner, each in its sharding; bit for bit (class docstring)."""
    total = sum(math.prod(s) for s in shapes)
    if self._leader:
      vec = np.ascontiguousarray(vec, dtype=np.float32)
      if vec.shape != (total,):
        raise ValueError(f"broadcast of a vector of shape {vec.shape}, expected ({total},)")
    host = self._chunks(total, lambda a, b: self(vec[a:b] if self._leader else None, b - a), copy=True)
    out, start = [], 0
    for shape, sharding in zip(shapes, shardings):
      piece = host[start:start + math.prod(shape)].reshape(shape)
      out.append(jax.make_array_from_callback(tuple(shape), sharding, lambda idx, piece=piece: piece[idx]))
      start += math.prod(shape)
    return tuple(out)

  def gather(self, pieces: Sequence[jax.Array]) -> np.ndarray | None:
    """A fragment's pieces (sharded over the learner's devices) as its flat float32 vector on process 0's
    host, in order (None on the other processes, which take part in the same transfers)."""
    owned = np.zeros(sum(x.size for x in pieces), np.uint32)  # this process's elements, zeros elsewhere
    start = 0
    for x in pieces:
      view = owned[start:start + x.size].reshape(x.shape)
      for shard in x.addressable_shards:
        if shard.replica_id == 0:
          view[shard.index] = np.asarray(shard.data, np.float32).view(np.uint32)
      start += x.size

    def transfer(a: int, b: int) -> jax.Array:
      local = np.zeros((self._local_rows, b - a), np.uint32)
      local[0] = owned[a:b]
      return self._sum(jax.make_array_from_process_local_data(self._in, local, (self._mesh.size, b - a)))

    return self._chunks(owned.size, transfer, copy=self._leader)


def spec_from_flags(fv) -> DistributedSpec:
  """The DistributedSpec of the flags `command_flags.distributed` defines; raises ValueError naming a bad flag."""
  num = fv["num-processes"].value
  explicit = num is not None and num > 1
  spec = DistributedSpec(coordinator=fv.coordinator, num_processes=num if num is not None else 1,
                         process_id=fv["process-id"].value, auto=fv.distributed and not explicit)
  spec.validate()
  return spec

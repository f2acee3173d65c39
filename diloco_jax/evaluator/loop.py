"""The global model's eval curve: the syncer's global model evaluated on the run's shared eval set every
`train.eval_every` steps of progress, off the learners' devices and threads.

Progress is the syncer's tokens merged, in steps of `data.global_batch * data.seq_len` tokens (the unit of
the baseline's step, so both curves line up). An eval runs at the start, whenever progress crosses the next
multiple of `train.eval_every` (evals that fall behind skip marks), and on `stop` if the model moved.
`GlobalEval` builds the global model as params from its fragment vectors and takes its loss;
`TransportSource` reads it as an observer through any `protocol.Transport` (status and full pulls; it never
joins); `GlobalEvaluator` is the thread writing each record to a `metrics.MetricsLog`. The `evaluator`
command runs it against a gRPC syncer, `train` against its in-process core (docs/observability.md).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import numpy as np

from diloco_jax.compute import inner
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.outer import merge as outer_lib
from diloco_jax.protocol.interfaces import Transport
from diloco_jax.protocol.messages import Kind

log = logging.getLogger(__name__)
_CONSISTENT_READS = 3  # fetches of the global model before its tokens are taken as read (`evaluate`)


def eval_mesh(config, devices: Sequence[jax.Device]):
  """A mesh over `devices` for evaluation: the config's axes if they fit (and split the eval batch),
  else plain data parallelism, else the first device alone."""
  for axes in (mesh_lib.mesh_axes_from_config(config), {"data": -1, "fsdp": 1, "tensor": 1}):
    try:
      sizes = mesh_lib.resolve_axis_sizes(axes, len(devices))
    except ValueError:
      continue
    if config.data.global_batch % (sizes["data"] * sizes["fsdp"]) == 0:
      return mesh_lib.make_mesh(devices, axes)
  return mesh_lib.make_mesh(list(devices)[:1], {"data": 1, "fsdp": 1, "tensor": 1})


class GlobalEval:
  """The model of `config` on `devices`, evaluated on the run's shared eval set (`trainer.eval_set`).

  Nothing is materialized until used: the parameters are shapes until `loss` receives some; the eval set
  is read at the first `loss`.
  """

  def __init__(self, config, devices: Sequence[jax.Device]):
    self.config = config
    self.mesh = eval_mesh(config, devices)
    self.graphdef, self.abstract_params = model_lib.abstract_model(config.model, self.mesh)
    self.shardings = jax.tree.map(lambda a: a.sharding, self.abstract_params)
    self.plan = fragments_lib.plan_for_config(self.abstract_params, config)
    self._eval_fn = inner.make_eval_step(self.graphdef, self.mesh, self.shardings)
    self._batches = None

  def params(self, vectors: Sequence[np.ndarray]) -> Any:
    """The model's parameters (a nested dict of host arrays) from the P flat fragment vectors."""
    return fragments_lib.assemble(self.plan, [np.asarray(v, np.float32) for v in vectors], self.abstract_params)

  def loss(self, params: Any) -> float:
    """Mean eval loss of `params` (host arrays, or arrays already on this mesh)."""
    if self._batches is None:
      self._batches = trainer_lib.eval_set(self.config, self.mesh)
    return trainer_lib.mean_loss(self._eval_fn, jax.device_put(params, self.shardings), self._batches)


@dataclasses.dataclass(frozen=True)
class EvalSchedule:
  """When the global model is due for an eval: every `every` steps of progress, a step being
  `tokens_per_step` tokens merged (the syncer's per-fragment count over `num_fragments`)."""

  every: int
  tokens_per_step: int
  num_fragments: int

  @classmethod
  def from_config(cls, config) -> EvalSchedule:
    return cls(every=int(config.train.eval_every), tokens_per_step=config.data.global_batch * config.data.seq_len,
               num_fragments=config.outer.num_fragments)

  def tokens(self, fragment_tokens_merged: int) -> float:
    return outer_lib.tokens_merged(fragment_tokens_merged, self.num_fragments)

  def step(self, fragment_tokens_merged: int) -> int:
    """Progress in global steps (whole ones)."""
    return int(self.tokens(fragment_tokens_merged) // self.tokens_per_step)

  def mark(self, fragment_tokens_merged: int) -> int:
    return self.step(fragment_tokens_merged) // max(self.every, 1)


class Source(Protocol):
  """Where the global model comes from."""

  def progress(self) -> tuple[int, list[int]]:
    """(the syncer's per-fragment tokens-merged count, the fragment versions)."""
    ...

  def fetch(self) -> tuple[list[np.ndarray], list[int]]:
    """(the P global fragment vectors, their versions)."""
    ...


class TransportSource:
  """The global model over `protocol.Transport`, as an observer (no join, no push: never a member)."""

  def __init__(self, transport: Transport, sizes: Sequence[int], block: int):
    self.transport, self.sizes, self.block = transport, tuple(sizes), block

  def progress(self) -> tuple[int, list[int]]:
    status = self.transport.status()
    return int(status["counters"]["tokens_merged"]), [int(v) for v in status["versions"]]

  def fetch(self) -> tuple[list[np.ndarray], list[int]]:
    vectors, versions = [], []
    for p, size in enumerate(self.sizes):
      # have_version -1: the full fragment (an observer holds no reference to apply a delta to).
      published = self.transport.pull(p, 0, 0.0, have_version=-1)
      if published is None or published.kind != Kind.FULL or published.fragment != p:
        raise codec_lib.CodecError(f"fragment {p}: the syncer answered a full pull with "
                                   f"{None if published is None else (published.fragment, published.kind)}")
      if codec_lib.checksum(published.payload) != published.checksum:
        raise codec_lib.CodecError(f"fragment {p} v{published.version}: bad checksum")
      vec = codec_lib.decode(published.payload, published.codec, size, self.block)
      if not np.isfinite(vec).all():
        raise codec_lib.CodecError(f"fragment {p} v{published.version}: non-finite values")
      vectors.append(vec)
      versions.append(int(published.version))
    return vectors, versions


class GlobalEvaluator:
  """Evaluates the global model from `source` with `global_eval` when `schedule` says so, on its own
  thread (`start`, `stop`), writing each record to `metrics_log` (if any). `latest` is the newest record.

  A failed eval (the syncer unreachable, a bad answer) is logged and retried at the next poll: the
  evaluator never stops the run it watches.
  """

  def __init__(self, global_eval: GlobalEval, source: Source, schedule: EvalSchedule, metrics_log=None, *,
               poll_s: float = 0.5):
    self.global_eval, self.source, self.schedule, self.log = global_eval, source, schedule, metrics_log
    self.poll_s = poll_s
    self.latest: dict | None = None
    self.failures = 0
    self._t0 = time.perf_counter()
    self._stop = threading.Event()
    self._lock = threading.Lock()  # one eval at a time (the thread and the final eval)
    self._thread: threading.Thread | None = None

  def evaluate(self, final: bool = False) -> dict:
    """Evaluate the global model now; returns (and writes) the record."""
    with self._lock:
      # The tokens of the model evaluated: read after the fetch, and matched by its versions (a merge between
      # two reads made a record of stale tokens with the new versions, which the final record then repeated).
      for _ in range(_CONSISTENT_READS):
        vectors, versions = self.source.fetch()
        fragment_tokens, now = self.source.progress()
        if now == versions:
          break
      t0 = time.perf_counter()
      loss = self.global_eval.loss(self.global_eval.params(vectors))
      record = {"step": self.schedule.step(fragment_tokens), "tokens": self.schedule.tokens(fragment_tokens),
                "eval_loss": loss, "versions": versions, "elapsed_s": time.perf_counter() - self._t0,
                "eval_s": time.perf_counter() - t0, "final": final}
      if self.log is not None:
        self.log.write(record)
      self.latest = record
      return record

  def _due(self) -> bool:
    fragment_tokens, versions = self.source.progress()
    if self.latest is None:
      return True
    # A later mark than the last eval's, and a model that moved since (a restored syncer may repeat one).
    last_mark = self.latest["step"] // max(self.schedule.every, 1)
    return self.schedule.mark(fragment_tokens) > last_mark and versions != self.latest["versions"]

  def poll(self) -> dict | None:
    """One look at the progress: evaluates (returning the record) if an eval is due, else None."""
    return self.evaluate() if self._due() else None

  def _run(self) -> None:
    while not self._stop.is_set():
      try:
        self.poll()
      except Exception as e:  # noqa: BLE001 - the run goes on without its curve; retry at the next poll
        self.failures += 1
        log.warning("global eval failed (%d so far): %s", self.failures, e)
      self._stop.wait(self.poll_s)

  def start(self) -> GlobalEvaluator:
    self._thread = threading.Thread(target=self._run, name="global-eval", daemon=True)
    self._thread.start()
    return self

  def stop(self, final: bool = True) -> dict | None:
    """Stops the thread; with `final`, evaluates once more if the model moved since the last eval, else
    writes the last eval's record again marked final (`"repeat": true`): the last record is the final one.
    Returns the newest record."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if final:
      fragment_tokens, versions = self.source.progress()
      if (self.latest is None or versions != self.latest["versions"]
          or self.schedule.tokens(fragment_tokens) != self.latest["tokens"]):
        self.evaluate(final=True)
      elif not self.latest["final"]:
        self.latest = {**self.latest, "final": True, "repeat": True, "eval_s": 0.0,
                       "elapsed_s": time.perf_counter() - self._t0}
        if self.log is not None:
          self.log.write(self.latest)
    return self.latest

"""Helpers shared by the tests: syncer cores and pushes, a fake clock, waiting, and real child processes.

Test modules `import helpers` (pyproject.toml puts tests/ on pytest's path); conftest.py has set the fake CPU devices
before anything here imports jax.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence

import grain
import jax
import numpy as np
import pytest

from diloco_jax import config as config_lib
from diloco_jax.data import shards, tokenizer
from diloco_jax.outer import codec as codec_lib
from diloco_jax.protocol.messages import Push
from diloco_jax.runs import children as run_children
from diloco_jax.runs import launcher as run_launcher
from diloco_jax.syncer.core import SyncerCore
from diloco_jax.syncer.rules.quorum import QuorumPolicy
from diloco_jax.syncer.settings import SyncerSettings
from diloco_jax.transports.grpc_client import GrpcTransport

REPO = pathlib.Path(__file__).resolve().parents[1]
FP = "fp-test"


class FakeClock:
  """An injectable clock the test moves by hand: `clock.t = 5.0`."""

  def __init__(self, t: float = 0.0):
    self.t = t

  def __call__(self) -> float:
    return self.t


# QuorumPolicy fields, and the `outer` config field each is resolved from.
_POLICY_FIELDS = {"min_quorum": "min_quorum", "tau": "tau", "gamma": "grace_gamma", "min_grace_s": "min_grace_s",
                  "max_grace_s": "max_grace_s"}


def syncer_settings(sizes: Sequence[int] = (8,), *, config=None, fingerprint: str = FP, **overrides) -> SyncerSettings:
  """The SyncerSettings a run gives over fragments of `sizes` (a periodic schedule: the period is
  `outer.sync_every`): `config` (default `base_config()`, the shipped defaults) resolved, as the syncer builds
  them (`SyncerSettings.from_spec`). `overrides`: `num_learners` and the QuorumPolicy fields (min_quorum,
  tau, gamma, min_grace_s, max_grace_s) set the config fields they come from before resolving (what derives
  from them follows: `stall_s` from `max_grace_s`, `downlink_history` from `num_learners`, ...); any other
  SyncerSettings field is replaced on top. A test that overrides a field says why."""
  config = config_lib.base_config() if config is None else config.copy_and_resolve_references()
  if "num_learners" in overrides:
    config.learners.num = overrides.pop("num_learners")
  for field, name in _POLICY_FIELDS.items():
    if field in overrides:
      config.outer[name] = overrides.pop(field)
  spec = config_lib.resolve(config)
  return dataclasses.replace(SyncerSettings.for_fragments(spec, tuple(sizes), spec.outer.sync_every, fingerprint),
                             **overrides)


def quorum_policy(**overrides) -> QuorumPolicy:
  """The QuorumPolicy of the shipped defaults with `overrides` (its fields) set: `syncer_settings(...).policy`."""
  return syncer_settings(**overrides).policy


def make_core(sizes: Sequence[int] = (8,), *, codec: str = "fp32", downlink: str = "fp32", block: int = 64,
              k: int = 1, max_grace_s: float = 0.0, lr: float = 0.7, momentum: float = 0.9,
              initial: Sequence[np.ndarray] | str = "random", clock=None, fingerprint: str = FP, config=None,
              tape=None,
              **settings) -> SyncerCore:
  """A SyncerCore over fragments of `sizes` with the shipped defaults (`syncer_settings` of `config`, default
  `base_config()`), but for two on purpose: an fp32 uplink (`codec`: exact arithmetic for the tests'
  equalities) and no grace window (`max_grace_s` 0: a round closes at its quorum, so that no test waits on
  timing unless it says so); and 8 learners (`num_learners`). `codec`, `downlink`, `block`, `k`,
  `max_grace_s`, `lr`, `momentum`, `num_learners` and the policy's fields (gamma, tau, min_grace_s) set
  config fields before resolving (what derives from them follows: `stall_s` from `max_grace_s`); other
  keyword arguments replace SyncerSettings fields (lease_s, merge_rule, staleness_beta, max_norm_ratio...).
  `initial`: "random" (seeded), "arange" (arange(n) / 8), "linspace" (-1..1), or the vectors."""
  c = config_lib.base_config() if config is None else config.copy_and_resolve_references()
  o = c.outer
  o.codec, o.downlink_codec, o.codec_block, o.lr, o.momentum = codec, downlink, block, lr, momentum
  settings.setdefault("num_learners", 8)
  s = syncer_settings(sizes, config=c, fingerprint=fingerprint, min_quorum=k, max_grace_s=max_grace_s, **settings)
  if isinstance(initial, str):
    rng = np.random.default_rng(0)
    make = {"random": lambda n: rng.standard_normal(n).astype(np.float32),
            "arange": lambda n: np.arange(n, dtype=np.float32) / 8,
            "linspace": lambda n: np.linspace(-1, 1, n, dtype=np.float32)}[initial]
    initial = [make(n) for n in sizes]
  kwargs = {} if clock is None else {"clock": clock}
  return SyncerCore(s, list(initial), tape=tape, **kwargs)


def make_push(learner: int, delta, *, core: SyncerCore | None = None, fragment: int = 0, base_version: int = 0,
              steps: int = 10, tokens: int = 100, codec: str | None = None, block: int | None = None,
              **overrides) -> Push:
  """A push of `delta`, encoded with `codec` and `block` (default: the core's, else fp32 and 64) for the
  core's run (else `FP`); `overrides` replace any field of the Push (a wrong checksum, another
  fingerprint...)."""
  codec = codec or (core.settings.codec if core else "fp32")
  block = block or (core.settings.block if core else 64)
  payload = codec_lib.encode(np.asarray(delta, np.float32), codec, block)
  fields = dict(learner_id=learner, fingerprint=core.settings.fingerprint if core else FP, fragment=fragment,
                base_version=base_version, steps=steps, tokens=tokens, codec=codec, payload=payload,
                checksum=codec_lib.checksum(payload))
  fields.update(overrides)
  return Push(**fields)


def joined_core(num_learners=3, sizes=(8,), k=1, lr=1.0, momentum=0.0, lease_s=100.0, step_time=10.0, **kw):
  """A core (`make_core`) with lr 1 / momentum 0 (the new global is the old one minus the merged delta),
  fp32 blocks of 4, "arange" initial fragments and QuorumPolicy's own grace bound (`max_grace_s` 30 unless
  given), every learner joined and reporting `step_time`; returns (core, its fake clock)."""
  clock = FakeClock()
  kw.setdefault("max_grace_s", 30.0)  # QuorumPolicy's own default
  c = make_core(sizes, k=k, lr=lr, momentum=momentum, block=4, initial="arange", clock=clock, lease_s=lease_s, **kw)
  for i in range(num_learners):
    c.join(i, FP)
    c.heartbeat(i, step_time)
  return c, clock


def global_of(core: SyncerCore, p: int = 0) -> np.ndarray:
  """Fragment `p` of the core's global model, as its checkpoint holds it."""
  return core.state_dict()["fragments"][p]


def assert_states_equal(a: dict, b: dict) -> None:
  """Two `state_dict()`s are the same: arrays bitwise (dtype and bytes), everything else equal."""
  assert a.keys() == b.keys()
  for key in a:
    if key in ("fragments", "opt_states"):
      la, lb = [[np.asarray(x) for x in jax.tree.leaves(s[key])] for s in (a, b)]
      assert len(la) == len(lb) > 0
      for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()
    else:
      assert a[key] == b[key], key


# A run with tiny_cpu-like bounds, for the merge-safety rules: its period, tokens per learner step, steps.
PERIOD_STEPS, TOKENS_PER_STEP, TRAIN_STEPS = 10, 256, 60


def bounded_core(num_learners=4, sizes=(64,), k=1, max_norm_ratio=10.0, **kw):
  """A core of a run with tiny_cpu-like bounds (each learner's step: 4 sequences of 64 tokens,
  TOKENS_PER_STEP; a period of PERIOD_STEPS; TRAIN_STEPS steps), lr 1 / momentum 0 (new global = old global
  - merged delta), every learner joined; returns (core, its fake clock)."""
  clock = FakeClock()
  kw.setdefault("lease_s", 100.0)
  config = config_lib.base_config()
  config.data.global_batch, config.data.seq_len = 4 * num_learners, TOKENS_PER_STEP // 4
  config.outer.sync_every, config.train.steps = PERIOD_STEPS, TRAIN_STEPS
  c = make_core(sizes, k=k, lr=1.0, momentum=0.0, clock=clock, num_learners=num_learners, config=config,
                max_norm_ratio=max_norm_ratio, **kw)
  for i in range(num_learners):
    c.join(i, FP)
  return c, clock


def push_period(c: SyncerCore, learner: int, delta, **kw):
  """Pushes `delta` as one period's work (PERIOD_STEPS steps of TOKENS_PER_STEP tokens unless given)."""
  kw.setdefault("steps", PERIOD_STEPS)
  kw.setdefault("tokens", kw["steps"] * TOKENS_PER_STEP)
  return c.push(make_push(learner, np.asarray(delta, np.float32), core=c, **kw))


def frozen(c: SyncerCore) -> str:
  """Everything but the counters (and the members' refusal counts): globals, momentum, versions, open rounds,
  members."""
  state = c.state_dict()
  status = c.status()
  for d in (state, status):
    d.pop("counters")
  status.pop("refused_repeatedly")  # refusals are counted (per member too): counters, not the model
  for m in status["members"].values():
    m.pop("refused_in_row"), m.pop("refused_total")
  return repr({k: ([np.asarray(x).tobytes() for x in v] if k == "fragments" else v)
               for k, v in state.items() if k != "opt_states"}) + json.dumps(status, sort_keys=True)


def small_delta(n=64, scale=0.01, seed=0) -> np.ndarray:
  """A seeded normal vector of `n` float32 values of standard deviation `scale`."""
  return (scale * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


# Four fragments of unequal sizes, for a sharded syncer (placement on two shards: [[2, 3], [0, 1]]).
SHARDED_SIZES = (40, 24, 56, 16)


def fake_params(num_layers=6, d=8, vocab=16, lm_head=False):
  """A seeded numpy parameter tree shaped like the model's (embed, layers, final norm, optional head)."""
  rng = np.random.default_rng(0)
  arr = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  params = {
      "embed": {"embedding": arr(vocab, d)},
      "layers": {
          i: {
              "attn": {"q": {"kernel": arr(d, d)}, "k": {"kernel": arr(d, d)}, "o": {"kernel": arr(d, d)}},
              "mlp": {"up": {"kernel": arr(d, 2 * d)}, "down": {"kernel": arr(2 * d, d)}},
              "norm": {"scale": arr(d)},
          } for i in range(num_layers)
      },
      "final_norm": {"scale": arr(d)},
  }
  if lm_head:
    params["lm_head"] = {"kernel": arr(d, vocab)}
  return params


def sizing_config(**model_fields):
  """`base_config()` with `model_fields` set (the sizing tests' models)."""
  c = config_lib.base_config()
  for k, v in model_fields.items():
    c.model[k] = v
  return c


class StepLog:
  """A tape for `SyncerCore(tape=...)` that keeps only each step's kind, in order: a test waits on it for a
  step to have happened (e.g. a pull's first look of the core, "poll")."""

  def __init__(self):
    self._kinds: list[str] = []
    self._lock = threading.Lock()

  def begin(self, settings, fragments, epoch, started) -> None:
    pass

  def event(self, kind: str, args, reads, outcome) -> None:
    with self._lock:
      self._kinds.append(kind)

  def end(self, state) -> None:
    pass

  def close(self) -> None:
    pass

  def kinds(self) -> list[str]:
    with self._lock:
      return list(self._kinds)


def wait_for(predicate, what: str, timeout: float = 240.0, poll: float = 0.2):
  """Polls `predicate` until it returns something true (returned), or fails the test after `timeout`."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = predicate()
    if value:
      return value
    time.sleep(poll)
  pytest.fail(f"timed out after {timeout}s waiting for {what}")


free_port = run_children.free_port


# ---- real processes --------------------------------------------------------------------------------------

PROCESS_TIMEOUT_S = 240.0  # a loaded 2-core machine starts jax slowly
PROCESS_TOKEN = "process-test-token-0123456789abcdef"


def tiny_overrides(steps: int = 20, **extra) -> list[str]:
  """`--config` arguments of a tiny multi-process run (a 32-wide model, 2 learners of 1 device)."""
  fields = {
      "learners.num": 2, "learners.devices": 1, "train.steps": steps, "train.warmup_steps": 2,
      "train.log_every": 2, "train.eval_every": 10_000, "train.checkpoint_every": 5,
      "outer.sync_every": 5, "outer.lease_s": 3.0, "outer.min_quorum": 1, "outer.max_grace_s": 0.2,
      "model.d_model": 32, "model.mlp_dim": 64, "model.head_dim": 8, "data.max_bytes": 60_000,
      "data.eval_batches": 1, "syncer.checkpoint_every_rounds": 2, "comms.max_backoff_s": 0.5,
      "comms.unreachable_deadline_s": 120.0,
  }
  fields.update(extra)
  return ["--config", "configs/tiny_cpu.py"] + [f"--config.{k}={v}" for k, v in fields.items()]


class ProcessRun:
  """The child processes of one test (a syncer, learners), each logging to tmp/logs/<name>.log.
  Call `kill_all` in a finally block."""

  def __init__(self, tmp: pathlib.Path, config_argv: list[str]):
    self.tmp, self.config_argv = tmp, config_argv
    (tmp / "logs").mkdir(exist_ok=True)
    self.token_file = tmp / "token"
    self.token_file.write_text(PROCESS_TOKEN + "\n")
    self.token_file.chmod(0o600)
    self.procs: dict[str, subprocess.Popen] = {}
    self.port = None  # the syncer's (shard 0's, when sharded)
    self.ports: dict[int, int] = {}  # shard -> port
    self.syncer_flags: list[str] = []  # more flags for every syncer this run starts (e.g. --record-tape)

  def spawn(self, name: str, argv: list[str], devices: int = 1) -> subprocess.Popen:
    log = open(self.tmp / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "diloco_jax", *argv], cwd=REPO, stdout=log,
                            stderr=subprocess.STDOUT, env=run_children.child_env(devices))
    log.close()
    self.procs[name] = proc
    return proc

  def syncer(self, bind: str = "127.0.0.1:0", shard: int = 0, shards: int = 1) -> subprocess.Popen:
    """The syncer in tmp/syncer (log `syncer`), or shard `shard` of `shards` in tmp/syncer/shard_<i> (log
    `syncer_<i>`)."""
    workdir = self.tmp / "syncer" if shards == 1 else self.tmp / "syncer" / f"shard_{shard}"
    name = "syncer" if shards == 1 else f"syncer_{shard}"
    port_file = workdir / "syncer.port"
    port_file.unlink(missing_ok=True)
    extra = ["--shard", str(shard), "--shards", str(shards)] if shards > 1 else []
    proc = self.spawn(name, ["syncer", *self.config_argv, "--workdir", str(workdir), "--bind", bind,
                             "--token-file", str(self.token_file), *extra, *self.syncer_flags])
    wait_for(lambda: port_file.exists() and port_file.read_text().strip().isdigit() or proc.poll() is not None,
             "syncer port file", PROCESS_TIMEOUT_S)
    assert proc.poll() is None, self.log(name)
    self.ports[shard] = int(port_file.read_text())
    self.port = self.ports.get(0)
    return proc

  @property
  def target(self) -> str:
    """`--syncer`: every shard's address, in shard order."""
    return ",".join(f"127.0.0.1:{self.ports[s]}" for s in sorted(self.ports))

  def learner(self, i: int, devices: int = 1, extra: Sequence[str] = (), name: str | None = None
              ) -> subprocess.Popen:
    return self.spawn(name or f"learner_{i}",
                      ["learner", *self.config_argv, "--syncer", self.target, "--learner-id", str(i),
                       "--workdir", str(self.tmp / f"learner_{i}"), "--token-file", str(self.token_file), *extra],
                      devices=devices)

  def group_learner(self, i: int, hosts: int, devices_per_host: int = 1) -> list[subprocess.Popen]:
    """Learner i as `hosts` processes joined by jax.distributed on loopback, named learner_<i>_p<p>."""
    coordinator = f"127.0.0.1:{free_port()}"
    return [self.learner(i, devices_per_host, ["--coordinator", coordinator, "--num-processes", str(hosts),
                                               "--process-id", str(p)], name=f"learner_{i}_p{p}")
            for p in range(hosts)]

  def evaluator(self) -> subprocess.Popen:
    """The global model's evaluator process, in tmp/global."""
    return self.spawn("evaluator", ["evaluator", *self.config_argv, "--syncer", self.target,
                                    "--workdir", str(self.tmp / "global"), "--token-file", str(self.token_file),
                                    "--poll-s", "0.2"])

  def status(self, shard: int | None = None) -> dict:
    """The syncer's status (of shard `shard`, when sharded)."""
    port = self.port if shard is None else self.ports[shard]
    with GrpcTransport(f"127.0.0.1:{port}", PROCESS_TOKEN, -1, unreachable_deadline_s=30.0) as t:
      return t.status()

  def log(self, name: str) -> str:
    return (self.tmp / "logs" / f"{name}.log").read_text(errors="replace")[-4000:]

  def summary(self, i: int) -> dict:
    return json.loads((self.tmp / f"learner_{i}" / "summary.json").read_text())

  def step(self, i: int) -> int:
    return run_launcher.learner_progress(self.tmp / f"learner_{i}")["step"]

  def wait_ok(self, name: str, timeout: float = PROCESS_TIMEOUT_S) -> None:
    try:
      rc = self.procs[name].wait(timeout)
    except subprocess.TimeoutExpired:
      pytest.fail(f"{name} still running after {timeout}s:\n{self.log(name)}")
    assert rc == 0, f"{name} exited {rc}:\n{self.log(name)}"

  def kill_all(self) -> None:
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
      proc.wait()


def shipped_overrides(steps: int = 60, learners: int = 3, **extra) -> list[str]:
  """`--config` arguments of a small multi-process run that keeps every shipped fault-tolerance default of
  tiny_cpu (quorum, lease, grace, stall bound, retries): only the model, the data, the step count and the
  logging are shrunk, and the global batch set to tiny_cpu's per-learner batch times `learners`."""
  fields = {
      "learners.num": learners, "learners.devices": 1, "data.global_batch": 4 * learners,
      "train.steps": steps, "train.warmup_steps": 2, "train.log_every": 2, "train.eval_every": 10_000,
      "train.checkpoint_every": 10, "model.d_model": 32, "model.mlp_dim": 64, "model.head_dim": 8,
      "data.max_bytes": 60_000, "data.eval_batches": 1,
  }
  fields.update(extra)
  return ["--config", "configs/tiny_cpu.py"] + [f"--config.{k}={v}" for k, v in fields.items()]
# ---- tokenized data --------------------------------------------------------------------------------------

TOKEN_VOCAB = 1000  # small enough to train in a few seconds, large enough for real merges


@dataclasses.dataclass(frozen=True)
class TokenData:
  """A small tokenized corpus made by the real commands' functions: `corpus/` (stdlib sources), a
  SentencePiece model and ArrayRecord shards (small records, so windows span records)."""

  corpus: pathlib.Path
  tokenizer: pathlib.Path
  shards: pathlib.Path
  meta: dict

  def overrides(self) -> dict:
    """Config fields that read this corpus."""
    return {"data.format": "array_record", "data.tokenizer": str(self.tokenizer),
            "data.train_files": f"{self.shards}/train-*.array_record",
            "data.eval_files": f"{self.shards}/eval-*.array_record", "model.vocab_size": TOKEN_VOCAB}

  def apply(self, config):
    """`config` reading this corpus (changed in place and returned)."""
    for field, value in self.overrides().items():
      section, name = field.split(".")
      config[section][name] = value
    return config


def make_token_data(root: pathlib.Path, max_bytes: int = 300_000, num_shards: int = 4,
                    chunk_tokens: int = 100) -> TokenData:
  """Writes the first `max_bytes` of the standard library's top-level modules to `root/corpus` (one file
  each), trains a tokenizer on them and tokenizes them into `num_shards` train shards."""
  corpus = root / "corpus"
  corpus.mkdir(parents=True)
  stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
  total = 0
  for path in sorted(stdlib.glob("*.py")):
    text = path.read_bytes()
    if total + len(text) > max_bytes:
      continue
    (corpus / path.name).write_bytes(text)
    total += len(text)
  model = tokenizer.train_sentencepiece((t for _, t in tokenizer.read_documents(str(corpus))), TOKEN_VOCAB)
  tok_path = root / "tok.model"
  tok_path.write_bytes(model)
  meta = shards.write_shards(tokenizer.load(str(tok_path)), str(corpus), str(root / "tokens"),
                             num_shards=num_shards, chunk_tokens=chunk_tokens)
  return TokenData(corpus=corpus, tokenizer=tok_path, shards=root / "tokens", meta=meta)


def data_cfg(token_data: TokenData, seq_len=64):
  """The `data` section of `base_config()` reading `token_data`, with `seq_len`."""
  c = token_data.apply(config_lib.base_config())
  c.data.seq_len = seq_len
  return c.data


def corpus_texts(token_data: TokenData) -> dict:
  """The corpus files' texts by file name."""
  return {p.name: p.read_text() for p in sorted(token_data.corpus.iterdir())}


def file_streams(paths, dtype=np.uint16):
  """Each shard file's whole token stream, read record by record."""
  return [np.concatenate([np.frombuffer(r, dtype) for r in grain.sources.ArrayRecordDataSource(p)])
          for p in paths]


def split_documents(stream, eos):
  """A shard's token stream cut into its documents (each ends with `eos`, dropped)."""
  ends = np.flatnonzero(stream == eos)
  assert ends.size and ends[-1] == stream.size - 1  # every document ends with eos
  return np.split(stream[:-1], ends[:-1] + 1) if ends.size > 1 else [stream[:-1]]

"""The trained model out of a run: its parameters, config and tokenizer in one directory that `eval` and
`sample` load.

`train` and `baseline` export at their end to `WORKDIR/model` (the syncer's global model; the baseline's
parameters), `local` from the syncer's final checkpoint; the `export` command (tools/export.py) exports
from a syncer's checkpoint directory on request.

A model directory (local or gs://):

  params/          params-only orbax checkpoint (float32; the model's nested dict)
  config.json      the run's config, as resolved (overrides applied)
  tokenizer.model  a copy of data.tokenizer (tokenized data; byte-level models need none)
  model.json       what it is (source, run id, steps, tokens, final eval loss, parameter count, the
                   tokenizer's original path and sha256); written last, so a directory holding it is complete
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from diloco_jax import config as config_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.data import tokenizer as tokenizer_lib
from diloco_jax.syncer import build
from diloco_jax.syncer import checkpoint as syncer_checkpoint

FORMAT = 1
PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.model"
META_FILE = "model.json"


def export(out: str | pathlib.Path, config, params: Any, *, source: str, **meta) -> epath.Path:
  """Writes `params` (device or host arrays, the model's nested dict) with `config` and its tokenizer to
  `out` (local or gs://, replacing an earlier export there); `meta` (JSON values) goes into model.json.
  Returns the directory."""
  tok = tokenizer_lib.for_data(config.data)
  if tok.vocab_size != config.model.vocab_size:
    raise config_lib.ConfigError(f"config.model.vocab_size: {config.model.vocab_size} differs from the "
                                 f"{tok.vocab_size} pieces of the tokenizer {tok.reference}")
  out = epath.Path(out)
  if not out.is_absolute() and "://" not in str(out):
    out = epath.Path(pathlib.Path(str(out)).absolute())
  out.mkdir(parents=True, exist_ok=True)
  (out / META_FILE).unlink(missing_ok=True)  # incomplete until rewritten below
  checkpointer = ocp.StandardCheckpointer()
  try:
    checkpointer.save(out / PARAMS_DIR, params, force=True)
    checkpointer.wait_until_finished()
  finally:
    checkpointer.close()
  (out / CONFIG_FILE).write_text(config_lib.config_json(config))  # resolved, as the run's own config.json
  if tok.reference is not None:
    (out / TOKENIZER_FILE).write_bytes(tok.model_proto)
  info = {"format": FORMAT, "source": source, "params": model_lib.count_params(params),
          "vocab_size": tok.vocab_size, "tokenizer": tok.reference, **meta}
  (out / META_FILE).write_text(json.dumps(info, indent=2, sort_keys=True, default=float) + "\n")
  return out


def config_from_json(text: str) -> ml_collections.ConfigDict:
  """A config saved by `export`, on top of `base_config()` (so a field added since is at its default)."""
  c = config_lib.base_config()
  for section, fields in json.loads(text).items():
    if isinstance(fields, dict) and section in c and isinstance(c[section], ml_collections.ConfigDict):
      for key, value in fields.items():
        c[section][key] = value
    else:
      c[section] = fields
  return c


@dataclasses.dataclass(frozen=True)
class Model:
  """An exported model loaded onto a mesh."""

  config: ml_collections.ConfigDict
  params: Any  # sharded on `mesh` as the config's rules say
  graphdef: Any
  mesh: jax.sharding.Mesh
  tokenizer: tokenizer_lib.Tokenizer
  meta: dict

  @property
  def param_shardings(self):
    return jax.tree.map(lambda p: p.sharding, self.params)


def load(model_dir: str | pathlib.Path, devices: Sequence[jax.Device] | None = None) -> Model:
  """The model exported to `model_dir`, its parameters restored straight into their shardings on a mesh
  of `devices` (default: all) with the config's mesh axes.

  Raises FileNotFoundError when `model_dir` holds no complete export, ValueError when the devices do not
  fit the config's mesh or the tokenizer copy does not match its recorded hash."""
  root = epath.Path(model_dir)
  if not (root / META_FILE).exists():
    raise FileNotFoundError(f"{str(model_dir)!r} holds no exported model (no {META_FILE}); export one with "
                            "`python -m diloco_jax export`, or train with `train`/`baseline`/`local`")
  meta = json.loads((root / META_FILE).read_text())
  if meta.get("format") != FORMAT:
    raise ValueError(f"{str(model_dir)!r}: export format {meta.get('format')!r}, this version reads {FORMAT}")
  config = config_from_json((root / CONFIG_FILE).read_text())
  config_lib.validate(config)
  if meta.get("tokenizer"):
    tok = tokenizer_lib.SentencePieceTokenizer((root / TOKENIZER_FILE).read_bytes(), str(root / TOKENIZER_FILE))
    if tok.sha256 != meta["tokenizer"]["sha256"]:
      raise ValueError(f"{str(model_dir)!r}: {TOKENIZER_FILE} is not the tokenizer the model was trained with")
  else:
    tok = tokenizer_lib.ByteTokenizer()
  devices = list(devices or jax.devices())
  try:
    mesh = mesh_lib.make_mesh(devices, mesh_lib.mesh_axes_from_config(config))
  except ValueError as e:
    raise ValueError(f"the model's mesh axes do not fit {len(devices)} devices ({e}); "
                     "choose another --devices") from None
  graphdef, abstract = model_lib.abstract_model(config.model, mesh)
  checkpointer = ocp.StandardCheckpointer()
  try:
    params = checkpointer.restore(root / PARAMS_DIR, abstract)
  finally:
    checkpointer.close()
  return Model(config=config, params=params, graphdef=graphdef, mesh=mesh, tokenizer=tok, meta=meta)


def syncer_checkpoint_dir(syncer_workdir: str | pathlib.Path) -> pathlib.Path:
  """Where a syncer keeps its checkpoints: `syncer_checkpoints/` under its workdir (the `syncer` process's,
  and `WORKDIR/syncer` of `train` and `local`); a path to the checkpoint directory itself works too."""
  workdir = pathlib.Path(syncer_workdir)
  nested = workdir / "syncer_checkpoints"
  return nested if nested.is_dir() else workdir


def _latest_state(syncer_workdir: str | pathlib.Path) -> tuple[dict, dict] | None:
  """(state dict, info) of a syncer's latest checkpoint; None when there is none."""
  directory = syncer_checkpoint_dir(syncer_workdir)
  if not directory.is_dir():
    return None
  checkpointer = syncer_checkpoint.SyncerCheckpointer(directory, keep=1 << 20, async_save=False)
  try:
    if checkpointer.latest_step() is None:
      return None
    return checkpointer.restore()
  finally:
    checkpointer.close()


def syncer_params(config, syncer_workdirs: str | pathlib.Path | Sequence[str | pathlib.Path], run_id: str
                  ) -> tuple[Any, dict] | None:
  """(the global model as host arrays, checkpoint info) from the latest checkpoint of the syncer that ran
  with `config` and `run_id`; None when there is no checkpoint. Raises ValueError for another run's.

  A sharded syncer: `syncer_workdirs` lists every shard's workdir (any order); each fragment comes from the
  shard that owns it, and a fragment no shard's checkpoint holds raises ValueError."""
  workdirs = [syncer_workdirs] if isinstance(syncer_workdirs, (str, pathlib.Path)) else list(syncer_workdirs)
  found = [_latest_state(w) for w in workdirs]
  if any(f is None for f in found):
    return None
  first = found[0][0]
  num = len(first["fragments"])
  fragments, versions, seen = [None] * num, [0] * num, set()
  for state, _ in found:
    if state["fingerprint"] != first["fingerprint"]:
      raise ValueError(f"the syncer checkpoints in {[str(w) for w in workdirs]} are of different runs")
    owned = state.get("owned")  # a shard's fragments (None: every fragment, an unsharded syncer)
    for p in range(num) if owned is None else owned:
      fragments[p], versions[p] = state["fragments"][p], state["versions"][p]
      seen.add(p)
  if len(seen) != num:
    missing = sorted(set(range(num)) - seen)
    raise ValueError(f"no checkpoint in {[str(w) for w in workdirs]} holds fragments {missing} (a sharded "
                     "syncer: give every shard's workdir)")
  state = {"fingerprint": first["fingerprint"], "fragments": fragments, "versions": versions}
  infos = [i for _, i in found]
  info = (infos[0] if len(infos) == 1
          else {"step": [i["step"] for i in infos], "rounds": sum(i["rounds"] for i in infos)})
  cpu_mesh = mesh_lib.make_mesh(jax.devices("cpu")[:1], {"data": 1, "fsdp": 1, "tensor": 1})
  _, template = model_lib.abstract_model(config.model, cpu_mesh)
  params = build.global_params_from_state(config, state, run_id, template)
  return params, {**info, "versions": [int(v) for v in state["versions"]]}


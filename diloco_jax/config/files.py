"""A run's config on disk: `config.json` (resolved: what the run ran with) and its fingerprint."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib

import ml_collections

from diloco_jax.config.resolve import as_config, resolve
from diloco_jax.config.schema import ConfigError, base_config

# Fields every process of one run must agree on: a learner whose fingerprint differs is refused.
_FINGERPRINT_FIELDS = ("model", "data.seq_len", "outer.num_fragments", "outer.sync_every", "outer.codec",
                       "outer.codec_block", "outer.fragment_plan", "outer.sync_schedule", "outer.schedule_power",
                       "learners.num", "seed")

CONFIG_FILE = "config.json"
FINGERPRINT_FILE = "fingerprint.txt"


def fingerprint(c, run_id: str = "") -> str:
  """A short hash of the run id and the config fields that must match across a run's processes (`c`: a
  config or its RunSpec: none of these fields is derived, so both give the same hash)."""
  def get(path):
    node = c
    for part in path.split("."):
      node = getattr(node, part)
    if isinstance(node, ml_collections.ConfigDict):
      return node.to_dict()
    return dataclasses.asdict(node) if dataclasses.is_dataclass(node) else node

  blob = json.dumps({"run_id": run_id, **{f: get(f) for f in _FINGERPRINT_FIELDS}}, sort_keys=True, default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_json(c) -> str:
  """`c` (a config or its RunSpec) resolved, as the JSON text of `config.json`."""
  return as_config(resolve(c)).to_json_best_effort(indent=2, sort_keys=True) + "\n"


def save_resolved(c, workdir: str | os.PathLike, run_id: str = "") -> pathlib.Path:
  """Writes the config as this process runs it (after every override, with every derived value filled in)
  to `<workdir>/config.json`, and its run fingerprint to `<workdir>/fingerprint.txt` beside it; returns the
  config file's path. Both are replaced atomically (a run resumed with other overrides records the ones it
  resumed with). `c`: a config or its RunSpec."""
  workdir = pathlib.Path(workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  files = {CONFIG_FILE: config_json(c), FINGERPRINT_FILE: f"{fingerprint(c, run_id)}\n"}
  for name, text in files.items():
    tmp = workdir / f"{name}.tmp"
    tmp.write_text(text)
    tmp.replace(workdir / name)
  return workdir / CONFIG_FILE


def check_workdir(c, workdir: str | os.PathLike, run_id: str = "") -> None:
  """Raise ConfigError when `workdir` holds a run of another config or run id: a `fingerprint.txt` that is
  not this run's (`fingerprint`). Call it before writing anything there: resuming a workdir is for the run
  that made it, and its files must keep describing its checkpoints. A workdir without one passes."""
  path = pathlib.Path(workdir) / FINGERPRINT_FILE
  try:
    saved = path.read_text().strip()
  except (FileNotFoundError, NotADirectoryError):
    return
  mine = fingerprint(c, run_id)
  if saved != mine:
    raise ConfigError(f"{workdir} holds a run of another config or run id (fingerprint {saved}, this run's {mine}); "
                      "use a new --workdir (or delete this one to start over)")


def load_resolved(workdir: str | os.PathLike) -> ml_collections.ConfigDict:
  """The config a run saved with `save_resolved` (resolving it gives the run's spec; its fingerprint
  matches the saved one). JSON has no tuples: fields that are tuples in `base_config` (e.g.
  `emulation.speeds`) come back as tuples."""
  loaded = json.loads((pathlib.Path(workdir) / CONFIG_FILE).read_text())

  def restore(node: dict, template) -> None:
    for key, value in node.items():
      want = template.get(key) if isinstance(template, ml_collections.ConfigDict) else None
      if isinstance(value, dict):
        restore(value, want)
      elif isinstance(value, list) and isinstance(want, tuple):
        node[key] = tuple(value)

  restore(loaded, base_config())
  return ml_collections.ConfigDict(loaded)

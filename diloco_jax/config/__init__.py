"""The one config system: the schema (fields, defaults, tiers), one validation pass, `resolve()` into a
frozen RunSpec, and the run's config.json. Imports no jax, flax or optax.

  schema.py    every field with its default and tier; `base_config()`, `ConfigError`
  validate.py  `validate()`: the field checks (their second stage, plan and data files: `cli.validated`)
  resolve.py   `resolve(config) -> RunSpec`: frozen per-part specs, every derived value filled in
  files.py     `fingerprint`, `save_resolved` / `load_resolved` of `<workdir>/config.json`, `check_workdir`

`from diloco_jax import config as config_lib` gives the names below.
"""

from diloco_jax.config.files import (
                                     CONFIG_FILE,
                                     FINGERPRINT_FILE,
                                     check_workdir,
                                     config_json,
                                     fingerprint,
                                     load_resolved,
                                     save_resolved,
)
from diloco_jax.config.resolve import (
                                     CommsSpec,
                                     DataSpec,
                                     EmulationSpec,
                                     LearnersSpec,
                                     MeshSpec,
                                     ModelSpec,
                                     OuterSpec,
                                     RunSpec,
                                     SyncerSpec,
                                     TrainSpec,
                                     as_config,
                                     resolve,
                                     resolve_axis_sizes,
)
from diloco_jax.config.schema import (
                                     INNER_FIELDS,
                                     SCHEMA,
                                     TIERS,
                                     ConfigError,
                                     base_config,
                                     field_paths,
                                     tier_of,
                                     use_token_shards,
)
from diloco_jax.config.validate import validate

__all__ = ["CONFIG_FILE", "FINGERPRINT_FILE", "INNER_FIELDS", "SCHEMA", "TIERS", "CommsSpec", "ConfigError",
           "DataSpec", "EmulationSpec", "LearnersSpec", "MeshSpec", "ModelSpec", "OuterSpec", "RunSpec",
           "SyncerSpec", "TrainSpec", "as_config", "base_config", "check_workdir", "config_json", "field_paths",
           "fingerprint", "load_resolved", "resolve", "resolve_axis_sizes", "save_resolved", "tier_of",
           "use_token_shards", "validate"]

"""The resolved config: every derived field filled in once (`config.resolve`), recorded in config.json and
read back to the same spec; the schema's tiers against docs/configs.md; bad fields named by the one check."""

import dataclasses
import re

import pytest

import helpers
from configs import small_cpu
from diloco_jax import config as config_lib
from diloco_jax.outer import chunked
from diloco_jax.syncer.settings import SyncerSettings

DOC_TIERS = {"## User fields": "user", "## Expert fields": "expert", "## Operations fields": "operations",
             "## Emulation and test fields": "emulation"}
# Values of the spec derived from several fields, beside the schema's own.
DERIVED_ONLY = {"learners": {"batches"}, "outer": {"heartbeat_s"}}


def test_every_field_has_one_tier_and_the_user_tier_is_small():
  paths = config_lib.field_paths()
  assert len(paths) == len(set(paths)) > 100
  assert sum(len(config_lib.field_paths(t)) for t in config_lib.TIERS) == len(paths)
  assert len(config_lib.field_paths("user")) <= 30
  assert set(config_lib.field_paths("emulation")) == {f"emulation.{f}" for f in config_lib.SCHEMA["emulation"]}
  with pytest.raises(KeyError):
    config_lib.tier_of("train.min_step_s")  # moved to emulation


def test_every_field_is_documented_under_its_tier():
  text = (helpers.REPO / "docs" / "configs.md").read_text()
  starts = sorted((text.index(h), tier) for h, tier in DOC_TIERS.items())
  documented = {}
  for (start, tier), (end, _) in zip(starts, starts[1:] + [(len(text), None)]):
    section = text[start:text.find("\n## ", start + 1) if text.find("\n## ", start + 1) > 0 else end]
    first_cells = re.findall(r"^\| `([^`]+)` \|", section, flags=re.MULTILINE)
    documented[tier] = first_cells
  for tier in config_lib.TIERS:
    assert sorted(documented[tier]) == sorted(config_lib.field_paths(tier)), tier
  # The user tier comes first.
  assert min(starts)[1] == "user"


def test_spec_sections_have_the_schema_fields():
  spec = config_lib.resolve(config_lib.base_config())
  for section in (f.name for f in dataclasses.fields(spec) if f.name != "seed"):
    fields = {f.name for f in dataclasses.fields(getattr(spec, section))}
    subsections = {name.split(".")[1] for name in config_lib.SCHEMA if name.startswith(f"{section}.")}
    assert fields == set(config_lib.SCHEMA[section]) | subsections | DERIVED_ONLY.get(section, set()), section
  assert {f.name for f in dataclasses.fields(spec.learners.inner)} >= set(config_lib.INNER_FIELDS)


def test_resolve_fills_in_every_derived_field(tiny_config):
  c = tiny_config
  c.outer.min_quorum, c.outer.downlink_history, c.outer.stall_s, c.outer.max_in_flight = 0, 0, 0.0, 0
  c.syncer.merge_threads = 0
  s = config_lib.resolve(c)
  m = c.learners.num
  assert s.outer.min_quorum == m and s.outer.downlink_history == 2 * m
  assert s.outer.stall_s == max(c.outer.max_grace_s, 0.5) == 0.5
  c.outer.max_grace_s = 3.0
  assert config_lib.resolve(c).outer.stall_s == 3.0
  assert s.outer.max_in_flight == -(-c.outer.tau * c.outer.num_fragments
                                                                         // c.outer.sync_every) + 1
  assert s.outer.heartbeat_s == max(min(1.0, c.outer.lease_s / 4, s.outer.stall_s / 3), 0.02)
  assert s.syncer.merge_threads == chunked.default_threads() >= 1
  assert s.learners.device_counts == (c.learners.devices,) * m
  assert s.learners.batches == (c.data.global_batch // m,) * m
  assert s.emulation.speeds == (1.0,) * m
  assert s.learners.inner == s.train  # nothing set in learners.inner: the learners use `train`
  # A set value stays as it is.
  c.outer.min_quorum, c.outer.downlink_history, c.outer.stall_s, c.outer.max_in_flight = 2, 3, 7.0, 5
  c.syncer.merge_threads, c.emulation.speeds = 1, (1.0, 0.5, 1.0, 0.5)
  c.learners.device_counts, c.data.global_batch = (1, 3, 2, 2), 32
  c.learners.inner.lr = 1e-2
  s = config_lib.resolve(c)
  assert (s.outer.min_quorum, s.outer.downlink_history, s.outer.stall_s, s.outer.max_in_flight) == (2, 3, 7.0, 5)
  assert s.syncer.merge_threads == 1 and s.emulation.speeds == (1.0, 0.5, 1.0, 0.5)
  assert s.learners.device_counts == (1, 3, 2, 2) and s.learners.batches == (4, 12, 8, 8)
  assert s.learners.inner.lr == 1e-2 and s.train.lr == c.train.lr
  assert config_lib.resolve(s) is s  # a spec is already resolved


def test_front_loaded_in_flight_limit_uses_the_schedules_spacing(tiny_config):
  tiny_config.outer.sync_schedule, tiny_config.outer.tau = "front_loaded", 2
  assert config_lib.resolve(tiny_config).outer.max_in_flight == 3  # P + 1: front-loaded syncs max(1, tau) apart


def test_the_resolved_config_json_resolves_to_the_same_spec(tmp_path):
  c = small_cpu.get_config()
  c.outer.min_quorum, c.emulation.speeds, c.learners.inner.b2 = 0, (1.0, 1.0, 0.5, 0.5), 0.99
  spec = config_lib.resolve(c)
  config_lib.save_resolved(spec, tmp_path, "run-7")
  loaded = config_lib.load_resolved(tmp_path)
  assert loaded.outer.min_quorum == 4 and loaded.outer.stall_s == 5.0 and loaded.outer.max_in_flight == 2
  assert loaded.learners.inner.lr == c.train.lr and loaded.learners.inner.b2 == 0.99
  assert loaded.emulation.speeds == (1.0, 1.0, 0.5, 0.5)
  assert config_lib.resolve(loaded) == spec
  # Saving the config or its spec writes the same file; loading and saving again changes nothing.
  text = (tmp_path / config_lib.CONFIG_FILE).read_text()
  config_lib.save_resolved(c, tmp_path / "again", "run-7")
  assert (tmp_path / "again" / config_lib.CONFIG_FILE).read_text() == text
  config_lib.save_resolved(loaded, tmp_path / "twice", "run-7")
  assert (tmp_path / "twice" / config_lib.CONFIG_FILE).read_text() == text
  # Resolution changes no fingerprinted field: a run's processes agree whether they hold a config or a spec.
  fp = (tmp_path / config_lib.FINGERPRINT_FILE).read_text().strip()
  assert fp == config_lib.fingerprint(c, "run-7") == config_lib.fingerprint(spec, "run-7")
  assert fp == config_lib.fingerprint(loaded, "run-7")


def test_the_syncer_settings_come_from_the_spec(tiny_config):
  tiny_config.outer.min_quorum, tiny_config.outer.downlink_history = 0, 0
  spec = config_lib.resolve(tiny_config)
  s = SyncerSettings.for_fragments(spec, (8, 4), 15, "fp")
  assert (s.policy.min_quorum, s.downlink_history, s.stall_s) == (4, 8, 0.5)
  assert (s.merge_threads, s.num_learners, s.period_steps, s.max_push_steps) == (
      spec.syncer.merge_threads, 4, 15, tiny_config.train.steps)
  assert s.tokens_per_step == max(spec.learners.batches) * tiny_config.data.seq_len
  assert (s.codec, s.downlink_codec, s.outer_lr, s.outer_momentum) == ("int4", "int4", 0.8, 0.5)


@pytest.mark.parametrize("field,value,learners", [
    ("outer.tau", -1, True),
    ("outer.grace_gamma", 1.0, True),
    ("outer.min_grace_s", 6.0, True),  # above outer.max_grace_s
    ("outer.staleness_beta", -0.5, True),
    ("outer.lease_s", 0.0, True),
    ("emulation.min_step_s", -1.0, False),
    ("emulation.speeds", (1.0, 2.0), True),
    ("emulation.step_cv", 1.0, True),
    ("learners.device_counts", (2, 2, 2), True),
    ("syncer.merge_threads", -1, False),
])
def test_a_bad_field_is_named_by_the_one_check(field, value, learners):
  c = config_lib.base_config()
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(config_lib.ConfigError, match=rf"^config\.{re.escape(field)}:"):
    config_lib.validate(c, learners=learners)

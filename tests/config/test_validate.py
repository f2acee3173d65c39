"""Shipped configs load, validate and have the sizes they claim; bad configs fail early, naming the field.

The big configs (m150, b1, b12) are only ever built abstractly here: shapes, never arrays.
"""

import importlib.util
import os
import subprocess
import sys

import jax
import pytest

import helpers
from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.outer import fragments

REPO = helpers.REPO
CONFIG_FILES = sorted(p for p in (REPO / "configs").glob("*.py") if p.name != "__init__.py")
# Nominal sizes of the big configs, in parameters; the abstract count must be within 20%.
NOMINAL_PARAMS = {"m150": 150e6, "b1": 1e9, "b12": 12e9}


def _load(path):
  spec = importlib.util.spec_from_file_location(f"_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _one_device_mesh():
  return mesh_lib.make_mesh(jax.devices()[:1], {"data": 1, "fsdp": 1, "tensor": 1})


def test_every_nominal_config_is_shipped():
  names = {p.stem for p in CONFIG_FILES}
  assert {"tiny_cpu", "small_cpu", *NOMINAL_PARAMS} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_config_loads_and_validates(path):
  module = _load(path)
  assert "python -m diloco_jax" in (module.__doc__ or ""), "the docstring must hold the run command"
  assert f"configs/{path.name}" in module.__doc__, "the docstring's command must name this file"
  c = module.get_config()
  # Every field a config sets must already exist in base_config: no typo silently adds a new one.
  base = config_lib.base_config()
  for section, fields in c.items():
    if hasattr(fields, "keys"):
      assert set(fields.keys()) == set(base[section].keys()), section
  config_lib.validate(c, num_devices=None, learners=True)
  config_lib.validate(c, num_devices=None, learners=False)
  # On exactly the devices it asks for, the learner meshes and the baseline mesh both work out.
  devices = c.learners.num * c.learners.devices
  config_lib.validate(c, num_devices=devices, learners=True)
  config_lib.validate(c, num_devices=devices, learners=False)


@pytest.mark.parametrize("name", sorted(NOMINAL_PARAMS))
def test_big_config_sizes_are_abstract_and_nominal(name):
  c = _load(REPO / "configs" / f"{name}.py").get_config()
  live_before = {id(a) for a in jax.live_arrays()}  # arrays of earlier tests may be freed meanwhile
  _, abstract = model_lib.abstract_model(c.model, _one_device_mesh())
  leaves = jax.tree.leaves(abstract)
  assert leaves and all(type(x) is jax.ShapeDtypeStruct for x in leaves)
  new = [a for a in jax.live_arrays() if id(a) not in live_before]
  assert not new, f"building the abstract model allocated device arrays: {[a.shape for a in new]}"
  n = model_lib.count_params(abstract)
  nominal = NOMINAL_PARAMS[name]
  assert 0.8 * nominal <= n <= 1.2 * nominal, f"{name}: {n / 1e6:.1f}M params, nominal {nominal / 1e6:.0f}M"
  # The docstring states the count (to 3 significant figures, in M or B).
  doc = _load(REPO / "configs" / f"{name}.py").__doc__
  stated = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.4g}M"
  assert stated in doc, f"{name}: docstring should state {stated}"

  # Every sharded dimension divides evenly over its axis on the real learner mesh (no padded shards).
  sizes = mesh_lib.resolve_axis_sizes(mesh_lib.mesh_axes_from_config(c), c.learners.devices)
  for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
    for dim, axis in zip(leaf.shape, leaf.sharding.spec):
      if axis is not None:
        assert dim % sizes[axis] == 0, f"{jax.tree_util.keystr(path)}: {dim} over {axis}={sizes[axis]}"

  # The fragment plan the learners will build splits these parameters into non-empty fragments.
  plan = fragments.make_plan(abstract, c.outer.num_fragments, c.outer.sync_every, c.outer.fragment_plan)
  assert plan.num_fragments == c.outer.num_fragments
  assert sum(len(p) for p in plan.paths) == len(leaves)


def test_big_configs_are_accelerator_shaped():
  for name in NOMINAL_PARAMS:
    c = _load(REPO / "configs" / f"{name}.py").get_config()
    assert c.data.seq_len == 2048 and c.model.max_seq_len >= 2048, name
    assert c.model.dtype == "bfloat16" and c.model.remat, name
    assert c.learners.num >= 2, name


BAD_OVERRIDES = {
    "--config.train.stepz=3": "stepz",  # no such field
    "--config.train.steps=abc": "train.steps",  # wrong type
    "--config.data.global_batch=12": "data.global_batch",  # 12 does not split over 8 data-parallel ways
    "--config.mesh.num_devices=16": "mesh.num_devices",  # only 8 devices exist
}
_NEVER_WRITTEN = "/tmp/diloco_test_configs_never_written"


@pytest.fixture(scope="module")
def bad_override_runs():
  """Each bad override's baseline command, all started at once (most of each run is importing jax)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  procs = {
      override: subprocess.Popen(
          [sys.executable, "-m", "diloco_jax", "baseline", "--config", "configs/tiny_cpu.py", override,
           "--workdir", _NEVER_WRITTEN],
          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
      for override in BAD_OVERRIDES
  }
  results = {}
  for override, proc in procs.items():
    stdout, stderr = proc.communicate(timeout=180)
    results[override] = (proc.returncode, stdout, stderr)
  return results


@pytest.mark.process  # a `baseline` process per override
@pytest.mark.parametrize("override", sorted(BAD_OVERRIDES))
def test_bad_override_exits_2_naming_the_field(bad_override_runs, override):
  returncode, stdout, stderr = bad_override_runs[override]
  assert returncode == 2, (returncode, stderr[-2000:])
  assert BAD_OVERRIDES[override] in stderr, stderr[-2000:]
  assert "Traceback" not in stderr, stderr[-2000:]
  # It failed before training: the baseline never announced its model, never wrote metrics.
  assert "baseline:" not in stdout
  assert not os.path.exists(os.path.join(_NEVER_WRITTEN, "metrics.jsonl"))


def _expect_error(c, field, **kwargs):
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, **kwargs)
  assert f"config.{field}" in str(e.value)


def test_validate_rejects_kv_heads_not_dividing_heads(tiny_config):
  tiny_config.model.num_heads, tiny_config.model.num_kv_heads = 4, 3
  _expect_error(tiny_config, "model.num_kv_heads")


def test_validate_rejects_tensor_not_dividing_kv_heads(tiny_config):
  tiny_config.model.num_kv_heads = 2
  tiny_config.mesh.tensor = 4
  _expect_error(tiny_config, "mesh.tensor")


def test_validate_rejects_quorum_above_learners(tiny_config):
  tiny_config.outer.min_quorum = tiny_config.learners.num + 1
  _expect_error(tiny_config, "outer.min_quorum", learners=True)
  config_lib.validate(tiny_config, learners=False)  # the baseline has no quorum


def test_validate_rejects_unknown_codec(tiny_config):
  tiny_config.outer.codec = "int3"
  _expect_error(tiny_config, "outer.codec", learners=True)


def test_validate_rejects_two_fill_axes(tiny_config):
  tiny_config.mesh.data, tiny_config.mesh.fsdp = -1, -1
  _expect_error(tiny_config, "mesh.fsdp")


def test_validate_rejects_learners_beyond_devices(tiny_config):
  tiny_config.learners.num, tiny_config.learners.devices = 4, 4
  _expect_error(tiny_config, "learners.devices", num_devices=8, learners=True)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_paper_schedule_one_fragment_per_step_on_every_config(path):
  """P = H (Decoupled DiLoCo's default: one fragment due every inner step) plans on every shipped config,
  from abstract shapes: H fragments, every element of every leaf in exactly one piece, none empty, and
  the bytes per step even to within 2x of the mean."""
  c = _load(path).get_config()
  _, abstract = model_lib.abstract_model(c.model, _one_device_mesh())
  h = c.outer.sync_every
  for kind in fragments.PLANS:
    plan = fragments.make_plan(abstract, h, h, kind)
    assert plan.num_fragments == h and sorted(plan.offsets) == list(range(h))
    covered = {}
    for p in range(h):
      assert plan.size(p) > 0
      for leaf, _, a, b in plan.pieces(p):
        covered.setdefault(leaf, []).append((a, b))
    leaves = fragments.flatten(abstract)
    assert set(covered) == set(leaves)
    for leaf, ranges in covered.items():  # disjoint ranges that tile [0, size)
      ranges.sort()
      assert ranges[0][0] == 0 and ranges[-1][1] == leaves[leaf].size, leaf
      assert all(b0 == a1 for (_, b0), (a1, _) in zip(ranges, ranges[1:])), leaf
    sizes = [plan.size(p) for p in range(h)]
    assert sum(sizes) == model_lib.count_params(abstract)
    assert max(sizes) <= 2 * sum(sizes) / h, kind


def test_impossible_fragment_plans_are_config_errors_before_compiling(capsys):
  """`cli.validated` makes the run's fragment plan from abstract shapes: P = H plans on small_cpu (its 4
  layer groups split into pieces), and a P no plan can reach exits with a message naming the field."""
  c = _load(REPO / "configs" / "small_cpu.py").get_config()
  c.outer.num_fragments = c.outer.sync_every = 20
  cli.validated(c, None, learners=True, data=False)
  tiny = _load(REPO / "configs" / "tiny_cpu.py").get_config()
  tiny.model.update(d_model=2, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, mlp_dim=1)
  tiny.outer.sync_every = tiny.outer.num_fragments = 5000  # more fragments than the model's parameters
  with pytest.raises(SystemExit) as e:
    cli.validated(tiny, None, learners=True, data=False)
  assert e.value.code == 2
  assert "config.outer.num_fragments" in capsys.readouterr().err


def test_validate_rejects_unknown_sync_schedule_and_bad_power(tiny_config):
  tiny_config.outer.sync_schedule = "cosine"
  _expect_error(tiny_config, "outer.sync_schedule", learners=True)
  tiny_config.outer.sync_schedule = "front_loaded"
  for power in (0.5, float("nan"), float("inf")):
    tiny_config.outer.schedule_power = power
    _expect_error(tiny_config, "outer.schedule_power", learners=True)
  tiny_config.outer.schedule_power = 2.0
  config_lib.validate(tiny_config, learners=True)
  # The schedule is part of what every process of a run must agree on.
  front = config_lib.fingerprint(tiny_config)
  tiny_config.outer.sync_schedule = "periodic"
  assert config_lib.fingerprint(tiny_config) != front


def test_config_validates_speeds_and_device_counts(tiny_config):
  c = tiny_config
  c.emulation.speeds = (1.0, 1.0, 0.847, 0.847)
  c.emulation.step_cv = 0.1
  config_lib.validate(c, 8, learners=True)
  assert list(config_lib.resolve(c).emulation.speeds) == [1.0, 1.0, 0.847, 0.847]
  for field, value, match in (("emulation.speeds", (1.0, 0.5), "emulation.speeds"),
                              ("emulation.speeds", (1.0, 1.0, 1.0, -1.0), "emulation.speeds"),
                              ("emulation.step_cv", 1.5, "emulation.step_cv"),
                              ("emulation.step_s", -0.1, "emulation.step_s"),
                              ("learners.device_counts", (1, 2), "learners.device_counts")):
    bad = config_lib.base_config()
    section, name = field.split(".")
    bad[section][name] = value
    with pytest.raises(config_lib.ConfigError, match=match):
      config_lib.validate(bad, 8, learners=True)
  # Learners of different sizes: the global batch is split in proportion to their devices.
  d = config_lib.base_config()
  d.learners.num, d.learners.device_counts, d.data.global_batch = 2, (1, 3), 24
  config_lib.validate(d, 4, learners=True)
  assert list(config_lib.resolve(d).learners.batches) == [6, 18]
  assert list(config_lib.resolve(d).learners.device_counts) == [1, 3]
  with pytest.raises(config_lib.ConfigError, match="learners.device_counts"):
    config_lib.validate(d, 3, learners=True)  # 4 devices asked for
  d.data.global_batch = 16
  with pytest.raises(config_lib.ConfigError, match="eval batch 16"):
    config_lib.validate(d, 4, learners=True)  # 12 sequences split over 3 devices, the eval batch not


@pytest.mark.parametrize("learners", [True, False])
def test_a_batch_that_does_not_split_names_one_that_does(tiny_config, learners):
  """Three learners and a batch of 16: the error's suggestion, applied, validates (the learners' commands
  and the baseline's alike); the baseline's other way out, the shuffled order, too."""
  c = tiny_config
  c.learners.num = 3
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, 8, learners=learners)
  message = str(e.value)
  assert message.startswith("config.data.global_batch: (16) must divide over learners.num (3)"), message
  suggested = int(message.rsplit("--config.data.global_batch=", 1)[1])
  assert suggested > 16
  c.data.global_batch = suggested
  config_lib.validate(c, 8, learners=learners)
  if not learners:
    assert "--config.data.baseline_order=shuffled" in message
    c.data.global_batch, c.data.baseline_order = 16, "shuffled"
    config_lib.validate(c, 8, learners=False)
  else:
    assert "shuffled" not in message  # it would not help: each learner's share must divide

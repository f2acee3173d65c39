"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere."""

import os
import pathlib

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from configs import tiny_cpu  # noqa: E402

# Compiled programs are cached across tests (and across runs, by the CLI's default cache): most tests
# build the same tiny model, and on 2 cores compiling is most of their time.
from diloco_jax import cli  # noqa: E402

cli.enable_compilation_cache()

PROCESS_TIER = pathlib.Path(__file__).resolve().parent / "process"


def pytest_collection_modifyitems(config, items):
  """Every test under tests/process/ is of the process tier (tests/README.md): marked `process`."""
  for item in items:
    if PROCESS_TIER in item.path.resolve().parents:
      item.add_marker(pytest.mark.process)


@pytest.fixture
def tiny_config():
  """The tiny_cpu config, unlocked so a test can change fields."""
  return tiny_cpu.get_config()


@pytest.fixture(scope="session")
def token_data(tmp_path_factory):
  """A tokenizer and ArrayRecord shards of a few hundred KB of stdlib sources (helpers.make_token_data)."""
  import helpers  # noqa: PLC0415 - lazy: after the fake-device flags above, before jax starts

  return helpers.make_token_data(tmp_path_factory.mktemp("token_data"))

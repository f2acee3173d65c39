"""The `syncer` command's checks before it serves (`diloco_jax/syncer/app.py`), in process: a port in use and
a workdir of another run are one line each, exit 2, and nothing is written."""

import socket

import pytest

import helpers
from configs import tiny_cpu
from diloco_jax import config as config_lib
from diloco_jax.syncer import app

CONFIG = str(helpers.REPO / "configs" / "tiny_cpu.py")


def _argv(workdir, token_file, bind: str) -> list[str]:
  return ["python -m diloco_jax syncer", "--config", CONFIG, "--workdir", str(workdir), "--bind", bind,
          "--token-file", str(token_file)]


@pytest.fixture
def token_file(tmp_path):
  path = tmp_path / "token"
  path.write_text("a" * 64 + "\n")
  path.chmod(0o600)
  return path


def test_a_port_in_use_is_one_line_and_writes_nothing(tmp_path, token_file, capsys):
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    with pytest.raises(SystemExit) as e:
      app.run_syncer_process(_argv(tmp_path / "syncer", token_file, f"127.0.0.1:{port}"))
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert lines == [f"error: syncer: --bind 127.0.0.1:{port}: the port is in use (another syncer?); stop what "
                   "holds it or choose another port (--bind HOST:0 picks a free one)"], lines
  assert not (tmp_path / "syncer").exists()


def test_a_workdir_of_another_run_is_refused(tmp_path, token_file, capsys):
  workdir = tmp_path / "syncer"
  config_lib.save_resolved(tiny_cpu.get_config(), workdir, "another-run")
  before = {p.name: p.read_bytes() for p in workdir.iterdir()}
  with pytest.raises(SystemExit) as e:
    app.run_syncer_process(_argv(workdir, token_file, "127.0.0.1:0") + ["--run-id", "mine"])
  assert e.value.code == 2
  line = capsys.readouterr().err.strip()
  assert "holds a run of another config or run id" in line and "use a new --workdir" in line, line
  assert {p.name: p.read_bytes() for p in workdir.iterdir()} == before

"""The `local` launcher as a user meets it, in process (its children are real processes): a workdir of
another run is refused before anything is written there, a failing child is named with its log tail (exit
1, no traceback), the suggested fix of a batch that does not split works, and no child is forked with jax's
fork warning."""

import os
import sys

import pytest

import helpers
from configs import tiny_cpu
from diloco_jax import command_flags
from diloco_jax import config as config_lib
from diloco_jax.runs import children, local
from diloco_jax.runs.launcher import Launcher


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
  """`launch` sets the launcher's own XLA_FLAGS and JAX_PLATFORMS: put them back after the test."""
  for name in ("XLA_FLAGS", "JAX_PLATFORMS"):
    if name in os.environ:
      monkeypatch.setenv(name, os.environ[name])
    else:
      monkeypatch.delenv(name, raising=False)


def _argv(workdir, *extra: str) -> list[str]:
  return ["python -m diloco_jax local", *helpers.tiny_overrides(steps=4), "--learners", "2", "--workdir",
          str(workdir), *extra]


def _snapshot(directory) -> dict:
  return {str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
          for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_workdir_of_another_config_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(helpers.REPO)
  workdir = tmp_path / "run"
  other = tiny_cpu.get_config()
  other.seed = 7  # a fingerprint field: another run
  config_lib.save_resolved(other, workdir, "local")
  (workdir / "token").write_text("the old run's token\n")
  before = _snapshot(workdir)
  with pytest.raises(SystemExit) as e:
    local.launch(_argv(workdir))
  assert e.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"error: {workdir} holds a run of another config or run id"), lines
  assert lines[0].endswith("use a new --workdir (or delete this one to start over)")
  assert _snapshot(workdir) == before  # config.json, fingerprint.txt and token untouched, nothing added


def test_a_failing_child_is_named_with_its_log_tail_and_exit_1(tmp_path, capsys, monkeypatch):
  """The syncer child (a real process) fails at once: the launcher names it, prints its log's last lines
  and exits 1, without a traceback, after closing every log."""
  monkeypatch.chdir(helpers.REPO)
  real_command = Launcher._command

  def command(self, name, *args):
    if name == "syncer":
      return [sys.executable, "-c", "import sys; print('syncer: the reason it failed'); sys.exit(3)"]
    return real_command(self, name, *args)

  monkeypatch.setattr(Launcher, "_command", command)
  assert local.launch(_argv(tmp_path / "run")) == local.EXIT_FAILED
  err = capsys.readouterr().err
  assert "Traceback" not in err and "closed file" not in err, err
  assert "local: syncer (pid " in err and "exited with status 3; last lines of" in err, err
  assert err.rstrip().endswith("syncer: the reason it failed"), err


def test_the_suggested_batch_of_three_learners_works(capsys, monkeypatch):
  """learners.num=3 with a batch of 16: the error names a batch; with it, the same command validates."""
  monkeypatch.chdir(helpers.REPO)
  argv = ["python -m diloco_jax local", "--config", "configs/tiny_cpu.py", "--learners", "3", "--workdir", "x"]
  fv = local.cli.parse(argv, command_flags.local)
  with pytest.raises(SystemExit) as e:
    local._run_config(fv, argv)
  assert e.value.code == 2
  line = capsys.readouterr().err.strip()
  assert line.startswith("error: config.data.global_batch: (16) must divide over learners.num (3)"), line
  suggestion = line.rsplit("e.g. ", 1)[1]
  assert suggestion.startswith("--config.data.global_batch=")
  fixed = [*argv, suggestion]
  config, _, counts = local._run_config(local.cli.parse(fixed, command_flags.local), fixed)
  assert config.learners.num == 3 and config.data.global_batch == int(suggestion.split("=")[1])


def test_children_are_started_without_the_fork_warning(tmp_path, recwarn):
  """No preexec_fn (which would run jax's at-fork hook in this process): the child is told its parent and
  sets its own death signal."""
  import jax  # noqa: PLC0415 - jax started, as in the launcher: its fork hook is armed

  jax.devices()
  code = f"import os; print(os.environ.get({children.cli.PARENT_PID_ENV!r}))"
  child = children.Child("probe", [sys.executable, "-c", code], children.child_env(1), tmp_path / "probe.log")
  assert child.wait(60) == 0
  child.close()
  assert not [w for w in recwarn if "fork" in str(w.message)]
  assert child.tail() == str(os.getpid())  # a closed child's tail reads back its log

"""The README's examples stay true: its ```bash blocks are run as written, in a fresh directory, with
configs/tiny_cpu.py for configs/small_cpu.py and a few steps (NOT_RUN lists the lines that are not run, and
why). `make run` runs its Makefile recipe; the baseline run that the plot and eval examples compare with is
made by the README's own command. Each `python -m diloco_jax` line runs through the command table in this
process (`local`'s children are real processes); each must exit 0 and leave what the README says it does."""

import contextlib
import io
import os
import re
import shlex

import pytest

import helpers
from diloco_jax import commands

pytestmark = pytest.mark.process  # `local` starts a syncer, an evaluator and 4 learner processes

README = helpers.REPO / "README.md"
SMALL, TINY = "configs/small_cpu.py", "configs/tiny_cpu.py"
FEW_STEPS = ["--config.train.steps=10", "--config.train.warmup_steps=2", "--config.train.eval_every=5",
             "--config.train.log_every=5", "--config.outer.sync_every=5", "--config.model.d_model=32",
             "--config.model.mlp_dim=64", "--config.model.head_dim=8", "--config.data.max_bytes=60000",
             "--config.data.eval_batches=1", "--config.learners.devices=1"]
NOT_RUN = {
    "make test": "the test suite itself",
    "tensorboard --logdir": "a server that runs until stopped (its data: the event files the runs leave)",
    "status --syncer 127.0.0.1:PORT": "needs a live syncer's port (tests/tools/test_status.py runs `status`)",
}


def _bash_lines() -> list[str]:
  """Every command line of the README's ```bash blocks, as written (comments included)."""
  blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
  return [line.strip() for block in blocks for line in block.splitlines() if shlex.split(line, comments=True)]


def _inline(command: str) -> str:
  """The README's first inline example `[python -m diloco_jax ]<command> ...`, as a command line."""
  found = re.search(rf"`(?:python -m diloco_jax )?({re.escape(command)} [^`]*)`", README.read_text())
  assert found, command
  return f"python -m diloco_jax {found.group(1)}"


def _shown_lines(first: str) -> list[str]:
  """The lines of the README's plain ``` block that starts with `first` (output it shows)."""
  block = re.search(rf"```\n({re.escape(first)}.*?)```", README.read_text(), re.S)
  assert block, first
  return block.group(1).strip().splitlines()


def _shape(line: str) -> str:
  """A regular expression of `line` with any number where it has one (a run's figures vary)."""
  return re.sub(r"\d[\d,]*(?:\\\.\d+)?", r"[\\d,]+(?:\\.\\d+)?", re.escape(line))


def _make_recipe(target: str) -> str:
  """The command of a Makefile target, as `make` runs it ($(PY) is the venv's python)."""
  recipe = re.search(rf"^{target}:.*\n\t(.*)$", (helpers.REPO / "Makefile").read_text(), re.M).group(1)
  return recipe.replace("$(PY)", "python")


def _run(line: str) -> tuple[int, str, str]:
  """A `python -m diloco_jax ...` line through the command table: (exit status, stdout, stderr)."""
  words = shlex.split(line.replace(SMALL, TINY), comments=True)
  start = words.index("diloco_jax") + 1
  argv = ["python -m diloco_jax", *words[start:], *(FEW_STEPS if "--config" in words else [])]
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      rc = commands.main(argv)
    except SystemExit as e:
      rc = e.code
  return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def here(tmp_path, monkeypatch):
  """A fresh directory with the repository's configs, as the README's commands expect: they run there (and
  `local`'s children import this checkout)."""
  (tmp_path / "configs").symlink_to(helpers.REPO / "configs")
  (tmp_path / "notes.txt").write_text("def greet(name):\n    return f'hello {name}'\n" * 20)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("PYTHONPATH", str(helpers.REPO))
  for name in ("XLA_FLAGS", "JAX_PLATFORMS"):  # `local` sets its own: put them back afterwards
    monkeypatch.setenv(name, os.environ[name]) if name in os.environ else monkeypatch.delenv(name, raising=False)
  return tmp_path


def test_the_readmes_commands_run_as_written(here):
  lines = _bash_lines()
  skipped = [line for line in lines if any(k in line for k in NOT_RUN)]
  assert len(skipped) == len(NOT_RUN), skipped  # each reason names a line the README has
  to_run = [_make_recipe("run") if line.startswith("make run") else line for line in lines if line not in skipped]
  assert to_run[0].startswith("python -m diloco_jax local"), to_run
  # The baseline the plot and eval examples compare with, made as the README says, after `make run`.
  to_run.insert(1, _inline("baseline"))
  to_run.append(_inline("eval --model runs/dp/model"))
  said = {}
  for line in to_run:
    rc, out, err = _run(line)
    assert rc == 0, f"{line}\n{out[-2000:]}\n{err[-3000:]}"
    said[line] = (out, err)

  def output(start: str) -> tuple[str, str]:
    return next(v for line, v in said.items() if line.split("diloco_jax ", 1)[1].startswith(start))

  default = here / "runs" / "default"
  assert (default / "summary.json").exists() and (default / "model").is_dir()
  for name in ("eval_loss", "step_rate", "versions", "bytes"):
    assert (default / "plots" / f"{name}.png").exists() and (here / "runs" / "compare" / f"{name}.png").exists()
  # The launch's last lines, as the README shows them (its figures aside).
  err = output("local")[1]
  for line in _shown_lines("local done:"):
    assert re.search(f"^{_shape(line)}$", err, re.M), f"{line}\n{err[-3000:]}"
  assert "os.fork()" not in err
  eval_out = output("eval --model runs/default/model --data")[0]
  assert re.fullmatch(r"runs/default/model: \d+\.\d{4} nats/token, \d+\.\d{4} bits/byte over [\d,]+ tokens "
                      r"\([\d,]+ bytes\) of notes.txt\n", eval_out), eval_out
  assert output("sample")[0].startswith("def ")

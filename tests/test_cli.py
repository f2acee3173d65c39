"""The command-line edge (`diloco_jax/cli.py`). What a user sees for everyday mistakes: one line, exit 2,
nothing written (a missing config file, a misspelled field); relative paths made absolute in one place;
the help of every command. And no XLA_FLAGS by hand: on a CPU-only machine `train` (like `baseline` and `bench`)
gives itself the fake CPU devices its config needs and says so; an explicit device count in XLA_FLAGS still
wins (those cases run `train` in a fresh interpreter, the only place a device count can still be chosen)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from absl import flags

import helpers
from diloco_jax import cli, commands

CONFIG = str(helpers.REPO / "configs" / "tiny_cpu.py")


def _stderr_line(capsys) -> str:
  """The one line a usage error printed (asserting it is one)."""
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  return lines[0]


def _path_flags(fv: flags.FlagValues) -> None:
  flags.DEFINE_string("workdir", None, "", flag_values=fv)
  flags.DEFINE_multi_string("model", None, "", flag_values=fv)
  flags.DEFINE_string("syncer-workdir", None, "", flag_values=fv)
  flags.DEFINE_string("out", None, "", flag_values=fv)


def test_relative_paths_are_absolute_from_the_edge_on(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  fv = cli.parse(["prog", "--config", CONFIG, "--workdir", "runs/x", "--model", "runs/a/model", "--model",
                  "/abs/model", "--syncer-workdir", "s0, s1", "--out", "gs://bucket/m",
                  "--config.data.path=notes.txt", "--config.data.train_files=t/a-*.array_record,gs://b/t-*",
                  "--config.emulation.cutoff_file=cut_{learner}"], _path_flags)
  assert fv.workdir == str(tmp_path / "runs" / "x")
  assert cli.shown(fv.workdir) == "runs/x" and cli.shown("/abs/model") == "/abs/model"  # as the user gave them
  assert fv.model == [str(tmp_path / "runs" / "a" / "model"), "/abs/model"]
  assert fv["syncer-workdir"].value == f"{tmp_path / 's0'},{tmp_path / 's1'}"
  assert fv.out == "gs://bucket/m"  # a URL stays as it is
  c = fv.config
  assert c.data.path == str(tmp_path / "notes.txt") and c.data.tokenizer == ""  # "" stays: the default
  assert c.data.train_files == f"{tmp_path / 't' / 'a-*.array_record'},gs://b/t-*"
  assert c.emulation.cutoff_file == str(tmp_path / "cut_{learner}")


def test_a_config_file_that_does_not_exist_is_one_line(tmp_path, capsys):
  for argv in (["--config", "configs/nope.py"], ["--config=configs/nope.py:arg"]):
    with pytest.raises(SystemExit) as e:
      commands.main(["python -m diloco_jax", "train", *argv, "--workdir", str(tmp_path / "run")])
    assert e.value.code == 2
    line = _stderr_line(capsys)
    assert line.startswith("error: --config: no config file 'configs/nope.py'"), line
  assert not (tmp_path / "run").exists()


def test_a_misspelled_field_is_one_line_without_stray_quotes(capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse(["prog", "--config", CONFIG, "--config.train.stepz=3"])
  assert e.value.code == 2
  line = _stderr_line(capsys)
  assert line == ("error: bad config override among ['--config.train.stepz']: no field 'stepz'; "
                  'did you mean "steps" instead of "stepz"?'), line


def test_config_shows_as_required_in_help(capsys):
  with pytest.raises(SystemExit) as e:
    cli.parse(["prog", "--help"], doc="a command")
  assert e.value.code == 0
  text = capsys.readouterr().out
  assert "required" in text and "(default: 'None')" not in text.split("--config")[1].split("--")[0]


SMALL = ["--config", "configs/tiny_cpu.py", "--config.learners.num=2", "--config.learners.devices=1",
         "--config.train.steps=4", "--config.train.warmup_steps=1", "--config.train.log_every=2",
         "--config.outer.sync_every=2", "--config.model.d_model=32", "--config.model.mlp_dim=64",
         "--config.model.head_dim=8", "--config.data.max_bytes=60000", "--config.data.eval_batches=1"]


def _env(xla_flags: str | None) -> dict[str, str]:
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  if xla_flags is not None:
    env["XLA_FLAGS"] = xla_flags
  return env


def _train(tmp_path, xla_flags: str | None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "diloco_jax", "train", *SMALL, "--workdir", str(tmp_path / "run")],
                        cwd=helpers.REPO, env=_env(xla_flags), capture_output=True, text=True,
                        timeout=helpers.PROCESS_TIMEOUT_S)


@pytest.mark.process  # runs `train` in a child process
def test_train_gives_itself_the_fake_devices_it_needs(tmp_path):
  proc = _train(tmp_path, None)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # 2 learners x 1 device, and 1 for the global model's evaluator; said in one line.
  lines = [line for line in proc.stderr.splitlines() if "fake CPU devices" in line]
  assert len(lines) == 1 and lines[0].startswith("train: no accelerator: running on 3 fake CPU devices"), lines
  assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.process  # runs `train` in a child process
def test_an_explicit_device_count_wins(tmp_path):
  proc = _train(tmp_path, f"{cli.DEVICE_COUNT_FLAG}=1")
  assert proc.returncode == 2
  assert "config.learners.devices: asks for 2 devices but only 1 exist" in proc.stderr
  assert "fake CPU devices" not in proc.stderr


def test_a_stop_signal_taken_by_another_thread_still_ends_the_wait():
  # Any thread may take a process-directed signal; Python runs its handler on the main thread only, between
  # bytecodes. An untimed wait there was never interrupted (a syncer sat through SIGTERM until killed).
  # Here the signal goes to a helper thread on purpose; the untimed wait must still end, promptly.
  waited = {}

  def raise_in_this_thread():
    time.sleep(0.2)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

  with cli.StopSignals("test", doing=None) as signals:
    sender = threading.Thread(target=raise_in_this_thread, daemon=True)
    start = time.monotonic()
    sender.start()
    # Before the fix this wait sat out its whole timeout (an untimed one, as the syncer's, forever).
    waited["came"] = signals.wait(timeout_s=20.0)
    waited["took"] = time.monotonic() - start
    sender.join(5)
  assert waited["came"] and signals.received == [signal.SIGTERM]
  assert waited["took"] < 5.0, waited

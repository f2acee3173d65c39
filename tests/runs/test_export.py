"""The trained model out of a run: export at the end of `train` and `baseline` (and by the `export` command
from a syncer checkpoint), load, `eval` on the run's eval set and on any text, `sample`; byte-level and
tokenized models both."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import helpers
from configs import tiny_cpu
from diloco_jax import config as config_lib
from diloco_jax.compute import inner
from diloco_jax.compute import model as model_lib
from diloco_jax.runs import baseline, export, inprocess
from diloco_jax.runs import children as run_children
from diloco_jax.syncer import build, checkpoint
from diloco_jax.tools import evaluate, sample

STEPS = 10
SHORT = {"train.steps": STEPS, "train.eval_every": STEPS, "train.warmup_steps": 2, "outer.sync_every": 5}


def short(config):
  for field, value in SHORT.items():
    section, name = field.split(".")
    config[section][name] = value
  return config


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
  """A byte-level Decoupled DiLoCo run in one process (4 learners x 2 devices)."""
  workdir = tmp_path_factory.mktemp("diloco")
  config = short(tiny_cpu.get_config())
  return config, workdir, inprocess.run(config, str(workdir), quiet=True)


@pytest.fixture(scope="module")
def baseline_run(tmp_path_factory, token_data):
  """A tokenized data-parallel baseline run."""
  workdir = tmp_path_factory.mktemp("baseline")
  config = token_data.apply(short(tiny_cpu.get_config()))
  return config, workdir, baseline.run(config, str(workdir), quiet=True)


def host(params):
  return jax.tree.map(np.asarray, jax.device_get(params))


def assert_same_params(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, host(a), host(b))


def test_train_exports_the_global_model_at_its_final_eval_loss(diloco_run):
  config, workdir, summary = diloco_run
  assert summary["model"] == str(workdir / "model")
  model = export.load(workdir / "model")
  assert model.meta["source"] == "train" and model.meta["final_eval_loss"] == summary["final_eval_loss"]
  assert model.meta["tokenizer"] is None and model.tokenizer.vocab_size == 256
  # The run's config as it ran (resolved, as its config.json records it).
  resolved = config_lib.as_config(config_lib.resolve(config))
  assert model.meta["params"] == summary["params"] and model.config.to_dict() == resolved.to_dict()
  result = evaluate.evaluate(model, evaluate.config_windows(model.config))
  assert result.tokens == config.data.eval_batches * config.data.global_batch * config.data.seq_len
  assert result.nats_per_token == pytest.approx(summary["final_eval_loss"], rel=1e-5)
  assert result.bits_per_byte == pytest.approx(result.nats / math.log(2) / result.bytes)
  # It is the syncer's global model: the same arrays as in the syncer's final checkpoint.
  params, info = export.syncer_params(config, workdir / "syncer", inprocess.RUN_ID)
  assert info["versions"] == summary["versions"]
  assert_same_params(model.params, params)
  with pytest.raises(ValueError, match="another run"):
    export.syncer_params(config, workdir / "syncer", "another-run-id")


@pytest.mark.process
def test_export_command_exports_the_syncer_checkpoint(diloco_run, tmp_path):
  _, workdir, _ = diloco_run
  out = tmp_path / "exported"
  argv = [sys.executable, "-m", "diloco_jax", "export", "--syncer-workdir", str(workdir / "syncer"),
          "--config", "configs/tiny_cpu.py", *[f"--config.{k}={v}" for k, v in SHORT.items()],
          "--run-id", inprocess.RUN_ID,
          "--out", str(out)]
  proc = subprocess.run(argv, cwd=helpers.REPO, capture_output=True, text=True, timeout=240,
                        env=run_children.child_env(1))
  assert proc.returncode == 0, proc.stderr[-3000:]
  ours, theirs = export.load(out), export.load(workdir / "model")
  assert ours.meta["source"] == "syncer checkpoint" and ours.meta["run_id"] == inprocess.RUN_ID
  assert_same_params(ours.params, theirs.params)
  # The wrong run id: refused, naming what to fix; nothing written.
  proc = subprocess.run(argv[:-4] + ["--run-id", "other", "--out", str(tmp_path / "never")], cwd=helpers.REPO,
                        capture_output=True, text=True, timeout=240, env=run_children.child_env(1))
  assert proc.returncode == 2 and "--run-id" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
  assert not (tmp_path / "never").exists()


def test_baseline_exports_a_tokenized_model_at_its_final_eval_loss(baseline_run, token_data):
  config, workdir, summary = baseline_run
  model = export.load(summary["model"])
  assert model.meta["source"] == "baseline" and model.meta["steps"] == STEPS
  assert model.meta["tokenizer"] == {"path": str(token_data.tokenizer),
                                     "sha256": model.tokenizer.sha256}
  assert (workdir / "model" / export.TOKENIZER_FILE).read_bytes() == token_data.tokenizer.read_bytes()
  result = evaluate.evaluate(model, evaluate.config_windows(model.config), batch_size=8)
  assert result.nats_per_token == pytest.approx(summary["final_eval_loss"], rel=1e-5)
  # Tokens stand for more than a byte each here.
  assert result.bytes > 2 * result.tokens


def _text_file(tmp_path):
  path = tmp_path / "notes.txt"
  path.write_text("def greet(name):\n    return f'hello {name}'  # é\n" * 40 + "print(greet('world'))\n")
  return path


@pytest.mark.parametrize("run", ["diloco_run", "baseline_run"])
def test_eval_on_a_text_file_is_the_forward_pass_over_every_token(run, request, tmp_path):
  _, workdir, _ = request.getfixturevalue(run)
  model = export.load(workdir / "model")
  text = _text_file(tmp_path).read_text()
  tok, seq_len = model.tokenizer, model.config.data.seq_len
  windows = evaluate.text_windows(tok, [text], seq_len)
  stream = np.append(tok.encode(text), tok.eos_id)
  # Every token but the first is predicted once: full windows, then the rest.
  assert sum(w.size - 1 for w in windows) == stream.size - 1
  assert windows[-1].size < seq_len + 1
  result = evaluate.evaluate(model, windows, batch_size=3)
  assert result.tokens == stream.size - 1
  assert result.bytes == len(text.encode()) - tok.token_bytes[stream[0]]
  # The same losses from the model's forward pass, one window at a time, on one device.
  params, losses = host(model.params), jax.jit(functools.partial(inner.token_losses, model.graphdef))
  nats = sum(float(np.asarray(losses(params, w[None]), np.float64).sum()) for w in windows)
  assert result.nats == pytest.approx(nats, rel=1e-5)


@pytest.mark.process
def test_eval_command_compares_two_models_on_one_text(diloco_run, baseline_run, tmp_path):
  path = _text_file(tmp_path)
  models = [diloco_run[1] / "model", baseline_run[1] / "model"]
  # Relative paths, as the README's examples give them (orbax itself takes only absolute ones).
  argv = [sys.executable, "-m", "diloco_jax", "eval", *[f"--model={os.path.relpath(m, tmp_path)}" for m in models],
          "--data", path.name, "--json"]
  proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                        env={**run_children.child_env(2), "PYTHONPATH": str(helpers.REPO)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
  assert [r["model"] for r in rows] == [str(m) for m in models]
  text = path.read_text()
  for row, m in zip(rows, models):
    model = export.load(m)
    want = evaluate.evaluate(model, evaluate.text_windows(model.tokenizer, [text], model.config.data.seq_len))
    assert row["nats_per_token"] == pytest.approx(want.nats_per_token, rel=1e-5)
    assert row["bits_per_byte"] == pytest.approx(want.bits_per_byte, rel=1e-5)
    assert (row["tokens"], row["bytes"]) == (want.tokens, want.bytes)
  # Bits per byte are over the same text for both, whatever their tokenizers: all of it but the first token.
  assert abs(rows[0]["bytes"] - rows[1]["bytes"]) < 16 and rows[0]["tokens"] > rows[1]["tokens"]


def _forward(model):
  """The model's logits for a [1, length] batch, on one device (a compile per length)."""
  return functools.partial(jax.jit(functools.partial(model_lib.apply, model.graphdef)), host(model.params))


@pytest.mark.parametrize("run", ["diloco_run", "baseline_run"])
def test_greedy_sampling_is_the_argmax_of_the_full_forward_pass(run, request):
  _, workdir, _ = request.getfixturevalue(run)
  model = export.load(workdir / "model")
  forward, tok = _forward(model), model.tokenizer
  prompt = np.concatenate([[tok.eos_id], tok.encode("def ")]).astype(np.int32)
  new = sample.generate(model, prompt, max_new_tokens=10, stop_at_eos=False)
  # Causal attention: one forward pass over the whole sequence gives, at each position, the logits the model
  # had for the next token when the sequence ended there; greedy picked their argmax at every step.
  logits = np.asarray(forward(np.concatenate([prompt, new])[None]))[0]
  np.testing.assert_array_equal(new, logits[len(prompt) - 1:-1].argmax(-1))
  # Past model.max_seq_len the window slides: each step sees only the last max_seq_len tokens.
  narrow = model.config.copy_and_resolve_references()
  narrow.model.max_seq_len = width = 4
  new = sample.generate(dataclasses.replace(model, config=narrow), prompt, max_new_tokens=8, stop_at_eos=False)
  seq = prompt.tolist()
  for token in new:
    context = np.asarray(seq[-width:], np.int32)[None]
    assert token == np.asarray(forward(context))[0, -1].argmax()
    seq.append(int(token))


def test_temperature_sampling_draws_by_seed(diloco_run):
  model = export.load(diloco_run[1] / "model")
  prompt = np.concatenate([[0], model.tokenizer.encode("import ")])
  draw = lambda **kw: sample.generate(model, prompt, max_new_tokens=12, stop_at_eos=False, **kw).tolist()
  assert draw(temperature=1.0, seed=1) == draw(temperature=1.0, seed=1)
  assert draw(temperature=1.0, seed=1) != draw(temperature=1.0, seed=2)
  assert draw(temperature=1.0, top_k=1, seed=3) == draw()  # top-1 is greedy
  assert all(0 <= t < 256 for t in draw(temperature=2.0, seed=4))


@pytest.mark.process
def test_sample_command_continues_the_prompt(baseline_run):
  argv = [sys.executable, "-m", "diloco_jax", "sample", "--model", "model", "--prompt", "def ", "--max-tokens",
          "20"]
  proc = subprocess.run(argv, cwd=baseline_run[1], capture_output=True, text=True, timeout=240,  # a relative
                        env={**run_children.child_env(1), "PYTHONPATH": str(helpers.REPO)})  # --model, as in README
  assert proc.returncode == 0, proc.stderr[-3000:]
  model = export.load(baseline_run[1] / "model")
  prompt = np.concatenate([[model.tokenizer.eos_id], model.tokenizer.encode("def ")])
  new = sample.generate(model, prompt, max_new_tokens=20)
  new = new[:-1] if new.size and new[-1] == model.tokenizer.eos_id else new
  assert proc.stdout == model.tokenizer.decode(np.concatenate([prompt[1:], new])) + "\n"
  assert proc.stdout.startswith("def ")


@pytest.mark.process
@pytest.mark.slow
def test_local_exports_the_syncer_final_checkpoint_on_tokenized_data(token_data, tmp_path):
  """Learner processes read the shards; the launcher exports the global model from the syncer's final
  checkpoint, and that export evaluates to the loss the launcher reported."""
  workdir = tmp_path / "run"
  argv = [sys.executable, "-m", "diloco_jax", "local", *helpers.tiny_overrides(steps=10),
          *[f"--config.{k}={v}" for k, v in token_data.overrides().items()], "--learners", "2",
          "--workdir", str(workdir)]
  proc = subprocess.run(argv, cwd=helpers.REPO, env=run_children.child_env(1), capture_output=True, text=True,
                        timeout=helpers.PROCESS_TIMEOUT_S + 60)
  assert proc.returncode == 0, proc.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["model"] == str(workdir / "model") and "model in" in proc.stderr
  model = export.load(workdir / "model")
  assert model.meta["source"] == "local" and model.meta["versions"] == summary["versions"]
  assert model.tokenizer.sha256 == token_data.meta["tokenizer"]["sha256"]
  result = evaluate.evaluate(model, evaluate.config_windows(model.config))
  assert result.nats_per_token == pytest.approx(summary["final_eval_loss"], rel=1e-5)


def test_export_assembles_the_model_from_every_shards_checkpoint(tmp_path):
  config = tiny_cpu.get_config()
  config.learners.num = 2
  unsharded, _ = build.build_core(config, "r")
  shards = [build.build_core(config, "r", shard=i, shards=2)[0] for i in (0, 1)]
  assert [c.status()["owned"] for c in shards] == [[0], [1]]
  dirs = []
  for i, core in enumerate(shards):
    ckpt = checkpoint.SyncerCheckpointer(tmp_path / f"shard_{i}" / "syncer_checkpoints", async_save=False)
    checkpoint.save_core(ckpt, core)
    ckpt.close()
    dirs.append(tmp_path / f"shard_{i}")
  params, info = export.syncer_params(config, list(reversed(dirs)), "r")  # any order
  assert info["versions"] == [0, 0] and len(info["step"]) == 2
  template = jax.tree.map(np.asarray, params)
  expected = build.global_params(unsharded, build.fragment_plan(config, template), template)
  jax.tree.map(np.testing.assert_array_equal, params, expected)
  with pytest.raises(ValueError, match=r"holds fragments \[1\]"):
    export.syncer_params(config, dirs[:1], "r")

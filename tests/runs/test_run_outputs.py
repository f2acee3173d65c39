"""What a run leaves behind, from real tiny runs (`train` in process, and `baseline`): the resolved config,
the global model's eval curve, TensorBoard event files whose tags overlay, and the `plot` command's PNGs."""

import json
import shutil

import jax
import matplotlib.image
import numpy as np
import pytest
from test_metrics import read_events

from configs import tiny_cpu
from diloco_jax import config as config_lib
from diloco_jax.compute import model as model_lib
from diloco_jax.compute import trainer as trainer_lib
from diloco_jax.evaluator import loop as eval_loop
from diloco_jax.outer import fragments as fragments_lib
from diloco_jax.runs import baseline, inprocess
from diloco_jax.runs import plots as plot
from diloco_jax.syncer import build
from diloco_jax.tools import plot as plot_tool


def small(config):
  """2 learners x 1 device, a 32-wide model, 20 steps with an eval every 5 steps of progress."""
  c = config
  c.learners.num, c.learners.devices = 2, 1
  c.model.d_model, c.model.mlp_dim, c.model.head_dim = 32, 64, 8
  c.data.max_bytes, c.data.eval_batches = 60_000, 1
  c.train.steps, c.train.warmup_steps, c.train.log_every, c.train.eval_every = 20, 2, 5, 5
  c.outer.sync_every, c.outer.min_quorum, c.outer.max_grace_s = 5, 1, 0.2
  return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """A Decoupled DiLoCo run and a baseline run of the same small config."""

  root = tmp_path_factory.mktemp("runs")
  config = small(tiny_cpu.get_config())
  diloco = inprocess.run(config, str(root / "diloco"), quiet=True)
  dp = baseline.run(config, str(root / "dp"), quiet=True)
  return {"config": config, "root": root, "diloco": diloco, "dp": dp}


def test_the_resolved_config_is_saved_beside_the_results(runs):
  config = runs["config"]
  for name, run_id in (("diloco", inprocess.RUN_ID), ("dp", "")):
    workdir = runs["root"] / name
    # The config as run, every derived value filled in: it resolves to the spec the run had.
    assert config_lib.load_resolved(workdir) == config_lib.as_config(config_lib.resolve(config))
    assert config_lib.resolve(config_lib.load_resolved(workdir)) == config_lib.resolve(config)
    assert (workdir / "fingerprint.txt").read_text().strip() == config_lib.fingerprint(config, run_id)


def test_the_global_model_is_evaluated_along_the_run(runs):
  config, summary = runs["config"], runs["diloco"]
  records = [json.loads(line)
             for line in (runs["root"] / "diloco" / "global" / "metrics.jsonl").read_text().splitlines()]
  assert records[0]["step"] == 0 and records[0]["versions"] == [0, 0]
  assert records[0]["eval_loss"] == summary["initial_eval_loss"]
  assert records[-1]["eval_loss"] == summary["final_eval_loss"] and records[-1]["versions"] == summary["versions"]
  assert records[-1]["tokens"] == summary["tokens_merged"] == summary["tokens"]
  assert records[-1]["step"] == config.train.steps  # progress counted in global steps
  # Every scheduled eval is at a later mark of train.eval_every than the one before (the final one aside).
  marks = [r["step"] // config.train.eval_every for r in records if not r["final"]]
  assert marks == sorted(set(marks)) and len(records) >= 2
  assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5
  assert records[-1]["final"]


def test_rerunning_a_finished_run_keeps_the_whole_runs_summary(runs, tmp_path):
  """A rerun on the same workdir resumes and has nothing left to train: its summary covers both segments
  (wall time and bytes summed), never the no-op's figures alone; the global curve still ends final."""
  workdir = tmp_path / "diloco"
  shutil.copytree(runs["root"] / "diloco", workdir)
  first = json.loads((workdir / "summary.json").read_text())
  again = inprocess.run(runs["config"], str(workdir), quiet=True, export=False)
  saved = json.loads((workdir / "summary.json").read_text())
  assert saved == json.loads(json.dumps(again))
  assert [s["wall_s"] for s in saved["segments"]][0] == first["wall_s"] and len(saved["segments"]) == 2
  assert saved["wall_s"] == pytest.approx(first["wall_s"] + saved["segments"][1]["wall_s"])
  assert saved["bytes_sent"] >= first["bytes_sent"] and saved["comm_bytes"] >= first["comm_bytes"]
  assert saved["tokens"] == first["tokens"] and saved["initial_eval_loss"] == first["initial_eval_loss"]
  assert saved["final_eval_loss"] == pytest.approx(first["final_eval_loss"], rel=1e-6)
  records = [json.loads(line) for line in (workdir / "global" / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["final"] and records[-1]["versions"] == saved["versions"]


def test_one_colour_and_legend_entry_per_learner_and_a_baseline_in_its_own(runs):
  plt = plot._pyplot()
  loaded = [plot.load_run(runs["root"] / "diloco"), plot.load_run(runs["root"] / "dp")]
  for draw in (plot._bytes, plot._step_rate):
    fig, ax = plt.subplots()
    assert draw(ax, loaded)
    lines = {line.get_label(): line.get_color() for line in ax.get_lines()}
    learners = {label: colour for label, colour in lines.items() if "learner" in label and "diloco" in label}
    assert sorted(learners) == ["diloco: learner 0", "diloco: learner 1"], lines
    assert len(set(learners.values())) == 2
    dp = [colour for label, colour in lines.items() if label.startswith("dp:")]
    assert dp and not set(dp) & set(learners.values()), lines
    plt.close(fig)


def test_tensorboard_tags_overlay_baseline_and_diloco(runs):
  root = runs["root"]
  learner = read_events(root / "diloco" / "learner_0")
  global_model = read_events(root / "diloco" / "global")
  syncer = read_events(root / "diloco" / "syncer")
  dp = read_events(root / "dp")
  assert {"train/loss", "train/tokens_per_s", "train/blocked_s", "comm/bytes", "eval/local_loss",
          "learner/base_version/0"} <= set(learner)
  assert {"train/loss", "train/tokens_per_s", "comm/bytes", "eval/loss"} <= set(dp)
  assert {"eval/loss", "eval/tokens_merged"} <= set(global_model)
  assert {"syncer/rounds", "syncer/contributors_per_round", "syncer/grace_wait_s", "syncer/rejected",
          "syncer/bytes_in", "syncer/bytes_out", "syncer/tokens_merged", "syncer/live_learners",
          "syncer/version/1"} <= set(syncer)
  # The same eval tag on one step axis: both start at step 0 from the same initial model.
  assert global_model["eval/loss"][0][:2] == pytest.approx(dp["eval/loss"][0][:2])
  assert dp["eval/loss"][-1][0] == global_model["eval/loss"][-1][0] == runs["config"].train.steps
  # What TensorBoard shows is what the JSONL holds.
  records = [json.loads(line) for line in (root / "diloco" / "global" / "metrics.jsonl").read_text().splitlines()]
  assert [s for s, _, _ in global_model["eval/loss"]] == [r["step"] for r in records]
  assert [v for _, v, _ in global_model["eval/loss"]] == pytest.approx([r["eval_loss"] for r in records])
  assert syncer["syncer/rounds"][-1][1] == runs["diloco"]["outer_rounds"]


def test_plot_writes_the_figures_from_the_runs_output(runs, tmp_path):
  root = runs["root"]
  out = tmp_path / "plots"
  assert plot_tool.plot_runs(["plot", str(root / "diloco"), str(root / "dp"), "--out", str(out)]) == 0
  for name in plot.FIGURES:
    image = matplotlib.image.imread(out / f"{name}.png")
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # a drawn figure
  diloco, dp = plot.load_run(root / "diloco"), plot.load_run(root / "dp")
  assert (diloco.kind, dp.kind) == ("diloco", "baseline") and diloco.params == runs["diloco"]["params"]
  assert len(diloco.learners()) == 2 and diloco.records["syncer"] and diloco.records["global"]
  # Without a baseline run, the data-parallel reference is computed for the DiLoCo run's devices.
  label, points = plot._dp_reference(diloco)
  c = runs["config"]
  per_step = 2 * (2 - 1) / 2 * 4 * runs["diloco"]["params"]
  assert points[-1] == (c.train.steps * c.data.global_batch * c.data.seq_len, c.train.steps * per_step)
  # A figure with nothing to show is not written: a baseline has no fragment versions.
  alone = plot.write_plots([root / "dp"], tmp_path / "alone")
  assert sorted(p.stem for p in alone) == ["bytes", "eval_loss", "step_rate"]


def test_outputs_lines_name_the_logs_and_plots(runs):
  workdir = runs["root"] / "diloco"
  text = plot.outputs(workdir, "train")
  assert f"tensorboard --logdir {workdir}" in text and str(workdir / "plots" / "eval_loss.png") in text
  assert (workdir / "plots" / "versions.png").exists()


def test_plot_refuses_a_directory_without_metrics(tmp_path):
  with pytest.raises(SystemExit) as e:
    plot_tool.plot_runs(["plot", str(tmp_path)])
  assert e.value.code == 2


def test_global_eval_params_round_trip_and_loss(tiny_config):
  """The global model as params: from its fragment vectors back to the model, with the loss a trainer
  computes for the same params."""
  c = tiny_config
  global_eval = eval_loop.GlobalEval(c, jax.devices()[6:8])
  params = jax.tree.map(np.asarray, model_lib.init_params_host(c))
  plan = build.fragment_plan(c, params)
  assert plan == global_eval.plan
  vectors = [fragments_lib.gather(plan, params, p) for p in range(plan.num_fragments)]
  back = global_eval.params(vectors)
  jax.tree.map(np.testing.assert_array_equal, back, params)
  trainer = trainer_lib.MeshTrainer(c, jax.devices()[:2], None, batch_size=8)
  assert global_eval.loss(back) == pytest.approx(trainer.evaluate(jax.device_put(params, trainer.shardings.params)),
                                                 rel=1e-5)


def test_eval_schedule_counts_progress_in_global_steps(tiny_config):
  s = eval_loop.EvalSchedule.from_config(tiny_config)
  per_step = tiny_config.data.global_batch * tiny_config.data.seq_len
  p = tiny_config.outer.num_fragments
  assert s.step(p * per_step * 29) == 29 and s.mark(p * per_step * 29) == 29 // tiny_config.train.eval_every
  assert s.tokens(p * 1000) == 1000.0

"""The one metrics writer: JSONL lines and TensorBoard event files that TensorBoard itself reads back."""

import json
import math

import pytest
from tensorboard.backend.event_processing import event_accumulator

from diloco_jax import metrics


def read_events(directory) -> dict[str, list[tuple[int, float, float]]]:
  """{tag: [(step, value, wall_time)]} of the event files in `directory`, as TensorBoard reads them."""
  acc = event_accumulator.EventAccumulator(str(directory), size_guidance={event_accumulator.SCALARS: 0})
  acc.Reload()
  return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_records_go_to_jsonl_whole_and_tagged_fields_to_tensorboard(tmp_path):
  log = metrics.MetricsLog(tmp_path, tags={"loss": "train/loss", "versions": "v", "rejected": "r",
                                           "flag": "f", "gone": "g", "missing": "m"})
  log.write({"step": 1, "loss": 2.5, "versions": [3, 4], "rejected": {"shape": 2}, "flag": True,
             "gone": float("nan"), "other": 7})
  log.write({"step": 2, "loss": 2.0, "versions": [5, 6], "rejected": {"shape": 3}, "flag": False,
             "gone": 1.0, "other": 8})
  log.write({"loss": 9.0})  # no step: JSONL only
  log.close()
  lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r.get("step") for r in lines] == [1, 2, None] and lines[0]["other"] == 7
  assert math.isnan(lines[0]["gone"]) and lines[1]["rejected"] == {"shape": 3}
  events = read_events(tmp_path)
  # Lists and dicts element by element; booleans, non-finite values and untagged fields are not scalars.
  assert set(events) == {"train/loss", "v/0", "v/1", "r/shape", "g"}
  assert [(s, v) for s, v, _ in events["train/loss"]] == [(1, 2.5), (2, 2.0)]
  assert [(s, v) for s, v, _ in events["v/1"]] == [(1, 4.0), (2, 6.0)]
  assert [(s, v) for s, v, _ in events["g"]] == [(2, 1.0)]
  # Each scalar carries its record's wall time, so TensorBoard's time axis is the JSONL's.
  assert [w for _, _, w in events["train/loss"]] == pytest.approx([lines[0]["time"], lines[1]["time"]])


def test_without_tags_no_event_files(tmp_path):
  log = metrics.MetricsLog(tmp_path, "plain")
  log.write({"step": 1, "loss": 1.0})
  log.close()
  assert [p.name for p in tmp_path.iterdir()] == ["plain.jsonl"]


def test_producers_share_the_tags_that_overlay():
  # The baseline's model and the syncer's global model under one eval tag; every trainer's loss under one.
  assert metrics.BASELINE_TAGS["eval_loss"] == metrics.GLOBAL_EVAL_TAGS["eval_loss"] == "eval/loss"
  assert metrics.BASELINE_TAGS["loss"] == metrics.LEARNER_TAGS["loss"] == "train/loss"
  assert metrics.BASELINE_TAGS["comm_bytes"] == metrics.LEARNER_TAGS["comm_bytes"] == "comm/bytes"
  # A learner's own model is not the global model: its eval goes elsewhere.
  assert metrics.LEARNER_TAGS["eval_loss"] != "eval/loss"


def test_ring_allreduce_bytes():
  assert metrics.ring_allreduce_bytes(1000, 1) == 0.0
  assert metrics.ring_allreduce_bytes(1000, 8) == 2 * 7 / 8 * 4000


def test_off_a_terminal_progress_is_plain_periodic_lines(capsys):
  """stderr is not a terminal under pytest: no bar (no carriage returns), a 'compiling' note before the
  first step, then a line at most every `every_s` of progress and one at the end."""
  bar = metrics.progress(100, initial=10, desc="learner 0")
  assert isinstance(bar, metrics.PlainProgress)
  now = [0.0]
  bar = metrics.PlainProgress(100, initial=10, desc="learner 0", every_s=10.0, clock=lambda: now[0])
  for _ in range(30):
    now[0] += 1.0
    bar.set_postfix(max_version=3, refresh=False)
    bar.update(2)
  bar.close()
  bar.close()
  err = capsys.readouterr().err
  assert "\r" not in err
  lines = err.strip().splitlines()
  assert lines[0].startswith("learner 0: compiling before the first step")
  assert lines[1:] == ["learner 0: 30/100 (30%) in 10s, 2.00/s, max_version=3",
                       "learner 0: 50/100 (50%) in 20s, 2.00/s, max_version=3",
                       "learner 0: 70/100 (70%) in 30s, 2.00/s, max_version=3",
                       "learner 0: 70/100 (70%) in 30s, 2.00/s, max_version=3"]


def test_a_resumed_runs_summary_covers_every_segment(tmp_path):
  fields = ("wall_s", "bytes_sent")
  first = {"tokens": 100, "wall_s": 10.0, "bytes_sent": 5, "initial_eval_loss": 6.0, "versions": [3]}
  assert metrics.write_summary(tmp_path, first, resumed_fields=fields) == first  # nothing earlier: as is
  second = {"tokens": 100, "wall_s": 2.0, "bytes_sent": 1, "initial_eval_loss": None, "versions": [4]}
  written = metrics.write_summary(tmp_path, second, resumed_fields=fields)
  third = metrics.write_summary(tmp_path, {**second, "tokens": 160, "wall_s": 4.0}, resumed_fields=fields)
  assert json.loads((tmp_path / "summary.json").read_text()) == third
  assert written["wall_s"] == 12.0 and written["bytes_sent"] == 6 and written["versions"] == [4]
  assert written["initial_eval_loss"] == 6.0 and written["tokens_per_s"] == pytest.approx(100 / 12.0)
  assert third["segments"] == [{"tokens": 100, "wall_s": 10.0, "bytes_sent": 5},
                               {"tokens": 100, "wall_s": 2.0, "bytes_sent": 1},
                               {"tokens": 160, "wall_s": 4.0, "bytes_sent": 1}]
  assert third["wall_s"] == 16.0 and third["bytes_sent"] == 7 and third["tokens_per_s"] == 10.0
  # Not resumed: the summary is replaced.
  assert "segments" not in metrics.write_summary(tmp_path, first)

"""The chaos run's timeline measures (`tools/chaos/history.py`)."""

import json

from diloco_jax.tools.chaos import history as chaos_history


def test_timeline_measures(tmp_path):
  assert chaos_history.monotone([[0, 0], [1, 0], [1, 2]]) and not chaos_history.monotone([[0, 3], [1, 2]])
  timeline = [(1.0, [0, 0]), (2.0, [1, 0]), (2.5, [1, 0]), (6.0, [1, 1])]
  assert chaos_history.advance_times(timeline) == [2.0, 6.0]
  # [0, 10]: gaps 2, 4, 4; excluding [3, 5] the middle one is 2.
  assert chaos_history.longest_gap([2.0, 6.0], 0.0, 10.0) == 4.0
  assert chaos_history.longest_gap([2.0, 6.0], 0.0, 10.0, [(3.0, 5.0), (7.0, 10.0)]) == 2.0
  assert chaos_history.value_at([(1.0, 10.0), (3.0, 20.0)], 2.0) == 10.0
  assert chaos_history.value_at([(1.0, 10.0)], 0.5) == 0
  # Learner 0 up, stopped 5-10, up; learner 1 up until it finished at 8: nobody trains during 8-10.
  states = {0: [[0, 5, "up"], [5, 10, "stopped"], [10, 20, "up"]], 1: [[0, 20, "up"]]}
  assert chaos_history.idle_intervals(states, [20, 8], 0, 20) == [(8, 10)]
  # A restarted learner counts from its first step record, not from its process start.
  states = {0: [[0, 5, "up"], [5, 8, "dead"], [8, 20, "up"]]}
  assert chaos_history.idle_intervals(states, [20], 0, 20, [[(1.0, 10), (12.0, 110)]]) == [(5, 12.0)]
  learner = tmp_path / "learner_0"
  learner.mkdir()
  records = [{"time": t, "step": s} for t, s in ((1, 10), (2, 20), (3, 30), (4, 40), (9, 30), (10, 40))]
  (learner / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n{cut")
  # Died after logging step 40, resumed from the checkpoint at 20 (first record 30): steps 20-40 twice.
  assert chaos_history.redone_steps(learner, 10) == 20
  assert chaos_history.first_done([learner], 40) == 4

"""The chaos command's fault schedules (`tools/chaos/schedule.py`): the standard one, and schedule files."""

import json

import pytest

from diloco_jax.tools.chaos import schedule as chaos_schedule


@pytest.mark.parametrize("seed", range(40))
def test_standard_schedule_holds_every_fault_one_learner_fault_at_a_time(seed):
  events = chaos_schedule.standard_schedule(seed, 3, 120.0)
  assert events == chaos_schedule.standard_schedule(seed, 3, 120.0)  # seeded
  kinds = [e.kind for e in events]
  assert sorted(kinds) == sorted(chaos_schedule.KINDS)
  learner = [e for e in events if e.kind in chaos_schedule.LEARNER_KINDS]
  assert len({e.target for e in learner}) == 3
  ends = {"learner_kill": 25.0, "learner_stop": 23.0, "learner_cutoff": 13.0}
  for a, b in zip(learner, learner[1:]):
    assert b.at_s >= a.at_s + ends[a.kind]  # never two learners faulty at once
  syncer = [e for e in events if e.kind.startswith("syncer")]
  assert syncer[1].at_s - syncer[0].at_s >= chaos_schedule.SETTLE_S
  kill = next(e for e in events if e.kind == "learner_kill")
  for e in syncer:
    assert not kill.at_s - chaos_schedule.SETTLE_S < e.at_s < kill.at_s + 25.0
    assert 2 <= e.duration_s <= 5


def test_schedule_files_are_checked(tmp_path):
  path = tmp_path / "s.json"
  path.write_text(json.dumps([{"at_s": 5, "kind": "syncer_kill", "duration_s": 2},
                              {"at_s": 1, "kind": "learner_stop", "target": 2, "duration_s": 3}]))
  events = chaos_schedule.load_schedule(str(path), 3)
  assert [e.kind for e in events] == ["learner_stop", "syncer_kill"] and events[0].target == 2
  for bad, match in (([{"at_s": 1, "kind": "reboot"}], "kind"),
                     ([{"at_s": 1, "kind": "learner_kill", "target": 3}], "target"),
                     ([{"at_s": -1, "kind": "syncer_kill"}], "finite"),
                     ([{"at_s": 1, "kind": "syncer_kill", "when": 3}], "expected an object"),
                     ({"at_s": 1}, "JSON list")):
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match) as e:
      chaos_schedule.load_schedule(str(path), 3)
    assert "--schedule" in str(e.value)

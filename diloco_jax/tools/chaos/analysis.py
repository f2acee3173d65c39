"""The report of a chaos run from its raw record and files: finished, monotone versions, stalls, syncer
restarts back to merging, contributions and tokens lost, goodput and eval loss beside the undisturbed run;
and the checks of docs/operations.md ("Chaos")."""

from __future__ import annotations

import json
import pathlib

from diloco_jax import config as config_lib
from diloco_jax.tools.chaos import history
from diloco_jax.tools.chaos.schedule import KINDS


def analyze(config, workdir: pathlib.Path, raw: dict, reference: dict | None, eval_loss: float | None) -> dict:
  """The report of one run: finished, monotone versions, stalls, restarts back to merging, contributions,
  tokens lost, goodput and eval loss beside the reference (undisturbed) run."""
  learners = config.learners.num
  dirs = [workdir / f"learner_{i}" for i in range(learners)]
  timeline = history.commits(workdir / "syncer")
  advances = history.advance_times(timeline)
  summaries = _summaries(dirs)
  t_train, t_end = raw["t_train"] or raw["t_launch"], raw["t_end"]
  outages = _outages(raw["syncer_down"], advances)
  # Outside syncer outages (from the signal to the first merge after the restart), and outside the times
  # when no learner trains (all stopped, dead, cut off or finished): nothing could be merged then.
  excluded = [(o["down_at"], o["first_merge"] or t_end) for o in outages]
  records = [history.step_records(d) for d in dirs]
  finish = [min((t for t, s in r if s >= config.train.steps), default=t_end) for r in records]
  excluded += history.idle_intervals(raw["learner_states"], finish, t_train, t_end, records)
  # Stalls count until the last version advance: after it the learners only write checkpoints and exit.
  last = max([t for t in advances if t > t_train], default=t_end)
  status = raw["status"] or {}
  counters = status.get("counters", {})
  tokens = [s["tokens"] if s else 0 for s in summaries]
  report = {
      "finished": bool(raw["finished"] and all(s and s.get("completed") for s in summaries)),
      "failure": raw["failure"],
      "learners": learners, "steps": config.train.steps, "wall_s": t_end - raw["t_launch"],
      "train_s": t_end - t_train,
      "versions": status.get("versions"),
      "versions_monotone": bool(history.monotone(v for _, v in timeline) and
                                all(history.monotone(history.learner_versions(d)) for d in dirs)),
      "longest_stall_s": history.longest_gap(advances, t_train, last, excluded),
      "longest_stall_raw_s": history.longest_gap(advances, t_train, last),
      "syncer_restarts": outages,
      "faults_applied": {k: sum(1 for e in raw["log"] if e["kind"] == k and not e["what"].startswith("skipped"))
                         for k in KINDS},
      "contributions": _contributions(config, raw["log"], counters, sum(tokens)),
      "tokens_processed": sum(tokens),
      "tokens_merged": sum(counters.get("tokens_merged_by_fragment", [0] * config.outer.num_fragments))
                       / config.outer.num_fragments,
      "steps_pushed_again": sum(s.get("steps_taken_back", 0) for s in summaries if s),
      "recoveries": [s.get("recoveries", 0) if s else None for s in summaries],
      "blocked_s": [s.get("blocked_s") if s else None for s in summaries],
      "learner_stalls": counters.get("learner_stalls", 0),
      # One step: the undisturbed run's wall time per step while every learner trains (all overheads in).
      "step_time_s": (reference or {}).get("step_time_s") or (
          ((history.first_done(dirs, config.train.steps) or t_end) - t_train) / config.train.steps),
      "eval_loss": eval_loss,
      "events": raw["log"], "learner_states": raw["learner_states"], "timeline": timeline,
      "t_launch": raw["t_launch"], "t_train": t_train, "t_end": t_end,
  }
  report.update(_merge_rate(config, workdir, dirs, finish, t_train, t_end))
  if reference is not None:
    report.update(_beside_reference(report, reference, eval_loss))
  return report


def _summaries(dirs: list[pathlib.Path]) -> list[dict | None]:
  """Each learner's summary.json (None where it wrote none)."""
  summaries = []
  for d in dirs:
    try:
      summaries.append(json.loads((d / "summary.json").read_text()))
    except (OSError, ValueError):
      summaries.append(None)
  return summaries


def _outages(syncer_down: list, advances: list[float]) -> list[dict]:
  """Each syncer outage: when it went down, when its process started again, its first merge after."""
  outages = []
  for down, up in syncer_down:
    back = next((t for t in advances if up is not None and t > up), None)
    outages.append({"down_at": down, "process_started": up, "first_merge": back,
                    "back_to_merging_s": None if back is None or up is None else back - up,
                    "down_s": None if up is None else up - down})
  return outages


def _contributions(config, log: list[dict], counters: dict, tokens: int) -> dict:
  """Contributions pushed, merged, rejected, rolled back or dropped by crashes, and the tokens lost: the
  tokens the learners processed that a fragment is short of, beyond what kills may take."""
  by_fragment = counters.get("tokens_merged_by_fragment", [0] * config.outer.num_fragments)
  short = [max(0, tokens - int(m)) for m in by_fragment]
  # A killed learner takes with it the work it had not pushed: at most two pushes' worth per fragment
  # (its steps since its last push, and a push the syncer had not accepted). More is lost work.
  kills = sum(1 for e in log if e["kind"] == "learner_kill")
  tokens_per_step = config.data.global_batch // config.learners.num * config.data.seq_len
  permitted = kills * 2 * config.outer.sync_every * tokens_per_step
  lost = [max(0, x - permitted) for x in short]
  return {
      "pushed": counters.get("contributions_accepted", 0) + counters.get("contributions_rejected", 0),
      "accepted": counters.get("contributions_accepted", 0),
      "merged": counters.get("contributions_merged", 0),
      "rejected": {k: v for k, v in counters.get("rejected", {}).items() if v},
      "rolled_back_by_crashes": counters.get("contributions_rolled_back", 0),
      "dropped_by_crashes": counters.get("contributions_lost_open", 0),
      "closed_at_stop_rounds": counters.get("rounds_closed_at_stop", 0),
      "tokens_short_by_fragment": short,
      "tokens_short_permitted": permitted,
      "lost_tokens_by_fragment": lost,
      "lost": sum(1 for x in lost if x),
  }


def _merge_rate(config, workdir: pathlib.Path, dirs: list[pathlib.Path], finish: list[float], t_train: float,
                t_end: float) -> dict:
  """Tokens merged into the global model per provisioned learner-second. A learner is provisioned from the
  moment every learner trains until it finished its steps (stopped, dead or cut off meanwhile: still
  provisioned; finished: released, as a learner of a longer run would go on). Tokens a killed learner
  trains twice (between its checkpoint and its death) are not counted."""
  tokens_per_step = config.data.global_batch // config.learners.num * config.data.seq_len
  redone = sum(history.redone_steps(d, config.train.log_every) for d in dirs) * tokens_per_step
  series = history.merged_tokens(workdir / "syncer", config.outer.num_fragments)
  provisioned = sum(max(f - t_train, 0.0) for f in finish)
  useful = history.value_at(series, t_end) - history.value_at(series, t_train) - redone
  return {"provisioned_learner_s": provisioned, "tokens_redone": redone, "tokens_merged_while_training": useful,
          "merge_rate": useful / max(provisioned, 1e-9)}


def _beside_reference(report: dict, reference: dict, eval_loss: float | None) -> dict:
  """Goodput (the merge rate over the undisturbed run's), the eval loss ratio and the excess stall."""
  rate = reference["merge_rate"]
  return {
      "reference": {k: reference[k] for k in ("wall_s", "train_s", "tokens_processed", "eval_loss",
                                              "longest_stall_s", "step_time_s", "merge_rate",
                                              "provisioned_learner_s")},
      "goodput": report["merge_rate"] / rate if rate > 0 else None,
      "eval_loss_ratio": eval_loss / reference["eval_loss"] if eval_loss and reference.get("eval_loss") else None,
      "excess_stall_s": report["longest_stall_s"] - reference["longest_stall_s"],
  }


def stall_bound_s(config, report: dict) -> float:
  """What a stall beyond the undisturbed cadence may cost: the stall bound (outer.max_grace_s by default)
  plus one step."""
  return config_lib.resolve(config).outer.stall_s + report["step_time_s"]


def verdict(config, report: dict) -> dict:
  """The checks of docs/operations.md ("Chaos"): each True, False, or None when not measured."""
  restarts = report["syncer_restarts"]
  excess = report.get("excess_stall_s")
  return {
      "finished": report["finished"],
      "versions_monotone": report["versions_monotone"],
      "no_stall_beyond_bound": None if excess is None else excess <= stall_bound_s(config, report),
      "restarts_back_within_30s": all(o["back_to_merging_s"] is not None and o["back_to_merging_s"] <= 30
                                      for o in restarts),
      "nothing_lost": report["contributions"]["lost"] == 0,
  }

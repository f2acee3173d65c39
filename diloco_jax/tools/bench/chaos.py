r"""`python -m diloco_jax bench chaos`: goodput on the real runtime under one fault schedule, Decoupled
DiLoCo beside data-parallel, beside what the simulator predicts for both.

    python -m diloco_jax bench chaos --config configs/tiny_cpu.py --learners 6 --seed 0 \
        --mtbf-s 15 --repair-s 10 --min-step-s 0.1 [--config.train.steps=3000] [--workdir runs/bench_chaos]

(3,000 steps draw about 20 failures per strategy, 1,500 (`make bench`'s) 7 to 30: four runs in 30 / 14-21 min.)

The schedule is the simulator's failure model on the real processes (`failure_schedule`; `--schedule FILE`
replaces it with any `chaos` schedule): a failure kills one Decoupled DiLoCo learner, the others go on; it
stops the whole data-parallel job (`_dp_run`). Each strategy also runs undisturbed. Goodput (each against
its own undisturbed run): tokens merged into the global model per second over the undisturbed rate,
beside `sim goodput`'s prediction for the same failure rate, repair time, restart cost, checkpoint
interval and schedule (`sim_configs`), and each final eval loss beside its undisturbed one. Report:
WORKDIR/bench_chaos.json. docs/benchmarks.md, "Failures: `bench chaos`".
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import signal
import sys
import time

import numpy as np

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax.runs import children as run_children
from diloco_jax.tools.bench import bench_flags
from diloco_jax.tools.chaos import history
from diloco_jax.tools.chaos import job as chaos_job
from diloco_jax.tools.chaos import schedule as chaos_schedule
from diloco_jax.tools.chaos.analysis import verdict
from diloco_jax.tools.sim import goodput as sim_goodput


def failure_schedule(seed: int, learners: int, mtbf_s: float, repair_s: float,
                     horizon_s: float = 7200.0) -> list[chaos_schedule.Event]:
  """Learner kills at the times of a Poisson process of mean interval `mtbf_s` (job-wide), each on a
  uniformly drawn learner, each restarted after `repair_s` (from its checkpoint): the simulator's failure
  model on the real processes. The same schedule is applied to Decoupled DiLoCo (`chaos`'s multi-process
  job, syncer + learners: a failure kills one learner with kill -9 and restarts it after the repair delay;
  the others go on) and to data-parallel (`_dp_run`)."""
  rng = np.random.default_rng(seed)
  events, t = [], 0.0
  while True:
    t += float(rng.exponential(mtbf_s))
    if t > horizon_s:
      return events
    events.append(chaos_schedule.Event(round(t, 1), "learner_kill", int(rng.integers(learners)), repair_s))


# ---- the data-parallel job under the same schedule -------------------------------------------------------


def _dp_run(config_argv: list[str], devices: int, workdir: pathlib.Path, events: list[chaos_schedule.Event], say,
            timeout_s: float) -> dict:
  """The baseline process under `events`; returns its raw record. It runs on the same devices in total
  (learners x learners.devices), the same global batch and steps; a failure stops the whole job (kill -9),
  which restarts from its last checkpoint after the same repair delay (a stop or cut-off of one worker
  stalls the whole synchronous job: SIGSTOP for its length; syncer faults have no data-parallel
  counterpart and are skipped)."""
  if workdir.exists():
    shutil.rmtree(workdir)
  (workdir / "logs").mkdir(parents=True)
  argv = [sys.executable, "-m", "diloco_jax", "baseline", *config_argv,
          f"--config.mesh.num_devices={devices}", "--workdir", str(workdir)]
  env = run_children.child_env(devices)
  start = lambda: run_children.Child("baseline", argv, env, workdir / "logs" / "baseline.log")
  t_launch = time.time()
  child, restarts, log = start(), [], []
  pending: list[tuple[float, str]] = []
  todo, t_train, failure = list(events), None, None
  note = lambda what: (log.append({"t": time.time(), "what": what}),
                       say(f"bench chaos dp {time.time() - t_launch:7.1f}s  {what}"))
  try:
    while True:
      now = time.time()
      if now - t_launch > timeout_s:
        failure = f"timed out after {timeout_s:.0f} s"
        break
      if t_train is None and history.step_records(workdir):
        t_train = now
        note("training: the schedule starts")
      while t_train is not None and todo and t_train + todo[0].at_s <= now:
        child = _dp_apply(todo.pop(0), child, now, note, pending)
      child = _dp_follow_ups(pending, now, child, start, restarts, note)
      if child is not None and child.poll() is not None:
        if child.poll() == 0:
          break
        failure = f"the baseline exited with status {child.poll()}"
        break
      time.sleep(0.2)
  finally:
    if child is not None and child.poll() is None:
      child.proc.send_signal(signal.SIGCONT)
      child.proc.kill()
      child.proc.wait()
    if child is not None:
      child.close()
  summary = None
  if failure is None:
    summary = json.loads((workdir / "summary.json").read_text())
  return {"finished": failure is None, "failure": failure, "t_launch": t_launch, "t_end": time.time(),
          "restarts": restarts, "log": log, "summary": summary}


def _dp_apply(event: chaos_schedule.Event, child, now: float, note, pending: list[tuple[float, str]]):
  """Applies one event to the data-parallel job (a learner fault stops the whole job); returns its process
  (None once killed). Follow-ups (restart, SIGCONT) go to `pending` as (due time, action)."""
  if event.kind.startswith("syncer"):
    note(f"skipped ({event.describe()}): no syncer in data-parallel")
  elif child is None or child.poll() is not None:
    note(f"skipped ({event.describe()}): the job is down")
  elif event.kind == "learner_kill":
    child.proc.send_signal(signal.SIGCONT)
    child.proc.kill()
    child.proc.wait()
    child.close()
    child = None
    note(f"failure on worker {event.target}: kill -9 the whole job (restart in {event.duration_s:g} s)")
    pending.append((now + event.duration_s, "restart"))
  else:
    child.proc.send_signal(signal.SIGSTOP)
    note(f"{event.describe()}: the synchronous job stalls (SIGSTOP)")
    pending.append((now + event.duration_s, "cont"))
  return child


def _dp_follow_ups(pending: list[tuple[float, str]], now: float, child, start, restarts: list[float], note):
  """Carries out the follow-ups due by `now`; returns the job's process (a new one after a restart)."""
  for due, action in list(pending):
    if due <= now:
      pending.remove((due, action))
      if action == "restart":
        child = start()
        restarts.append(time.time())
        note("restarted from its last checkpoint")
      elif child is not None:
        child.proc.send_signal(signal.SIGCONT)
        note("SIGCONT")
  return child


def _dp_measure(config, workdir: pathlib.Path, raw: dict) -> dict:
  """Window rate (tokens of the surviving trajectory per second from the first to the last record),
  restart cost, eval loss."""
  records = history.step_records(workdir)
  tokens_per_step = config.data.global_batch * config.data.seq_len
  out = {"finished": raw["finished"], "failure": raw["failure"], "events": raw["log"],
         "failures": len(raw["restarts"])}
  if not records or not raw["finished"]:
    return out
  (t0, s0), (t1, s1) = records[0], records[-1]
  window = t1 - t0
  out.update(window_s=window, rate=(s1 - s0) * tokens_per_step / window,
             eval_loss=raw["summary"]["final_eval_loss"], steps_in_window=s1 - s0)
  costs = []
  for r in raw["restarts"]:  # start-up to the first record after the restart, less the steps it logged
    first = next(((t, s) for t, s in records if t > r), None)
    if first is not None:
      costs.append(first[0] - r)
  out["restart_cost_s"] = float(np.mean(costs)) if costs else None
  out["redone_steps"] = history.redone_steps(workdir, config.train.log_every)
  return out


def _learner_restart_cost(workdir: pathlib.Path, report: dict) -> float | None:
  """Mean time from a learner's restart (process start) to its first metrics record."""
  costs = []
  for e in report["events"]:
    if e["kind"] == "learner_restart":
      first = next((t for t, _ in history.step_records(workdir / f"learner_{e['target']}") if t > e["t"]), None)
      if first is not None:
        costs.append(first - e["t"])
  return float(np.mean(costs)) if costs else None


# ---- the simulator's prediction for the same failure rate --------------------------------------------------


def sim_configs(config, learners: int, mtbf_s: float, dp: dict, diloco: dict, diloco_ref: dict,
                dp_ref: dict, repair_s: float) -> dict[str, sim_goodput.SimConfig]:
  """The simulator's configurations for both strategies, from what was measured (one slice per learner,
  the job-wide failure rate 1 / mtbf_s): `sim goodput`'s prediction (`diloco_jax.tools.sim.goodput
  .simulate`) for the same failure rate, repair time, restart cost (measured: a restarted process's
  start-up to its first steps, plus the steps it trains again from its checkpoint), checkpoint interval,
  step time, H, P, tau and quorum."""
  o, ckpt = config_lib.resolve(config).outer, config.train.checkpoint_every
  dp_step = dp_ref["window_s"] / dp_ref["steps_in_window"]
  dl_step = diloco_ref["step_time_s"]
  common = dict(chips=learners, slice_chips=1, mtbi_chip_s=mtbf_s * learners, repair_s=repair_s,
                step_cv=0.1, failures_per_job=300)
  dp_restart = repair_s + (dp.get("restart_cost_s") or 0.0)
  # A learner trains again, on average, half a checkpoint interval; a data-parallel job loses it (the
  # simulator's checkpoint model counts that for dp itself).
  learner_restart = repair_s + (diloco.get("learner_restart_cost_s") or 0.0) + ckpt / 2 * dl_step
  return {
      "dp": sim_goodput.SimConfig(strategy="dp", learners=1, restart_s=dp_restart, step_s=dp_step,
                                  ckpt_every_steps=ckpt, ckpt_cost_s=0.0, **common),
      "diloco": sim_goodput.SimConfig(strategy="diloco", learners=learners, learner_recovery="restart",
                                      restart_s=learner_restart, rejoin_s=0.0, step_s=dl_step,
                                      inner_steps=o.sync_every, fragments=o.num_fragments, tau=o.tau,
                                      min_quorum=o.min_quorum, max_grace_s=o.max_grace_s,
                                      grace_gamma=o.grace_gamma,
                                      max_in_flight=o.max_in_flight,
                                      t_sync_s=0.005, snapshot_s=0.0, **common),
  }


def applied_mtbf_s(result: dict) -> dict[str, float | None]:
  """Seconds between the failures each strategy's run actually took (job-wide): a failure drawn for a
  learner (data-parallel: the job) already down is skipped, so a run takes fewer than the schedule draws on average,
  the more so the longer a failure keeps its target down. Decoupled DiLoCo's window: its provisioned
  learner-seconds over the learners; data-parallel's: its first to last record."""
  windows = {"diloco": result["diloco"]["provisioned_learner_s"] / result["learners"],
             "dp": result["dp"]["window_s"]}
  return {k: w / result[k]["failures"] if result[k]["failures"] else None for k, w in windows.items()}


def predicted_at_applied_rate(sims: dict, result: dict, repeats: int, seed: int) -> dict[str, float | None]:
  """The simulator's goodput for each strategy at the failure rate its run took (`applied_mtbf_s`) instead
  of the rate drawn. A run of a few hundred seconds takes 7 to 30 failures, and how many it happened to
  take moves its goodput by more than the simulator's model error; this prediction removes that draw."""
  out = {}
  for k, mtbf in applied_mtbf_s(result).items():
    cfg = sims[k]
    out[k] = (None if mtbf is None else
              sim_goodput.simulate(dataclasses.replace(cfg, mtbi_chip_s=mtbf * cfg.chips), repeats=repeats,
                                   seed=seed).goodput)
  return out


# ---- the command ---------------------------------------------------------------------------------------


def bench_chaos(argv) -> int:
  """`python -m diloco_jax bench chaos --config C --learners N ...`; see the module docstring."""
  fv = cli.parse(argv, bench_flags.chaos, doc=__doc__)
  config, learners = fv.config, fv.learners
  if learners < 1 or fv["mtbf-s"].value <= 0 or fv["repair-s"].value < 0:
    raise cli.UsageError("--learners must be >= 1, --mtbf-s > 0 and --repair-s >= 0")
  config_argv = chaos_job.chaos_config_argv(config, run_children.config_args(argv), learners)
  if not config.emulation.min_step_s and fv["min-step-s"].value > 0:
    config.emulation.min_step_s = fv["min-step-s"].value
    config_argv.append(f"--config.emulation.min_step_s={config.emulation.min_step_s}")
  devices = learners * config.learners.devices
  cli.validated(config, devices, learners=True)
  os.environ.update({k: v for k, v in run_children.child_env(config.learners.devices).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  root = pathlib.Path(fv.workdir).resolve()
  root.mkdir(parents=True, exist_ok=True)
  say = lambda line: print(line, file=sys.stderr, flush=True)
  mtbf, repair, timeout = fv["mtbf-s"].value, fv["repair-s"].value, fv["timeout-s"].value
  try:
    events = (chaos_schedule.load_schedule(fv.schedule, learners) if fv.schedule
              else failure_schedule(fv.seed, learners, mtbf, repair))
  except ValueError as e:
    raise cli.UsageError(str(e)) from None
  say(f"bench chaos: {learners} learners, failures every {mtbf:g} s on average (job-wide), repair {repair:g} s; "
      f"first events: " + "; ".join(f"{e.at_s:.0f}s {e.describe()}" for e in events[:6]))
  if fv["diloco-reference"].value:
    dl_ref = json.loads(pathlib.Path(fv["diloco-reference"].value).read_text())["reference_run"]
    if dl_ref.get("steps") != config.train.steps or dl_ref.get("learners") != learners:
      raise cli.UsageError(f"--diloco-reference {fv['diloco-reference'].value}: its undisturbed run trained "
                           f"{dl_ref.get('learners')} learners for {dl_ref.get('steps')} steps, this one "
                           f"{learners} for {config.train.steps}")
  else:
    say("bench chaos: Decoupled DiLoCo, undisturbed")
    dl_ref = chaos_job.run_job(config, config_argv, root / "diloco_reference", "bench", [], say=say,
                               timeout_s=timeout, reference=None)
  say("bench chaos: Decoupled DiLoCo under the schedule")
  dl = chaos_job.run_job(config, config_argv, root / "diloco", "bench", events, say=say, timeout_s=timeout,
                         reference=dl_ref)
  dl["learner_restart_cost_s"] = _learner_restart_cost(root / "diloco", dl)
  say("bench chaos: data-parallel, undisturbed")
  dp_ref = _dp_measure(config, root / "dp_reference",
                       _dp_run(config_argv, devices, root / "dp_reference", [], say, timeout))
  say("bench chaos: data-parallel under the schedule")
  dp = _dp_measure(config, root / "dp", _dp_run(config_argv, devices, root / "dp", events, say, timeout))
  if not (dl["finished"] and dp["finished"] and dp_ref["finished"]):
    say(f"bench chaos: a run did not finish: DiLoCo {dl['failure']}, data-parallel {dp['failure']}, "
        f"undisturbed data-parallel {dp_ref['failure']}")
    return 1
  dp["goodput"] = dp["rate"] / dp_ref["rate"]
  sims = sim_configs(config, learners, mtbf, dp, dl, dl_ref, dp_ref, repair)
  predicted = {k: sim_goodput.simulate(cfg, repeats=fv.repeats, seed=fv.seed) for k, cfg in sims.items()}
  result = _result(config, events, dl, dl_ref, dp, dp_ref, sims, predicted, mtbf=mtbf, repair=repair)
  for k, p in predicted_at_applied_rate(sims, result, fv.repeats, fv.seed).items():
    result[k]["predicted_at_applied_rate"] = p
  result["applied_mtbf_s"] = applied_mtbf_s(result)
  result["reference_run"] = chaos_job.summary(dl_ref)  # so a later run can reuse it (--diloco-reference)
  (root / "bench_chaos.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
  _print_result(result)
  print(f"bench chaos: {root / 'bench_chaos.json'}")
  return 0


def _result(config, events, dl: dict, dl_ref: dict, dp: dict, dp_ref: dict, sims: dict, predicted: dict, *,
            mtbf: float, repair: float) -> dict:
  """The figures of both strategies beside the simulator's (what bench_chaos.json holds). Goodput, each
  against its own undisturbed run, over the window in which every learner trains: tokens merged into the
  global model per second (data-parallel: tokens of the surviving trajectory per second) over the
  undisturbed rate."""
  learners = config.learners.num
  result = {
      "learners": learners, "steps": config.train.steps, "mtbf_s": mtbf, "repair_s": repair,
      "schedule": [dataclasses.asdict(e) for e in events if e.at_s < max(dl["train_s"], 1) * 3],
      "diloco": {"goodput": dl["goodput"], "eval_loss": dl["eval_loss"], "reference_eval_loss": dl_ref["eval_loss"],
                 "failures": dl["faults_applied"]["learner_kill"],  # kills of a learner already down: none
                 "restart_cost_s": dl["learner_restart_cost_s"], "tokens_redone": dl["tokens_redone"],
                 "provisioned_learner_s": dl["provisioned_learner_s"], "predicted": predicted["diloco"].goodput,
                 "predicted_ci": predicted["diloco"].goodput_ci, "checks": verdict(config, dl)},
      "dp": {"goodput": dp["goodput"], "eval_loss": dp["eval_loss"], "reference_eval_loss": dp_ref["eval_loss"],
             "failures": dp["failures"], "restart_cost_s": dp["restart_cost_s"], "window_s": dp["window_s"],
             "redone_steps": dp["redone_steps"], "predicted": predicted["dp"].goodput,
             "predicted_ci": predicted["dp"].goodput_ci},
      "sim_configs": {k: dataclasses.asdict(v) for k, v in sims.items()},
  }
  result["ratio"] = dl["goodput"] / dp["goodput"] if dp["goodput"] > 0 else None
  result["diloco_vs_sim_points"] = 100 * (dl["goodput"] - predicted["diloco"].goodput)
  return result


def _print_result(result: dict) -> None:
  """The table of both strategies, measured beside simulated, and the ratio."""
  print(f"\n{'':18}{'goodput':>9}{'simulated':>16}{'failures':>10}{'restart cost':>14}{'eval loss':>22}")
  for name, key in (("Decoupled DiLoCo", "diloco"), ("data-parallel", "dp")):
    r = result[key]
    cost = f"{r['restart_cost_s']:.1f} s" if r["restart_cost_s"] is not None else "-"
    print(f"{name:18}{100 * r['goodput']:>8.1f}%{100 * r['predicted']:>9.1f}% +-{100 * r['predicted_ci']:.1f}"
          f"{r['failures']:>10}{cost:>14}{r['eval_loss']:>12.4f} ({r['reference_eval_loss']:.4f})")
  print(f"DiLoCo / data-parallel goodput: {result['ratio']:.2f}x; DiLoCo measured - simulated: "
        f"{result['diloco_vs_sim_points']:+.1f} points (eval loss: under the schedule, undisturbed in brackets)")
  for name, key in (("Decoupled DiLoCo", "diloco"), ("data-parallel", "dp")):
    mtbf, p = result.get("applied_mtbf_s", {}).get(key), result[key].get("predicted_at_applied_rate")
    if mtbf is not None and p is not None:
      print(f"{name}: failures taken every {mtbf:.1f} s (drawn every {result['mtbf_s']:g} s; one for a target "
            f"already down is skipped): simulated at that rate {100 * p:.1f}%")

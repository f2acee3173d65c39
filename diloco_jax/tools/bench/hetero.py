r"""`python -m diloco_jax bench hetero --config configs/tiny_cpu.py [--groups 0.847:2,1:2] [--processes]`

Mixed-speed learners under the paper's three quorum settings, on the same learner set and token budget:
K = M (every live learner), K = 1 without a grace window, and K = 1 with the adaptive grace window. By
default half the learners run 18% slower (speed 1/1.18 = 0.847) with 10% step-time noise, emulated by
stretching every inner step (`learner/pace.py`) to `step_s / speed` seconds (`--step-s`, or by default
`calibrate_step_s`). Each setting prints its goodput, the simulator's (`sim/goodput.py`), the eval loss,
contributors per round, late pushes and the bytes received (`format_result`); then the data-parallel
baseline on the same token budget (`baseline_config`) and the paper's three rows. `--processes` runs each
setting as a syncer and M learner processes over gRPC (`python -m diloco_jax local`); every run's files
stay in `--workdir/<setting>`. docs/benchmarks.md, "Mixed-speed learners".

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m diloco_jax bench hetero \
      --config configs/tiny_cpu.py --config.train.steps=2000 --config.data.max_bytes=2000000
"""

from __future__ import annotations

import copy
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading

import jax

from diloco_jax import cli
from diloco_jax import config as config_lib
from diloco_jax import metrics as metrics_lib
from diloco_jax.learner import loop as loop_lib
from diloco_jax.runs import baseline, inprocess
from diloco_jax.runs import children as run_children
from diloco_jax.tools.bench import bench_flags
from diloco_jax.tools.bench.bench_flags import SETTINGS, SLOW_SPEED
from diloco_jax.tools.sim import goodput as sim_goodput
from diloco_jax.tools.sim.args import parse_groups

# The paper's mixed-hardware rows (8 learners, 4 TPU v6e beside 4 TPU v5p): goodput (%), average text and
# vision scores. Reference values, printed beside the measured ones, never used in a computation.
PAPER = {"all": (84, 54.4, 37.6), "k1": (100, 51.4, 25.7), "k1grace": (100, 55.3, 37.0)}
GOAL_GOODPUT, GOAL_GAIN_POINTS, GOAL_LOSS_RATIO, GOAL_SIM_POINTS, GOAL_RX_RATIO = 0.97, 5.0, 1.01, 5.0, 1.5


def learner_speeds(groups: tuple[tuple[float, int], ...], num: int) -> tuple[float, ...]:
  """One speed per learner from SPEED:COUNT groups, or by default half of them 18% slower."""
  if not groups:
    slow = num // 2
    return (SLOW_SPEED,) * slow + (1.0,) * (num - slow)
  speeds = tuple(float(s) for s, n in groups for _ in range(n))
  if len(speeds) != num:
    raise cli.UsageError(f"--groups hold {len(speeds)} learners but learners.num is {num}")
  return speeds


def setting_overrides(setting: str) -> dict[str, object]:
  """Config fields of one quorum setting: K = M; K = 1 closing at the first push; K = 1 with the config's
  adaptive grace window (gamma, min and max grace)."""
  return {"all": {"outer.min_quorum": 0},
          "k1": {"outer.min_quorum": 1, "outer.min_grace_s": 0.0, "outer.max_grace_s": 0.0},
          "k1grace": {"outer.min_quorum": 1}}[setting]


def _with(config, fields: dict[str, object]):
  c = copy.deepcopy(config)
  for path, value in fields.items():
    node = c
    *parents, leaf = path.split(".")
    for part in parents:
      node = node[part]
    node[leaf] = value
  return c


def baseline_config(config):
  """The data-parallel baseline of the same run: the whole global batch per step for `train.steps` steps,
  on one learner's devices unless `mesh.num_devices` says otherwise. The device count changes neither the
  tokens nor the math (the global batch is split and the gradients averaged), only the speed; and an
  all-reduce over all 8 fake CPU devices of a 2-core machine under load was seen to hang in XLA's CPU
  collectives (fewer than 8 partitions reached the rendezvous)."""
  if config.mesh.num_devices:
    return config
  return _with(config, {"mesh.num_devices": config_lib.resolve(config).learners.device_counts[0]})


def calibrate_step_s(config, steps: int = 40) -> float:
  """Twice the slowest learner's median inner-step time with all M learners running at once, unstretched
  (the emulated step must be longer than the real one for every learner to run at its emulated speed; and
  measured with all of them running, so that load on the machine does not change the emulated speeds)."""
  # A step time far below the real one: every step is paced (it waits for the device, so the step time
  # the learner measures is its computation, not its dispatch) but never stretched.
  c = _with(config, {"train.steps": steps, "train.warmup_steps": min(config.train.warmup_steps, steps),
                     "train.eval_every": 10 * steps, "emulation.speeds": (), "emulation.step_cv": 0.0,
                     "emulation.step_s": 1e-9})
  job = inprocess.InProcessRun(c, None, run_id="bench-hetero-calibration")
  errors = []

  def work(learner):
    try:
      loop_lib.run_learner(learner, should_stop=lambda: bool(errors))
    except BaseException as e:  # noqa: BLE001 - re-raised below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(x,)) for x in job.learners]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  times = [x.comms.step_time_s for x in job.learners]
  job.close()
  if errors:
    raise errors[0]
  return 2.0 * max(times)


def _goodput(learners: list[dict]) -> float:
  """Mean over learners of compute / (compute + blocked): the share of its loop time a learner spent in
  inner steps (the emulated stretch included) rather than waiting on the outer loop."""
  return statistics.fmean(x["compute_s"] / max(x["compute_s"] + x["blocked_s"], 1e-9) for x in learners)


def _rounds(records_path: pathlib.Path) -> dict:
  records = metrics_lib.read_jsonl(records_path) if records_path.exists() else []
  if not records:
    return {"rounds": 0, "contributors_per_round": 0.0, "closed_all_in": 0.0, "mean_grace_s": 0.0}
  return {"rounds": len(records),
          "contributors_per_round": statistics.fmean(len(r["contributors"]) for r in records),
          "closed_all_in": statistics.fmean(r["close"] == "all_in" for r in records),
          "mean_grace_s": statistics.fmean(r["grace_s"] for r in records)}


def _run_in_process(config, workdir: pathlib.Path) -> dict:
  summary = inprocess.run(config, str(workdir), quiet=True)
  return {**summary, "rounds_file": workdir / "syncer" / "rounds.jsonl"}


def _run_processes(config_argv: list[str], fields: dict[str, object], workdir: pathlib.Path) -> dict:
  overrides = [f"--config.{k}={v!r}" if isinstance(v, tuple) else f"--config.{k}={v}" for k, v in fields.items()]
  cmd = [sys.executable, "-m", "diloco_jax", "local", *config_argv, *overrides, "--workdir", str(workdir)]
  log = workdir.parent / f"{workdir.name}.log"
  with open(log, "wb") as out:
    rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ)).returncode
  if rc != 0:
    raise RuntimeError(f"`{' '.join(cmd)}` exited {rc}; see {log}")
  summary = json.loads((workdir / "summary.json").read_text())
  status = summary.get("syncer") or {}
  return {**summary, "t_sync_s": status.get("t_sync_s", [0.0]),
          "contributions_late": status.get("counters", {}).get("contributions_late", 0),
          "rounds_file": workdir / "syncer" / "rounds.jsonl"}


def simulated(config, setting: str, speeds: tuple[float, ...], step_cv: float, step_s: float, t_sync_s: float,
              repeats: int) -> tuple[float, float]:
  """The simulator's (goodput, lockstep expectation) for this learner set and outer loop (failures
  negligible): the same quorum rule, grace window and learner blocking rules as the runtime."""
  o = config_lib.resolve(config).outer
  groups = tuple((v, speeds.count(v)) for v in dict.fromkeys(speeds))
  m = len(speeds)
  cfg = sim_goodput.SimConfig(
      chips=m, strategy="diloco", learners=m, slice_chips=1, mtbi_chip_s=1e9 * sim_goodput.YEAR_S,
      step_s=step_s, step_cv=step_cv, inner_steps=o.sync_every, fragments=o.num_fragments, snapshot_s=0.0,
      t_sync_s=t_sync_s, min_quorum=o.min_quorum, tau=o.tau, grace_gamma=o.grace_gamma,
      max_grace_s=o.max_grace_s,
      max_in_flight=o.max_in_flight,
      groups=groups, max_pushes=20_000)
  cfg = sim_goodput.with_quorum_setting(cfg, setting)
  return sim_goodput.simulate(cfg, repeats=repeats).goodput, sim_goodput.lockstep_goodput(cfg)


def run(config, *, settings, speeds, step_cv, step_s, workdir: pathlib.Path, processes=False, config_argv=(),
        with_baseline=True, sim_repeats=3, log=print) -> dict:
  """The baseline, then every setting with its simulator row; returns the JSON-able result. `step_s` 0:
  calibrated here (`calibrate_step_s`)."""
  dp = None
  if with_baseline:
    # First, on a fresh backend (as `bench quality` does): its all-reduce over every device then does not
    # share the device threads with anything the learner runs left behind.
    log("bench hetero: data-parallel baseline on the same token budget ...")
    dp = baseline.run(baseline_config(config), str(workdir / "dp"), quiet=True)
    log(f"  eval loss {dp['final_eval_loss']:.4f}, {dp['wall_s']:.0f}s")
  if step_s == 0:
    log("bench hetero: measuring the step time of all learners at once ...")
    step_s = calibrate_step_s(_with(config, {"emulation.speeds": tuple(speeds), "emulation.step_cv": step_cv}))
  log(f"bench hetero: speed-1 step {step_s * 1e3:.1f} ms")
  fields = {"emulation.speeds": tuple(speeds), "emulation.step_cv": step_cv, "emulation.step_s": step_s}
  rows = {}
  for setting in settings:
    setting_fields = {**fields, **setting_overrides(setting)}
    c = _with(config, setting_fields)
    log(f"bench hetero: {SETTINGS[setting]} ...")
    out = workdir / setting
    s = (_run_processes(list(config_argv), setting_fields, out) if processes else _run_in_process(c, out))
    learners = [x for x in s["learners"] if not x.get("missing")]
    fast = [x for x in learners if x.get("pace", {}).get("speed", 1.0) == max(speeds)]
    # The speed-1 step as run (overruns included): what the simulator's step_s stands for.
    step_fast = statistics.fmean(x["compute_s"] / max(x["steps"], 1) * x["pace"]["speed"] for x in fast)
    t_sync = statistics.fmean(s["t_sync_s"])
    sim, lockstep = simulated(c, setting, tuple(speeds), step_cv, step_fast, t_sync, sim_repeats)
    rows[setting] = {
        "setting": setting, "label": SETTINGS[setting], "goodput": _goodput(learners), "sim_goodput": sim,
        "lockstep": lockstep, "eval_loss": s["final_eval_loss"],
        "contributions_late": s["contributions_late"], "contributions_merged": s["contributions_merged"],
        "rx_mib": statistics.fmean(x["bytes_received"] for x in learners) / 2**20,
        "tx_mib": statistics.fmean(x["bytes_sent"] for x in learners) / 2**20,
        "blocked_s": {x["learner"]: x["blocked_s"] for x in learners},
        "overrun_steps": sum(x.get("pace", {}).get("overrun_steps", 0) for x in learners),
        "steps": sum(x["steps"] for x in learners), "step_s_speed1": step_fast, "t_sync_s": t_sync,
        "wall_s": s["wall_s"], "tokens": s["tokens"], "paper": PAPER[setting], **_rounds(s["rounds_file"]),
    }
    r = rows[setting]
    log(f"  goodput {r['goodput']:.3f} (sim {r['sim_goodput']:.3f}), eval loss {r['eval_loss']:.4f}, "
        f"{r['contributors_per_round']:.2f} contributors per round, {r['wall_s']:.0f}s")
  return {"rows": rows, "baseline_eval_loss": dp["final_eval_loss"] if dp else None,
          "baseline_tokens": dp["tokens"] if dp else None, "speeds": list(speeds), "step_cv": step_cv,
          "step_s": step_s, "processes": processes, "goals": goals(rows)}  # step_s: as calibrated


def goals(rows: dict) -> dict:
  """The done-criteria of mixed-speed learners, where the rows they need were run."""
  out = {}
  if "k1grace" in rows:
    g = rows["k1grace"]
    out["k1grace_goodput_ge_0.97"] = g["goodput"] >= GOAL_GOODPUT
    if "all" in rows:
      out["k1grace_5_points_above_k_all"] = 100 * (g["goodput"] - rows["all"]["goodput"]) >= GOAL_GAIN_POINTS
      out["k1grace_loss_within_1pct_of_k_all"] = g["eval_loss"] <= GOAL_LOSS_RATIO * rows["all"]["eval_loss"]
  if "all" in rows:
    out["downlink_within_1.5x_of_k_all"] = all(r["rx_mib"] <= GOAL_RX_RATIO * rows["all"]["rx_mib"]
                                               for r in rows.values())
  out["sim_within_5_points"] = all(abs(100 * (r["goodput"] - r["sim_goodput"])) <= GOAL_SIM_POINTS
                                   for r in rows.values())
  return out


def format_result(result: dict) -> str:
  """The table: per setting

    goodput      mean over learners of inner-step time / (inner-step time + time blocked on the outer loop)
    sim          the outer-loop simulator's goodput for the same setting (`sim/goodput.py`, called here with
                 the measured speed-1 step time and sync time), and beside K = M the lockstep expectation,
                 the mean over learners of slowest speed / own speed
    eval loss    of the syncer's global model at the end, on the held-out batches
    per round    distinct contributors per closed round; late: pushes based on an older version
    rx           bytes each learner received (the downlink), MiB

  then the data-parallel baseline on the same token budget (`train.steps` x `data.global_batch`, on one
  learner's devices: `baseline_config`) and the paper's three rows (8 learners, TPU v6e beside v5p). With
  `--processes` the syncer's per-round decisions are in `--workdir/<setting>/syncer/rounds.jsonl`.
  """
  rows = result["rows"]
  ref = rows.get("all")
  lines = [f"learners at speeds {', '.join(f'{v:.3f}' for v in result['speeds'])}, step cv {result['step_cv']}, "
           f"speed-1 step {1e3 * result['step_s']:.1f} ms" + (", learner processes over gRPC" if result["processes"]
                                                              else ", in one process"),
           f"{'setting':<24}{'goodput':>8}{'sim':>7}{'lockstep':>9}{'eval loss':>11}{'vs K=M':>8}"
           f"{'per round':>10}{'late':>7}{'rx MiB':>8}{'paper: goodput text vision':>29}"]
  for setting, r in rows.items():
    vs = f"{100 * (r['eval_loss'] / ref['eval_loss'] - 1):+.1f}%" if ref else "-"
    lock = f"{r['lockstep']:.3f}" if setting == "all" else ""
    p = r["paper"]
    lines.append(f"{r['label']:<24}{r['goodput']:>8.3f}{r['sim_goodput']:>7.3f}{lock:>9}{r['eval_loss']:>11.4f}"
                 f"{vs:>8}{r['contributors_per_round']:>10.2f}{r['contributions_late']:>7}{r['rx_mib']:>8.1f}"
                 f"{p[0]:>15}%{p[1]:>7}{p[2]:>7}")
  if result["baseline_eval_loss"] is not None:
    vs = f"{100 * (result['baseline_eval_loss'] / ref['eval_loss'] - 1):+.1f}%" if ref else "-"
    lines.append(f"{'data-parallel':<24}{'':>8}{'':>7}{'':>9}{result['baseline_eval_loss']:>11.4f}{vs:>8}")
  met = {True: "met", False: "NOT met"}
  g = result["goals"]
  lines.append("goals: " + "; ".join(f"{k} {met[v]}" for k, v in g.items()))
  return "\n".join(lines)


def bench_hetero(argv) -> int:
  fv = cli.parse(argv, bench_flags.hetero, doc=__doc__)
  config = fv.config
  settings = [s.strip() for s in fv.settings if s.strip()]
  for s in settings:
    if s not in SETTINGS:
      raise cli.UsageError(f"--settings must be a comma list of {', '.join(SETTINGS)}, got {s!r}")
  speeds = learner_speeds(parse_groups(fv.groups), config.learners.num)
  step_cv = fv["step-cv"].value
  if not 0 <= step_cv < 1:
    raise cli.UsageError(f"--step-cv must be in [0, 1), got {step_cv}")
  if fv["step-s"].value < 0:
    raise cli.UsageError(f"--step-s must be >= 0, got {fv['step-s'].value}")
  probe = _with(config, {"emulation.speeds": speeds, "emulation.step_cv": step_cv})
  cli.validated(probe, len(jax.devices()), learners=True)
  if fv.baseline:
    cli.validated(baseline_config(config), len(jax.devices()), learners=False)
  root = pathlib.Path(fv.workdir)
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  say = lambda message: print(message, file=sys.stderr, flush=True)
  step_s = fv["step-s"].value
  say(f"bench hetero: {config.learners.num} learners, speeds {', '.join(f'{v:.3f}' for v in speeds)}, step cv "
      f"{step_cv}, H={config.outer.sync_every}, P={config.outer.num_fragments}, "
      f"tau={config.outer.tau}, {config.train.steps} steps per learner"
      + (", learner processes over gRPC" if fv.processes else ", in one process"))
  result = run(config, settings=settings, speeds=speeds, step_cv=step_cv, step_s=step_s, workdir=root,
               processes=fv.processes, config_argv=run_children.config_args(argv), with_baseline=fv.baseline,
               sim_repeats=fv["sim-repeats"].value, log=say)
  if fv.json:
    print(json.dumps(metrics_lib._jsonable(result), indent=2, default=str))
  else:
    print(format_result(result))
  return 0

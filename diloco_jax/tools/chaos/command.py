r"""A multi-process run under a seeded fault schedule: `python -m diloco_jax chaos`.

    python -m diloco_jax chaos --config configs/tiny_cpu.py --learners 3 --seed 0 \
        [--schedule FILE] [--workdir runs/chaos] [--config.train.steps=2000]

It first runs the same job undisturbed (the reference; `--reference report.json` reuses one), then again
under the schedule (the standard one of `--seed`, or a JSON list of events from `--schedule`): kill -9 of a
learner and its restart after a repair delay, SIGSTOP/SIGCONT of a straggler, a learner cut off from the
syncer, kill -9 and SIGTERM of the syncer and its restart on the same port and workdir. Both runs use
`launch_local`'s launcher. Each event is printed as it happens; at the end the checks (finished, versions
monotone, longest stall, restarts back to merging, contributions lost), goodput and the final eval loss
beside the undisturbed ones. `WORKDIR/report.json` holds it all, `WORKDIR/timeline.png` draws it. Exit
status 1 if a check failed. What each check measures: docs/operations.md, "Chaos".
"""

from __future__ import annotations

import functools
import glob
import json
import os
import pathlib
import sys

from diloco_jax import cli, command_flags
from diloco_jax.runs import children as run_children
from diloco_jax.tools.chaos import job as job_lib
from diloco_jax.tools.chaos import report as report_lib
from diloco_jax.tools.chaos import schedule as schedule_lib
from diloco_jax.tools.chaos.analysis import verdict


def run_chaos(argv) -> int:
  """`python -m diloco_jax chaos --config C --learners N --seed S [--schedule FILE]`; see the docstring."""
  # --summarize only reads reports: it needs no --config.
  summarize = any(a == "--summarize" or a.startswith("--summarize=") for a in argv[1:])
  fv = cli.parse(argv, command_flags.chaos, doc=__doc__, config=not summarize)
  if summarize:
    paths = sorted({p for pattern in fv.summarize for p in glob.glob(pattern)})
    reports = [json.loads(pathlib.Path(p).read_text()) for p in paths]
    print(report_lib.summary_table(sorted(reports, key=lambda r: r.get("seed", 0))))
    return 0
  config = fv.config
  learners = fv.learners
  if learners < 1:
    raise cli.UsageError(f"--learners must be >= 1, got {learners}")
  config_argv = job_lib.chaos_config_argv(config, run_children.config_args(argv), learners)
  cli.validated(config, learners * config.learners.devices, learners=True)
  if fv.schedule:
    try:
      schedule_lib.load_schedule(fv.schedule, learners)
    except ValueError as e:
      raise cli.UsageError(str(e)) from None
  # The launcher's own jax (the final evals) gets one learner's worth of CPU devices; set before first use.
  os.environ.update({k: v for k, v in run_children.child_env(config.learners.devices).items()
                     if k in ("XLA_FLAGS", "JAX_PLATFORMS")})
  workdir = pathlib.Path(fv.workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  eval_batches = fv["eval-batches"].value or config.data.eval_batches
  if eval_batches < 1:
    raise cli.UsageError(f"--eval-batches must be >= 0, got {fv['eval-batches'].value}")
  run = functools.partial(job_lib.run_job, config, config_argv, run_id=fv["run-id"].value, say=_say,
                          timeout_s=fv["timeout-s"].value, eval_batches=eval_batches)
  reference = _reference(fv, config, eval_batches, run, workdir)
  if reference is None:
    return 1
  events = (schedule_lib.load_schedule(fv.schedule, learners) if fv.schedule
            else schedule_lib.standard_schedule(fv.seed, learners, reference["train_s"]))
  _say("chaos: schedule\n" + "\n".join(f"  {e.at_s:7.1f}s  {e.describe()}" for e in events))
  report = run(workdir=workdir / "chaos", events=events, reference=reference)
  report["seed"] = fv.seed
  report["checks"] = verdict(config, report)
  report["reference_run"] = job_lib.summary(reference)
  (workdir / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
  report_lib.plot_timeline(report, workdir / "timeline.png", config.outer.num_fragments)
  print(report_lib.format_report(config, report))
  print(f"chaos: report {workdir / 'report.json'}, timeline {workdir / 'timeline.png'}")
  return 0 if all(v is not False for v in report["checks"].values()) else 1


def _say(line: str) -> None:
  print(line, file=sys.stderr, flush=True)


def _reference(fv, config, eval_batches: int, run, workdir: pathlib.Path) -> dict | None:
  """The undisturbed run's report: `--reference`'s, or measured now by `run`; None if it did not finish."""
  if fv.reference:
    reference = json.loads(pathlib.Path(fv.reference).read_text())["reference_run"]
    if reference.get("eval_batches", config.data.eval_batches) != eval_batches:
      raise cli.UsageError(f"--reference {fv.reference} evaluated its final model on "
                           f"{reference.get('eval_batches')} batches, this run on {eval_batches}: "
                           "pass the same --eval-batches")
    _say(f"chaos: undisturbed run from {fv.reference}: {reference['wall_s']:.0f} s")
    return reference
  _say(f"chaos: undisturbed run of {config.train.steps} steps x {config.learners.num} learners (the reference)")
  reference = run(workdir=workdir / "reference", events=[], reference=None)
  if not reference["finished"]:
    _say(f"chaos: the undisturbed run did not finish: {reference['failure']}")
    return None
  return reference

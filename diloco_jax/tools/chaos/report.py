"""A chaos report in words (`format_report`), as a timeline figure (`plot_timeline`) and, for several
reports, as a markdown table (`summary_table`)."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from diloco_jax import config as config_lib
from diloco_jax.tools.chaos.analysis import verdict
from diloco_jax.tools.chaos.schedule import KINDS


def format_report(config, report: dict) -> str:
  """The report in a few lines: finished, versions, stalls, restarts, contributions, goodput, checks."""
  c = report["contributions"]
  applied = ", ".join(f"{n} {k}" for k, n in report["faults_applied"].items() if n)
  lines = [f"chaos: {'finished' if report['finished'] else 'NOT finished (' + str(report['failure']) + ')'}; "
           f"{report['learners']} learners x {report['steps']} steps in {report['wall_s']:.0f} s; versions "
           f"{report['versions']} {'monotone' if report['versions_monotone'] else 'WENT BACKWARDS'}; faults: "
           f"{applied or 'none'}",
           f"  longest time without any version advancing: {report['longest_stall_s']:.2f} s outside syncer "
           f"outages ({report['longest_stall_raw_s']:.2f} s with them)"
           + (f"; undisturbed {report['reference']['longest_stall_s']:.2f} s, excess "
              f"{report['excess_stall_s']:.2f} s (bound: stall "
              f"{config_lib.resolve(config).outer.stall_s:g} s + one step "
              f"{report['step_time_s']:.3f} s)" if "reference" in report else "")]
  for n, o in enumerate(report["syncer_restarts"]):
    back = o["back_to_merging_s"]
    lines.append(f"  syncer restart {n + 1}: down {o['down_s'] or 0:.1f} s, back to merging "
                 + (f"{back:.1f} s after its process started" if back is not None else "NEVER"))
  lines.append(f"  contributions: {c['pushed']} pushed, {c['merged']} merged, rejected {c['rejected'] or 'none'}, "
               f"{c['rolled_back_by_crashes']} merged then rolled back and {c['dropped_by_crashes']} dropped "
               f"by crashes (pushed again: {report['steps_pushed_again']} steps); lost {c['lost']} (tokens short per "
               f"fragment {c['tokens_short_by_fragment']}, of which a killed learner's unpushed work may be "
               f"{c['tokens_short_permitted']:,})")
  if "reference" in report:
    ref = report["reference"]
    lines.append(f"  goodput {100 * report['goodput']:.1f}%: {report['merge_rate']:,.0f} tokens merged into the "
                 f"global model per provisioned learner-second ({report['provisioned_learner_s']:.0f} learner-s; "
                 f"{report['tokens_redone']:,} tokens trained twice not counted) vs {ref['merge_rate']:,.0f} "
                 f"undisturbed")
    if report["eval_loss"] is not None and ref["eval_loss"] is not None:
      lines.append(f"  eval loss {report['eval_loss']:.4f} vs undisturbed {ref['eval_loss']:.4f} "
                   f"({100 * (report['eval_loss_ratio'] - 1):+.2f}%)")
  checks = verdict(config, report)
  lines.append("  checks: " + ", ".join(f"{k} {'ok' if v else ('n/a' if v is None else 'FAILED')}"
                                        for k, v in checks.items()))
  return "\n".join(lines)


def plot_timeline(report: dict, path: pathlib.Path, num_fragments: int) -> None:
  """Learners alive (and stopped, dead, cut off), the syncer's outages, each fragment's version, and the
  events, against wall time."""
  import matplotlib  # noqa: PLC0415 - lazy: only this figure needs it (a second to import); --summarize and the text do not

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415 - after matplotlib.use, as above

  t0 = report["t_launch"]
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, gridspec_kw={"height_ratios": [1, 2]})
  colors = {"up": "tab:green", "stopped": "tab:orange", "dead": "tab:red", "cut off": "tab:purple"}
  learners = report["learners"]
  for i in range(learners):
    for start, end, state in report["learner_states"].get(str(i), report["learner_states"].get(i, [])):
      top.barh(i, end - start, left=start - t0, color=colors[state], height=0.6)
  for o in report["syncer_restarts"]:
    up = o["process_started"] or report["t_end"]
    top.barh(learners, up - o["down_at"], left=o["down_at"] - t0, color="tab:red", height=0.6)
    if o["first_merge"]:
      top.barh(learners, o["first_merge"] - up, left=up - t0, color="tab:gray", height=0.6)
  top.barh(learners, 0, left=0)
  top.set_yticks(range(learners + 1), [f"learner {i}" for i in range(learners)] + ["syncer"])
  top.legend(handles=[matplotlib.patches.Patch(color=c, label=s) for s, c in colors.items()]
             + [matplotlib.patches.Patch(color="tab:gray", label="syncer recovering")],
             loc="upper right", fontsize=7, ncol=5)
  times = [t - t0 for t, _ in report["timeline"]]
  for p in range(num_fragments):
    bottom.step(times, [v[p] for _, v in report["timeline"]], where="post", label=f"fragment {p}")
  for e in report["events"]:
    if e["kind"] in KINDS:
      for ax in (top, bottom):
        ax.axvline(e["t"] - t0, color="black", lw=0.6, ls="--")
      bottom.annotate(e["what"], (e["t"] - t0, 0), rotation=90, fontsize=6, va="bottom")
  bottom.set_xlabel("seconds since launch")
  bottom.set_ylabel("version")
  bottom.legend(loc="upper left", fontsize=8)
  top.set_title("chaos: " + ("finished" if report["finished"] else "not finished")
                + (f", goodput {100 * report['goodput']:.0f}%" if report.get("goodput") is not None else ""))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary_table(reports: Sequence[dict]) -> str:
  """A markdown table of several chaos reports (one row per report; `--summarize`)."""
  rows = ["| seed | finished | monotone | faults | longest stall: chaos / undisturbed / excess (s) | "
          "restarts back to merging (s) | contributions lost | goodput | eval loss vs undisturbed | checks |",
          "|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    faults = " ".join(f"{n}{k.replace('learner_', 'L-').replace('syncer_', 'S-')}"
                      for k, n in r["faults_applied"].items() if n)
    backs = ", ".join(f"{o['back_to_merging_s']:.1f}" if o["back_to_merging_s"] is not None else "never"
                      for o in r["syncer_restarts"])
    ref = r.get("reference", {})
    checks = r.get("checks", {})
    failed = [k for k, v in checks.items() if v is False]
    rows.append(
        f"| {r.get('seed', '-')} | {'yes' if r['finished'] else 'NO'} | {'yes' if r['versions_monotone'] else 'NO'} "
        f"| {faults} | {r['longest_stall_s']:.2f} / {ref.get('longest_stall_s', float('nan')):.2f} / "
        f"{r.get('excess_stall_s', float('nan')):+.2f} | {backs} | {r['contributions']['lost']} | "
        f"{100 * r['goodput']:.1f}% | {100 * (r['eval_loss_ratio'] - 1):+.2f}% | "
        f"{'all ok' if not failed else 'FAILED: ' + ', '.join(failed)} |")
  return "\n".join(rows)

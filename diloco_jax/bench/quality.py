"""`python -m diloco_jax bench quality --config configs/small_cpu.py [--config.x=y]`

Trains, in one run and on the same token budget (same steps x global batch), the data-parallel baseline
and Decoupled DiLoCo (by default M=4 learners, int4 outer gradients, the config's H and P), then prints
both final eval losses (on the same held-out batches) and their ratio, and the bytes each moved per
worker and their ratio. Data-parallel bytes: a ring all-reduce of fp32 gradients every step,
2 (n-1)/n x gradient bytes per worker. DiLoCo bytes: what each learner sent and received (payloads).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

from absl import flags

from diloco_jax import baseline
from diloco_jax import cli
from diloco_jax import inprocess


def _flags(fv):
  flags.DEFINE_string("workdir", "runs/bench_quality", "Scratch directory (emptied first).", flag_values=fv)
  flags.DEFINE_bool("json", False, "Print the result as JSON.", flag_values=fv)


def main(argv) -> int:
  fv = cli.parse(argv, _flags, doc=__doc__)
  config = fv.config
  # The DiLoCo run's devices, which the baseline uses all of (its evaluator shares the first learner's).
  available = len(cli.devices(config.learners.num * config.learners.devices, "bench quality"))
  cli.validated(config, available, learners=True)
  cli.validated(config, available, learners=False)
  root = pathlib.Path(fv.workdir)
  shutil.rmtree(root, ignore_errors=True)
  print(f"bench quality: data-parallel, then Decoupled DiLoCo (M={config.learners.num}, "
        f"codec {config.outer.codec}/{config.outer.downlink_codec}, H={config.outer.sync_every}, "
        f"P={config.outer.num_fragments}, outer lr {config.outer.lr}, K={config.outer.min_quorum or 'all'}), "
        f"{config.train.steps} steps x {config.data.global_batch} sequences each", file=sys.stderr)
  dp = baseline.run(config, str(root / "dp"))
  dl = inprocess.run(config, str(root / "diloco"))
  result = {
      "dp_eval_loss": dp["final_eval_loss"], "diloco_eval_loss": dl["final_eval_loss"],
      "loss_ratio": dl["final_eval_loss"] / dp["final_eval_loss"],
      "dp_bytes_per_worker": dp["comm_bytes"], "diloco_bytes_per_learner": dl["comm_bytes"],
      "bytes_ratio": dp["comm_bytes"] / max(dl["comm_bytes"], 1),
      "tokens": dp["tokens"], "diloco_tokens": dl["tokens"], "outer_rounds": dl["outer_rounds"],
      "dp_wall_s": dp["wall_s"], "diloco_wall_s": dl["wall_s"],
      "config": {"H": config.outer.sync_every, "P": config.outer.num_fragments, "M": config.learners.num,
                 "outer_lr": config.outer.lr, "outer_momentum": config.outer.momentum,
                 "codec": config.outer.codec, "downlink_codec": config.outer.downlink_codec,
                 "min_quorum": config.outer.min_quorum, "tau": config.outer.tau, "steps": config.train.steps},
  }
  if fv.json:
    print(json.dumps(result, indent=2))
  else:
    print(f"\n{'':24}{'data-parallel':>16}{'Decoupled DiLoCo':>18}{'ratio':>10}")
    print(f"{'final eval loss':24}{dp['final_eval_loss']:>16.4f}{dl['final_eval_loss']:>18.4f}"
          f"{result['loss_ratio']:>10.4f}")
    print(f"{'bytes per worker':24}{dp['comm_bytes']:>16,.0f}{dl['comm_bytes']:>18,.0f}"
          f"{result['bytes_ratio']:>9.1f}x")
    print(f"{'tokens':24}{dp['tokens']:>16,}{dl['tokens']:>18,}")
    print(f"{'wall s':24}{dp['wall_s']:>16.1f}{dl['wall_s']:>18.1f}")
    goal_loss, goal_bytes = result["loss_ratio"] <= 1.03, result["bytes_ratio"] >= 100
    print(f"\ngoal: eval loss within 3% ({'met' if goal_loss else 'NOT met'}), "
          f">= 100x fewer bytes ({'met' if goal_bytes else 'NOT met'})")
  return 0

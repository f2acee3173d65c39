"""`python -m diloco_jax sim syncer [flags]`: the syncer's memory, ingest rate and shard count for each
shipped config and several M.

Examples:
  python -m diloco_jax sim syncer                                  # configs/*.py, M = 2,4,8, 1 s/step
  python -m diloco_jax sim syncer --configs configs/b12.py --learners 8,16 --step-s 0.5 --shards 4
  python -m diloco_jax sim syncer --merge-rate 150e6 --json        # the merge rate before the fused path
  python -m diloco_jax sim syncer --bench-syncer runs/bench/figures.json   # merge rates of `make bench`

For each config and M: the parameters the syncer must absorb per second and the merge cores that takes at
the merge rate per core (`--merge-rate`; else `--bench-syncer`'s; else measured here by `bench syncer`);
its peak memory as one process, per shard and in total with --shards shards; and the fewest shards that
keep up and fit (each shard's estimate x 1.25 + 4 GB within --host-memory-gb). The columns in full:
docs/simulator.md, "6. The syncer at scale"; formulas: `diloco_jax/tools/sim/syncer.py`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib

from diloco_jax import cli
from diloco_jax.tools.bench import syncer as bench_syncer
from diloco_jax.tools.sim import args, sizing, syncer
from diloco_jax.tools.sim.args import numbers

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[3] / "configs"
MEASURE_PARAMS = 1 << 22  # the fragment `bench syncer` merges when no rate is given (a few seconds)


def shipped_configs() -> list[str]:
  """The repository's configs/*.py, sorted by name."""
  return [str(p) for p in sorted(CONFIG_DIR.glob("*.py")) if p.name != "__init__.py"]


def load_config(path: str):
  """`get_config()` of a config file; a missing or broken file is a usage error naming --configs."""
  file = pathlib.Path(path)
  if not file.is_file():
    raise cli.UsageError(f"--configs: no config file {path!r}")
  spec = importlib.util.spec_from_file_location(f"_sim_syncer_{file.stem}", file)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    config = module.get_config()
  except Exception as e:  # a config file is user code: any failure is a bad --configs entry
    raise cli.UsageError(f"--configs: {path} did not give a config ({type(e).__name__}: {e})") from None
  cli.validated(config, None, learners=True, data=False)
  return config  # as configured, not resolved: the table derives its rows for other hosts and learner counts


def setup_of(config) -> syncer.Setup:
  o = config.outer
  return syncer.Setup(sizes=sizing.fragment_sizes(config), sync_every=o.sync_every, codec=o.codec,
                      downlink_codec=o.downlink_codec, block=o.codec_block, max_in_flight=sizing.in_flight(config),
                      downlink_history=sizing.downlink_history(config, config.learners.num))


def rows_for(name: str, config, setup: syncer.Setup, learners: list[int], step_s: float, shards: int,
             merge_rate: float, cores: int, host_bytes: int) -> list[dict]:
  """One row per M for `config` (whose `setup_of` is `setup`): everything the table prints, as plain values.
  `merge_rate`: parameters per second per core."""
  rate = merge_rate
  threads = syncer.merge_threads(config.syncer.merge_threads, cores)
  params = sum(setup.sizes)
  rows = []
  for m in learners:
    ingest = syncer.ingest_rate(params, m, setup.sync_every, step_s)
    at = None
    if shards <= len(setup.sizes):
      layout = syncer.shard_layout(setup, m, shards, step_s)
      at = {"shards": shards, "layout": layout, "per_shard": max(x["memory"]["total"] for x in layout),
            "total": sum(x["memory"]["total"] for x in layout)}
    needed = syncer.shards_needed(setup, m, step_s, threads * rate, host_bytes)
    there = None
    if needed["shards"] is not None:
      there = max(x["memory"]["total"] for x in syncer.shard_layout(setup, m, needed["shards"], step_s))
    rows.append({
        "config": name, "params": params, "fragment_sizes": list(setup.sizes), "sync_every": setup.sync_every,
        "codec": setup.codec, "downlink_codec": setup.downlink_codec, "max_in_flight": setup.max_in_flight,
        "learners": m, "step_s": step_s, "window_s": setup.sync_every / len(setup.sizes) * step_s,
        "ingest_params_per_s": ingest, "merge_rate_per_core": rate, "merge_threads": threads,
        "cores_busy": ingest / rate, "memory_one_process": setup.memory(setup.sizes, m), "at_shards": at,
        "shards_needed": needed, "per_shard_at_needed": there,
        "fragment_memory": [setup.fragment_memory(n) for n in setup.sizes],
    })
  return rows


def _gb(n: float) -> str:
  return f"{n / 1e9:,.1f}"


def _bytes(n: float) -> str:
  for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
    if n >= scale:
      return f"{n / scale:,.1f} {unit}"
  return f"{n:.0f} B"


def _params(n: float) -> str:
  for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
    if n >= scale:
      return f"{n / scale:.1f}{unit}"
  return f"{n:.0f}"


def format_table(rows: list[dict], shards: int, step_s: float, cores: int, host_bytes: int) -> str:
  head = (f"{'config':<10} {'params':>7} {'P':>2} {'H':>4} {'down':>5} {'M':>3} {'ingest/s':>8} {'merge cores':>11} "
          f"{'1 process':>10} {f'{shards} shards: each / total':>24} {'shards: rate mem both':>22} {'each there':>11}")
  lines = [f"The syncer at {step_s:g} s/step; a shard host: {cores} cores, {host_bytes / 1e9:g} GB (memory in GB).",
           head]
  for r in rows:
    at = r["at_shards"]
    at_text = "n/a (> P)" if at is None else f"{_gb(at['per_shard'])} / {_gb(at['total'])}"
    need = r["shards_needed"]
    need_text = " ".join(f"{'-' if need[k] is None else need[k]:>4}" for k in ("rate", "memory", "shards"))
    there = "-" if r["per_shard_at_needed"] is None else _gb(r["per_shard_at_needed"])
    lines.append(f"{r['config']:<10} {_params(r['params']):>7} {len(r['fragment_sizes']):>2} {r['sync_every']:>4} "
                 f"{r['downlink_codec']:>5} {r['learners']:>3} {_params(r['ingest_params_per_s']):>8} "
                 f"{r['cores_busy']:>11.2f} {_gb(r['memory_one_process']['total']):>10} {at_text:>24} "
                 f"{need_text:>22} {there:>11}")
  lines += [
      "",
      "ingest/s: parameters the syncer absorbs per second, M x params / (H x step); merge cores: the cores that",
      "takes at the merge rate per core (`bench syncer`). 1 process: the peak memory estimate of today's syncer",
      "(`sim sizing`). The shard columns: a sharded syncer (`syncer --shard I --shards S`) of S processes,",
      "whole fragments per shard balanced by bytes, each shard a process with its own open rounds and",
      "checkpoint copies. shards: the fewest that keep up (every shard's ingest within its merge threads x the",
      "rate), fit (estimate x 1.25 + 4 GB within the host), and both ('-': not even with one fragment per",
      "shard); each there: a shard's peak estimate at that count.",
      "",
      "Per fragment (the largest), held by the syncer:",
  ]
  seen = set()
  for r in rows:
    if r["config"] in seen:
      continue
    seen.add(r["config"])
    p = max(range(len(r["fragment_sizes"])), key=lambda i: r["fragment_sizes"][i])
    f = r["fragment_memory"][p]
    reference = _bytes(f["reference"]) if f["reference"] else "0 (fp32 downlink: the global itself)"
    delta = f", latest delta {_bytes(f['latest_delta'])} ({r['downlink_codec']})" if f["latest_delta"] else ""
    lines.append(f"  {r['config']} ({_params(r['fragment_sizes'][p])} of {_params(r['params'])} params): global "
                 f"{_bytes(f['global'])}, momentum {_bytes(f['momentum'])}, downlink reference {reference}, "
                 f"cached full answer {_bytes(f['full_answer'])}{delta}; an open round buffers up to M pushes of "
                 f"{_bytes(f['push'])} ({r['codec']})")
  return "\n".join(lines)


def read_merge_rates(path: str) -> dict[str, float]:
  """`syncer.merge_rates` of a `bench syncer --json` file or of `make bench`'s figures (its syncer runs)."""
  try:
    doc = json.loads(pathlib.Path(path).read_text())
    if "benches" in doc:  # `bench suite`'s figures: every syncer run's raw result
      results = [r["raw"] for name, b in doc["benches"].items() if name.startswith("syncer")
                 for r in b["runs"] if "raw" in r]
    else:
      results = [doc]
    return syncer.merge_rates(results)
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise cli.UsageError(f"--bench-syncer: {path} holds no `bench syncer` result ({type(e).__name__}: {e})") from None


def measured_merge_rate(downlink_codec: str, known: dict[str, float]) -> float:
  """The merge rate per core for `downlink_codec`: from `known` (filled as measured), else `bench syncer`
  now, on a `MEASURE_PARAMS` fragment, fused, 1 thread (int4 pushes; int4 for a quantized downlink)."""
  cls = syncer.downlink_class(downlink_codec)
  if cls not in known:
    down = "fp32" if cls == "fp32" else "int4"
    result = bench_syncer.run(MEASURE_PARAMS, 4, "int4", down, rounds=3, threads=(1,), unfused=False)
    known.update({cls: syncer.merge_rates([result])[cls]})
  return known[cls]


def sim_syncer(argv) -> int:
  fv = cli.parse(argv, args.sim_syncer, doc=__doc__, config=False)
  learners = numbers(fv, "learners", int)
  if not learners or min(learners) < 1:
    raise cli.UsageError(f"--learners must be integers >= 1, got {','.join(fv.learners)!r}")
  step_s, rate, cores, host_gb = fv["step-s"].value, fv["merge-rate"].value, fv["cores-per-shard"].value, \
      fv["host-memory-gb"].value
  for name, value, ok in (("step-s", step_s, step_s > 0), ("merge-rate", rate, rate >= 0),
                          ("cores-per-shard", cores, cores >= 1), ("host-memory-gb", host_gb, host_gb > 0),
                          ("shards", fv.shards, fv.shards >= 1)):
    if not (ok and math.isfinite(value)):
      raise cli.UsageError(f"--{name} must be {'>= 0' if name == 'merge-rate' else '> 0'} and finite, got {value}")
  host_bytes = int(host_gb * 1e9)
  configs = []
  for path in fv.configs or shipped_configs():
    config = load_config(path)
    configs.append((pathlib.Path(path).stem, config, setup_of(config)))
  rates = read_merge_rates(fv["bench-syncer"].value) if fv["bench-syncer"].value else {}
  rows = []
  for name, config, setup in sorted(configs, key=lambda c: sum(c[2].sizes)):  # the smallest model first
    rate_here = rate or measured_merge_rate(setup.downlink_codec, rates)
    rows += rows_for(name, config, setup, learners, step_s, fv.shards, rate_here, cores, host_bytes)
  if fv.json:
    print(json.dumps({"rows": rows, "cores_per_shard": cores, "host_bytes": host_bytes}, indent=2))
  else:
    print(format_table(rows, fv.shards, step_s, cores, host_bytes))
  return 0

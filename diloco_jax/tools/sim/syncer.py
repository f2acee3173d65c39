"""The syncer at scale: its memory per fragment and per shard, the parameters it must absorb per second at
a config's schedule, and the number of shards that keeps up. Pure functions of the fragment sizes and a few
figures; `python -m diloco_jax sim syncer` (`tools/sim/syncer_cli.py`) prints them for the shipped configs.

Memory is `sizing.fragment_memory` per fragment and `sizing.syncer_memory` per process; shards get whole
fragments balanced by size, as the sharded syncer places them (`placement.assign_shards`, `shard_layout`).
Ingest: each of M learners pushes every fragment once per H inner steps (`ingest_rate`). A shard keeps up
when its ingest is at most its merge threads x the merge rate per core (`merge_rates`), and fits
its host when its peak estimate x `HEADROOM` + `OS_BYTES` does, the rule `launch/tpu/create.sh` sizes the
syncer VM with; `shards_needed` is the smallest S <= P for which every shard does both. docs/simulator.md,
"6. The syncer at scale".
"""

from __future__ import annotations

import dataclasses

from diloco_jax.outer import chunked
from diloco_jax.outer.placement import assign_shards
from diloco_jax.tools.sim import sizing

HEADROOM = 1.25  # launch/tpu/create.sh: a syncer host holds its estimate with 25% headroom ...
OS_BYTES = 4 * 10**9  # ... plus 4 GB for the operating system


def downlink_class(downlink_codec: str) -> str:
  """fp32, or quantized (int8, int4, bf16: `bench syncer` measures one quantized downlink for all)."""
  return "fp32" if downlink_codec == "fp32" else "quantized"


def merge_rates(results) -> dict[str, float]:
  """{downlink class: parameters absorbed per second per core} from `bench syncer --json` results: the
  fused path on 1 thread, the lowest over the results of one class."""
  rates: dict[str, float] = {}
  for result in results:
    fused = [r["params_per_cpu_s"] for r in result["rows"] if r["path"] == "fused" and r["threads"] == 1]
    if fused:
      cls = downlink_class(result["downlink_codec"])
      rates[cls] = min([rates.get(cls, float("inf")), *fused])
  return rates


def merge_threads(config_threads: int, cores: int) -> int:
  """The threads of a syncer's merges on a host of `cores` cores: `syncer.merge_threads`, or with 0 the
  cores up to `chunked.DEFAULT_THREAD_LIMIT` (what `config.resolve` takes), never more than
  the cores."""
  return min(config_threads or chunked.DEFAULT_THREAD_LIMIT, cores)


def host_bytes_needed(peak_bytes: int) -> int:
  """The host memory a syncer process of peak estimate `peak_bytes` needs (create.sh's rule)."""
  return int(peak_bytes * HEADROOM) + OS_BYTES


def ingest_rate(params: int, learners: int, sync_every: int, step_s: float) -> float:
  """Parameters absorbed per second: every H inner steps each of M learners pushes every fragment once,
  M x params per H x step_s seconds."""
  return learners * params / (sync_every * step_s)


@dataclasses.dataclass(frozen=True)
class Setup:
  """One config's syncer as the sizing sees it."""

  sizes: tuple[int, ...]  # elements per fragment
  sync_every: int  # H
  codec: str  # uplink
  downlink_codec: str
  block: int
  max_in_flight: int  # per learner (`schedule.in_flight_limit`)
  downlink_history: int = 1  # references kept per fragment with a lossy downlink

  def fragment_memory(self, n: int) -> dict[str, int]:
    return sizing.fragment_memory(n, codec=self.codec, downlink_codec=self.downlink_codec, block=self.block,
                                  downlink_history=self.downlink_history)

  def memory(self, sizes, learners: int) -> dict[str, int]:
    return sizing.syncer_memory(sizes, learners, codec=self.codec, downlink_codec=self.downlink_codec,
                                block=self.block, max_in_flight=self.max_in_flight,
                                downlink_history=self.downlink_history)


def shard_layout(setup: Setup, learners: int, shards: int, step_s: float) -> list[dict]:
  """Per shard: its fragments, parameters, ingest (params/s) and memory (`sizing.syncer_memory` parts). The
  fragments are placed as the sharded syncer places them (`placement.assign_shards`: largest first, each to
  the shard holding the fewest so far), weighed by the bytes each keeps resident; a shard is one syncer
  process on its own host."""
  held = [setup.fragment_memory(n) for n in setup.sizes]
  weights = [sum(v for k, v in f.items() if k != "push") for f in held]  # bytes a fragment keeps resident
  out = []
  for owned in assign_shards(weights, shards):
    sizes = [setup.sizes[p] for p in owned]
    out.append({"fragments": owned, "params": sum(sizes),
                "ingest": ingest_rate(sum(sizes), learners, setup.sync_every, step_s),
                "memory": setup.memory(sizes, learners)})
  return out


def shards_needed(setup: Setup, learners: int, step_s: float, shard_rate: float, host_bytes: int) -> dict:
  """The smallest shard counts (1..P) at which the busiest shard keeps up (`rate`: ingest <= `shard_rate`,
  its merge threads x the merge rate per core), the largest fits its host (`memory`), and both (`shards`);
  None where no count up to P does."""
  found = {"rate": None, "memory": None, "shards": None}
  for s in range(1, len(setup.sizes) + 1):
    layout = shard_layout(setup, learners, s, step_s)
    rate_ok = max(x["ingest"] for x in layout) <= shard_rate
    memory_ok = max(host_bytes_needed(x["memory"]["total"]) for x in layout) <= host_bytes
    for key, ok in (("rate", rate_ok), ("memory", memory_ok), ("shards", rate_ok and memory_ok)):
      if ok and found[key] is None:
        found[key] = s
  return found

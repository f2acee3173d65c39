"""What a run needs from its machines: the syncer's memory and disk, and the bytes each learner moves.

    python -m diloco_jax sim sizing --config configs/b1.py --learners 8 [--step-s 1.2] [--json]

The syncer keeps, in float32 vectors of the model's size S (4S bytes each), the global fragments, their
Nesterov momentum, the downlink references (lossy downlink only) and the cached fp32 answer to full pulls;
pushed contributions wait in open rounds as they arrived, and transients (a checkpoint, a resume, the
fresh start) come on top, measured on a real syncer process (`syncer_memory`: the model and its
measurements). The learner's state per chip and the bytes per outer period come beside it.

Pure functions of the fragment sizes; `fragment_sizes` gets those from the model's abstract shapes (no
parameters are materialized). docs/simulator.md, "5. Machine sizing".
"""

from __future__ import annotations

import json

from diloco_jax import cli, command_flags
from diloco_jax import config as config_lib
from diloco_jax.compute import mesh as mesh_lib
from diloco_jax.compute import model
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import fragments
from diloco_jax.tools.sim import hbm

PROCESS_BYTES = 600 * 2**20  # a syncer process with nothing loaded (measured ~520 MiB, rounded up)
# Extra copies of the checkpointed vectors while a checkpoint is written (3 measured, one removed since).
CHECKPOINT_COPIES = 2
RESUME_COPIES = 2  # extra copies of the checkpointed vectors while a checkpoint is restored (measured)
START_COPIES = 2  # extra model-sized vectors while the initial parameters are built (measured)
MERGE_TEMPORARIES = 0  # fragment-sized float32 temporaries of one merge + outer step (chunked, in place)


def fragment_sizes(config) -> tuple[int, ...]:
  """Elements per fragment of `config`'s model under its fragment plan, from abstract shapes only."""
  o = config.outer
  plan = fragments.make_plan(model.abstract_params(config.model), o.num_fragments, o.sync_every, o.fragment_plan)
  return tuple(plan.size(p) for p in range(plan.num_fragments))


def fragment_memory(n: int, *, codec: str, downlink_codec: str, block: int,
                    downlink_history: int = 1) -> dict[str, int]:
  """Bytes the syncer holds for one fragment of `n` elements (`syncer/core.py`, `syncer/downlink.py`): the
  fp32 global and its Nesterov momentum; the downlink references (their own fp32
  copies only with a lossy `downlink_codec`, one per version of the last `downlink_history` plus a spare
  when that is more than one: with fp32 the reference is the global array itself) and their deltas (lossy
  downlink only); the cached fp32 answer to full pulls; and `push`, one learner's contribution as an open
  round buffers it (the payload as it arrived, in the uplink `codec`)."""
  delta_downlink = downlink_codec != "fp32"
  references = downlink_history + (downlink_history > 1) if delta_downlink else 0
  return {
      "global": 4 * n,
      "momentum": 4 * n,
      "reference": references * 4 * n,
      "full_answer": 4 * n,
      "latest_delta": downlink_history * codec_lib.encoded_size(n, downlink_codec, block) if delta_downlink else 0,
      "push": codec_lib.encoded_size(n, codec, block),
  }


def syncer_memory(sizes, learners: int, *, codec: str, downlink_codec: str, block: int,
                  max_in_flight: int, downlink_history: int = 1) -> dict[str, int]:
  """Bytes of the memory of a syncer process that owns fragments of `sizes` elements, by part, and `total`
  (the peak estimate). `downlink_history`: `fragment_memory`.

  The syncer (`syncer/core.py`) keeps, in float32 vectors of the model's size S (4S bytes each): the global
  fragments, their Nesterov momentum (which also holds the pending sum of partial rounds under a quorum
  K < M: no extra vector), the downlink references (only with a lossy `outer.downlink_codec`: one per
  version of the last `outer.downlink_history`, plus a spare when it keeps more than one; with fp32 the
  reference is the global fragment itself) and the cached fp32 answer to full pulls (joins, restarts).
  Pushed contributions wait in open rounds as they arrived (encoded, `outer.codec`); a learner has at most
  `outer.max_in_flight` fragments pushed and not yet adopted (0: the schedule's need,
  `schedule.in_flight_limit`), so at most M x min(max_in_flight, P) of them, each at most the largest
  fragment. Transients come on top, measured on a real syncer process (134.5M parameters, fp32 and int8
  downlinks, the commands in docs/tpu.md): a checkpoint held three extra copies of the checkpointed vectors
  (the state dict's copy, the save's copy, the writer's buffers; the save's copy is gone since, so two, not
  re-measured), a resume two, the fresh start two vectors of S; the process itself (Python, jax, gRPC,
  orbax) takes ~0.5 GiB. A round's merge, outer step and downlink encode work in place in cache-sized
  chunks (`outer.apply_round`, `codec.encode_residual`): no fragment-sized temporaries."""
  held = [fragment_memory(n, codec=codec, downlink_codec=downlink_codec, block=block,
                          downlink_history=downlink_history) for n in sizes]
  total_of = lambda key: sum(f[key] for f in held)
  model_bytes = 4 * sum(sizes)
  largest = 4 * max(sizes)
  vectors = 3 if downlink_codec != "fp32" else 2  # global, momentum (+ reference): what a checkpoint holds
  waiting = learners * min(max_in_flight, len(sizes))
  largest_push = max(f["push"] for f in held)
  parts = {
      "process": PROCESS_BYTES,
      "global": total_of("global"),
      "momentum": total_of("momentum"),
      "reference": total_of("reference"),
      "full_answer": total_of("full_answer"),
      "latest_deltas": total_of("latest_delta"),
      "open_rounds": waiting * largest_push,
      "pushes_receiving": waiting * largest_push,
      "checkpoint_transient": CHECKPOINT_COPIES * vectors * model_bytes,
      "merge_transient": MERGE_TEMPORARIES * largest,
      "resume_transient": RESUME_COPIES * vectors * model_bytes,
      "start_transient": START_COPIES * model_bytes,
  }
  resident = sum(parts[k] for k in ("process", "global", "momentum", "reference", "full_answer", "latest_deltas"))
  serving = parts["open_rounds"] + parts["pushes_receiving"] + parts["checkpoint_transient"] + parts["merge_transient"]
  # Resume and start happen before any learner pushes: their transients do not meet open rounds.
  parts["total"] = resident + max(serving, parts["resume_transient"], parts["start_transient"])
  parts["checkpoint_bytes"] = vectors * model_bytes + parts["latest_deltas"] // downlink_history
  return parts


def syncer_memory_bytes(config, learners: int | None = None) -> int:
  """The syncer's peak memory estimate in bytes for `config` with `learners` learners (default: config's)."""
  return _syncer_parts(config, fragment_sizes(config), learners)["total"]


def _syncer_parts(config, sizes, learners: int | None) -> dict[str, int]:
  o = config.outer
  learners = learners or config.learners.num
  return syncer_memory(sizes, learners, codec=o.codec, downlink_codec=o.get("downlink_codec", "fp32"),
                       block=o.codec_block, max_in_flight=in_flight(config),
                       downlink_history=downlink_history(config, learners))


def downlink_history(config, learners: int) -> int:
  """Downlink references the syncer keeps per fragment: `outer.downlink_history`, 0 = 2 x `learners`."""
  return config.outer.get("downlink_history", 0) or 2 * learners


def in_flight(config) -> int:
  """Fragments a learner of `config` may have pushed and not yet adopted (`outer.max_in_flight` resolved)."""
  return config_lib.resolve(config).outer.max_in_flight


def syncer_disk_bytes(config, sizes) -> int:
  """Disk under the syncer's workdir: `syncer.keep_checkpoints` steps plus one being written, plus one
  params-only export (fp32)."""
  one = _syncer_parts(config, sizes, None)["checkpoint_bytes"]
  return (config.syncer.keep_checkpoints + 1) * one + 4 * sum(sizes)


def traffic_per_period(sizes, *, codec: str, downlink_codec: str, block: int) -> tuple[int, int]:
  """(uplink, downlink) payload bytes of one learner per outer period (H inner steps: every fragment once).
  The syncer moves M times both; a (re)joining learner also pulls the whole model in fp32 (4S) once."""
  up = sum(codec_lib.encoded_size(n, codec, block) for n in sizes)
  down = sum(codec_lib.encoded_size(n, downlink_codec, block) for n in sizes)
  return up, down


def learner_memory(config, sizes) -> dict[str, int]:
  """Per chip: the learner's persistent state (float32 parameters, the adopted base, AdamW's two moments)
  divided over the parameter-sharding axes (fsdp x tensor), activations not included (`hbm.learner_hbm`
  has every part); host: the bound on the outer loop's host buffers, (max_in_flight + 1) x the largest
  fragment in fp32."""
  axes = mesh_lib.resolve_axis_sizes(mesh_lib.mesh_axes_from_config(config), config.learners.devices)
  shards = axes["fsdp"] * axes["tensor"]
  return {"state_bytes_per_chip": 16 * sum(sizes) // shards, "parameter_shards": shards,
          "host_bytes": (in_flight(config) + 1) * 4 * max(sizes)}


def sizing(config, learners: int | None = None, step_s: float = 0.0, accelerators=()) -> dict:
  """Everything `python -m diloco_jax sim sizing` prints, as plain values; `accelerators`: the slices to
  size a learner's device memory on (`hbm.for_slice`)."""
  sizes = fragment_sizes(config)
  o = config.outer
  m = learners or config.learners.num
  up, down = traffic_per_period(sizes, codec=o.codec, downlink_codec=o.get("downlink_codec", "fp32"),
                                block=o.codec_block)
  out = {
      "params": sum(sizes), "fragment_sizes": list(sizes), "learners": m, "sync_every": o.sync_every,
      "syncer": _syncer_parts(config, sizes, m), "syncer_disk_bytes": syncer_disk_bytes(config, sizes),
      "learner": learner_memory(config, sizes),
      "learner_hbm": [hbm.for_slice(config, sizes, a) for a in accelerators],
      "traffic": {"up_bytes_per_period": up, "down_bytes_per_period": down, "join_bytes": 4 * sum(sizes)},
  }
  if step_s > 0:
    period = o.sync_every * step_s
    out["traffic"]["step_s"] = step_s
    out["traffic"]["learner_gbps"] = {"up": 8 * up / period / 1e9, "down": 8 * down / period / 1e9}
    out["traffic"]["syncer_gbps"] = {"in": 8 * m * up / period / 1e9, "out": 8 * m * down / period / 1e9}
  return out


def _gb(n: int) -> str:
  return f"{n / 1e9:,.1f} GB"


def format_sizing(s: dict, config) -> str:
  """The human-readable report of `sizing`."""
  sy, o, t = s["syncer"], config.outer, s["traffic"]
  lines = [
      f"{s['params'] / 1e6:,.1f}M parameters in {len(s['fragment_sizes'])} fragments (largest "
      f"{max(s['fragment_sizes']) / 1e6:,.1f}M), {s['learners']} learners, H={s['sync_every']}, uplink "
      f"{o.codec}, downlink {o.get('downlink_codec', 'fp32')}, max_in_flight {in_flight(config)}",
      f"syncer memory, peak estimate: {_gb(sy['total'])}",
  ]
  for key, what in (("process", "process (Python, jax, gRPC, orbax)"), ("global", "global fragments (fp32)"),
                    ("momentum", "Nesterov momentum (fp32)"), ("reference", "downlink references (fp32)"),
                    ("full_answer", "cached full answer (fp32)"), ("latest_deltas", "latest downlink deltas"),
                    ("open_rounds", "open rounds (pushes as they arrived)"),
                    ("pushes_receiving", "pushes being received"),
                    ("checkpoint_transient", "while a checkpoint is written"),
                    ("merge_transient", "during a merge"), ("resume_transient", "while resuming (no rounds open)"),
                    ("start_transient", "at a fresh start (no rounds open)")):
    lines.append(f"  {what:<40} {_gb(sy[key]):>12}")
  lines.append(f"syncer disk (checkpoints kept + one in progress + an export): {_gb(s['syncer_disk_bytes'])}")
  lines.append(f"per learner and outer period: up {_gb(t['up_bytes_per_period'])}, down "
               f"{_gb(t['down_bytes_per_period'])}; a join pulls {_gb(t['join_bytes'])}; the syncer moves "
               f"{s['learners']}x")
  if "learner_gbps" in t:
    lines.append(f"at {t['step_s']:g} s/step: per learner up {t['learner_gbps']['up']:.2f} Gbit/s, down "
                 f"{t['learner_gbps']['down']:.2f} Gbit/s; syncer in {t['syncer_gbps']['in']:.2f}, out "
                 f"{t['syncer_gbps']['out']:.2f} Gbit/s (averages over an outer period)")
  ln = s["learner"]
  lines.append(f"learner state per chip ({ln['parameter_shards']}-way parameter sharding, activations not "
               f"included): {_gb(ln['state_bytes_per_chip'])}; host buffers of the outer loop <= "
               f"{_gb(ln['host_bytes'])}")
  lines += hbm.format_slices(s["learner_hbm"])
  return "\n".join(lines)


def sim_sizing(argv) -> int:
  """`python -m diloco_jax sim sizing --config CFG [--learners M] [--step-s S] [--json]`."""
  fv = cli.parse(argv, command_flags.sim_sizing, doc=__doc__)
  if fv.learners < 0 or fv["step-s"].value < 0:
    raise cli.UsageError("--learners and --step-s must be >= 0")
  config = fv.config  # as configured, not resolved: sizing derives its figures for --learners learners
  cli.validated(config, None, learners=True, data=False)  # sizing reads no data (create.sh runs it here)
  try:
    accelerators = fv.accelerators or hbm.default_slices(config, fv["config"].config_filename)
    for a in accelerators:
      hbm.parse_slice(a)
  except ValueError as e:
    raise cli.UsageError(f"--accelerators: {e}") from e
  s = sizing(config, fv.learners or None, fv["step-s"].value, accelerators)
  print(json.dumps(s, indent=2) if fv.json else format_sizing(s, config))
  return 0


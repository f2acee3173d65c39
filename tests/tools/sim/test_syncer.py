"""sim/syncer.py and `sim syncer`: the syncer's memory per fragment and per shard, its ingest rate and the
shard count that keeps up, against hand-computed values for tiny_cpu and real figures for b12."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest

import helpers
from diloco_jax import commands
from diloco_jax.tools.sim import sizing, syncer, syncer_cli

REPO = helpers.REPO
P = sizing.PROCESS_BYTES
TINY, SMALL = str(REPO / "configs" / "tiny_cpu.py"), str(REPO / "configs" / "small_cpu.py")


def _config(name: str):
  return syncer_cli.load_config(str(REPO / "configs" / f"{name}.py"))


@pytest.fixture(scope="module")
def tiny():
  # tiny_cpu's syncer with one downlink reference: the figures below by hand; its shipped downlink history
  # in `test_tiny_cpu_downlink_history_by_hand`.
  return dataclasses.replace(syncer_cli.setup_of(_config("tiny_cpu")), downlink_history=1)


def test_tiny_cpu_downlink_history_by_hand():
  shipped = syncer_cli.setup_of(_config("tiny_cpu"))
  # int4 downlink, history 2 M = 8: eight references and a spare, eight deltas; a checkpoint keeps the latest.
  assert shipped.downlink_history == 8
  f0 = shipped.fragment_memory(65_664)
  assert (f0["reference"], f0["latest_delta"]) == (9 * 262_656, 8 * 36_936)
  one = shipped.memory(shipped.sizes, 4)
  assert one["checkpoint_bytes"] == 3 * 460_032 + 36_936 + 27_756


def test_tiny_cpu_by_hand(tiny):
  # tiny_cpu's shapes: embed 256 x 64 = 16,384; per layer q 64x4x16 + k, v 64x2x16 + o 4x16x64 = 12,288,
  # SwiGLU 3 x 64 x 192 = 36,864, two norms of 64: 49,280; final norm 64. Strided plan over 2 layer groups:
  # fragment 0 = embed + layer 0 = 65,664, fragment 1 = layer 1 + final norm = 49,344.
  assert tiny.sizes == (65_664, 49_344) and sum(tiny.sizes) == 115_008
  assert (tiny.sync_every, tiny.codec, tiny.downlink_codec, tiny.block) == (10, "int4", "int4", 64)
  assert tiny.max_in_flight == 2  # ceil(tau P / H) + 1 = ceil(2 x 2 / 10) + 1
  # int4, 64-element blocks: 65,664 = 1,026 blocks -> 32,832 code bytes + 4,104 scale bytes = 36,936;
  # 49,344 = 771 blocks -> 24,672 + 3,084 = 27,756.
  f0, f1 = (tiny.fragment_memory(n) for n in tiny.sizes)
  assert f0 == {"global": 262_656, "momentum": 262_656, "reference": 262_656, "full_answer": 262_656,
                "latest_delta": 36_936, "push": 36_936}
  assert (f1["global"], f1["reference"], f1["latest_delta"], f1["push"]) == (197_376, 197_376, 27_756, 27_756)
  # One process, M = 4: resident = 4 vectors x 460,032 + both deltas (64,692); open rounds and pushes being
  # received: 4 learners x 2 in flight x 36,936 each; checkpoint copies 2 x 3 vectors x 460,032.
  one = tiny.memory(tiny.sizes, 4)
  assert (one["open_rounds"], one["pushes_receiving"], one["checkpoint_transient"]) == (295_488, 295_488, 2_760_192)
  assert one["total"] == P + 1_904_820 + 590_976 + 2_760_192
  # Two shards: one fragment each (the larger first). Shard 0: 4 x 262,656 + 36,936 resident, 4 x 1 in
  # flight x 36,936 twice, 6 x 262,656 checkpoint copies; shard 1 likewise with 49,344.
  layout = syncer.shard_layout(tiny, 4, 2, 0.5)
  assert [x["fragments"] for x in layout] == [[0], [1]]
  assert [x["memory"]["total"] for x in layout] == [P + 1_087_560 + 295_488 + 1_575_936,
                                                    P + 817_260 + 222_048 + 1_184_256]
  # Ingest at M = 4, H = 10, 0.5 s/step: 4 x 115,008 / 5 s; per shard 4 x 65,664 / 5 and 4 x 49,344 / 5.
  assert syncer.ingest_rate(115_008, 4, 10, 0.5) == pytest.approx(92_006.4)
  assert [x["ingest"] for x in layout] == pytest.approx([52_531.2, 39_475.2])


def test_shards_needed_by_hand(tiny):
  roomy = 10**12
  assert syncer.shards_needed(tiny, 4, 0.5, 100_000, roomy) == {"rate": 1, "memory": 1, "shards": 1}
  # 92,006 params/s do not fit one shard of 60,000; the busier of two takes 52,531.
  assert syncer.shards_needed(tiny, 4, 0.5, 60_000, roomy) == {"rate": 2, "memory": 1, "shards": 2}
  assert syncer.shards_needed(tiny, 4, 0.5, 50_000, roomy) == {"rate": None, "memory": 1, "shards": None}
  # A host that holds shard 0 (x 1.25 + 4 GB) but not the whole syncer.
  host = int((P + 2_958_984) * 1.25) + 4 * 10**9
  assert syncer.host_bytes_needed(P + 2_958_984) == host
  assert syncer.shards_needed(tiny, 4, 0.5, 100_000, host) == {"rate": 1, "memory": 2, "shards": 2}
  assert syncer.shards_needed(tiny, 4, 0.5, 100_000, host - 1)["memory"] is None


def test_assign_shards_balances_bytes_and_covers_every_fragment():
  # Largest first to the lighter shard: 9 -> A, 7 -> B, 5 -> B (12), 4 -> A (13), 3 -> B (15).
  assert syncer.assign_shards([5, 9, 4, 7, 3], 2) == [[1, 2], [0, 3, 4]]
  assert syncer.assign_shards([5, 9, 4, 7, 3], 1) == [[0, 1, 2, 3, 4]]
  assert syncer.assign_shards([5, 9, 4, 7, 3], 5) == [[1], [3], [0], [2], [4]]
  for bad in (0, 6):
    with pytest.raises(ValueError, match="shards"):
      syncer.assign_shards([5, 9, 4, 7, 3], bad)


def test_merge_threads_follow_the_runtime_default():
  assert syncer.merge_threads(0, 32) == 8  # syncer.merge_threads = 0: the cores, at most 8
  assert syncer.merge_threads(0, 4) == 4
  assert syncer.merge_threads(16, 32) == 16 and syncer.merge_threads(16, 4) == 4


def _bench_result(downlink, fused_rates):
  rows = [{"path": "unfused", "threads": 1, "params_per_cpu_s": 1.0}]
  rows += [{"path": "fused", "threads": t, "params_per_cpu_s": r} for t, r in fused_rates]
  return {"downlink_codec": downlink, "rows": rows}


def test_merge_rates_take_the_fused_single_thread_rate_per_downlink_class():
  results = [_bench_result("fp32", [(1, 700e6), (2, 1.3e9)]), _bench_result("fp32", [(1, 650e6)]),
             _bench_result("int4", [(1, 500e6)])]
  assert syncer.merge_rates(results) == {"fp32": 650e6, "quantized": 500e6}  # the lower of two runs
  assert syncer.downlink_class("int8") == syncer.downlink_class("bf16") == "quantized"


def _count(found):
  return math.inf if found is None else found


def test_shard_count_is_monotone_on_b12():
  b12 = syncer_cli.setup_of(_config("b12"))
  assert sum(b12.sizes) > 12e9 and len(b12.sizes) == 4
  rate = 8 * 743e6  # 8 merge threads at a measured fp32 rate per core
  host = 256 * 10**9
  # Faster steps: more shards for the rate, up to none at all (one fragment per shard is not enough).
  steps = [4.0, 1.0, 0.25, 0.1, 0.05, 0.02, 0.01]
  by_step = [_count(syncer.shards_needed(b12, 8, s, rate, host)["rate"]) for s in steps]
  assert by_step == sorted(by_step) and by_step[0] == 1 and by_step[-1] == math.inf and len(set(by_step)) >= 3
  # More learners: more shards for memory (open rounds and checkpoint copies per shard) and for the rate.
  ms = [1, 2, 4, 8, 16, 64]
  mem = [_count(syncer.shards_needed(b12, m, 1.0, rate, host)["memory"]) for m in ms]
  assert mem == sorted(mem) and len(set(mem)) >= 3
  both = [_count(syncer.shards_needed(b12, m, 0.1, rate, host)["shards"]) for m in ms]
  assert both == sorted(both)
  # A slower merge path: more shards.
  rates = [8e9, 4e9, 2e9, 1e9, 0.5e9]
  by_rate = [_count(syncer.shards_needed(b12, 8, 0.2, r, host)["rate"]) for r in rates]
  assert by_rate == sorted(by_rate) and len(set(by_rate)) >= 2
  # The count found is the fewest: the busiest shard keeps up there and not with one shard fewer.
  for s in steps[:4]:
    found = syncer.shards_needed(b12, 8, s, rate, host)["rate"]
    busiest = lambda n, s=s: max(x["ingest"] for x in syncer.shard_layout(b12, 8, n, s))
    assert busiest(found) <= rate and (found == 1 or busiest(found - 1) > rate)


def _run(args, capsys):
  rc = commands.main(["diloco_jax", "sim", "syncer", *args])
  return rc, capsys.readouterr()


def test_cli_json_and_table(capsys, tmp_path):
  measured = tmp_path / "bench_syncer.json"
  measured.write_text(json.dumps(_bench_result("int4", [(1, 512e6)])))
  rc, io = _run(["--configs", TINY, "--learners", "2,4", "--step-s", "0.5", "--json", "--bench-syncer",
                 str(measured)], capsys)
  rows = json.loads(io.out)["rows"]
  assert rc == 0 and [r["learners"] for r in rows] == [2, 4]
  r = rows[1]
  assert r["ingest_params_per_s"] == pytest.approx(92_006.4)
  # tiny_cpu as shipped (int4 downlink of history 2 M = 8): resident 12 vectors of 460,032 (global,
  # momentum, 9 references, full answer) + 8 x both deltas (64,692); open rounds and pushes being received
  # 2 x 295,488; checkpoint copies 2 x 3 vectors (global, momentum, reference).
  assert r["memory_one_process"]["total"] == P + 12 * 460_032 + 8 * 64_692 + 590_976 + 2 * 3 * 460_032
  shipped = syncer_cli.setup_of(_config("tiny_cpu"))
  assert r["at_shards"]["per_shard"] == max(x["memory"]["total"] for x in syncer.shard_layout(shipped, 4, 2, 0.5))
  assert r["merge_rate_per_core"] == 512e6 and r["cores_busy"] == pytest.approx(92_006.4 / 512e6)
  rc, io = _run(["--configs", f"{TINY},{SMALL}", "--shards", "3", "--merge-rate", "7e8"], capsys)
  assert rc == 0 and "a sharded syncer (`syncer --shard I --shards S`)" in io.out and "n/a (> P)" in io.out
  assert [line.split()[0] for line in io.out.splitlines()[2:8]] == ["tiny_cpu"] * 3 + ["small_cpu"] * 3


@pytest.mark.parametrize("args, names", [
    (["--learners", "0"], "--learners"),
    (["--learners", "2.5"], "--learners"),
    (["--step-s", "0"], "--step-s"),
    (["--merge-rate", "-1"], "--merge-rate"),
    (["--cores-per-shard", "0"], "--cores-per-shard"),
    (["--host-memory-gb", "nan"], "--host-memory-gb"),
    (["--shards", "0"], "--shards"),
    (["--configs", str(REPO / "configs" / "nope.py")], "--configs"),
])
def test_cli_errors_name_the_flag(args, names, capsys):
  with pytest.raises(SystemExit) as e:
    commands.main(["diloco_jax", "sim", "syncer", "--configs", TINY, *args])
  assert e.value.code == 2 and names in capsys.readouterr().err


def test_without_a_rate_it_measures_one_per_downlink_class(capsys, monkeypatch):
  monkeypatch.setattr(syncer_cli, "MEASURE_PARAMS", 20_000)  # a real `bench syncer` run, on a small fragment
  rc, io = _run(["--configs", TINY, "--learners", "4", "--json"], capsys)
  (row,) = json.loads(io.out)["rows"]
  assert rc == 0 and row["merge_rate_per_core"] > 1e6  # parameters per CPU-second, measured here


def test_a_bench_syncer_file_without_a_result_is_a_usage_error(capsys, tmp_path):
  bad = tmp_path / "figures.json"
  bad.write_text("{}")
  with pytest.raises(SystemExit) as e:
    commands.main(["diloco_jax", "sim", "syncer", "--configs", TINY, "--bench-syncer", str(bad)])
  assert e.value.code == 2 and "--bench-syncer" in capsys.readouterr().err


def test_help_names_the_command():
  out = subprocess.run([sys.executable, "-m", "diloco_jax", "sim", "syncer", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
  assert out.returncode == 0 and "python -m diloco_jax sim syncer" in out.stdout and "--merge-rate" in out.stdout

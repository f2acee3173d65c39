"""sim/sizing.py: the syncer's and learners' memory estimates against their formulas, and its command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import helpers
from diloco_jax.compute import model
from diloco_jax.outer import codec as codec_lib
from diloco_jax.outer import fragments, schedule
from diloco_jax.tools.sim import sizing, syncer_cli

REPO = helpers.REPO
MiB = 2**20
_config = helpers.sizing_config


def test_fragment_sizes_match_the_real_parameters():
  c = _config(num_layers=3, num_kv_heads=2)
  c.outer.num_fragments = 3
  params = model.init_params_host(c)
  plan = fragments.make_plan(params, 3, c.outer.sync_every, c.outer.fragment_plan)
  assert sizing.fragment_sizes(c) == tuple(plan.size(p) for p in range(3))
  assert sum(sizing.fragment_sizes(c)) == model.count_params(params)


def test_syncer_memory_parts_fp32_downlink():
  sizes = (1000, 3000, 2000)
  m = sizing.syncer_memory(sizes, 5, codec="int4", downlink_codec="fp32", block=64, max_in_flight=2)
  model_bytes, largest = 4 * 6000, 4 * 3000
  assert (m["global"], m["momentum"], m["full_answer"]) == (model_bytes,) * 3
  assert m["reference"] == 0 and m["latest_deltas"] == 0  # fp32 downlink: the reference is the global itself
  payload = codec_lib.encoded_size(3000, "int4", 64)
  assert m["open_rounds"] == 5 * 2 * payload  # 5 learners x 2 fragments in flight, as they arrived (int4)
  assert m["pushes_receiving"] == 5 * 2 * codec_lib.encoded_size(3000, "int4", 64)
  assert m["checkpoint_transient"] == 2 * 2 * model_bytes
  assert m["checkpoint_bytes"] == 2 * model_bytes
  assert m["merge_transient"] == 0 and largest > 0  # the merge works in place, in chunks
  resident = sizing.PROCESS_BYTES + 3 * model_bytes
  serving = m["open_rounds"] + m["pushes_receiving"] + 4 * model_bytes
  assert m["total"] == resident + serving
  assert sizing.syncer_memory(sizes, 5, codec="int4", downlink_codec="fp32", block=64,
                              max_in_flight=9)["open_rounds"] == 5 * 3 * payload  # never more than P


def test_syncer_memory_parts_delta_downlink():
  sizes = (4096, 4096)
  m = sizing.syncer_memory(sizes, 2, codec="int8", downlink_codec="int8", block=64, max_in_flight=1)
  model_bytes = 4 * 8192
  assert m["reference"] == model_bytes
  assert m["latest_deltas"] == 2 * codec_lib.encoded_size(4096, "int8", 64)
  assert m["checkpoint_transient"] == 2 * 3 * model_bytes  # global, momentum and reference, two copies
  assert m["checkpoint_bytes"] == 3 * model_bytes + m["latest_deltas"]


def test_syncer_memory_with_a_downlink_history():
  """A delta downlink keeping 4 versions holds 4 references and a spare, and 4 deltas (the checkpoint
  keeps the latest of each); an fp32 downlink holds none whatever the history."""
  sizes = (4096, 4096)
  model_bytes = 4 * 8192
  deltas = 2 * codec_lib.encoded_size(4096, "int8", 64)
  m = sizing.syncer_memory(sizes, 2, codec="int8", downlink_codec="int8", block=64, max_in_flight=1,
                           downlink_history=4)
  assert (m["reference"], m["latest_deltas"]) == (5 * model_bytes, 4 * deltas)
  assert m["checkpoint_bytes"] == 3 * model_bytes + deltas
  fp32 = sizing.syncer_memory(sizes, 2, codec="int8", downlink_codec="fp32", block=64, max_in_flight=1,
                              downlink_history=4)
  assert fp32["reference"] == 0 and fp32["latest_deltas"] == 0


def test_traffic_per_period_is_every_fragment_once():
  up, down = sizing.traffic_per_period((640, 64), codec="int4", downlink_codec="fp32", block=64)
  assert up == codec_lib.encoded_size(640, "int4", 64) + codec_lib.encoded_size(64, "int4", 64)
  assert down == 4 * 704


def test_learner_memory_divides_state_over_parameter_shards():
  c = _config()
  c.learners.devices, c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 8, 2, -1, 2
  sizes = sizing.fragment_sizes(c)
  ln = sizing.learner_memory(c, sizes)
  assert ln["parameter_shards"] == 8 // 2
  assert ln["state_bytes_per_chip"] == 16 * sum(sizes) // 4
  in_flight = schedule.in_flight_limit(c.outer.max_in_flight, c.outer.num_fragments, c.outer.sync_every,
                                       c.outer.tau)
  assert in_flight == 2 and ln["host_bytes"] == (in_flight + 1) * 4 * max(sizes)


def _cli(*args):
  return subprocess.run([sys.executable, "-m", "diloco_jax", "sim", "sizing", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=120)


def test_cli_prints_json_and_text():
  result = _cli("--config", "configs/tiny_cpu.py", "--learners", "3", "--step-s", "0.5", "--json")
  assert result.returncode == 0, result.stderr
  s = json.loads(result.stdout)
  assert s["learners"] == 3 and s["syncer"]["total"] > sizing.PROCESS_BYTES
  assert s["traffic"]["syncer_gbps"]["in"] == pytest.approx(3 * s["traffic"]["learner_gbps"]["up"])
  text = _cli("--config", "configs/tiny_cpu.py")
  assert text.returncode == 0 and "syncer memory, peak estimate" in text.stdout
  bad = _cli("--config", "configs/tiny_cpu.py", "--learners", "-2")
  assert bad.returncode == 2 and "--learners" in bad.stderr


def test_cli_sizes_a_config_whose_data_is_not_here():
  """m150 names token shards under data/ that this checkout does not hold: sizing reads no data."""
  assert not (REPO / "data" / "tokenizer.model").exists()
  result = _cli("--config", "configs/m150.py", "--learners", "8", "--json")
  assert result.returncode == 0, result.stderr
  assert json.loads(result.stdout)["params"] == sum(sizing.fragment_sizes(
      syncer_cli.load_config(str(REPO / "configs" / "m150.py"))))

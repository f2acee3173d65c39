"""`bench wan`: the modes it compares, its verdict, and one end-to-end run on a fast link."""

import pytest

from diloco_jax.tools.bench import wan, wan_mode, wan_paper


def test_modes_differ_only_in_schedule(tiny_config):
  tiny_config.outer.tau = 0
  tiny_config.outer.max_in_flight = 1
  all_at_once, streaming, int4 = wan.modes(tiny_config, int4=True)
  assert (all_at_once.num_fragments, all_at_once.tau, all_at_once.codec, all_at_once.downlink_codec) == (
      1, 0, "fp32", "fp32")
  # Streaming keeps the config's P, and always overlaps: tau >= 1, two fragments in flight.
  assert streaming.num_fragments is None and streaming.tau >= 1 and streaming.max_in_flight >= 2
  assert (streaming.codec, streaming.downlink_codec) == ("fp32", "fp32")
  assert (int4.codec, int4.downlink_codec) == ("int4", "int4")
  assert len(wan.modes(tiny_config, int4=False)) == 2


def test_mode_config_is_one_learner_and_leaves_the_input_alone(tiny_config):
  c = wan_mode._mode_config(tiny_config, wan.modes(tiny_config)[0])
  assert (c.learners.num, c.outer.min_quorum, c.outer.num_fragments, c.outer.tau) == (1, 1, 1, 0)
  assert tiny_config.learners.num == 4 and tiny_config.outer.num_fragments == 2


def test_verdict():
  rows = [{"mode": "all-at-once", "compute_utilization": 0.5},
          {"mode": "streaming", "compute_utilization": 0.97}]
  goal = wan.verdict(rows)
  assert goal["met"] and goal["all_at_once_stall"] == pytest.approx(0.5)
  rows[0]["compute_utilization"] = 0.8  # the link is too fast to show anything
  assert not wan.verdict(rows)["met"]


def test_paper_link_is_the_published_reduction_of_bf16_data_parallel(tiny_config):
  """1/236 of a ring all-reduce of the bf16 gradient every bare step; the modes: no overlap, the config's
  schedule (and with more in flight when the latency needs it), P = H with int4."""
  rate = wan_paper.paper_link(params=1_000_000, workers=8, bare_step_s=0.5)
  assert rate == pytest.approx(2 * 7 / 8 * 2e6 / 0.5 / 236)
  assert wan_paper.paper_link(1_000_000, 1, 0.5) == wan_paper.paper_link(1_000_000, 2, 0.5)  # at least two workers
  # int4 at 0.5625 bytes per parameter: one fragment per step fits from H = ceil(0.5625 N / link per step).
  per_step = rate * 0.5
  h = wan_paper.min_sync_every(1_000_000, 0.5625, per_step)
  assert 1_000_000 * 0.5625 / h <= per_step < 1_000_000 * 0.5625 / (h - 1)
  tiny_config.outer.sync_every = 30
  mode = wan_paper.paper_mode(tiny_config)
  assert (mode.num_fragments, mode.codec, mode.downlink_codec) == (30, "int4", "int4")
  assert mode.tau >= 1 and mode.max_in_flight == mode.tau + 1  # the schedule's own in-flight need
  names = [m.name for m in wan_paper.paper_modes(tiny_config, needed=9)]
  assert names == ["no overlap", "config", "config+flight", "P = H"]
  assert [m.name for m in wan_paper.paper_modes(tiny_config, needed=1)] == ["no overlap", "config", "P = H"]


def test_in_flight_for_covers_a_sync_at_the_latency():
  # 80 ms one-way: a sync of a 1 KB fragment at 1 MB/s holds it 4 x 80 ms + 2 ms; one falls due every 100 ms.
  assert wan_paper.in_flight_for(0.08, 1000, 1e6, 0.1, 0.04) == 5
  assert wan_paper.in_flight_for(0.0, 1000, 1e6, 0.1, 0.2) == 3  # tau's wait, when longer


def test_paper_goal_names_what_binds():
  link = {"link_mb_s": 1.0, "wall_s": 10.0, "bytes_sent": 2e6, "bytes_received": 3e6}  # 20% and 30% busy
  rows = [{"mode": "config", "latency_ms": 80.0, "compute_utilization": 0.6, **link},
          {"mode": "config+flight", "latency_ms": 80.0, "compute_utilization": 0.97, **link}]
  goal = wan_paper.paper_goal(rows, 80.0, 20, 10)
  assert goal["link_busy"] == {"up": pytest.approx(0.2), "down": pytest.approx(0.3)}
  assert (goal["config_utilization"], goal["met"], goal["fits"], goal["binds"]) == (0.97, True, True, "in-flight limit")
  goal = wan_paper.paper_goal(rows, 80.0, 20, 45)
  assert goal["binds"] == "bandwidth" and not goal["fits"]
  rows[0]["bytes_received"] = 9e6  # the downlink carried 90% of what it could: it binds
  assert wan_paper.paper_goal(rows, 80.0, 20, 10)["binds"] == "downlink bandwidth (90% busy)"
  rows[0]["bytes_received"], rows[1]["compute_utilization"] = 3e6, 0.7
  goal = wan_paper.paper_goal(rows, 80.0, 20, 10, sync_s=0.52, period_s=0.3)  # the fragment is due before it is back
  assert goal["binds"] == "fragment period (a sync takes 0.52 s, H steps 0.30 s)"


@pytest.mark.slow
def test_end_to_end_fast_link(tiny_config):
  """Both modes run against a real gRPC syncer; the same syncs happen and move the whole model."""
  tiny_config.outer.sync_every = 4
  result = wan.run(tiny_config, gbps=1.0, latency_ms=0.0, steps=4, int4=False)
  rows = {r["mode"]: r for r in result["rows"]}
  assert set(rows) == {"all-at-once", "streaming"}
  model_bytes = 4 * result["params"]
  for r in rows.values():
    assert r["steps"] == 4 and 0.0 < r["compute_utilization"] <= 1.0 + 1e-6
    assert sum(r["fragment_params"]) == result["params"]
    # One sync period: every parameter goes up and comes back once, in fp32, plus gRPC framing.
    assert model_bytes <= r["bytes_sent"] < 1.05 * model_bytes + 4096
    assert model_bytes <= r["bytes_received"] < 1.05 * model_bytes + 4096
  assert rows["all-at-once"]["syncs"] == 1
  assert rows["streaming"]["syncs"] == rows["streaming"]["fragments"] == tiny_config.outer.num_fragments
  assert wan.format_table(result["rows"]).count("\n") == 3

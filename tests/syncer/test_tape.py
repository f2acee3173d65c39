"""The syncer's input tape: a recorded run replays bit for bit through a fresh core (`tools/replay.py`).

If the core's shell held a rule of its own (a decision from state the steps do not carry, a clock read
outside a step, a random draw), a replay would differ; so these tests record runs that exercise every kind
of step (joins, heartbeats, pushes refused and accepted, retries, lapsed leases, partial and full rounds,
delta downlinks, pulls, a restart from a checkpoint with its journal) and check the replay, and check that
the replay does notice a changed rule or a changed input.
"""

import subprocess
import sys

import numpy as np

import helpers
from diloco_jax.protocol.reasons import Rejected
from diloco_jax.runs import inprocess
from diloco_jax.syncer import tape as tape_lib
from diloco_jax.syncer.rules import rounds
from diloco_jax.tools import replay

SIZES = (300, 200)


def _scripted_run(path) -> list[int]:
  """Three learners against a core on a fake clock, with a restart; returns the final versions."""
  clock = helpers.FakeClock(100.0)
  kwargs = dict(codec="int4", downlink="int8", block=32, k=2, max_grace_s=0.5, clock=clock, lease_s=5.0,
                num_learners=3, stall_s=2.0, max_norm_ratio=10.0, period_steps=10, tokens_per_step=64,
                downlink_history=4, scale_partial_rounds=True)
  core = helpers.make_core(SIZES, tape=tape_lib.Tape(path), **kwargs)
  rng = np.random.default_rng(1)

  def push(learner, fragment, scale=1e-2, **fields):
    base = core.status()["versions"][fragment]
    delta = (scale * rng.standard_normal(SIZES[fragment])).astype(np.float32)
    fields = {"base_version": base, "steps": 10, "tokens": 640, "fragment": fragment, **fields}
    try:
      return core.push(helpers.make_push(learner, delta, core=core, **fields))
    except Rejected as e:
      return e.reason

  for i in range(3):
    core.join(i, core.settings.fingerprint)
  for t in range(40):
    clock.t += 0.3
    for i in range(3):
      if not (i == 2 and 15 < t < 30):  # learner 2 goes quiet for a while: its lease lapses
        core.heartbeat(i, 0.1 + 0.01 * i, step=t, blocked=bool(t % 7 == 0))
    push(t % 3, t % 2, incarnation=7 + t % 3, sequence=t)
    if t % 5 == 0:
      push(t % 3, t % 2, incarnation=7 + t % 3, sequence=t)  # a retry of the same key: merged once
      push(1, 0, scale=1e3)  # an outlier
      push(0, 1, checksum=1)  # a bad checksum
    core.tick()
    core.pull(t % 2, 0, have_version=max(core.status()["versions"][t % 2] - 1, 0), have_epoch=core.epoch)
  saved, record = core.state_dict(), core.journal_record()
  # A crash and a restart: the same tape gets a second segment, from the checkpoint and the journal.
  restarted = helpers.make_core(SIZES, tape=tape_lib.Tape(path), **kwargs)
  restarted.load_state_dict(saved)
  restarted.attach_journal(lambda record, versions: None, record)
  core = restarted
  for i in range(3):
    core.join(i, core.settings.fingerprint)
  for t in range(40, 60):
    clock.t += 0.25
    push(t % 3, t % 2, base_epoch=core.epoch)
    core.tick()
  core.close_open_rounds()
  core.close_tape()
  return core.status()["versions"]


def test_a_scripted_run_with_a_restart_replays_bit_for_bit(tmp_path):
  path = tmp_path / "syncer.tape"
  versions = _scripted_run(path)
  assert sum(versions) > 10  # rounds closed in both lifetimes
  kinds = {step.kind for step in tape_lib.read(path)}
  assert {"begin", "join", "heartbeat", "push_check", "push_admit", "tick", "poll", "restore", "apply_journal",
          "close_all", "end"} <= kinds
  segments = replay.replay(path)
  # The first lifetime ended without a clean stop (as after a kill -9), the second with its digest.
  assert [s.mismatch for s in segments] == [None, None] and [s.ended for s in segments] == [False, True]
  assert all(s.steps > 50 for s in segments)


def test_replay_notices_a_changed_rule(tmp_path, monkeypatch):
  path = tmp_path / "syncer.tape"
  _scripted_run(path)
  # Rounds that close one tick later than recorded: the same inputs, another decision.
  original = rounds.close_reason
  monkeypatch.setattr(rounds, "close_reason",
                      lambda rnd, counted, now: None if original(rnd, counted, now) == "deadline" and
                      now < rnd.deadline + 0.2 else original(rnd, counted, now))
  segments = replay.replay(path)
  assert segments[0].mismatch is not None  # at the first step whose tick closed a round (a push, a tick...)


def test_replay_notices_a_changed_input_and_stops_at_a_cut(tmp_path):
  path = tmp_path / "syncer.tape"
  _scripted_run(path)
  data = bytearray(path.read_bytes())
  # A tape cut short (a kill -9 mid-write) replays up to the cut, without an end.
  cut = tmp_path / "cut.tape"
  cut.write_bytes(bytes(data[: len(data) // 3]))
  segments = replay.replay(cut)
  assert len(segments) == 1 and segments[0].mismatch is None and not segments[0].ended
  # One changed byte in a push's payload: its checksum no longer matches, the replayed step differs.
  steps = list(tape_lib.read(path))
  admitted = next(s for s in steps if s.kind == "push_admit" and "receipt" in s.record["outcome"]["result"])
  payload = admitted.args["push"].payload
  changed = tmp_path / "changed.tape"
  changed.write_bytes(bytes(data).replace(payload, bytes([payload[0] ^ 0xFF]) + payload[1:]))
  assert replay.replay(changed)[0].mismatch is not None


def test_a_threaded_in_process_run_replays_bit_for_bit(tiny_config, tmp_path):
  """Real threads and the real clock: four learners, the ticker, the evaluator and a delta downlink."""
  tiny_config.outer.downlink_codec = "int8"
  path = tmp_path / "syncer.tape"
  inprocess.run(tiny_config, str(tmp_path / "run"), quiet=True, export=False, tape=tape_lib.Tape(path))
  segments = replay.replay(path)
  assert len(segments) == 1 and segments[0].mismatch is None and segments[0].ended
  assert segments[0].steps > 100
  # The command says so too, and exits 0.
  out = subprocess.run([sys.executable, "-m", "diloco_jax", "replay", "--tape", str(path)], cwd=helpers.REPO,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and "all identical" in out.stdout, out.stdout + out.stderr


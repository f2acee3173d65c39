"""A sharded syncer as real processes: a kill -9 of one shard."""

import re
import signal
import subprocess
import sys

import helpers
from diloco_jax.runs import children as run_children


def _versions(run, shard: int) -> int:
  """The versions of the fragments shard `shard` owns, summed."""
  status = run.status(shard)
  return sum(status["versions"][p] for p in status["owned"])


def test_kill_9_of_one_shard_leaves_the_other_merging_and_it_recovers(tmp_path):
  run = helpers.ProcessRun(tmp_path, helpers.tiny_overrides(steps=60))
  base = run_children.free_ports(2)
  try:
    shard0 = run.syncer(f"127.0.0.1:{base}", shard=0, shards=2)
    run.syncer(f"127.0.0.1:{base + 1}", shard=1, shards=2)
    assert [run.status(s)["owned"] for s in (0, 1)] == [[0], [1]]
    run.learner(0)
    run.learner(1)
    ckpt_dir = tmp_path / "syncer" / "shard_0" / "syncer_checkpoints"
    helpers.wait_for(lambda: _versions(run, 0) >= 3 and any(p.name.isdigit() for p in ckpt_dir.iterdir()),
                     "a few rounds and a checkpoint on shard 0")
    shard0.send_signal(signal.SIGKILL)
    shard0.wait()
    # Shard 1's fragment goes on merging while shard 0 is dead.
    at_kill = _versions(run, 1)
    helpers.wait_for(lambda: _versions(run, 1) > at_kill, "shard 1 to merge while shard 0 is dead")
    run.syncer(f"127.0.0.1:{base}", shard=0, shards=2)  # same workdir, same port
    match = re.search(r"resumed from checkpoint step \d+ \((\d+) rounds\)", run.log("syncer_0"))
    assert match, run.log("syncer_0")
    resumed = int(match.group(1))
    run.wait_ok("learner_0")
    run.wait_ok("learner_1")
    status = [run.status(s) for s in (0, 1)]
    status_command = subprocess.run(
        [sys.executable, "-m", "diloco_jax", "status", "--syncer", run.target, "--token-file", str(run.token_file)],
        cwd=helpers.REPO, capture_output=True, text=True, timeout=helpers.PROCESS_TIMEOUT_S)
  finally:
    run.kill_all()
  # The restarted shard merged again after its restore; the learners never restarted and finished.
  assert status[0]["versions"][0] > resumed >= 1
  for i in (0, 1):
    s = run.summary(i)
    assert s["steps"] == 60 and s["completed"] and not s["restored"]
  assert all(s["counters"]["joins"] >= 2 for s in status)
  # `status` shows every shard: each with its own fragment.
  assert status_command.returncode == 0, status_command.stderr
  out = status_command.stdout
  blocks = out.split("syncer shard ")[1:]
  assert [b.split()[0] for b in blocks] == ["0/2", "1/2"], out
  for shard, block in enumerate(blocks):
    lines = block.splitlines()
    table = lines[[i for i, line in enumerate(lines) if line.startswith("fragment")][0] + 1:]
    rows = [line.split() for line in table[:table.index("")]]
    assert [(int(r[0]), int(r[1])) for r in rows] == [(shard, status[shard]["versions"][shard])], out

"""What a learner reports: its summary at the end of a run (`learner_summary`) and its traffic so far."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from diloco_jax.learner import loop


def learner_summary(learner: loop.Learner, wall_s: float, eval_loss: float | None) -> dict:
  """What `run_learner` returns: steps, tokens, time, syncs, traffic and the local eval loss."""
  stats, trainer = learner.stats, learner.trainer
  return {
      "learner": learner.learner_id, "steps": trainer.step, "tokens": trainer.tokens, "wall_s": wall_s,
      "blocked_s": stats.blocked_s, "compute_s": stats.compute_s,
      "compute_utilization": stats.compute_s / wall_s if wall_s > 0 else 0.0,
      "syncs": stats.syncs, "adopted": stats.adopted, "late_merges": stats.late_merges,
      "recoveries": stats.recoveries, "steps_taken_back": stats.steps_taken_back, "rebased": stats.rebased,
      "catch_ups": stats.catch_ups, "adopt_lag_steps": stats.adopt_lag_steps,
      **({"rejected_pushes": list(learner.comms.rejected), **learner.comms.traffic()} if learner.comms else {}),
      "local_eval_loss": eval_loss, "params": trainer.num_params, "batch_size": trainer.batch_size,
      "devices": len(trainer.mesh.devices.flat),
      **({"pace": learner.pacer.stats()} if learner.pacer.active else {}),
  }


def wire_bytes(learner: loop.Learner) -> int:
  """Bytes this learner has moved on the wire so far, both ways (its transport's count; 0 for a process
  of a multi-host learner that does not talk to the syncer)."""
  if learner.comms is None:
    return 0
  traffic = learner.comms.traffic()
  return traffic["bytes_sent"] + traffic["bytes_received"]

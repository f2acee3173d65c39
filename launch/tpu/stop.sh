#!/usr/bin/env bash
# Stop the run cleanly: SIGTERM the learners (they flush, checkpoint and leave), then the syncer (final
# checkpoint). `stop.sh --delete` then deletes every VM (checkpoints on their disks go with them).
set -euo pipefail
source "$(dirname "$0")/common.sh"
D="diloco_jax/runs/$RUN"
# SIGTERM the pid that start.sh recorded, and wait until that process is gone.
STOP='stop() { p=$(cat "$1") && kill -TERM "$p" && while kill -0 "$p" 2>/dev/null; do sleep 1; done; }; stop'
for i in $(seq 0 $((LEARNERS - 1))); do
  "${G[@]}" compute tpus tpu-vm ssh "$(learner_vm "$i")" --zone "$ZONE" \
      --command "$STOP $D/learner.pid" &
done
wait
"${G[@]}" compute ssh "$SYNCER_VM" --zone "$ZONE" \
    --command "$STOP $D/syncer.pid"
if [[ "${1:-}" == "--delete" ]]; then
  for i in $(seq 0 $((LEARNERS - 1))); do
    "${G[@]}" compute tpus tpu-vm delete "$(learner_vm "$i")" --zone "$ZONE" --quiet &
  done
  "${G[@]}" compute instances delete "$SYNCER_VM" --zone "$ZONE" --quiet &
  wait
  "${G[@]}" compute firewall-rules delete "$RUN-grpc" --quiet || true
fi

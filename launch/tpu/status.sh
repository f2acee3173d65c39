#!/usr/bin/env bash
# Where the run stands: each learner slice's state, whether its supervisor runs and the last lines of its
# log on every worker, and the syncer's versions, members and counters (python -m diloco_jax status on the
# syncer VM, over loopback).
#
#   launch/tpu/status.sh [--dry-run]
#
# Logs on the hosts: ~/diloco/RUN/logs/learner.log (supervisor and learner) and ~/diloco/RUN/logs/syncer.log.
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

parse_common_flags "$@"
((${#ARGS[@]} == 0)) || die "unknown arguments: ${ARGS[*]} (see --help)"
check_settings
FAILED=0

# Print each worker's output of a status step, prefixed with its slice and worker.
show_workers() {
  local node=$1 f
  for f in "$LOG_DIR/status.$node"/*.log; do
    [[ -e $f ]] || continue
    sed "s/^/  [$node worker $(basename "$f" .log)] /" "$f"
  done
}

for i in "${!L_NODE[@]}"; do
  state=$(qr_state "$i")
  echo "learner $i: ${L_NODE[i]} (${L_ACCEL[i]}, ${L_ZONE[i]}, ${L_CAPACITY[i]}): ${state:-no queued resource}"
  if [[ $state == ACTIVE ]] || ((DRY_RUN)); then
    on_tpu status "${L_NODE[i]}" "${L_ZONE[i]}" "$(host_cmd status learner)" || FAILED=1
    show_workers "${L_NODE[i]}"
  fi
done

vm=$(syncer_status)
echo "syncer: $SYNCER_VM ($SYNCER_ZONE): ${vm:-no VM}"
if [[ $vm == RUNNING ]] || ((DRY_RUN)); then
  on_syncer status "$(host_cmd status syncer "$PORT" "${TLS_DIR:+ca.pem}")" || FAILED=1
  [[ -e $LOG_DIR/status.syncer.log ]] && sed "s/^/  /" "$LOG_DIR/status.syncer.log"
fi
exit "$FAILED"

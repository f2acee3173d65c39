#!/usr/bin/env bash
# Where the run stands: each learner slice's state, whether its supervisor runs, how often it restarted its
# learner (with the last error line) and the last lines of its log on every worker, and the syncer's (every
# shard's) versions, members and counters (python -m diloco_jax status on the syncer VM, over loopback, with
# the learner's certificate under mutual TLS). Exit status 1 if a slice is not ACTIVE, or a process does not run
# or was restarted.
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
  [[ $state == ACTIVE ]] || ((DRY_RUN)) || FAILED=1  # preempted, failed or waiting: heal.sh
  if [[ $state == ACTIVE ]] || ((DRY_RUN)); then
    on_tpu status "${L_NODE[i]}" "${L_ZONE[i]}" "$(host_cmd status learner)" || FAILED=1
    show_workers "${L_NODE[i]}"
    # A learner that is not running, or that its supervisor restarted, makes the status fail.
    ! grep -qE "NOT running|CRASH LOOP" "$LOG_DIR/status.${L_NODE[i]}"/*.log 2> /dev/null || FAILED=1
  fi
done

vm=$(syncer_status)
echo "syncer: $SYNCER_VM ($SYNCER_ZONE): ${vm:-no VM}"
if [[ $vm == RUNNING ]] || ((DRY_RUN)); then
  client_tls_flags
  for s in "${!SHARD_NAMES[@]}"; do
    name=${SHARD_NAMES[s]}
    on_syncer "status-$name" "$(host_cmd status "$name" "${SHARD_PORTS[s]}" "${CLIENT_TLS[@]}")" || FAILED=1
    [[ -e $LOG_DIR/status-$name.syncer.log ]] && sed "s/^/  /" "$LOG_DIR/status-$name.syncer.log"
    ! grep -qE "NOT running|CRASH LOOP" "$LOG_DIR/status-$name.syncer.log" 2> /dev/null || FAILED=1
  done
fi
exit "$FAILED"

#!/usr/bin/env bash
# Stop the run without losing the global model; with --delete, then delete its cloud resources.
#
#   launch/tpu/stop.sh [--dry-run] [--delete] [--delete-without-export]
#
#   1. every learner: SIGTERM to its supervisor on every worker, which passes it on; the learner flushes its
#      pending fragments, checkpoints, leaves the quorum and exits (waits up to STOP_TIMEOUT_S); with BUCKET
#      each worker's logs and the learner's metrics then go to BUCKET/RUN/learner_i/learner_logs/workerW
#   2. the syncer (every shard): SIGTERM; it writes a final checkpoint and exits
#   3. the global model out of the syncer VM (the only place it lives):
#      with BUCKET: `python -m diloco_jax export --config CONFIG ...` (a params-only checkpoint) to
#        BUCKET/RUN/export, and the syncer's workdir (every checkpoint, with the outer optimizer state) and
#        logs copied (gcsfs) to BUCKET/RUN/syncer and BUCKET/RUN/syncer_logs (the VM's service account needs
#        write access to the bucket);
#      without BUCKET: the export is copied to LOG_ROOT/RUN/export on this machine (LOG_ROOT: runs/tpu), or,
#        if the export failed, the syncer's workdir to LOG_ROOT/RUN/syncer
#   4. with --delete, and only if step 3 saved a copy (or there is no syncer VM): the queued resources with
#      their slices, the syncer VM and the firewall rule. --delete-without-export deletes even so.
# Exit status 1 if a process did not stop or no copy of the model could be made.
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DELETE=0
FORCE=0
parse_common_flags "$@"
for a in "${ARGS[@]}"; do
  case $a in
    --delete) DELETE=1 ;;
    --delete-without-export) DELETE=1 FORCE=1 ;;
    *) die "unknown argument $a (see --help)" ;;
  esac
done
check_settings
config_flags
PROBLEMS=()
SAVED=()

# stop_learner i: every worker's learner, then (with BUCKET) its logs and metrics to BUCKET/RUN/learner_i/.
stop_learner() {
  local i=$1 state sync=-
  state=$(qr_state "$i")
  if [[ $state != ACTIVE ]] && ((!DRY_RUN)); then
    note "learner $i: slice ${L_NODE[i]} is ${state:-absent}: nothing runs there"
    return 0
  fi
  [[ -z $BUCKET ]] || sync="$BUCKET/$RUN/learner_$i"
  on_tpu stop-learner "${L_NODE[i]}" "${L_ZONE[i]}" "$(host_cmd stop learner "$STOP_TIMEOUT_S" "$sync")"
}

# save_model: the export (every shard's checkpoint, with the run's config), and the syncer's workdirs and
# logs, to BUCKET or to this machine. Sets SAVED.
save_model() {
  local here="$LOG_ROOT/$RUN" name workdirs
  workdirs=$(IFS=,; echo "${SHARD_NAMES[*]}")
  if [[ -n $BUCKET ]]; then
    on_syncer export "$(host_cmd export "$workdirs" "$BUCKET/$RUN/export" -- "${CONFIG_FLAGS[@]}" --run-id "$RUN")" &&
      SAVED+=("params-only export: $BUCKET/$RUN/export")
    for name in "${SHARD_NAMES[@]}"; do
      on_syncer "copy-$name" "$(host_cmd upload "diloco/$RUN/$name" "$BUCKET/$RUN/$name")" &&
        SAVED+=("syncer checkpoints: $BUCKET/$RUN/$name")
    done
    on_syncer copy-logs "$(host_cmd upload "diloco/$RUN/logs" "$BUCKET/$RUN/syncer_logs")" ||
      PROBLEMS+=("the syncer's logs were not copied to $BUCKET/$RUN/syncer_logs (above)")
  else
    mkdir -p "$here"
    # shellcheck disable=SC2046  # ssh_flags: words on purpose
    if on_syncer export "$(host_cmd export "$workdirs" ../export -- "${CONFIG_FLAGS[@]}" --run-id "$RUN")" &&
      gc compute scp --recurse "$SYNCER_VM:diloco/$RUN/export" "$here/" --zone="$SYNCER_ZONE" $(ssh_flags); then
      SAVED+=("params-only export: $here/export")
    else
      echo "the export failed: copying the syncer's workdirs (their checkpoints) here instead" >&2
      for name in "${SHARD_NAMES[@]}"; do
        # shellcheck disable=SC2046
        gc compute scp --recurse "$SYNCER_VM:diloco/$RUN/$name" "$here/" --zone="$SYNCER_ZONE" $(ssh_flags) &&
          SAVED+=("syncer checkpoints: $here/$name")
      done
    fi
  fi
  return 0
}

# stop_syncer: every shard (each writes a final checkpoint).
stop_syncer() {
  local name
  for name in "${SHARD_NAMES[@]}"; do
    on_syncer "stop-$name" "$(host_cmd stop "$name" "$STOP_TIMEOUT_S")" || return 1
  done
}

delete_resources() {
  local i
  for i in "${!L_NODE[@]}"; do
    if [[ -n $(qr_state "$i") ]] || ((DRY_RUN)); then
      gc compute tpus queued-resources delete "${L_NODE[i]}" --zone="${L_ZONE[i]}" --force --quiet --async
    fi
  done
  if [[ -n $(syncer_status) ]] || ((DRY_RUN)); then
    gc compute instances delete "$SYNCER_VM" --zone="$SYNCER_ZONE" --quiet
  fi
  if [[ -n $(gq "$FIREWALL_RULE" compute firewall-rules describe "$FIREWALL_RULE" --format="value(name)") ]]; then
    gc compute firewall-rules delete "$FIREWALL_RULE" --quiet
  fi
  ((DRY_RUN)) || note "deleted run $RUN's resources (the queued resources finish deleting in the background)"
}

jobs=()
for i in "${!L_NODE[@]}"; do jobs+=("learner-$i" "stop_learner $i"); done
note "stopping ${#L_NODE[@]} learners (they flush, checkpoint and leave; up to ${STOP_TIMEOUT_S}s)"
(in_parallel "${jobs[@]}") || PROBLEMS+=("a learner did not stop cleanly (above)")

syncer_vm_status=$(syncer_status)
((DRY_RUN)) && syncer_vm_status=RUNNING
case $syncer_vm_status in
  RUNNING)
    note "stopping the syncer (final checkpoint)"
    if stop_syncer; then
      note "saving the global model"
      save_model
      ((${#SAVED[@]})) || PROBLEMS+=("no copy of the global model could be made (above)")
    else
      PROBLEMS+=("the syncer did not stop: its model was not exported")
    fi
    ;;
  "") note "no syncer VM $SYNCER_VM: no model to save" ;;
  *) PROBLEMS+=("the syncer VM is $syncer_vm_status: start it (gcloud compute instances start) and re-run stop.sh to save the model") ;;
esac
if ((DRY_RUN)); then
  note "dry run: nothing was stopped, saved or deleted"
  SAVED=()
fi
for s in "${SAVED[@]}"; do note "saved $s"; done

if ((DELETE)); then
  if [[ -n $syncer_vm_status ]] && ((${#SAVED[@]} == 0 && !FORCE && !DRY_RUN)); then
    die "refusing to delete: the syncer VM holds the only copy of the global model and none was saved. Fix the cause and re-run stop.sh --delete, or delete anyway with --delete-without-export"
  fi
  delete_resources
elif ((!DRY_RUN)); then
  note "the VMs and slices still exist (and cost money): stop.sh --delete removes them"
fi
if ((${#PROBLEMS[@]})); then
  printf 'problem: %s\n' "${PROBLEMS[@]}" >&2
  exit 1
fi

#!/usr/bin/env bash
# Stop the run without losing the global model; with --delete, then delete its cloud resources.
#
#   launch/tpu/stop.sh [--dry-run] [--delete] [--delete-without-export]
#
#   1. every learner: SIGTERM to its supervisor on every worker, which passes it on; the learner flushes its
#      pending fragments, checkpoints, leaves the quorum and exits (waits up to STOP_TIMEOUT_S)
#   2. the syncer: SIGTERM; it writes a final checkpoint and exits
#   3. the global model out of the syncer VM (the only place it lives):
#      with BUCKET: `python -m diloco_jax export` (a params-only checkpoint) to BUCKET/RUN/export, and the
#        syncer's workdir (every checkpoint, with the outer optimizer state) copied with `gcloud storage cp -r`
#        to BUCKET/RUN/syncer (the VM's service account needs write access to the bucket);
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
PROBLEMS=()
SAVED=()

stop_learner() {
  local i=$1 state
  state=$(qr_state "$i")
  if [[ $state != ACTIVE ]] && ((!DRY_RUN)); then
    note "learner $i: slice ${L_NODE[i]} is ${state:-absent}: nothing runs there"
    return 0
  fi
  on_tpu stop-learner "${L_NODE[i]}" "${L_ZONE[i]}" "$(host_cmd stop learner "$STOP_TIMEOUT_S")"
}

# save_model: the export, and the syncer's workdir, to BUCKET or to this machine. Sets SAVED.
save_model() {
  local here="$LOG_ROOT/$RUN"
  if [[ -n $BUCKET ]]; then
    on_syncer export "$(host_cmd export "$BUCKET/$RUN/export")" &&
      SAVED+=("params-only export: $BUCKET/$RUN/export")
    on_syncer copy-workdir "$(host_cmd copy-workdir "$BUCKET/$RUN/")" &&
      SAVED+=("syncer checkpoints: $BUCKET/$RUN/syncer")
  else
    mkdir -p "$here"
    # shellcheck disable=SC2046  # ssh_flags: words on purpose
    if on_syncer export "$(host_cmd export ../export)" &&
      gc compute scp --recurse "$SYNCER_VM:diloco/$RUN/export" "$here/" --zone="$SYNCER_ZONE" $(ssh_flags); then
      SAVED+=("params-only export: $here/export")
    else
      echo "the export failed: copying the syncer's workdir (its checkpoints) here instead" >&2
      # shellcheck disable=SC2046
      gc compute scp --recurse "$SYNCER_VM:diloco/$RUN/syncer" "$here/" --zone="$SYNCER_ZONE" $(ssh_flags) &&
        SAVED+=("syncer checkpoints: $here/syncer")
    fi
  fi
  return 0
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
  note "deleted run $RUN's resources (the queued resources finish deleting in the background)"
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
    if on_syncer stop-syncer "$(host_cmd stop syncer "$STOP_TIMEOUT_S")"; then
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
for s in "${SAVED[@]}"; do note "saved $s"; done

if ((DELETE)); then
  if [[ -n $syncer_vm_status ]] && ((${#SAVED[@]} == 0 && !FORCE)); then
    die "refusing to delete: the syncer VM holds the only copy of the global model and none was saved. Fix the cause and re-run stop.sh --delete, or delete anyway with --delete-without-export"
  fi
  delete_resources
else
  note "the VMs and slices still exist (and cost money): stop.sh --delete removes them"
fi
if ((${#PROBLEMS[@]})); then
  printf 'problem: %s\n' "${PROBLEMS[@]}" >&2
  exit 1
fi

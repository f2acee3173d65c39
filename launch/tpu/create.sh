#!/usr/bin/env bash
# Create the run's cloud resources (or whatever of them is missing) and install this working copy on them.
#
#   launch/tpu/create.sh [--dry-run] [--deploy-new-only]
#
#   1. the firewall rule: the syncer's port, open to the VPC's internal ranges only
#   2. the syncer VM, its memory and disk sized from the model (python -m diloco_jax sim sizing) unless
#      SYNCER_MACHINE is set
#   3. one queued resource per learner: accelerator type, zone and capacity (spot, reserved, on-demand) from
#      LEARNERS; a slice that was preempted (SUSPENDED) or FAILED is deleted and requested again; then a
#      wait until every one is ACTIVE (QR_TIMEOUT_S)
#   4. on every host, in parallel (--worker=all on the slices): this working copy (tracked and untracked
#      files, as they are now), uv, Python PYTHON_VERSION, the pinned dependencies, and jax[tpu] on the TPU
#      hosts. A host where a process of the run runs keeps its code. --deploy-new-only: only the hosts
#      created by this invocation (heal.sh).
# Safe to re-run. Next: launch/tpu/start.sh.
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DEPLOY_NEW_ONLY=0
parse_common_flags "$@"
for a in "${ARGS[@]}"; do
  case $a in
    --deploy-new-only) DEPLOY_NEW_ONLY=1 ;;
    *) die "unknown argument $a (see --help)" ;;
  esac
done
check_settings
check_bucket_for_multihost
config_flags
NEW=()  # what this invocation created: "syncer" and learner indices

# The syncer's machine and disk from the model's size (sim sizing), or SYNCER_MACHINE as given.
size_syncer() {
  local py json summary total disk need_gb machine gb
  py=$(local_python)
  json="$LOG_DIR/sizing.json"
  (cd "$REPO" && "$py" -m diloco_jax sim sizing "${CONFIG_FLAGS[@]}" --learners "${#L_ACCEL[@]}" --json) \
    > "$json" 2> "$LOG_DIR/sizing.err" || {
    tail -n 5 "$LOG_DIR/sizing.err" >&2
    die "\`$py -m diloco_jax sim sizing\` failed (above): fix the config, or make the environment here (make .venv/.installed)"
  }
  summary=$("$py" - "$json" << 'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
y = s["syncer"]
state = y["global"] + y["momentum"] + y["reference"] + y["full_answer"]
print(y["total"], s["syncer_disk_bytes"], f"{s['params'] / 1e6:,.1f}M parameters, {s['learners']} learners: syncer "
      f"peak memory estimate {y['total'] / 1e9:,.1f} GB (global, momentum and cached answer {state / 1e9:,.1f} GB, "
      f"open rounds {y['open_rounds'] / 1e9:,.1f} GB, checkpoint copies {y['checkpoint_transient'] / 1e9:,.1f} GB)")
EOF
)
  read -r total disk summary <<< "$summary"
  note "$summary; details: $json"
  need_gb=$((total * 5 / 4 / 1000000000 + 4))  # 25% headroom and the OS
  SYNCER_DISK_GB=${SYNCER_DISK_GB:-$((disk * 3 / 2 / 1000000000 + 50))}
  while read -r machine gb; do
    if [[ -n $SYNCER_MACHINE ]]; then
      [[ $machine == "$SYNCER_MACHINE" ]] && ((gb < need_gb)) &&
        echo "WARNING: SYNCER_MACHINE=$SYNCER_MACHINE has $gb GB, the estimate asks for $need_gb GB" >&2
    elif ((gb >= need_gb)); then
      SYNCER_MACHINE=$machine
      note "syncer VM: $machine ($gb GB), boot disk $SYNCER_DISK_GB GB"
    fi
  done <<< "$SYNCER_MACHINES"
  [[ -n $SYNCER_MACHINE ]] || die "no machine in presets.sh holds $need_gb GB: set SYNCER_MACHINE"
}

create_firewall_rule() {
  if [[ -n $(gq "" compute firewall-rules describe "$FIREWALL_RULE" --format="value(name)") ]]; then
    note "firewall rule $FIREWALL_RULE exists"
    return 0
  fi
  gc compute firewall-rules create "$FIREWALL_RULE" --network="$NETWORK" --direction=INGRESS \
    --allow="tcp:$PORT" --source-ranges="$INTERNAL_RANGES" --target-tags="$SYNCER_VM"
}

# shellcheck disable=SC2046  # $(service_account_flag): no word or one
create_syncer_vm() {
  local status
  status=$(syncer_status)
  case $status in
    "")
      gc compute instances create "$SYNCER_VM" --zone="$SYNCER_ZONE" --machine-type="$SYNCER_MACHINE" \
        --network="$NETWORK" --image-family=ubuntu-2204-lts --image-project=ubuntu-os-cloud \
        --boot-disk-size="${SYNCER_DISK_GB}GB" --tags="$SYNCER_VM" --scopes="$SCOPES" $(service_account_flag)
      NEW+=(syncer)
      ;;
    RUNNING) note "syncer VM $SYNCER_VM exists" ;;
    TERMINATED | STOPPED | SUSPENDED) gc compute instances start "$SYNCER_VM" --zone="$SYNCER_ZONE" ;;
    *) note "syncer VM $SYNCER_VM is $status" ;;
  esac
}

# shellcheck disable=SC2046
request_slice() {
  local i=$1 capacity=()
  case ${L_CAPACITY[i]} in
    spot) capacity=(--spot) ;;
    reserved) capacity=(--reserved) ;;
  esac
  gc compute tpus queued-resources create "${L_NODE[i]}" --node-id="${L_NODE[i]}" --zone="${L_ZONE[i]}" \
    --accelerator-type="${L_ACCEL[i]}" --runtime-version="$(preset_runtime_version "${L_ACCEL[i]}")" \
    --network="$NETWORK" --scopes="$SCOPES" $(service_account_flag) "${capacity[@]}"
  NEW+=("$i")
}

request_slices() {
  local i state
  for i in "${!L_NODE[@]}"; do
    state=$(qr_state "$i")
    case $state in
      "") request_slice "$i" ;;
      FAILED | SUSPENDED)
        note "slice ${L_NODE[i]} is $state (preempted or failed): deleting it and requesting it again"
        # Its logs and metrics first, where its hosts still answer (else: their last periodic copy).
        [[ -z $BUCKET ]] || on_tpu collect "${L_NODE[i]}" "${L_ZONE[i]}" "$(host_cmd collect)" ||
          note "slice ${L_NODE[i]} does not answer: its logs are in $BUCKET/$RUN/learner_$i as last copied"
        gc compute tpus queued-resources delete "${L_NODE[i]}" --zone="${L_ZONE[i]}" --force --quiet
        request_slice "$i"
        ;;
      SUSPENDING | DELETING) die "slice ${L_NODE[i]} is $state: re-run create.sh when it is SUSPENDED or gone" ;;
      *) note "slice ${L_NODE[i]} (${L_ACCEL[i]}, ${L_ZONE[i]}): $state" ;;
    esac
  done
}

wait_until_active() {
  local deadline=$((SECONDS + QR_TIMEOUT_S)) pending i state
  while true; do
    pending=()
    for i in "${!L_NODE[@]}"; do
      state=$(qr_state "$i")
      ((DRY_RUN)) && state=ACTIVE
      case $state in
        ACTIVE) ;;
        FAILED | SUSPENDING | SUSPENDED)
          die "slice ${L_NODE[i]} (${L_ACCEL[i]}, ${L_ZONE[i]}) became $state (see: gcloud compute tpus queued-resources describe ${L_NODE[i]} --zone=${L_ZONE[i]}); re-run create.sh to request it again" ;;
        *) pending+=("${L_NODE[i]}=${state:-absent}") ;;
      esac
    done
    if ((${#pending[@]} == 0)); then
      note "every slice is ACTIVE"
      return 0
    fi
    ((SECONDS < deadline)) ||
      die "not ACTIVE after ${QR_TIMEOUT_S}s: ${pending[*]}. The requests stay queued: re-run create.sh to wait again, or stop.sh --delete to drop them"
    note "waiting for capacity: ${pending[*]}"
    sleep "$POLL_S"
  done
}

deploy_all() {
  local jobs=() names=() i
  for i in "${!L_NODE[@]}"; do
    if ((!DEPLOY_NEW_ONLY)) || [[ " ${NEW[*]} " == *" $i "* ]]; then
      jobs+=("learner-$i" "deploy_tpu $i")
      names+=("${L_NODE[i]}")
    fi
  done
  if ((!DEPLOY_NEW_ONLY)) || [[ " ${NEW[*]} " == *" syncer "* ]]; then
    jobs+=(syncer deploy_syncer)
    names+=("$SYNCER_VM")
  fi
  ((${#jobs[@]})) || { note "nothing new to deploy"; return 0; }
  make_archive
  note "deploying to ${names[*]} (logs: $LOG_DIR)"
  in_parallel "${jobs[@]}"
}

size_syncer
create_firewall_rule
create_syncer_vm
request_slices
wait_until_active
deploy_all
note "created run $RUN: syncer $SYNCER_VM ($SYNCER_ZONE), learners ${L_NODE[*]}; next: launch/tpu/start.sh"

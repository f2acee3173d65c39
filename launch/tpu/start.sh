#!/usr/bin/env bash
# Start the run: the syncer, then every learner on every worker of its slice, under a supervisor.
#
#   launch/tpu/start.sh [--dry-run] [--no-deploy]
#
#   1. unless --no-deploy: this working copy to every host, as create.sh does (a host where a process of the
#      run runs keeps its code: stop.sh first to change the code of a running run)
#   2. the run token: TOKEN_FILE, made once (mode 600) and kept for the run; copied to each host with scp
#      into ~/diloco/RUN/token, never put on a command line. With TLS_DIR: the syncer's certificate and key
#      to the syncer, the CA (and the learner certificate and key, for mutual TLS) to every learner host
#   3. the syncer on its VM, under supervise.sh (a crash restarts it from its latest checkpoint), listening on
#      0.0.0.0:PORT (--allow-remote; the firewall rule admits the VPC's internal ranges only), workdir
#      ~/diloco/RUN/syncer; waits until it serves (a crash before that fails the start)
#   4. learner i on every worker of its slice (--worker=all), under supervise.sh (restarts after a crash):
#      python -m diloco_jax learner --syncer SYNCER_INTERNAL_IP:PORT --learner-id i, with
#      --config.learners.devices = the slice's chips, workdir BUCKET/RUN/learner_i (or ~/diloco/RUN/learner
#      without BUCKET); a slice of several hosts adds --coordinator WORKER0_IP:COORDINATOR_PORT
#      --num-processes HOSTS --process-id WORKER (from the TPU VM's metadata)
# Safe to re-run: a syncer or learner that runs is left alone, so this also restarts what stopped.
# Next: launch/tpu/status.sh.
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

DEPLOY=1
parse_common_flags "$@"
for a in "${ARGS[@]}"; do
  case $a in
    --no-deploy) DEPLOY=0 ;;
    *) die "unknown argument $a (see --help)" ;;
  esac
done
check_settings
check_bucket_for_multihost
config_flags

ensure_token() {
  if [[ -s $TOKEN_FILE ]]; then
    note "run token: $TOKEN_FILE (kept)"
  elif ((DRY_RUN)); then
    note "would make the run token $TOKEN_FILE"
  else
    mkdir -p "$(dirname "$TOKEN_FILE")"
    (umask 077 && head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$TOKEN_FILE")
    note "made the run token $TOKEN_FILE (mode 600): keep it for the run"
  fi
}

# Paths on the hosts are relative to ~/diloco/RUN/code, where host.sh starts the processes.
syncer_flags() {
  SYNCER_FLAGS=("${CONFIG_FLAGS[@]}" --workdir ../syncer --bind "0.0.0.0:$PORT" --allow-remote
    --token-file ../token --run-id "$RUN")
  if [[ -n $TLS_DIR ]]; then
    SYNCER_FLAGS+=(--tls-cert ../tls/syncer.pem --tls-key ../tls/syncer.key)
    [[ -f $TLS_DIR/learner.pem ]] && SYNCER_FLAGS+=(--tls-client-ca ../tls/ca.pem)
  fi
  return 0
}

learner_flags() {
  local i=$1 syncer_ip=$2 workdir=../learner
  [[ -z $BUCKET ]] || workdir="$BUCKET/$RUN/learner_$i"
  LEARNER_FLAGS=("${CONFIG_FLAGS[@]}" "--config.learners.devices=$(preset_chips "${L_ACCEL[i]}")"
    --syncer "$syncer_ip:$PORT" --learner-id "$i" --workdir "$workdir" --token-file ../token --run-id "$RUN")
  if [[ -n $TLS_DIR ]]; then
    LEARNER_FLAGS+=(--tls-ca ../tls/ca.pem)
    [[ -f $TLS_DIR/learner.pem ]] && LEARNER_FLAGS+=(--tls-cert ../tls/learner.pem --tls-key ../tls/learner.key)
  fi
  return 0
}

start_syncer() {
  copy_to_syncer token "diloco/$RUN/token" "$TOKEN_FILE"
  if [[ -n $TLS_DIR ]]; then
    copy_to_syncer tls "diloco/$RUN/tls/" "$TLS_DIR/ca.pem" "$TLS_DIR/syncer.pem" "$TLS_DIR/syncer.key"
  fi
  syncer_flags
  on_syncer start-syncer "$(host_cmd start-syncer "$SYNCER_START_TIMEOUT_S" -- "${SYNCER_FLAGS[@]}")"
  ((DRY_RUN)) || cat "$LOG_DIR/start-syncer.syncer.log"
}

start_learner() {
  local i=$1 syncer_ip=$2 ips hosts coordinator=- tls=()
  [[ $(qr_state "$i") == ACTIVE ]] || ((DRY_RUN)) ||
    die "slice ${L_NODE[i]} is not ACTIVE: run create.sh (or heal.sh) first"
  ips=$(worker_ips "$i")
  hosts=$(grep -c . <<< "$ips")
  ((hosts == 1)) || coordinator="$(head -n 1 <<< "$ips"):$COORDINATOR_PORT"
  copy_to_tpu token "${L_NODE[i]}" "${L_ZONE[i]}" "diloco/$RUN/token" "$TOKEN_FILE"
  if [[ -n $TLS_DIR ]]; then
    tls=("$TLS_DIR/ca.pem")
    [[ -f $TLS_DIR/learner.pem ]] && tls+=("$TLS_DIR/learner.pem" "$TLS_DIR/learner.key")
    copy_to_tpu tls "${L_NODE[i]}" "${L_ZONE[i]}" "diloco/$RUN/tls/" "${tls[@]}"
  fi
  learner_flags "$i" "$syncer_ip"
  on_tpu start-learner "${L_NODE[i]}" "${L_ZONE[i]}" \
    "$(host_cmd start-learner "$coordinator" "$hosts" -- "${LEARNER_FLAGS[@]}")"
  note "learner $i: ${L_ACCEL[i]} in ${L_ZONE[i]}, $hosts host(s)"
}

if ((DEPLOY)); then
  make_archive
  jobs=(syncer deploy_syncer)
  for i in "${!L_NODE[@]}"; do jobs+=("learner-$i" "deploy_tpu $i"); done
  note "deploying this working copy (logs: $LOG_DIR)"
  in_parallel "${jobs[@]}"
fi
ensure_token
[[ $(syncer_status) == RUNNING ]] || ((DRY_RUN)) || die "the syncer VM $SYNCER_VM is not RUNNING: run create.sh first"
SYNCER_IP=$(syncer_ip)
note "starting the syncer on $SYNCER_VM ($SYNCER_IP:$PORT)"
start_syncer
jobs=()
for i in "${!L_NODE[@]}"; do jobs+=("learner-$i" "start_learner $i $SYNCER_IP"); done
note "starting ${#L_NODE[@]} learners (logs: $LOG_DIR)"
in_parallel "${jobs[@]}"
note "run $RUN started; watch it with launch/tpu/status.sh, stop it with launch/tpu/stop.sh"

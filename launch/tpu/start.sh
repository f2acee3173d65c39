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
#      ~/diloco/RUN/syncer; waits until it serves (a crash before that fails the start). SYNCER_SHARDS=S: S
#      shard processes (--shard s --shards S), ports PORT..PORT+S-1, workdirs syncer, syncer1, ...
#   4. learner i on every worker of its slice (--worker=all), under supervise.sh (restarts after a crash):
#      python -m diloco_jax learner --syncer SYNCER_INTERNAL_IP:PORT --learner-id i, with
#      --config.learners.devices = the slice's chips, workdir ~/diloco/RUN/learner (metrics; copied with the
#      logs to BUCKET/RUN/learner_i/ every SYNC_EVERY_S) and --checkpoint-dir BUCKET/RUN/learner_i/checkpoints;
#      a slice of several hosts adds --coordinator WORKER0_IP:COORDINATOR_PORT --num-processes HOSTS
#      --process-id WORKER (from the TPU VM's metadata) --init-timeout-s INIT_TIMEOUT_S. Before it starts,
#      a stale process holding the TPU and /tmp/libtpu_lockfile are cleared; a learner that crashes before
#      its first line fails the start with its last error
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
# syncer_flags S: shard S's flags (its workdir ~/diloco/RUN/SHARD_NAMES[S], its port PORT + S).
syncer_flags() {
  local s=$1
  SYNCER_FLAGS=("${CONFIG_FLAGS[@]}" --workdir "../${SHARD_NAMES[s]}" --bind "0.0.0.0:${SHARD_PORTS[s]}" --allow-remote
    --token-file ../token --run-id "$RUN")
  ((SYNCER_SHARDS == 1)) || SYNCER_FLAGS+=(--shard "$s" --shards "$SYNCER_SHARDS")
  if [[ -n $TLS_DIR ]]; then
    SYNCER_FLAGS+=(--tls-cert ../tls/syncer.pem --tls-key ../tls/syncer.key)
    [[ -f $TLS_DIR/learner.pem ]] && SYNCER_FLAGS+=(--tls-client-ca ../tls/ca.pem)
  fi
  return 0
}

# The learner's workdir stays on its host (metrics, TensorBoard, summary.json; copied to
# BUCKET/RUN/learner_i/ by host.sh), its checkpoints go to BUCKET/RUN/learner_i/checkpoints, which every
# process of a multi-host learner reaches.
learner_flags() {
  local i=$1 syncer_ip=$2 targets=() s
  for s in "${!SHARD_PORTS[@]}"; do targets+=("$syncer_ip:${SHARD_PORTS[s]}"); done
  LEARNER_FLAGS=("${CONFIG_FLAGS[@]}" "--config.learners.devices=$(preset_chips "${L_ACCEL[i]}")"
    --syncer "$(IFS=,; echo "${targets[*]}")" --learner-id "$i" --workdir ../learner --token-file ../token
    --run-id "$RUN")
  [[ -z $BUCKET ]] || LEARNER_FLAGS+=(--checkpoint-dir "$BUCKET/$RUN/learner_$i/checkpoints")
  client_tls_flags
  LEARNER_FLAGS+=("${CLIENT_TLS[@]}")
  return 0
}

start_syncer() {
  local s
  copy_to_syncer token "diloco/$RUN/token" "$TOKEN_FILE"
  if [[ -n $TLS_DIR ]]; then
    # The learner's certificate too under mutual TLS: status.sh asks the syncer as a client from its VM.
    local tls=("$TLS_DIR/ca.pem" "$TLS_DIR/syncer.pem" "$TLS_DIR/syncer.key")
    [[ ! -f $TLS_DIR/learner.pem ]] || tls+=("$TLS_DIR/learner.pem" "$TLS_DIR/learner.key")
    copy_to_syncer tls "diloco/$RUN/tls/" "${tls[@]}"
  fi
  for s in "${!SHARD_NAMES[@]}"; do
    syncer_flags "$s"
    on_syncer "start-${SHARD_NAMES[s]}" \
      "$(host_cmd start-syncer "${SHARD_NAMES[s]}" "$SYNCER_START_TIMEOUT_S" -- "${SYNCER_FLAGS[@]}")"
    ((DRY_RUN)) || cat "$LOG_DIR/start-${SHARD_NAMES[s]}.syncer.log"
  done
}

start_learner() {
  local i=$1 syncer_ip=$2 ips hosts coordinator=- tls=() sync=-
  [[ $(qr_state "$i") == ACTIVE ]] || ((DRY_RUN)) ||
    die "slice ${L_NODE[i]} is not ACTIVE: run create.sh (or heal.sh) first"
  ips=$(worker_ips "$i")
  hosts=$(grep -c . <<< "$ips")
  copy_to_tpu token "${L_NODE[i]}" "${L_ZONE[i]}" "diloco/$RUN/token" "$TOKEN_FILE"
  if [[ -n $TLS_DIR ]]; then
    tls=("$TLS_DIR/ca.pem")
    [[ -f $TLS_DIR/learner.pem ]] && tls+=("$TLS_DIR/learner.pem" "$TLS_DIR/learner.key")
    copy_to_tpu tls "${L_NODE[i]}" "${L_ZONE[i]}" "diloco/$RUN/tls/" "${tls[@]}"
  fi
  learner_flags "$i" "$syncer_ip"
  if ((hosts > 1)); then
    coordinator="$(head -n 1 <<< "$ips"):$COORDINATOR_PORT"
    LEARNER_FLAGS+=(--init-timeout-s "$INIT_TIMEOUT_S")
  fi
  [[ -z $BUCKET ]] || sync="$BUCKET/$RUN/learner_$i"
  on_tpu start-learner "${L_NODE[i]}" "${L_ZONE[i]}" \
    "$(host_cmd start-learner "$coordinator" "$hosts" "$sync" -- "${LEARNER_FLAGS[@]}")"
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
note "starting the syncer on $SYNCER_VM ($SYNCER_IP, ports ${SHARD_PORTS[*]})"
start_syncer
jobs=()
for i in "${!L_NODE[@]}"; do jobs+=("learner-$i" "start_learner $i $SYNCER_IP"); done
note "starting ${#L_NODE[@]} learners (logs: $LOG_DIR)"
in_parallel "${jobs[@]}"
if ((DRY_RUN)); then
  note "dry run: nothing was started"
else
  note "run $RUN started; watch it with launch/tpu/status.sh, stop it with launch/tpu/stop.sh"
fi

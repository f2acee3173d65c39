# shellcheck shell=bash disable=SC2034  # variables used by the scripts that source this file
# Settings and helpers of the Cloud TPU scripts; sourced, not run. Every setting below can be set in the
# environment (launch/tpu/README.md describes them). Each script accepts --dry-run: it then prints every
# gcloud command it would run (queries included, answered with placeholders) and runs none.
set -euo pipefail
if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
  echo "error: these scripts need bash >= 4.4 (this is $BASH_VERSION; on macOS: brew install bash)" >&2
  exit 1
fi

TPU_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$TPU_DIR/../.." && pwd)
# shellcheck source=presets.sh
source "$TPU_DIR/presets.sh"

RUN=${RUN:-diloco}                           # run id; prefix of every resource name
PROJECT=${PROJECT:-}                         # empty: gcloud's configured project
LEARNERS=${LEARNERS:-v5p-8,v6e-8}            # ACCEL[@ZONE][:CAPACITY], comma-separated; "4xACCEL..." repeats
CAPACITY=${CAPACITY:-spot}                   # spot | reserved | on-demand, for learners that name none
CONFIG=${CONFIG:-configs/m150.py}            # relative to the repository; the same for every process
OVERRIDES=${OVERRIDES:-}                     # "--config.x=y ..." for every process (the fingerprint checks it)
BUCKET=${BUCKET:-}                           # gs://bucket[/prefix]: learner checkpoints and the exported model
PORT=${PORT:-50051}                          # the syncer's gRPC port
SYNCER_ZONE=${SYNCER_ZONE:-}                 # default: the first learner's zone
SYNCER_MACHINE=${SYNCER_MACHINE:-}           # default: sized from the model (sim sizing)
NETWORK=${NETWORK:-default}
INTERNAL_RANGES=${INTERNAL_RANGES:-10.0.0.0/8}  # who may reach the syncer's port: the VPC's internal ranges
TLS_DIR=${TLS_DIR:-}                         # ca.pem, syncer.pem, syncer.key [, learner.pem, learner.key]
TOKEN_FILE=${TOKEN_FILE:-$HOME/.config/diloco_jax/$RUN.token}
QR_TIMEOUT_S=${QR_TIMEOUT_S:-3600}           # how long create.sh waits for the slices to become ACTIVE
POLL_S=${POLL_S:-30}
SYNCER_START_TIMEOUT_S=${SYNCER_START_TIMEOUT_S:-1800}
STOP_TIMEOUT_S=${STOP_TIMEOUT_S:-900}        # a learner flushes, checkpoints and leaves within this
COORDINATOR_PORT=${COORDINATOR_PORT:-8476}   # jax.distributed coordinator on worker 0 of a multi-host slice
INIT_TIMEOUT_S=${INIT_TIMEOUT_S:-300}         # how long a multi-host learner's processes wait for each other
PYTHON_VERSION=${PYTHON_VERSION:-3.11}
HOST_PYTHON=${HOST_PYTHON:-}                 # a pre-built environment's python on every host: no install
SYNCER_SHARDS=${SYNCER_SHARDS:-1}            # syncer shard processes on the syncer VM (ports PORT, PORT+1...)
UV_VERSION=${UV_VERSION:-0.13.9}
SERVICE_ACCOUNT=${SERVICE_ACCOUNT:-}         # of the VMs; empty: the project's default compute service account
GCLOUD_SSH_FLAGS=${GCLOUD_SSH_FLAGS:-}       # e.g. "--internal-ip" when this machine is inside the VPC
LOG_ROOT=${LOG_ROOT:-$REPO/runs/tpu}         # here: LOG_ROOT/RUN/<script>-<time>/ logs, LOG_ROOT/RUN/ saved models

SCOPES=https://www.googleapis.com/auth/cloud-platform  # what the VMs' service account may do (gs:// access)
SYNCER_VM="$RUN-syncer"
FIREWALL_RULE="$RUN-syncer-grpc"
# shellcheck disable=SC2088  # the remote shell expands it
REMOTE="~/diloco/$RUN"                       # on every host; host.sh runs processes from $REMOTE/code
DRY_RUN=0
exec 3>&1                                    # --dry-run prints here, also from inside $(...)
exec 4>&2                                    # gcloud_failed prints here, also from a parallel job
MAIN_PID=$$                                  # gcloud_failed ends the script from any subshell
trap 'exit 1' TERM

die() {
  echo "error: $*" >&2
  exit 1
}

note() { echo "[$(date +%H:%M:%S)] $*"; }

# Words quoted for bash as one would type them: plain words as they are, others in single quotes.
quoted() {
  local w out=() q="'"
  for w in "$@"; do
    if [[ $w =~ ^[-A-Za-z0-9_./:=@,+%]+$ ]]; then out+=("$w"); else out+=("$q${w//$q/$q\\$q$q}$q"); fi
  done
  echo "${out[*]}"
}

project_flag() { [[ -z $PROJECT ]] || echo "--project=$PROJECT"; }

# --service-account=... when SERVICE_ACCOUNT is set, for the commands that create VMs.
service_account_flag() { [[ -z $SERVICE_ACCOUNT ]] || echo "--service-account=$SERVICE_ACCOUNT"; }

# gc ARGS...: run one gcloud command (with --dry-run: print it).
gc() {
  local project=()
  read -r -a project <<< "$(project_flag)"
  if ((DRY_RUN)); then
    echo "+ $(quoted gcloud "$@" "${project[@]}")" >&3
    return 0
  fi
  gcloud "$@" "${project[@]}"
}

# gq PLACEHOLDER ARGS...: the output of a read-only gcloud query, empty if what it asks about does not exist
# (gcloud's NOT_FOUND). Any other failure (credentials, permissions, a wrong project or zone) ends the
# script with gcloud's message: it must never read as "absent". With --dry-run: print the command and answer
# PLACEHOLDER.
gq() {
  local placeholder=$1 err rc=0 out
  shift
  if ((DRY_RUN)); then
    gc "$@"
    printf '%s\n' "$placeholder"
    return 0
  fi
  err=$(mktemp)
  out=$(gc "$@" 2> "$err") || rc=$?
  if ((rc == 0)); then
    rm -f "$err"
    [[ -z $out ]] || printf '%s\n' "$out"
    return 0
  fi
  if grep -qE "NOT_FOUND|was not found|could not be found" "$err"; then
    rm -f "$err"
    return 0
  fi
  gcloud_failed "gcloud $(quoted "$@") (exit $rc)" "$err"
}

# gcloud_failed WHAT ERRFILE: print gcloud's message and end the whole script (also from inside $(...) or a
# parallel job, whose own exit would be taken for an answer).
gcloud_failed() {
  # Once (parallel jobs may each fail the same way), on the script's own stderr (fd 4: a job's is a file).
  if mkdir "$LOG_DIR/gcloud-failed" 2> /dev/null; then
    {
      echo "error: $1 failed:"
      sed 's/^/  /' "$2"
    } >&4
  fi
  rm -f "$2"
  kill -TERM "$MAIN_PID" 2> /dev/null
  exit 1
}

ssh_flags() {
  local flags=()
  read -r -a flags <<< "$GCLOUD_SSH_FLAGS"
  echo "${flags[@]}"
}

# Parse LEARNERS into L_ACCEL, L_ZONE, L_CAPACITY, L_NODE (learner i runs on TPU slice L_NODE[i], whose
# queued resource has the same name).
parse_learners() {
  L_ACCEL=() L_ZONE=() L_CAPACITY=() L_NODE=()
  local items item count accel zone capacity k
  IFS=',' read -r -a items <<< "$LEARNERS"
  for item in "${items[@]}"; do
    item=${item//[[:space:]]/}
    [[ -n $item ]] || continue
    count=1
    if [[ $item =~ ^([0-9]+)x(.+)$ ]]; then
      count=${BASH_REMATCH[1]}
      item=${BASH_REMATCH[2]}
    fi
    capacity=$CAPACITY
    if [[ $item == *:* ]]; then
      capacity=${item##*:}
      item=${item%:*}
    fi
    zone=""
    if [[ $item == *@* ]]; then
      zone=${item#*@}
      item=${item%%@*}
    fi
    accel=$item
    if ! preset_runtime_version "$accel" > /dev/null || ! preset_chips "$accel" > /dev/null; then
      die "LEARNERS: no preset for accelerator type '$accel' (known: v5p-N with N a multiple of 8, v6e-1/4/8/16/.../256; presets.sh)"
    fi
    [[ -n $zone ]] || zone=$(preset_zone "$accel")
    case $capacity in spot | reserved | on-demand) ;; *) die "LEARNERS: capacity '$capacity' of $accel@$zone is not spot, reserved or on-demand" ;; esac
    for ((k = 0; k < count; k++)); do
      L_ACCEL+=("$accel")
      L_ZONE+=("$zone")
      L_CAPACITY+=("$capacity")
    done
  done
  ((${#L_ACCEL[@]} > 0)) || die "LEARNERS is empty"
  for k in "${!L_ACCEL[@]}"; do L_NODE[k]="$RUN-l$k"; done
  SYNCER_ZONE=${SYNCER_ZONE:-${L_ZONE[0]}}
}

# Checks every script makes before touching anything.
check_settings() {
  [[ $RUN =~ ^[a-z]([-a-z0-9]{0,28}[a-z0-9])?$ ]] ||
    die "RUN='$RUN': use 1-30 lowercase letters, digits and hyphens, starting with a letter (it names VMs)"
  [[ $PORT =~ ^[0-9]+$ ]] || die "PORT='$PORT' is not a port number"
  [[ -z $BUCKET || $BUCKET =~ ^gs://[a-z0-9][-_.a-z0-9]*[a-z0-9](/[^[:space:]]*[^/])?$ ]] ||
    die "BUCKET='$BUCKET': expected gs://bucket or gs://bucket/prefix (no trailing slash)"
  [[ -f $REPO/$CONFIG ]] || die "CONFIG=$CONFIG: no such file in $REPO"
  if [[ -n $TLS_DIR ]]; then
    local f
    for f in ca.pem syncer.pem syncer.key; do [[ -f $TLS_DIR/$f ]] || die "TLS_DIR=$TLS_DIR has no $f (launch/tpu/certs.sh makes them)"; done
    [[ -f $TLS_DIR/learner.pem && -f $TLS_DIR/learner.key ]] || [[ ! -f $TLS_DIR/learner.pem && ! -f $TLS_DIR/learner.key ]] ||
      die "TLS_DIR=$TLS_DIR: learner.pem and learner.key (mutual TLS) go together"
  fi
  parse_learners
  syncer_shards
}

# Parse the flags every script has (--dry-run, --help); the others are left in ARGS.
parse_common_flags() {
  ARGS=()
  local a
  for a in "$@"; do
    case $a in
      --dry-run) DRY_RUN=1 ;;
      -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
      *) ARGS+=("$a") ;;
    esac
  done
  LOG_DIR="$LOG_ROOT/$RUN/$(basename "$0" .sh)-$(date +%Y%m%d-%H%M%S)-$$"
  mkdir -p "$LOG_DIR"
}

# The Python that runs `python -m diloco_jax` here (sizing): the repository's .venv if made, else python3.
local_python() {
  if [[ -x $REPO/.venv/bin/python ]]; then echo "$REPO/.venv/bin/python"; else echo "${PYTHON:-python3}"; fi
}

# ---- remote steps: every failure names its step and its host ----

# A remote command line that runs host.sh with these arguments.
host_cmd() { echo "bash $REMOTE/host.sh $(quoted "$RUN" "$@")"; }

# on_tpu STEP NODE ZONE COMMAND: run COMMAND on every worker of slice NODE (--worker=all). Each worker's
# output goes to $LOG_DIR/STEP.NODE/<worker>.log; on failure, the failing workers are named.
on_tpu() {
  local step=$1 node=$2 zone=$3 command=$4 out rc=0 workers w
  out="$LOG_DIR/$step.$node"
  mkdir -p "$out"
  # shellcheck disable=SC2046  # ssh_flags: words on purpose
  gc compute tpus tpu-vm ssh "$node" --zone="$zone" --worker=all --command="$command" \
    --output-directory="$out" $(ssh_flags) 2> "$out/gcloud.err" || rc=$?
  ((rc == 0)) && return 0
  workers=$(sed -n 's/.*Command execution on worker \([0-9][0-9]*\) failed.*/\1/p' "$out/gcloud.err" | sort -un | paste -sd ' ' -)
  echo "FAILED: step '$step' on slice $node ($zone), worker(s) ${workers:-unknown: see $out/gcloud.err} (gcloud exit $rc)" >&2
  for w in $workers; do
    tail -n 15 "$out/$w.log" 2> /dev/null | sed "s/^/  [$node worker $w] /" >&2 || true
  done
  [[ -n $workers ]] || tail -n 15 "$out/gcloud.err" | sed "s/^/  [$node gcloud] /" >&2
  return "$rc"
}

# on_syncer STEP COMMAND: run COMMAND on the syncer VM; its output goes to $LOG_DIR/STEP.syncer.log.
on_syncer() {
  local step=$1 command=$2 out rc=0
  out="$LOG_DIR/$step.syncer.log"
  # shellcheck disable=SC2046
  gc compute ssh "$SYNCER_VM" --zone="$SYNCER_ZONE" --command="$command" $(ssh_flags) > "$out" 2>&1 || rc=$?
  ((rc == 0)) && return 0
  echo "FAILED: step '$step' on the syncer VM $SYNCER_VM ($SYNCER_ZONE) (exit $rc)" >&2
  tail -n 15 "$out" | sed "s/^/  [$SYNCER_VM] /" >&2
  return "$rc"
}

# copy_to_tpu STEP NODE ZONE DEST FILES...: scp FILES to DEST on every worker of NODE.
copy_to_tpu() {
  local step=$1 node=$2 zone=$3 dest=$4 out rc=0 workers
  shift 4
  out="$LOG_DIR/$step.$node.scp.log"
  # shellcheck disable=SC2046
  gc compute tpus tpu-vm scp "$@" "$node:$dest" --zone="$zone" --worker=all $(ssh_flags) > "$out" 2>&1 || rc=$?
  ((rc == 0)) && return 0
  workers=$(sed -n 's/.*Command execution on worker \([0-9][0-9]*\) failed.*/\1/p' "$out" | sort -un | paste -sd ' ' -)
  echo "FAILED: step '$step' (copy to $dest) on slice $node ($zone), worker(s) ${workers:-unknown} (gcloud exit $rc)" >&2
  tail -n 15 "$out" | sed "s/^/  [$node] /" >&2
  return "$rc"
}

# copy_to_syncer STEP DEST FILES...
copy_to_syncer() {
  local step=$1 dest=$2 out rc=0
  shift 2
  out="$LOG_DIR/$step.syncer.scp.log"
  # shellcheck disable=SC2046
  gc compute scp "$@" "$SYNCER_VM:$dest" --zone="$SYNCER_ZONE" $(ssh_flags) > "$out" 2>&1 || rc=$?
  ((rc == 0)) && return 0
  echo "FAILED: step '$step' (copy to $dest) on the syncer VM $SYNCER_VM ($SYNCER_ZONE) (exit $rc)" >&2
  tail -n 15 "$out" | sed "s/^/  [$SYNCER_VM] /" >&2
  return "$rc"
}

# in_parallel NAME1 "FUNC1 ARGS" NAME2 "FUNC2 ARGS" ...: run the function calls (simple words) as parallel
# jobs, wait for every one, and fail naming each that failed (their output: $LOG_DIR/NAME.out). With
# --dry-run they run one after the other, so that the printed commands stay in order.
in_parallel() {
  local names=() pids=() failed=() i
  if ((DRY_RUN)); then
    while (($#)); do $2; shift 2; done
    return 0
  fi
  while (($#)); do
    names+=("$1")
    # shellcheck disable=SC2086  # a function name and its arguments
    ($2) > "$LOG_DIR/$1.out" 2>&1 &
    pids+=($!)
    shift 2
  done
  for i in "${!pids[@]}"; do
    if wait "${pids[i]}"; then
      note "${names[i]}: done"
    else
      failed+=("${names[i]}")
      echo "--- ${names[i]} failed ($LOG_DIR/${names[i]}.out):" >&2
      tail -n 25 "$LOG_DIR/${names[i]}.out" >&2
    fi
  done
  ((${#failed[@]} == 0)) || die "failed: ${failed[*]}"
}

# ---- resources ----

# The state of learner i's queued resource (ACTIVE, WAITING_FOR_RESOURCES, ..., or empty if it has none).
qr_state() {
  gq "" compute tpus queued-resources describe "${L_NODE[$1]}" --zone="${L_ZONE[$1]}" --format="value(state.state)"
}

# The internal IPs of learner i's workers, one per line, worker 0 first.
worker_ips() {
  local i=$1 hosts k placeholder=""
  if ((DRY_RUN)); then
    hosts=$(preset_hosts "${L_ACCEL[i]}")
    for ((k = 0; k < hosts; k++)); do placeholder+="WORKER${k}_IP_OF_${L_NODE[i]}"$'\n'; done
  fi
  local ips
  ips=$(gq "${placeholder%$'\n'}" compute tpus tpu-vm describe "${L_NODE[i]}" --zone="${L_ZONE[i]}" \
    --flatten="networkEndpoints[]" --format="value(networkEndpoints.ipAddress)")
  [[ -n $ips ]] || die "cannot read the workers of slice ${L_NODE[i]} (${L_ZONE[i]}): is it ACTIVE? (status.sh)"
  echo "$ips"
}

syncer_ip() {
  local ip
  ip=$(gq "SYNCER_INTERNAL_IP" compute instances describe "$SYNCER_VM" --zone="$SYNCER_ZONE" \
    --format="value(networkInterfaces[0].networkIP)")
  [[ -n $ip ]] || die "cannot read the internal IP of $SYNCER_VM ($SYNCER_ZONE): run create.sh first"
  echo "$ip"
}

syncer_status() {
  gq "" compute instances describe "$SYNCER_VM" --zone="$SYNCER_ZONE" --format="value(status)"
}

# ---- code shipping: this working copy (tracked and untracked files, not ignored ones) to every host ----

# make_archive: writes $LOG_DIR/diloco-$RUN-code.tgz and a copy of host.sh; sets ARCHIVE and HOST_SH.
make_archive() {
  ARCHIVE="$LOG_DIR/diloco-$RUN-code.tgz"
  HOST_SH="$LOG_DIR/diloco-$RUN-host.sh"
  cp "$TPU_DIR/host.sh" "$HOST_SH"
  if git -C "$REPO" rev-parse --is-inside-work-tree > /dev/null 2>&1; then
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' f; do [[ -e $f ]] && printf '%s\0' "$f"; done |
      tar -czf "$ARCHIVE" --null -T -)
  else
    tar -czf "$ARCHIVE" -C "$REPO" --exclude=.git --exclude=.venv --exclude=runs .
  fi
  note "code: $(du -h "$ARCHIVE" | cut -f1) archive of $REPO$(git -C "$REPO" describe --always --dirty 2> /dev/null | sed 's/^/ at /')"
}

# deploy_tpu i: ship the code to every worker of learner i and install it (install.sh: uv, Python, the
# pinned deps, jax[tpu] and gcsfs), or point it at HOST_PYTHON.
deploy_tpu() {
  local i=$1
  copy_to_tpu ship "${L_NODE[i]}" "${L_ZONE[i]}" "" "$ARCHIVE" "$HOST_SH"
  on_tpu deploy "${L_NODE[i]}" "${L_ZONE[i]}" "$(deploy_cmd tpu,gcs)"
}

deploy_syncer() {
  copy_to_syncer ship "" "$ARCHIVE" "$HOST_SH"
  on_syncer deploy "$(deploy_cmd gcs)"
}

# The remote side of a deploy: host.sh into place (a rename: a running host.sh keeps its file), then
# `host.sh deploy` of the archive scp'd to the home directory. EXTRAS: the pyproject extras.
deploy_cmd() {
  echo "mkdir -p $REMOTE && mv -f diloco-$RUN-host.sh $REMOTE/host.sh && $(host_cmd deploy "diloco-$RUN-code.tgz" "$1" "$PYTHON_VERSION" "$UV_VERSION" ${HOST_PYTHON:+"$HOST_PYTHON"})"
}

# The syncer's shard processes on its VM: names (their workdirs and logs on the VM) and ports.
syncer_shards() {
  SHARD_NAMES=() SHARD_PORTS=()
  local s
  [[ $SYNCER_SHARDS =~ ^[1-9][0-9]*$ ]] || die "SYNCER_SHARDS='$SYNCER_SHARDS' is not a positive number"
  for ((s = 0; s < SYNCER_SHARDS; s++)); do
    if ((s == 0)); then SHARD_NAMES+=(syncer); else SHARD_NAMES+=("syncer$s"); fi
    SHARD_PORTS+=($((PORT + s)))
  done
}

# The TLS flags of a client of the syncer on a host (paths relative to ~/diloco/RUN/code): the CA, and the
# learner's certificate and key under mutual TLS.
client_tls_flags() {
  CLIENT_TLS=()
  [[ -n $TLS_DIR ]] || return 0
  CLIENT_TLS=(--tls-ca ../tls/ca.pem)
  [[ ! -f $TLS_DIR/learner.pem ]] || CLIENT_TLS+=(--tls-cert ../tls/learner.pem --tls-key ../tls/learner.key)
}

# A learner spanning several hosts writes one checkpoint from all of them: that needs a shared gs:// path.
check_bucket_for_multihost() {
  local i hosts
  for i in "${!L_ACCEL[@]}"; do
    hosts=$(preset_hosts "${L_ACCEL[i]}")
    ((hosts == 1)) || [[ -n $BUCKET ]] ||
      die "learner $i (${L_ACCEL[i]}) spans $hosts hosts: its checkpoints need a shared gs:// path; set BUCKET"
  done
}

# The config flags every process gets: the same file and overrides, and the run's number of learners.
config_flags() {
  local overrides=()
  read -r -a overrides <<< "$OVERRIDES"
  CONFIG_FLAGS=(--config "$CONFIG" "${overrides[@]}" "--config.learners.num=${#L_ACCEL[@]}")
}

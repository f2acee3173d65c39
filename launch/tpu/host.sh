#!/usr/bin/env bash
# The remote half of the Cloud TPU scripts: runs on the syncer VM and on every worker of every learner slice
# (create.sh and start.sh copy it to ~/diloco/RUN/host.sh). Everything of run RUN lives in ~/diloco/RUN:
#   bin/uv, python/    uv and the Python it installs (never the image's): install.sh
#   venv/              this repository, installed with its pinned dependencies (+ jax[tpu] on TPU hosts)
#   python             instead of venv/: the path of a pre-built environment's python (HOST_PYTHON)
#   code/              the working copy shipped by the last deploy (replaced only while nothing runs)
#   token, tls/        the run token (mode 600) and, with TLS, certificates
#   logs/              syncer*.log or learner.log (the supervisor's and the process's output)
#   syncer*/, learner/ workdirs (the learner's metrics; its checkpoints are on gs:// with BUCKET)
#   NAME.pid, NAME.cmd the supervisor's pid and the command it runs (NAME: syncer, syncer1.., learner);
#   NAME.state         the supervisor's restart count and last exit status
#
#   host.sh RUN deploy ARCHIVE EXTRAS PYTHON_VERSION UV_VERSION [HOST_PYTHON]
#   host.sh RUN start-syncer NAME START_TIMEOUT_S -- SYNCER_FLAGS...
#   host.sh RUN start-learner COORDINATOR NUM_PROCESSES SYNC_DEST -- LEARNER_FLAGS...
#       (COORDINATOR "-": one host; SYNC_DEST "-": no copy of logs and metrics to gs://)
#   host.sh RUN stop NAME TIMEOUT_S [SYNC_DEST]
#   host.sh RUN export SYNCER_WORKDIRS DEST -- CONFIG_FLAGS...   (python -m diloco_jax export)
#   host.sh RUN upload SRC DEST                (a directory, relative to ~, to gs://, through gcsfs)
#   host.sh RUN collect                        (logs and metrics to where the periodic copy puts them)
#   host.sh RUN status NAME [PORT TLS_FLAGS...]
set -euo pipefail

[[ $# -ge 2 ]] || { echo "usage: host.sh RUN COMMAND ARGS..." >&2; exit 2; }
RUN=$1
CMD=$2
shift 2
D="$HOME/diloco/$RUN"
PY="$D/venv/bin/python"
[[ -s $D/python ]] && PY=$(<"$D/python")
SYNC_EVERY_S=${SYNC_EVERY_S:-300}           # how often a learner's logs and metrics go to gs://
LIBTPU_LOCKFILE=${LIBTPU_LOCKFILE:-/tmp/libtpu_lockfile}
ACCEL_DEVICES=${ACCEL_DEVICES:-/dev/accel* /dev/vfio/[0-9]*}

running() {
  local f="$D/$1.pid"
  [[ -s $f ]] && kill -0 "$(<"$f")" 2>/dev/null
}

log_tail() {
  echo "--- last lines of $1:" >&2
  tail -n "${2:-30}" "$1" 2>/dev/null | tr '\r' '\n' | tail -n "${2:-30}" >&2 || true
}

# The last line of LOG that reads as an error (a traceback's last line, "error: ...").
last_error() {
  tail -c 200000 "$1" 2>/dev/null | tr '\r' '\n' | grep -v '^supervise ' |
    grep -E '(Error|Exception|error:|refused|FAILED)' | tail -n 1 || true
}

deploy() {
  local archive=$1 extras=$2 python_version=$3 uv_version=$4 prebuilt=${5:-}
  mkdir -p "$D/logs" "$D/tls"
  chmod 700 "$D"
  if running syncer || running learner; then
    echo "a process of run $RUN runs here: it keeps the code it started with (stop it to update)"
  else
    rm -rf "$D/code.new"
    mkdir "$D/code.new"
    tar -xzf "$archive" -C "$D/code.new"
    rm -rf "$D/code"
    mv "$D/code.new" "$D/code"
  fi
  rm -f "$archive"
  if [[ -n $prebuilt ]]; then
    # A pre-built environment (the container image's): the shipped code runs on it from code/, first on
    # sys.path (python -m from there), so nothing is installed.
    echo "$prebuilt" > "$D/python"
  else
    rm -f "$D/python"
    PYTHON_VERSION=$python_version UV_VERSION=$uv_version bash "$D/code/launch/tpu/install.sh" "$D" "$D/venv" \
      "$D/code" "$extras"
  fi
  [[ -s $D/python ]] && PY=$(<"$D/python") || PY="$D/venv/bin/python"
  # The processes must run the shipped code (code/ first on sys.path), with gcsfs for gs:// paths.
  (cd "$D/code" && "$PY" -c 'import os, sys, jax, gcsfs, diloco_jax
where = os.path.dirname(os.path.dirname(os.path.abspath(diloco_jax.__file__)))
if where != os.getcwd():
  sys.exit(f"diloco_jax comes from {where}, not from the shipped code {os.getcwd()}")
print(f"ready: python {sys.version.split()[0]}, jax {jax.__version__}, gcsfs {gcsfs.__version__}")')
}

# start_supervised NAME LOG COMMAND...: COMMAND under supervise.sh, from code/. The command line goes to
# NAME.cmd; with a systemd user manager it runs as the user unit diloco-RUN-NAME (enabled: a host reboot
# starts it again), else from this session with setsid (a reboot loses it: heal.sh starts it again).
start_supervised() {
  local name=$1 log=$2 unit
  shift 2
  {
    echo "cd $(printf '%q' "$D/code")"
    echo "export SUPERVISE_STATE_FILE=$(printf '%q' "$D/$name.state")"
    printf 'exec bash %q --' "$D/code/launch/tpu/supervise.sh"
    printf ' %q' "$@"
    printf ' >> %q 2>&1 < /dev/null\n' "$log"
  } > "$D/$name.cmd"
  rm -f "$D/$name.state"
  unit="diloco-$RUN-$name.service"
  write_unit "$name" > "$D/$unit"
  if systemd_user; then
    mkdir -p "$HOME/.config/systemd/user"
    cp "$D/$unit" "$HOME/.config/systemd/user/$unit"
    systemctl --user daemon-reload
    systemctl --user enable --now "$unit" > /dev/null
    systemctl --user show -p MainPID --value "$unit" > "$D/$name.pid"
  else
    setsid bash "$D/$name.cmd" &
    echo $! > "$D/$name.pid"
  fi
}

# A user manager to run units under (and lingering, so that it starts at boot); DILOCO_NO_SYSTEMD=1: none.
systemd_user() {
  [[ -z ${DILOCO_NO_SYSTEMD:-} ]] && command -v systemctl > /dev/null &&
    systemctl --user show-environment > /dev/null 2>&1 &&
    { loginctl enable-linger "$(id -un)" > /dev/null 2>&1 || true; }
}

# The systemd user unit of NAME: its command file under bash; SIGTERM to the supervisor only (it passes it
# on and waits), restarted only if the supervisor itself dies abnormally.
write_unit() {
  cat << UNIT
[Unit]
Description=diloco_jax run $RUN: $1 (supervise.sh)
After=network-online.target

[Service]
Type=simple
ExecStart=/bin/bash $D/$1.cmd
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec=${STOP_TIMEOUT_S:-900}
Restart=on-abnormal

[Install]
WantedBy=default.target
UNIT
}

# Unit or not, NAME's supervisor stops for good: disable its unit so that a reboot does not start it.
disable_unit() {
  local unit="diloco-$RUN-$1.service"
  [[ -e $HOME/.config/systemd/user/$unit ]] || return 0
  systemctl --user disable "$unit" > /dev/null 2>&1 || true
  rm -f "$HOME/.config/systemd/user/$unit"
}

start_syncer() {
  local name=$1 timeout=$2 log offset t
  shift 2
  [[ ${1:-} == "--" ]] && shift
  log="$D/logs/$name.log"
  if running "$name"; then
    echo "$name already runs (supervisor pid $(<"$D/$name.pid")): left alone"
    return 0
  fi
  chmod 600 "$D/token"
  mkdir -p "$D/$name" "$D/logs"
  rm -f "$D/$name/syncer.port"
  offset=$(stat -c %s "$log" 2> /dev/null || echo 0)
  # Under a supervisor too: a syncer that crashes later restarts from its latest checkpoint.
  start_supervised "$name" "$log" "$PY" -m diloco_jax syncer "$@"
  # Building the initial global model takes minutes for billions of parameters: wait for the port file.
  for ((t = 0; t < timeout; t += 1)); do
    if [[ -s $D/$name/syncer.port ]]; then
      echo "$name serving on port $(<"$D/$name/syncer.port") (supervisor pid $(<"$D/$name.pid"))"
      return 0
    fi
    if ! running "$name"; then
      echo "the $name exited during start" >&2
      log_tail "$log"
      return 1
    fi
    if crashed_since "$log" "$offset"; then
      echo "the $name crashed during start: stopping its supervisor" >&2
      stop_process "$name" 60 > /dev/null || true
      log_tail "$log"
      return 1
    fi
    sleep 1
  done
  echo "$name is not serving after ${timeout}s" >&2
  log_tail "$log"
  return 1
}

# Whether the supervisor logged a crash (an exit but 0 and 2, which end it) in LOG after byte OFFSET.
crashed_since() {
  tail -c "+$(($2 + 1))" "$1" | grep "^supervise .*: the command exited" | grep -qv "exited [02]\b"
}

# This worker's index in its slice (the process id of a multi-host learner), from the TPU VM's metadata
# server (GCE_METADATA_HOST overrides its address, as for Google's client libraries).
worker_number() {
  curl -sf -H "Metadata-Flavor: Google" \
    "http://${GCE_METADATA_HOST:-metadata.google.internal}/computeMetadata/v1/instance/attributes/agent-worker-number"
}

# Before a learner starts: end a stale process that holds the TPU (a learner of an earlier start that did not
# exit) and remove libtpu's lock file, as MaxText's multihost runner does.
tpu_cleanup() {
  local fd target dev pid pids=()
  for fd in /proc/[0-9]*/fd/*; do
    target=$(readlink "$fd" 2> /dev/null) || continue
    for dev in $ACCEL_DEVICES; do
      [[ $target == "$dev" ]] || continue
      pid=${fd#/proc/}
      pids+=("${pid%%/*}")
    done
  done
  if ((${#pids[@]})); then
    mapfile -t pids < <(printf '%s\n' "${pids[@]}" | sort -un)
    echo "ending stale TPU holder(s): pid ${pids[*]}"
    kill -KILL "${pids[@]}" 2> /dev/null || true
  fi
  if [[ -e $LIBTPU_LOCKFILE ]]; then
    rm -f "$LIBTPU_LOCKFILE" 2> /dev/null || sudo -n rm -f "$LIBTPU_LOCKFILE" || true
    echo "removed $LIBTPU_LOCKFILE"
  fi
}

start_learner() {
  local coordinator=$1 num_processes=$2 sync_dest=$3 log="$D/logs/learner.log" offset t worker=0
  shift 3
  [[ ${1:-} == "--" ]] && shift
  if running learner; then
    echo "the learner already runs here (supervisor pid $(<"$D/learner.pid")): left alone"
    return 0
  fi
  chmod 600 "$D/token"
  mkdir -p "$D/learner" "$D/logs"
  local distributed=()
  if [[ $coordinator != "-" ]]; then
    worker=$(worker_number) || { echo "cannot read agent-worker-number from the metadata server" >&2; return 1; }
    distributed=(--coordinator "$coordinator" --num-processes "$num_processes" --process-id "$worker")
  fi
  tpu_cleanup
  offset=$(stat -c %s "$log" 2> /dev/null || echo 0)
  start_supervised learner "$log" "$PY" -m diloco_jax learner "$@" "${distributed[@]}"
  [[ $sync_dest == "-" ]] || start_sync "$sync_dest/learner_logs/worker$worker"
  # Started: the learner printed its first line (after its model and data are built); a crash before that
  # fails the start, with the error.
  for ((t = 0; t < ${HOST_START_CHECK_S:-600}; t++)); do
    # The first line counts even if a crash followed it (the supervisor restarts it; status.sh reports it).
    if tail -c "+$((offset + 1))" "$log" | grep -qE '^learner [0-9]+( process [0-9]+)?: '; then
      echo "learner started under its supervisor (pid $(<"$D/learner.pid"))"
      return 0
    fi
    if crashed_since "$log" "$offset" || ! running learner; then
      echo "the learner crashed during start (last error: $(last_error "$log"))" >&2
      stop_process learner 60 > /dev/null || true
      log_tail "$log"
      return 1
    fi
    sleep 1
  done
  echo "the learner has not started after ${HOST_START_CHECK_S:-600}s: see $log" >&2
  return 1
}

# A background loop that copies logs/ and the learner's workdir (metrics, TensorBoard) to DEST every
# SYNC_EVERY_S, so that they outlive a preempted host.
start_sync() {
  local dest=$1
  echo "$dest" > "$D/sync.dest"
  # shellcheck disable=SC2016  # expanded by the inner bash
  setsid bash -c 'while sleep "$1"; do bash "$2" "$3" upload-host "$4" > /dev/null 2>&1 || true; done' \
    _ "$SYNC_EVERY_S" "$D/host.sh" "$RUN" "$dest" < /dev/null > /dev/null 2>&1 &
  echo $! > "$D/sync.pid"
}

# upload SRC DEST: the directory SRC to DEST (gs://...), through gcsfs (installed with the gcs extra).
upload() {
  local src=$1
  [[ $src == /* ]] || src="$HOME/$src"  # relative to the home directory, as scp's paths
  set -- "$src" "$2"
  (cd "$D/code" && "$PY" -c 'import sys, gcsfs
gcsfs.GCSFileSystem().put(sys.argv[1].rstrip("/") + "/", sys.argv[2].rstrip("/") + "/", recursive=True)' "$1" "$2")
}

# This host's logs and learner workdir to DEST.
upload_host() {
  local dest=$1
  upload "$D/logs" "$dest/logs"
  [[ ! -d $D/learner ]] || upload "$D/learner" "$dest/learner"
}

stop_process() {
  local name=$1 timeout=$2 pid t
  disable_unit "$name"
  if [[ $name == learner && -s $D/sync.pid ]]; then
    kill "$(<"$D/sync.pid")" 2> /dev/null || true
    rm -f "$D/sync.pid"
  fi
  if ! running "$name"; then
    echo "$name: not running"
    return 0
  fi
  pid=$(<"$D/$name.pid")
  kill -TERM "$pid"
  for ((t = 0; t < timeout; t++)); do
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "$name stopped"
      return 0
    fi
    sleep 1
  done
  echo "$name (pid $pid) still runs ${timeout}s after SIGTERM" >&2
  log_tail "$D/logs/$name.log" 10
  return 1
}

stop_and_upload() {
  local name=$1 timeout=$2 dest=${3:--} rc=0
  stop_process "$name" "$timeout" || rc=$?
  if [[ $dest != "-" ]]; then
    if upload_host "$dest"; then echo "logs and metrics copied to $dest"; else echo "copy to $dest failed" >&2; rc=1; fi
  fi
  return "$rc"
}

export_model() {
  local workdirs=$1 dest=$2 w
  shift 2
  [[ ${1:-} == "--" ]] && shift
  for w in ${workdirs//,/ }; do
    if running "$w"; then
      echo "$w still runs: stop it first (its last checkpoint is written at shutdown)" >&2
      return 1
    fi
  done
  cd "$D/code"
  local dirs=()
  for w in ${workdirs//,/ }; do dirs+=("$D/$w"); done
  "$PY" -m diloco_jax export --syncer-workdir "$(IFS=,; echo "${dirs[*]}")" --out "$dest" "$@"
  echo "exported the global model to $dest"
}

status() {
  local name=$1 port=${2:-} restarts last
  shift $(($# < 2 ? $# : 2))
  if running "$name"; then echo "$name: running"; else echo "$name: NOT running"; fi
  if [[ -s $D/$name.state ]]; then
    read -r _ restarts _ last < "$D/$name.state"
    if ((restarts > 0)); then
      echo "$name: CRASH LOOP? restarted $restarts time(s), last exit $last; last error: $(last_error "$D/logs/$name.log")"
    fi
  fi
  tail -c 2000 "$D/logs/$name.log" 2>/dev/null | tr '\r' '\n' | grep -v '^$' | tail -n 3 || true
  if [[ -n $port ]] && running "$name"; then
    cd "$D/code"
    "$PY" -m diloco_jax status --syncer "127.0.0.1:$port" --token-file "$D/token" "$@"
  fi
}

case $CMD in
  deploy) deploy "$@" ;;
  start-syncer) start_syncer "$@" ;;
  start-learner) start_learner "$@" ;;
  stop) stop_and_upload "$@" ;;
  export) export_model "$@" ;;
  upload) upload "$@" ;;
  upload-host) upload_host "$@" ;;
  collect) [[ ! -s $D/sync.dest ]] || upload_host "$(<"$D/sync.dest")" ;;
  status) status "$@" ;;
  *) echo "host.sh: unknown command $CMD" >&2; exit 2 ;;
esac

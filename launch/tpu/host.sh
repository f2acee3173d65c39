#!/usr/bin/env bash
# The remote half of the Cloud TPU scripts: runs on the syncer VM and on every worker of every learner slice
# (create.sh and start.sh copy it to ~/diloco/RUN/host.sh). Everything of run RUN lives in ~/diloco/RUN:
#   bin/uv, python/    uv and the Python it installs (never the image's)
#   venv/              this repository, installed with its pinned dependencies (+ jax[tpu] on TPU hosts)
#   code/              the working copy shipped by the last deploy (replaced only while nothing runs)
#   token, tls/        the run token (mode 600) and, with TLS, certificates
#   logs/              syncer.log or learner.log (the supervisor's and the learner's output)
#   syncer/, learner/  workdirs (checkpoints) unless they are on gs://; export/ the exported model
#   *.pid              the pid of the supervisor (supervise.sh) of the syncer or of the learner
#
#   host.sh RUN deploy ARCHIVE EXTRA PYTHON_VERSION UV_VERSION
#   host.sh RUN start-syncer START_TIMEOUT_S -- SYNCER_FLAGS...
#   host.sh RUN start-learner COORDINATOR NUM_PROCESSES -- LEARNER_FLAGS...   (COORDINATOR "-": one host)
#   host.sh RUN stop NAME TIMEOUT_S            (NAME: syncer | learner)
#   host.sh RUN export DEST                    (python -m diloco_jax export of the syncer's checkpoint)
#   host.sh RUN copy-workdir DEST              (gcloud storage cp -r of the syncer's workdir to gs://)
#   host.sh RUN status NAME [PORT TLS_CA]
set -euo pipefail

[[ $# -ge 2 ]] || { echo "usage: host.sh RUN COMMAND ARGS..." >&2; exit 2; }
RUN=$1
CMD=$2
shift 2
D="$HOME/diloco/$RUN"
PY="$D/venv/bin/python"

running() {
  local f="$D/$1.pid"
  [[ -s $f ]] && kill -0 "$(<"$f")" 2>/dev/null
}

log_tail() {
  echo "--- last lines of $1:" >&2
  tail -n "${2:-30}" "$1" 2>/dev/null | tr '\r' '\n' | tail -n "${2:-30}" >&2 || true
}

deploy() {
  local archive=$1 extra=$2 python_version=$3 uv_version=$4
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
  if [[ ! -x $D/bin/uv ]] || [[ $("$D/bin/uv" --version) != "uv $uv_version"* ]]; then
    curl -LsSf "https://astral.sh/uv/$uv_version/install.sh" | env UV_UNMANAGED_INSTALL="$D/bin" sh
  fi
  export UV_PYTHON_INSTALL_DIR="$D/python" UV_PYTHON_PREFERENCE=only-managed
  if [[ ! -x $PY ]] || [[ $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') != "$python_version" ]]; then
    rm -rf "$D/venv"
    "$D/bin/uv" venv --quiet --python "$python_version" "$D/venv"
  fi
  "$D/bin/uv" pip install --quiet --python "$PY" -e "$D/code${extra:+[$extra]}"
  "$PY" -c 'import sys, jax; print(f"ready: python {sys.version.split()[0]}, jax {jax.__version__}")'
}

start_syncer() {
  local timeout=$1 log="$D/logs/syncer.log" offset t
  shift
  [[ ${1:-} == "--" ]] && shift
  if running syncer; then
    echo "the syncer already runs (supervisor pid $(<"$D/syncer.pid")): left alone"
    return 0
  fi
  chmod 600 "$D/token"
  mkdir -p "$D/syncer" "$D/logs"
  rm -f "$D/syncer/syncer.port"
  offset=$(stat -c %s "$log" 2> /dev/null || echo 0)
  cd "$D/code"
  # Under a supervisor too: a syncer that crashes later restarts from its latest checkpoint.
  setsid bash "$D/code/launch/tpu/supervise.sh" -- "$PY" -m diloco_jax syncer "$@" >> "$log" 2>&1 < /dev/null &
  echo $! > "$D/syncer.pid"
  # Building the initial global model takes minutes for billions of parameters: wait for the port file.
  for ((t = 0; t < timeout; t += 2)); do
    if [[ -s $D/syncer/syncer.port ]]; then
      echo "syncer serving on port $(<"$D/syncer/syncer.port") (supervisor pid $(<"$D/syncer.pid"))"
      return 0
    fi
    if ! running syncer; then
      echo "the syncer exited during start" >&2
      log_tail "$log"
      return 1
    fi
    # Exits 0 and 2 end the supervisor too ("exited" above, once it is gone); any other exit is a crash.
    if tail -c "+$((offset + 1))" "$log" | grep "^supervise .*: the command exited" | grep -qv "exited [02]\b"; then
      echo "the syncer crashed during start: stopping its supervisor" >&2
      stop_process syncer 60 > /dev/null || true
      log_tail "$log"
      return 1
    fi
    sleep 2
  done
  echo "the syncer is not serving after ${timeout}s" >&2
  log_tail "$log"
  return 1
}

# This worker's index in its slice (the process id of a multi-host learner), from the TPU VM's metadata.
worker_number() {
  curl -sf -H "Metadata-Flavor: Google" \
    "http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number"
}

start_learner() {
  local coordinator=$1 num_processes=$2
  shift 2
  [[ ${1:-} == "--" ]] && shift
  if running learner; then
    echo "the learner already runs here (supervisor pid $(<"$D/learner.pid")): left alone"
    return 0
  fi
  chmod 600 "$D/token"
  mkdir -p "$D/learner" "$D/logs"
  local distributed=()
  if [[ $coordinator != "-" ]]; then
    local worker
    worker=$(worker_number) || { echo "cannot read agent-worker-number from the metadata server" >&2; return 1; }
    distributed=(--coordinator "$coordinator" --num-processes "$num_processes" --process-id "$worker")
  fi
  cd "$D/code"
  setsid bash "$D/code/launch/tpu/supervise.sh" -- "$PY" -m diloco_jax learner "$@" "${distributed[@]}" \
    >> "$D/logs/learner.log" 2>&1 < /dev/null &
  echo $! > "$D/learner.pid"
  sleep "${HOST_START_CHECK_S:-5}"
  if ! running learner; then
    echo "the learner's supervisor exited at once" >&2
    log_tail "$D/logs/learner.log"
    return 1
  fi
  echo "learner started under its supervisor (pid $(<"$D/learner.pid"))"
}

stop_process() {
  local name=$1 timeout=$2 pid t
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

export_model() {
  local dest=$1
  if running syncer; then
    echo "the syncer still runs: stop it first (its last checkpoint is written at shutdown)" >&2
    return 1
  fi
  cd "$D/code"
  "$PY" -m diloco_jax export --syncer-workdir "$D/syncer" --out "$dest"
  echo "exported the global model to $dest"
}

copy_workdir() {
  local dest=$1
  if running syncer; then
    echo "the syncer still runs: stop it first" >&2
    return 1
  fi
  local gcloud
  gcloud=$(command -v gcloud || echo /snap/bin/gcloud)
  "$gcloud" storage cp -r "$D/syncer" "$dest"
  echo "copied the syncer's workdir (checkpoints) to $dest"
}

status() {
  local name=$1 port=${2:-} tls_ca=${3:-}
  if running "$name"; then echo "$name: running"; else echo "$name: NOT running"; fi
  tail -c 2000 "$D/logs/$name.log" 2>/dev/null | tr '\r' '\n' | grep -v '^$' | tail -n 3 || true
  if [[ $name == syncer && -n $port ]] && running syncer; then
    cd "$D/code"
    local tls=()
    [[ -n $tls_ca ]] && tls=(--tls-ca "$D/tls/$tls_ca")
    "$PY" -m diloco_jax status --syncer "127.0.0.1:$port" --token-file "$D/token" "${tls[@]}"
  fi
}

case $CMD in
  deploy) deploy "$@" ;;
  start-syncer) start_syncer "$@" ;;
  start-learner) start_learner "$@" ;;
  stop) stop_process "$@" ;;
  export) export_model "$@" ;;
  copy-workdir) copy_workdir "$@" ;;
  status) status "$@" ;;
  *) echo "host.sh: unknown command $CMD" >&2; exit 2 ;;
esac

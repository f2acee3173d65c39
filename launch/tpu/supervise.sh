#!/usr/bin/env bash
# Keep one command running on this host: restart it after a crash, stop when it is done.
#
#   supervise.sh [--max-restarts N] -- COMMAND [ARGS...]
#
# Exit status 0 of COMMAND (finished, or stopped cleanly by SIGTERM) ends the supervision, and so does 2 (bad
# flags or config: a restart cannot help); any other status, or death by a signal, restarts it after a
# backoff that doubles from SUPERVISE_BACKOFF_S (5) to SUPERVISE_MAX_BACKOFF_S (300) and starts over after a
# run that lasted SUPERVISE_RESET_AFTER_S (600). SIGTERM or SIGINT to the supervisor goes to COMMAND, which
# is waited for (a learner flushes, checkpoints and leaves); then the supervisor exits with its status.
# The learner restarted here resumes from its checkpoint, or, without one, from the syncer's global model.
# SUPERVISE_STATE_FILE (optional): rewritten at every start with "restarts N last_exit RC" (host.sh status
# reads it to report a crash loop).
set -uo pipefail

max_restarts=0
while [[ $# -gt 0 && $1 != "--" ]]; do
  case $1 in
    --max-restarts) max_restarts=$2; shift 2 ;;
    *) echo "supervise.sh: unknown flag $1" >&2; exit 2 ;;
  esac
done
[[ ${1:-} == "--" && $# -gt 1 ]] || { echo "usage: supervise.sh [--max-restarts N] -- COMMAND [ARGS...]" >&2; exit 2; }
shift
backoff=${SUPERVISE_BACKOFF_S:-5}
max_backoff=${SUPERVISE_MAX_BACKOFF_S:-300}
reset_after=${SUPERVISE_RESET_AFTER_S:-600}

log() { echo "supervise $(date -u +%FT%TZ): $*"; }
state_file=${SUPERVISE_STATE_FILE:-}
record() { [[ -z $state_file ]] || echo "restarts $1 last_exit $2" > "$state_file"; }
child=0
stopping=0
on_signal() {
  stopping=1
  if ((child)); then kill -TERM "$child" 2>/dev/null; fi
}
trap on_signal TERM INT

delay=$backoff
restarts=0
rc=-
while true; do
  record "$restarts" "$rc"
  log "start: $*"
  started=$SECONDS
  "$@" &
  child=$!
  # A trapped signal interrupts `wait`; wait again until the child is gone, then collect its status.
  while kill -0 "$child" 2>/dev/null; do wait "$child"; done
  wait "$child"
  rc=$?
  child=0
  if ((stopping)); then log "stopped by a signal; the command exited $rc"; exit "$rc"; fi
  if ((rc == 0)); then log "the command exited 0: done"; exit 0; fi
  if ((rc == 2)); then log "the command exited 2 (bad flags or config): not restarting"; exit 2; fi
  if ((max_restarts > 0 && restarts >= max_restarts)); then log "exited $rc; $restarts restarts done: giving up"; exit "$rc"; fi
  if ((SECONDS - started >= reset_after)); then delay=$backoff; fi
  log "the command exited $rc; restart $((restarts + 1)) in ${delay}s"
  sleep "$delay" &
  sleeper=$!
  wait "$sleeper" || true
  if ((stopping)); then kill "$sleeper" 2>/dev/null; log "stopped by a signal while waiting to restart"; exit 0; fi
  restarts=$((restarts + 1))
  delay=$(awk -v d="$delay" -v m="$max_backoff" 'BEGIN { d *= 2; print (d > m ? m : d) }')
done

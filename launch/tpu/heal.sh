#!/usr/bin/env bash
# Bring the run back to full strength after preemptions and crashes: re-request every learner slice that was
# preempted (SUSPENDED) or FAILED, install the code on the new hosts, and start whatever does not run. A
# re-created learner rejoins from its checkpoint on BUCKET, or, without BUCKET, from the syncer's global
# model. (A learner process that crashes on a live host is restarted by its supervisor, without this.)
#
#   launch/tpu/heal.sh [--dry-run] [--every SECONDS]
#
# --every: repeat forever, SECONDS apart (e.g. in tmux); otherwise once. It runs
# `create.sh --deploy-new-only` and then `start.sh --no-deploy`.
# shellcheck source=common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

EVERY=0
parse_common_flags "$@"
set -- "${ARGS[@]}"
while (($#)); do
  case $1 in
    --every) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--every takes seconds"; EVERY=$2; shift 2 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
check_settings
dry=()
((DRY_RUN)) && dry=(--dry-run)
while true; do
  rc=0
  "$TPU_DIR/create.sh" --deploy-new-only "${dry[@]}" && "$TPU_DIR/start.sh" --no-deploy "${dry[@]}" || rc=$?
  ((EVERY)) || exit "$rc"
  ((rc == 0)) || note "this round failed (exit $rc, above); next one in ${EVERY}s"
  sleep "$EVERY"
done

#!/usr/bin/env bash
# A syncer and N learner processes on this machine, each learner on its own fake CPU devices.
#
#   launch/local.sh [--config configs/tiny_cpu.py] [--learners 2] [--workdir runs/local] [--config.x=y ...]
#
# A thin wrapper around `python -m diloco_jax local` (diloco_jax/runs/local.py), which does the work:
# run token, syncer, learners, per-process logs in WORKDIR/logs, progress, WORKDIR/summary.json.
# Ctrl-C stops every process cleanly. Uses .venv/bin/python if present (make test creates it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] && PY=.venv/bin/python
args=("$@")
[[ " ${args[*]-} " == *" --config "* || " ${args[*]-} " == *" --config="* ]] || args=(--config configs/tiny_cpu.py "${args[@]}")
[[ " ${args[*]} " == *" --learners"* ]] || args+=(--learners 2)
[[ " ${args[*]} " == *" --workdir"* ]] || args+=(--workdir runs/local)
exec "$PY" -m diloco_jax local "${args[@]}"

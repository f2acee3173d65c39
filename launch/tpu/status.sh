#!/usr/bin/env bash
# Each process's last log line, and the syncer's versions and counters.
set -euo pipefail
source "$(dirname "$0")/common.sh"
D="runs/$RUN"
"${G[@]}" compute ssh "$SYNCER_VM" --zone "$ZONE" --command "cd diloco_jax && tail -n 2 $D/syncer.log &&
  .venv/bin/python -c \"from diloco_jax import grpc_transport as g; from diloco_jax.syncer import server as s;
import json; t = g.GrpcTransport('127.0.0.1:$PORT', s.read_token('$D/token'), -1); st = t.status();
print(json.dumps({k: st[k] for k in ('versions', 'live', 'counters')}))\""
for i in $(seq 0 $((LEARNERS - 1))); do
  "${G[@]}" compute tpus tpu-vm ssh "$(learner_vm "$i")" --zone "$ZONE" \
      --command "tail -c 300 diloco_jax/$D/learner_$i.log | tr '\r' '\n' | tail -n 1"
done

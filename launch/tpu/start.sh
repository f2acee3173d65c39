#!/usr/bin/env bash
# Start the syncer, then one learner process per TPU VM, with the same commands as `python -m diloco_jax
# local` uses (nohup; logs in ~/diloco_jax/runs/$RUN/). The run token is generated here, copied to each
# VM as a mode-600 file, and never put on a command line.
set -euo pipefail
source "$(dirname "$0")/common.sh"
TOKEN_FILE=$(mktemp); trap 'rm -f "$TOKEN_FILE"' EXIT
(umask 077; openssl rand -hex 32 > "$TOKEN_FILE")
SYNCER_IP=$("${G[@]}" compute instances describe "$SYNCER_VM" --zone "$ZONE" \
    --format 'value(networkInterfaces[0].networkIP)')
D="runs/$RUN"
"${G[@]}" compute scp "$TOKEN_FILE" "$SYNCER_VM:/tmp/$RUN.token" --zone "$ZONE"
# --allow-remote: the syncer listens on the VPC address. Add --tls-cert/--tls-key for TLS (docs/operations.md).
"${G[@]}" compute ssh "$SYNCER_VM" --zone "$ZONE" --command "cd diloco_jax && mkdir -p $D &&
  install -m 600 /tmp/$RUN.token $D/token && rm /tmp/$RUN.token &&
  nohup .venv/bin/python -m diloco_jax syncer --config $CONFIG $OVERRIDES --workdir $D/syncer \
    --bind 0.0.0.0:$PORT --allow-remote --token-file $D/token --run-id $RUN > $D/syncer.log 2>&1 & echo \$! > $D/syncer.pid"
for i in $(seq 0 $((LEARNERS - 1))); do
  vm=$(learner_vm "$i")
  "${G[@]}" compute tpus tpu-vm scp "$TOKEN_FILE" "$vm:/tmp/$RUN.token" --zone "$ZONE"
  # The learner uses the VM's chips (config.learners.devices of them); it retries until the syncer is up.
  "${G[@]}" compute tpus tpu-vm ssh "$vm" --zone "$ZONE" --command "cd diloco_jax && mkdir -p $D &&
    install -m 600 /tmp/$RUN.token $D/token && rm /tmp/$RUN.token &&
    nohup .venv/bin/python -m diloco_jax learner --config $CONFIG $OVERRIDES --syncer $SYNCER_IP:$PORT \
      --learner-id $i --workdir $D/learner_$i --token-file $D/token --run-id $RUN > $D/learner_$i.log 2>&1 & echo \$! > $D/learner.pid"
done
echo "started; watch with: launch/tpu/status.sh"

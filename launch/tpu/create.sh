#!/usr/bin/env bash
# Create the syncer VM (CPU) and $LEARNERS TPU VMs, and install this repository on each (make's .venv).
set -euo pipefail
source "$(dirname "$0")/common.sh"
: "${REPO_URL:?set REPO_URL to a git URL of this repository that the VMs can clone}"
SETUP="set -e; sudo apt-get -qq update && sudo apt-get -qq install -y git python3-venv make;
  [ -d diloco_jax ] || git clone -q $REPO_URL diloco_jax; cd diloco_jax && git fetch -q && git checkout -q $REF;
  make .venv/.installed"
"${G[@]}" compute instances create "$SYNCER_VM" --zone "$ZONE" --machine-type "$SYNCER_MACHINE" \
    --image-family ubuntu-2204-lts --image-project ubuntu-os-cloud --tags diloco-syncer
for i in $(seq 0 $((LEARNERS - 1))); do
  "${G[@]}" compute tpus tpu-vm create "$(learner_vm "$i")" --zone "$ZONE" --accelerator-type "$ACCEL" \
      --version "$TPU_VERSION" &
done
wait
# Learners reach the syncer on its internal IP only (same VPC); nothing is opened to the internet.
"${G[@]}" compute firewall-rules create "$RUN-grpc" --allow "tcp:$PORT" --source-ranges 10.0.0.0/8 \
    --target-tags diloco-syncer 2>/dev/null || true
"${G[@]}" compute ssh "$SYNCER_VM" --zone "$ZONE" --command "$SETUP"
for i in $(seq 0 $((LEARNERS - 1))); do
  # jax[tpu] replaces the CPU jaxlib on TPU VMs (same jax version as pyproject.toml pins).
  "${G[@]}" compute tpus tpu-vm ssh "$(learner_vm "$i")" --zone "$ZONE" --command "$SETUP;
    .venv/bin/pip install -q 'jax[tpu]==0.10.2'" &
done
wait
echo "created $SYNCER_VM and $LEARNERS learners; next: launch/tpu/start.sh"

# Shared settings of the Cloud TPU VM scripts; sourced, not run. Override any of them in the environment.
RUN=${RUN:-diloco-$(whoami)}                 # name prefix of every VM, and the run id
PROJECT=${PROJECT:-$(gcloud config get-value project 2>/dev/null)}
ZONE=${ZONE:-us-central2-b}                  # a zone that has the accelerator below
ACCEL=${ACCEL:-v4-8}                         # one learner = one single-host TPU VM slice
TPU_VERSION=${TPU_VERSION:-tpu-ubuntu2204-base}
SYNCER_MACHINE=${SYNCER_MACHINE:-n2-standard-8}
LEARNERS=${LEARNERS:-2}
CONFIG=${CONFIG:-configs/small_cpu.py}       # same file and overrides on every VM (the fingerprint checks it)
OVERRIDES=${OVERRIDES:-}                     # e.g. "--config.train.steps=2000"
PORT=${PORT:-50051}
REPO_URL=${REPO_URL:-}                       # git URL of this repository, reachable from the VMs (create.sh)
REF=${REF:-main}
SYNCER_VM="$RUN-syncer"
learner_vm() { echo "$RUN-learner-$1"; }
G=(gcloud --project "$PROJECT")

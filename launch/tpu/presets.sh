# shellcheck shell=bash disable=SC2034  # SYNCER_MACHINES is read by create.sh
# Hardware presets of the Cloud TPU scripts, in one place; sourced by common.sh. To add a generation, add a
# case to each function below.
#
# Accelerator types name the slice size: v5p-N has N TensorCores (N/2 chips, 4 chips per host VM); v6e-N
# has N chips (up to 8 on one host VM; larger slices have 4 chips per host VM).

# The TPU software (runtime) version to create a slice of this accelerator type with.
preset_runtime_version() {
  case "$1" in
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) return 1 ;;
  esac
}

# The zone used when a learner spec names none (check your quota there: docs/tpu.md, "Quotas").
preset_zone() {
  case "$1" in
    v5p-*) echo "us-east5-a" ;;
    v6e-*) echo "us-east1-d" ;;
    *) return 1 ;;
  esac
}

# Chips in a slice of this accelerator type (a learner's `learners.devices`).
preset_chips() {
  local n=${1##*-}
  [[ $n =~ ^[0-9]+$ ]] || return 1
  case "$1" in
    v5p-*) ((n >= 8 && n % 8 == 0)) || return 1; echo $((n / 2)) ;;
    v6e-*) case $n in 1 | 4 | 8 | 16 | 32 | 64 | 128 | 256) echo "$n" ;; *) return 1 ;; esac ;;
    *) return 1 ;;
  esac
}

# Host VMs (workers) expected in a slice. Only --dry-run uses it: a real run asks the created slice.
preset_hosts() {
  local chips
  chips=$(preset_chips "$1") || return 1
  case "$1" in
    v5p-*) echo $((chips / 4)) ;;
    v6e-*) if ((chips <= 8)); then echo 1; else echo $((chips / 4)); fi ;;
  esac
}

# The syncer's machine: the smallest of these whose memory holds the sizing estimate with headroom.
# "machine-type GB" lines, ascending. n2-highmem: 8 GB per vCPU, network egress up to 2 Gbit/s per vCPU
# (32 Gbit/s from 16 vCPUs on); m3-ultramem past n2's largest.
SYNCER_MACHINES="n2-highmem-8 64
n2-highmem-16 128
n2-highmem-32 256
n2-highmem-48 384
n2-highmem-64 512
n2-highmem-80 640
n2-highmem-96 768
n2-highmem-128 864
m3-ultramem-32 976
m3-ultramem-64 1952
m3-ultramem-128 3904"

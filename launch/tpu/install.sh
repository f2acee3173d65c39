#!/usr/bin/env bash
# Install this repository with its pinned dependencies into a virtual environment. The same steps run on
# every host of a run (host.sh deploy) and in the container image (Dockerfile), so the image is what a
# deploy makes.
#
#   install.sh TOOLS VENV CODE EXTRAS
#
# TOOLS: where uv (TOOLS/bin/uv, version UV_VERSION) and the Python it manages (TOOLS/python, version
# PYTHON_VERSION) go, never the image's own; VENV: the virtual environment, made (or remade when its Python
# is not PYTHON_VERSION); CODE: the repository; EXTRAS: pyproject extras, comma-separated (tpu,gcs on a TPU
# host, gcs elsewhere). PIP_ARGS: more flags for `uv pip install` (e.g. "--no-index --find-links DIR" for
# an offline install from a wheel directory). INSTALL_DRY_RUN=1 prints each step instead of running it.
set -euo pipefail

[[ $# -eq 4 ]] || { echo "usage: install.sh TOOLS VENV CODE EXTRAS" >&2; exit 2; }
tools=$1 venv=$2 code=$3 extras=$4
python_version=${PYTHON_VERSION:-3.11}
uv_version=${UV_VERSION:-0.13.9}
pip_args=()
read -r -a pip_args <<< "${PIP_ARGS:-}"
uv="$tools/bin/uv"

step() {
  if [[ -n ${INSTALL_DRY_RUN:-} ]]; then echo "+ $*"; else "$@"; fi
}

get_uv() {
  curl -LsSf "https://astral.sh/uv/$uv_version/install.sh" | env UV_UNMANAGED_INSTALL="$tools/bin" sh
}

if [[ ! -x $uv ]] || [[ $("$uv" --version) != "uv $uv_version"* ]]; then
  step get_uv
fi
export UV_PYTHON_INSTALL_DIR="$tools/python" UV_PYTHON_PREFERENCE=only-managed
if [[ ! -x $venv/bin/python ]] ||
  [[ $("$venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])') != "$python_version" ]]; then
  step rm -rf "$venv"
  step "$uv" venv --quiet --python "$python_version" "$venv"
fi
step "$uv" pip install --quiet --python "$venv/bin/python" "${pip_args[@]}" -e "$code${extras:+[$extras]}"

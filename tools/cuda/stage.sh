#!/usr/bin/env bash
# Builds the CUDA backend's test binary and kernel lab and copies them to .cuda-stage/, to
# carry to a machine with an NVIDIA GPU and no Rust toolchain. There:
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH   # where libnvrtc.so lives
#   .cuda-stage/bit_exact --ignored       # the CUDA-vs-CPU bit-exactness tests
#   .cuda-stage/cuda-lab [--json]         # checks, then timings
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p sluice-cuda --bin cuda-lab
test_bin=$(cargo test --release -p sluice-cuda --test bit_exact --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "bit_exact":
        print(m["executable"])')
mkdir -p .cuda-stage
cp target/release/cuda-lab "$test_bin" .cuda-stage/
mv .cuda-stage/"$(basename "$test_bin")" .cuda-stage/bit_exact
ls -la .cuda-stage

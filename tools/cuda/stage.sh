#!/usr/bin/env bash
# Builds the CUDA backend's test binary and kernel lab and copies them to .cuda-stage/, to
# carry to a machine with an NVIDIA GPU and no Rust toolchain. There:
#   export LD_LIBRARY_PATH=/usr/local/cuda/lib64:$LD_LIBRARY_PATH   # where libnvrtc.so lives
#   .cuda-stage/bit_exact --ignored       # the CUDA-vs-CPU bit-exactness tests
#   .cuda-stage/vram_cache --ignored      # the VRAM expert tier
#   .cuda-stage/model_experts --ignored   # a model with GPU experts gives the CPU's logits
#   .cuda-stage/cuda-lab [--json]         # checks, then timings
#   .cuda-stage/sluice bench --model M --gpu-experts 8GiB   # a whole model
#   python3 bench/cuda.py --peer-bin "$(tools/cuda/build-peer.sh)"   # against llama.cpp's CUDA build
# STAGE.json records the commit the binaries were built from and whether the tree was clean,
# for bench/cuda.py's result (a copy of the tree without its git history cannot tell).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p sluice-cuda --bin cuda-lab -p sluice-cli --bin sluice
mkdir -p .cuda-stage
cargo test --release -p sluice-cuda --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, shutil, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".cuda-stage/" + m["target"]["name"])'
cp target/release/cuda-lab target/release/sluice .cuda-stage/
# Symbols and line tables are not needed there, and the whole folder must travel.
for f in .cuda-stage/*; do
  if [ -x "$f" ]; then strip --strip-all "$f"; fi
done
python3 -c 'import json, sys; sys.path.insert(0, "bench"); import lib; print(json.dumps(lib.git_state()))' >.cuda-stage/STAGE.json
ls -la .cuda-stage

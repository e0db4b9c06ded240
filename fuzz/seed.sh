#!/usr/bin/env bash
# Recreates the seed corpora fuzz/corpus/{gguf,safetensors} from the repository's test files
# (see examples/gen_seeds.rs for what goes in). Seeds are added to whatever the corpus already
# holds; pass --clean to start from the seeds alone.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
if [[ "${1:-}" == "--clean" ]]; then
    rm -rf "$here/corpus/gguf" "$here/corpus/safetensors"
fi
# A plain (non-fuzzing) build of the generator, in its own target directory so that it never
# mixes with cargo fuzz's instrumented builds.
cargo run --quiet --release --manifest-path "$here/Cargo.toml" --target-dir "$here/target/seedgen" \
    --example gen_seeds -- "$root" "$here/corpus"

#!/usr/bin/env bash
# The llama.cpp peer built for avx512 (see install-llama-cpp.sh); prints its binaries' directory.
exec "$(dirname "$0")/install-llama-cpp.sh" avx512

#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: unpacks the binaries tools/cuda/stage.sh packed (into
# .cuda-stage/bin) and runs every CUDA test, the GPU-only ones included; exits non-zero when
# one fails. NVRTC is looked for in /usr/local/cuda/lib64 too.
#
#   tools/cuda/gpu-tests.sh
set -uo pipefail
stage="$(cd "$(dirname "$0")/../.." && pwd)/.cuda-stage"
[ -d "$stage/bin" ] || tar xJf "$stage/binaries.tar.xz" -C "$stage" || exit 1
export LD_LIBRARY_PATH="/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
cat "$stage/STAGE.json" 2>/dev/null
status=0
for t in "$stage"/bin/*; do
  case "$(basename "$t")" in sluice | cuda-lab) continue ;; esac
  echo "== $(basename "$t")"
  out=$("$t" --include-ignored --test-threads 1 2>&1)
  rc=$?
  grep -E '^test |test result|panicked|left:|right:' <<<"$out"
  [ "$rc" -eq 0 ] || status=1
done
exit $status

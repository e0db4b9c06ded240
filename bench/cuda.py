#!/usr/bin/env python3
"""Routed experts on an NVIDIA GPU: sluice's --gpu-experts against llama.cpp's CUDA build, on
the same synthetic Qwen3-30B-A3B GGUF, in the same run.

Runs on a GPU machine that may lack a Rust toolchain, git and network, from the binaries
tools/cuda/stage.sh put in .cuda-stage/ (.cuda-stage/STAGE.json names the commit they were
built from) and a llama.cpp built there by tools/cuda/build-peer.sh from the same PyPI sdist
as the CPU peer.

Cases (each tool: one warm-up and --reps timed repetitions per test, llama-bench's protocol):
  resident     llama.cpp: everything in VRAM (-ngl 99).
               sluice: every routed expert in VRAM (--gpu-experts of the experts' size).
  experts-1/8  sluice: a VRAM expert tier of 1/8 of the experts' bytes, the rest in host RAM
               (decode steps copy every miss to the tier; prefill's products copy them or
               have the CPU compute them, whichever finishes the layer sooner).
               llama.cpp: -ngl 99 with the experts of the first N layers on the CPU (-ncmoe):
               N = all layers (every expert computed by the CPU: the usual setting) and N =
               7/8 of the layers (the same VRAM share for experts as sluice's tier); the
               better of the two is the denominator.
  cpu          sluice with no GPU, for reference (no ratio).
sluice's dense matrices are in VRAM. Decode steps run whole on the GPU (attention, norms, the
KV cache and each MoE layer's routing in VRAM; the host steps in only to acquire experts the
tier does not hold), prefill sends each product to the GPU with attention on the CPU. Beside
the resident case two variants run once: --gpu-per-product (decode steps on the host, each
product on the GPU: the CPU's bits) and --cpu-dense (dense products on the CPU too).
--ratios-only leaves out the cases with no ratio (those two variants and the run with no GPU).

    python3 bench/cuda.py --peer-bin DIR [--model M.gguf] [--threads 16] [--ratios-only] [--out DIR]
"""

import argparse
import json
import os
import subprocess

import lib

STAGE = os.path.join(lib.ROOT, ".cuda-stage")


def gpu():
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"], text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"no NVIDIA GPU here (nvidia-smi: {e})")
    name, driver, mem, cap = [x.strip() for x in out.splitlines()[0].split(",")]
    return {"name": name, "driver": driver, "memory": mem, "compute_capability": cap}


def sluice_case(exe, model, a, gpu_bytes, extra=()):
    cmd = [exe, "bench", "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "--json"]
    if gpu_bytes:
        cmd += ["--gpu-experts", f"{gpu_bytes // 2**20}MiB"]
    cmd += list(extra)
    r = lib.last_json(lib.run(cmd)["out"])
    out = {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"], "placement": r["experts"]["placement"]}
    # The GPU's counters and placement, over both tests.
    for k in ("gpu_placement", "gpu_experts", "gpu_dense_placement", "gpu_dense", "gpu_step_placement", "gpu_step"):
        if k in r:
            out[k] = r[k]
    return cmd, out


def peer_case(d, model, a, ncmoe):
    cmd = [os.path.join(d, "llama-bench"), "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "-ngl", "99", "-o", "json"]
    if ncmoe:
        cmd += ["-ncmoe", str(ncmoe)]
    r = lib.run(cmd, env=lib.peer_env(d), check=False)
    if r["rc"] != 0:
        return cmd, {"failed": lib.describe_exit(r["rc"]), "stderr_tail": r["err"][-600:]}
    m = {}
    for row in json.loads(r["out"]):
        if row["n_prompt"] > 0 and row["n_gen"] == 0:
            m["prefill_tok_s"] = row["avg_ts"]
        elif row["n_gen"] > 0 and row["n_prompt"] == 0:
            m["decode_tok_s"] = row["avg_ts"]
    return cmd, m


def ratio(s, peers, key):
    vals = [p[key] for p in peers if key in p]
    return round(s[key] / max(vals), 3) if vals and key in s else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer-bin", required=True, metavar="DIR", help="llama.cpp's CUDA binaries (tools/cuda/build-peer.sh prints the directory)")
    ap.add_argument("--model", help="GGUF to run (default: sluice synth --shape qwen3-30b-a3b into /tmp)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ratios-only", action="store_true", help="leave out the cases that have no ratio: the resident case with --gpu-per-product and with --cpu-dense, and the run with no GPU")
    ap.add_argument("--out", metavar="DIR", default=lib.RESULTS, help="where the result goes (default: bench/results)")
    a = ap.parse_args()

    if not os.path.isdir(os.path.join(STAGE, "bin")):
        subprocess.check_call(["tar", "xJf", os.path.join(STAGE, "binaries.tar.xz"), "-C", STAGE])
    exe = os.path.join(STAGE, "bin", "sluice")
    with open(os.path.join(STAGE, "STAGE.json")) as f:
        state = json.load(f)
    model = a.model
    if not model:
        model = "/tmp/qwen3-30b-a3b-q4_k_m.gguf"
        if not os.path.exists(model):
            lib.run([exe, "synth", "--shape", "qwen3-30b-a3b", "--out", model])
    info = lib.last_json(lib.run([exe, "inspect", "--json", model])["out"])
    layers, expert_bytes = info["layers"], info["expert_bytes"]
    # Every routed expert: a tier slot holds the largest expert's three matrices, each
    # aligned, so the tier needs more than the experts' mean size (a quarter more covers
    # Q4_K_M's mix of Q4_K and Q6_K down projections); and 1/8 of the experts' bytes.
    everything = expert_bytes + expert_bytes // 4
    eighth = expert_bytes // 8
    ncmoe_share = layers - layers // 8

    cases, cmds = {}, {}

    def measured(key, case):
        # Each measurement is logged as it lands: a run cut short still says what it measured.
        cmds[key], r = case
        lib.log(json.dumps({key: r}))
        return r

    s_res = measured("sluice_resident", sluice_case(exe, model, a, everything))
    p_res = measured("peer_resident", peer_case(a.peer_bin, model, a, 0))
    s_8 = measured("sluice_eighth", sluice_case(exe, model, a, eighth))
    p_all = measured("peer_ncmoe_all", peer_case(a.peer_bin, model, a, layers))
    p_share = measured("peer_ncmoe_share", peer_case(a.peer_bin, model, a, ncmoe_share))
    cases["resident"] = {
        "sluice": s_res,
        "peer": p_res,
        "ratio": {k: ratio(s_res, [p_res], k) for k in ("prefill_tok_s", "decode_tok_s")},
    }
    # The cases with no ratio come last, so that a run cut short has the compared ones.
    if not a.ratios_only:
        cases["resident"]["sluice_per_product"] = measured("sluice_resident_per_product", sluice_case(exe, model, a, everything, ["--gpu-per-product"]))
        cases["resident"]["sluice_cpu_dense"] = measured("sluice_resident_cpu_dense", sluice_case(exe, model, a, everything, ["--cpu-dense"]))
    cases["experts-1/8"] = {
        "sluice": s_8,
        "sluice_gpu_expert_bytes": eighth,
        "peer_ncmoe_all": dict(p_all, ncmoe=layers),
        "peer_ncmoe_share": dict(p_share, ncmoe=ncmoe_share),
        "ratio": {k: ratio(s_8, [p_all, p_share], k) for k in ("prefill_tok_s", "decode_tok_s")},
    }
    if not a.ratios_only:
        cases["cpu"] = {"sluice": measured("sluice_cpu", sluice_case(exe, model, a, 0))}
    m = lib.machine()
    m["gpu"] = gpu()
    result = {
        "name": "cuda-qwen3-30b-a3b",
        "clean": state["clean"],
        "git": state,
        "date": lib.now_iso(),
        "machine": m,
        "sluice": {"version": lib.version(state), "gpu_backend": "decode steps whole on the GPU (attention, norms, KV cache, routing, dense and expert products; the host only acquires experts the VRAM tier lacks); prefill: each product on the GPU, attention and norms on the CPU"},
        "peer": {"version": lib.PEER_VERSION, "backend": "CUDA (tools/cuda/build-peer.sh)"},
        "model": dict(lib.model_info(model), layers=layers, expert_bytes=expert_bytes, dense_bytes=info["dense_bytes"]),
        "protocol": {"threads": a.threads, "n_prompt": a.prompt, "n_gen": a.gen, "reps": a.reps, "ratios_only": a.ratios_only},
        "commands": cmds,
        "cases": cases,
    }
    os.makedirs(a.out, exist_ok=True)
    day = lib.now_iso()[:10]
    path = os.path.join(a.out, f"{result['name']}-{day}{'' if state['clean'] else '-dirty'}.json")
    n = 2
    while os.path.exists(path):
        path = os.path.join(a.out, f"{result['name']}-{day}-{n}{'' if state['clean'] else '-dirty'}.json")
        n += 1
    with open(path, "x") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))
    lib.log("wrote " + path)


if __name__ == "__main__":
    main()

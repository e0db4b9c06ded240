#!/usr/bin/env python3
"""Resident prefill and decode, sluice against llama.cpp on the same GGUF file.

Protocol (bench/README.md): the same file, threads, prompt length and generation length for
both; rounds alternate sluice, llama.cpp --repack 0, llama.cpp --repack 1; each tool does one
warm-up and `--reps` timed repetitions per test (llama-bench's own protocol, which `sluice
bench` follows). The ratio of a round is sluice over the better of the two llama.cpp settings
in that round; the result quotes the median ratio and its spread. Beside the decode rate
stands its bound: bytes one decode step reads (sluice inspect) over the memory bandwidth the
kernel lab measures at the same thread count.

    python3 bench/resident.py --model M.gguf [--model N.gguf] [--threads 2] [--rounds 3]
"""

import argparse
import json
import os

import lib


def sluice_round(exe, model, a):
    cmd = [exe, "bench", "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "--json"]
    r = lib.last_json(lib.run(cmd)["out"])
    return cmd, {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]}


def peer_round(d, model, a, repack):
    exe = os.path.join(d, "llama-bench")
    cmd = [exe, "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "--repack", str(repack), "-o", "json"]
    rows = json.loads(lib.run(cmd, env=lib.peer_env(d))["out"])
    m = {}
    for row in rows:
        if row["n_prompt"] > 0 and row["n_gen"] == 0:
            m["prefill_tok_s"] = row["avg_ts"]
        elif row["n_gen"] > 0 and row["n_prompt"] == 0:
            m["decode_tok_s"] = row["avg_ts"]
    return cmd, m


def bench_model(model, a, peer, exe, bw):
    info = lib.last_json(lib.run([exe, "inspect", "--json", model])["out"])
    per_token = info["decode_bytes_per_token"]
    rounds = []
    cmds = {}
    for i in range(a.rounds):
        lib.log(f"round {i + 1}/{a.rounds} {os.path.basename(model)}")
        cmds["sluice"], s = sluice_round(exe, model, a)
        cmds["repack0"], p0 = peer_round(peer, model, a, 0)
        cmds["repack1"], p1 = peer_round(peer, model, a, 1)
        rounds.append({"sluice": s, "repack0": p0, "repack1": p1})
        lib.log(f"  sluice {s}  repack0 {p0}  repack1 {p1}")

    def best_peer(r, k):
        return max(r["repack0"][k], r["repack1"][k])

    def med(tool, k):
        return lib.summary([r[tool][k] for r in rounds])["median"]

    ratios = {
        k.split("_")[0]: lib.ratio_summary([r["sluice"][k] / best_peer(r, k) for r in rounds]) for k in ("decode_tok_s", "prefill_tok_s")
    }
    best_setting = {
        k: ("--repack 0" if med("repack0", k) >= med("repack1", k) else "--repack 1") for k in ("decode_tok_s", "prefill_tok_s")
    }
    bound = bw * 1e9 / per_token
    decode = med("sluice", "decode_tok_s")
    return {
        "name": "resident-" + os.path.splitext(os.path.basename(model))[0],
        "date": lib.now_iso(),
        "machine": lib.machine(),
        "model": dict(lib.model_info(model), architecture=info["architecture"], decode_bytes_per_token=per_token),
        "protocol": {
            "prompt_tokens": a.prompt,
            "gen_tokens": a.gen,
            "threads": a.threads,
            "rounds": a.rounds,
            "reps_per_round": a.reps,
            "order": "sluice, llama.cpp --repack 0, llama.cpp --repack 1, each round",
        },
        "sluice": {
            "version": lib.git_sha(),
            "command": " ".join(cmds["sluice"]),
            "metrics": {"decode_tok_s": decode, "prefill_tok_s": med("sluice", "prefill_tok_s")},
        },
        "peer": {
            "name": "llama.cpp",
            "version": lib.PEER_VERSION,
            "command": " ".join(cmds["repack0"]) + "  |  --repack 1",
            "best_setting": best_setting,
            "metrics": {
                "repack0": {k: med("repack0", k) for k in ("decode_tok_s", "prefill_tok_s")},
                "repack1": {k: med("repack1", k) for k in ("decode_tok_s", "prefill_tok_s")},
            },
        },
        "ratios": ratios,
        "bound": {
            "decode_tok_s": bound,
            "sluice_fraction": decode / bound,
            "basis": f"{per_token} bytes read per decode step (sluice inspect) / {bw:.1f} GB/s memory bandwidth at {a.threads} threads (kernel-lab)",
        },
        "rounds": rounds,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="GGUF file (repeat for several)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per test per round")
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=64)
    a = ap.parse_args()
    exe = lib.sluice_bin()
    peer = lib.peer_dir()
    bw = lib.memory_bandwidth(a.threads)
    lib.log(f"memory bandwidth at {a.threads} threads: {bw:.1f} GB/s")
    for m in a.model:
        r = bench_model(m, a, peer, exe, bw)
        r["bound"]["memory_gb_s"] = bw
        lib.write_result(r["name"], r)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Resident prefill and decode, sluice against llama.cpp on the same GGUF file.

Protocol (bench/README.md): the same file, threads, prompt length and generation length for
both; rounds alternate sluice, llama.cpp --repack 0, llama.cpp --repack 1; each tool does one
warm-up and `--reps` timed repetitions per test (llama-bench's own protocol, which `sluice
bench` follows). The ratio of a round is sluice over the better of the two llama.cpp settings
in that round; the result quotes the median ratio and its spread. Beside the decode rate
stands its bound: bytes one decode step reads (sluice inspect) over the memory bandwidth the
kernel lab measures at the same thread count.

Both sides' SIMD level is recorded: sluice's as the kernel lab reports it under the same
SLUICE_ISA (`--sluice-isa avx2` runs sluice at AVX2 on an AVX-512 machine), llama.cpp's as its
CPU backend was compiled (`--peer-bin DIR` takes a build without AVX-512, made by
tools/peer/install-llama-cpp-avx2.sh). The tree must be clean (or `--allow-dirty`, and the
result says "clean": false).

    python3 bench/resident.py --model M.gguf [--model N.gguf] [--threads 2] [--rounds 3]
        [--sluice-isa avx2] [--peer-bin DIR]
"""

import argparse
import json
import os

import lib


def sluice_round(exe, model, a):
    cmd = [exe, "bench", "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "--json"]
    r = lib.last_json(lib.run(cmd, env=lib.sluice_env(a.sluice_isa))["out"])
    return cmd, {"prefill_tok_s": r["prefill_tok_s"], "decode_tok_s": r["decode_tok_s"]}, r.get("experts", {}).get("routing_note")


def peer_round(d, model, a, repack):
    """One llama-bench run at `--repack` (0 or 1): (command, metrics or None, failure or None).
    A setting that dies (e.g. SIGILL where the CPU lists AMX but the kernel withholds its tile
    registers) is reported as such, and the round's ratio uses the setting that ran."""
    exe = os.path.join(d, "llama-bench")
    cmd = [exe, "-m", model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen), "-r", str(a.reps), "--repack", str(repack), "-o", "json"]
    r = lib.run(cmd, env=lib.peer_env(d), check=False)
    if r["rc"] != 0:
        why = lib.describe_exit(r["rc"])
        lib.log(f"  llama.cpp --repack {repack} failed: {why}")
        return cmd, None, {"exit": r["rc"], "why": why, "stderr_tail": r["err"][-600:]}
    rows = json.loads(r["out"])
    m = {}
    for row in rows:
        if row["n_prompt"] > 0 and row["n_gen"] == 0:
            m["prefill_tok_s"] = row["avg_ts"]
        elif row["n_gen"] > 0 and row["n_prompt"] == 0:
            m["decode_tok_s"] = row["avg_ts"]
    return cmd, m, None


def bench_model(model, a, peer, exe, bw, state, isas):
    info = lib.last_json(lib.run([exe, "inspect", "--json", model])["out"])
    per_token = info["decode_bytes_per_token"]
    rounds = []
    cmds = {}
    failures = {"repack0": [], "repack1": []}
    routing_note = None
    for i in range(a.rounds):
        lib.log(f"round {i + 1}/{a.rounds} {os.path.basename(model)}")
        cmds["sluice"], s, routing_note = sluice_round(exe, model, a)
        cmds["repack0"], p0, f0 = peer_round(peer, model, a, 0)
        cmds["repack1"], p1, f1 = peer_round(peer, model, a, 1)
        for key, f in (("repack0", f0), ("repack1", f1)):
            if f:
                failures[key].append(dict(f, round=i + 1))
        rounds.append({"sluice": s, "repack0": p0, "repack1": p1})
        lib.log(f"  sluice {s}  repack0 {p0}  repack1 {p1}")
    ran = [k for k in ("repack0", "repack1") if any(r[k] for r in rounds)]
    if not ran:
        raise RuntimeError("llama.cpp failed in every setting: %s" % json.dumps(failures))

    def best_peer(r, k):
        vals = [r[s][k] for s in ran if r[s]]
        return max(vals) if vals else None

    def med(tool, k):
        s = lib.summary([r[tool][k] for r in rounds if r[tool]])
        return s["median"] if s else None

    ratios = {
        k.split("_")[0]: lib.ratio_summary([r["sluice"][k] / best_peer(r, k) for r in rounds if best_peer(r, k)])
        for k in ("decode_tok_s", "prefill_tok_s")
    }

    def best_setting_of(k):
        m0, m1 = med("repack0", k), med("repack1", k)
        if m1 is None or (m0 is not None and m0 >= m1):
            return "--repack 0"
        return "--repack 1"

    best_setting = {k: best_setting_of(k) for k in ("decode_tok_s", "prefill_tok_s")}
    bound = bw * 1e9 / per_token
    decode = med("sluice", "decode_tok_s")
    result = lib.header("resident-" + os.path.splitext(os.path.basename(model))[0], state, a.dry_run)
    model_entry = dict(lib.model_info(model), architecture=info["architecture"], decode_bytes_per_token=per_token)
    if routing_note:
        # sluice says so for its synthetic models: their routing is not a real model's.
        model_entry["synthetic"] = True
        model_entry["routing_note"] = routing_note
    result.update(
        {
        "model": model_entry,
        "protocol": {
            "prompt_tokens": a.prompt,
            "gen_tokens": a.gen,
            "threads": a.threads,
            "rounds": a.rounds,
            "reps_per_round": a.reps,
            "order": "sluice, llama.cpp --repack 0, llama.cpp --repack 1, each round",
        },
        "sluice": {
            "version": lib.version(state),
            "isa": isas["sluice"]["isa"],
            "isa_detail": isas["sluice"],
            "command": ("SLUICE_ISA=%s " % a.sluice_isa if a.sluice_isa else "") + " ".join(cmds["sluice"]),
            "metrics": {"decode_tok_s": decode, "prefill_tok_s": med("sluice", "prefill_tok_s")},
        },
        "peer": {
            "name": "llama.cpp",
            "version": lib.PEER_VERSION,
            "bin": peer,
            "isa": isas["peer"]["isa"],
            "isa_detail": isas["peer"],
            "command": " ".join(cmds["repack0"]) + "  |  --repack 1",
            "best_setting": best_setting,
            "metrics": {
                key: ({k: med(key, k) for k in ("decode_tok_s", "prefill_tok_s")} if key in ran else {"failed": failures[key][0]["why"]})
                for key in ("repack0", "repack1")
            },
            "failures": {k: v for k, v in failures.items() if v},
        },
        "ratios": ratios,
        "bound": {
            "decode_tok_s": bound,
            "sluice_fraction": decode / bound,
            "basis": f"{per_token} bytes read per decode step (sluice inspect) / {bw:.1f} GB/s memory bandwidth at {a.threads} threads (kernel-lab)",
        },
        "rounds": rounds,
        }
    )
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", required=True, help="GGUF file (repeat for several)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per test per round")
    ap.add_argument("-p", "--prompt", type=int, default=128)
    ap.add_argument("-n", "--gen", type=int, default=64)
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty)
    build = not a.dry_run
    exe = lib.sluice_bin(build)
    peer = lib.peer_dir(a.peer_bin)
    isas = {"sluice": lib.sluice_isa(a.sluice_isa, build), "peer": lib.peer_isa(peer, a.model[0])}
    lib.log(f"sluice runs at {isas['sluice']['isa']}; llama.cpp in {peer} is built for {isas['peer']['isa']}")
    bw = lib.memory_bandwidth(a.threads, build)
    lib.log(f"memory bandwidth at {a.threads} threads: {bw:.1f} GB/s")
    for m in a.model:
        r = bench_model(m, a, peer, exe, bw, state, isas)
        r["bound"]["memory_gb_s"] = bw
        lib.write_result(r["name"], r, lib.out_dir(a))


if __name__ == "__main__":
    main()

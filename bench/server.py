#!/usr/bin/env python3
"""Aggregate generation throughput of `sluice serve` and llama-server side by side: the same
GGUF, the same threads, 1 and 8 concurrent streaming clients, alternating rounds. Each client
asks for a greedy completion of a fixed length (ignore_eos); aggregate tok/s = all generated
tokens / wall time of the round. JSON to bench/results/server-<date>.json (a clean commit on a
quiet machine only; --dry-run writes under /tmp).

  python3 bench/server.py --model ~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf --threads 2
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lib  # noqa: E402
import server_common as sc  # noqa: E402


def round_tok_s(port, clients, n):
    _, wall = sc.concurrent_streams(clients, lambda k: sc.stream_completion(port, sc.story_body(k, n)))
    return clients * n / wall


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    exe = lib.sluice_bin(build=not a.dry_run)
    peer = lib.peer_dir(a.peer_bin)
    par = max(a.concurrency)
    ctx = 1024
    sp, lp = sc.free_port(), sc.free_port()
    s_cmd = [exe, "serve", "--model", a.model, "--port", str(sp), "--threads", str(a.threads),
             "--parallel", str(par), "--ctx-size", str(ctx)]
    # llama-server's context is shared by its slots: give each slot the same context.
    l_cmd = [os.path.join(peer, "llama-server"), "-m", a.model, "--port", str(lp), "-t", str(a.threads),
             "-np", str(par), "-c", str(ctx * par), "--no-webui"]
    lib.log("sluice: " + " ".join(s_cmd))
    lib.log("llama-server: " + " ".join(l_cmd))
    procs = []
    try:
        isas = {"sluice": lib.sluice_isa(a.sluice_isa, not a.dry_run), "llama.cpp": lib.peer_isa(peer, a.model)}
        procs.append(sc.start(s_cmd, sp, env=lib.sluice_env(a.sluice_isa), log_path="/tmp/sluice-bench-server.log"))
        procs.append(sc.start(l_cmd, lp, env=lib.peer_env(peer), log_path="/tmp/llama-bench-server.log"))
        rows = {c: {"sluice": [], "llama.cpp": []} for c in a.concurrency}
        for r in range(a.rounds):
            for c in a.concurrency:
                order = [("sluice", sp), ("llama.cpp", lp)]
                if r % 2:
                    order.reverse()
                for name, port in order:
                    v = round_tok_s(port, c, a.tokens)
                    rows[c][name].append(v)
                    lib.log(f"round {r} concurrency {c}: {name} {v:.1f} tok/s")
        res = lib.header("server", state, a.dry_run)
        res.update({
            "model": lib.model_info(a.model),
            "threads": a.threads,
            "tokens_per_request": a.tokens,
            "commands": {"sluice": (["SLUICE_ISA=" + a.sluice_isa] if a.sluice_isa else []) + s_cmd, "llama.cpp": l_cmd},
            "isa": {k: v["isa"] for k, v in isas.items()},
            "isa_detail": isas,
            "peer": lib.PEER_VERSION,
            "cases": [
                {
                    "concurrency": c,
                    "sluice_tok_s": lib.summary(rows[c]["sluice"]),
                    "llama_cpp_tok_s": lib.summary(rows[c]["llama.cpp"]),
                    "ratio": lib.ratio_summary([s / l for s, l in zip(rows[c]["sluice"], rows[c]["llama.cpp"])]),
                }
                for c in a.concurrency
            ],
        })
        lib.write_result("server", res, lib.out_dir(a))
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=60)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Speculative decoding in the servers: `sluice serve` with and without n-gram drafting
(`"spec": "ngram"` per request) against llama-server without and with its n-gram speculation
(`--spec-type ngram-simple`, a server of its own), on the same GGUF, threads and prompt: the
code edit of bench/spec.py (a 60-line function written out again with one variable renamed),
one streaming client, greedy, alternating rounds.

A request's decode rate is (completion tokens - 1) / (time from its first text chunk to its
last): the prompt's prefill is left out, as `sluice run`'s and llama.cpp's decode rates leave it
out. Each server's speedup is its speculative rate over its plain rate in the same round; the
result quotes medians over rounds, the ratio of the speedups, and whether each server's
speculative text equals its plain text (greedy speculation changes no token).

    python3 bench/server_spec.py --model ~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf
        [--threads 2] [--rounds 3] [-n 512] [--draft-max 16] [--peer-bin DIR]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lib  # noqa: E402
import server_common as sc  # noqa: E402
from spec import PROMPT  # noqa: E402


def decode(port, n, **extra):
    counts = {}
    body = dict({"prompt": PROMPT, "max_tokens": n, "n_predict": n, "temperature": 0, "stream_options": {"include_usage": True}}, **extra)
    status, text, ttft, gaps, chunks, _ = sc.stream_completion(port, body, counts=counts)
    if status != 200:
        raise SystemExit(f"request failed: {status} {text[:300]}")
    tokens = counts.get("usage_tokens") or chunks
    secs = sum(gaps)
    return {"decode_tok_s": (tokens - 1) / secs if secs > 0 else None, "tokens": tokens, "ttft_s": ttft}, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--gen", type=int, default=512, help="most tokens to generate (both stop at end of turn)")
    ap.add_argument("--draft-max", type=int, default=16, help="sluice's draft_max")
    ap.add_argument(
        "--peer-spec",
        default="--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 16",
        help="llama-server's speculation flags (default: n-gram lookup of 3 tokens, drafts of up to 16)",
    )
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    exe = lib.sluice_bin(build=not a.dry_run)
    peer = lib.peer_dir(a.peer_bin)
    ctx = 4096
    sp, lp, lsp = sc.free_port(), sc.free_port(), sc.free_port()
    s_cmd = [exe, "serve", "--model", a.model, "--port", str(sp), "--threads", str(a.threads), "--parallel", "1", "--ctx-size", str(ctx), "--prefix-cache", "0"]
    l_base = [os.path.join(peer, "llama-server"), "-m", a.model, "-t", str(a.threads), "-np", "1", "-c", str(ctx), "--no-webui", "--cache-reuse", "0"]
    l_cmd = l_base + ["--port", str(lp)]
    ls_cmd = l_base + ["--port", str(lsp)] + a.peer_spec.split()
    for name, cmd in (("sluice", s_cmd), ("llama-server", l_cmd), ("llama-server spec", ls_cmd)):
        lib.log(f"{name}: " + " ".join(cmd))
    procs = []
    try:
        isas = {"sluice": lib.sluice_isa(a.sluice_isa, not a.dry_run), "llama.cpp": lib.peer_isa(peer, a.model)}
        procs.append(sc.start(s_cmd, sp, env=lib.sluice_env(a.sluice_isa), log_path="/tmp/sluice-bench-server.log"))
        procs.append(sc.start(l_cmd, lp, env=lib.peer_env(peer), log_path="/tmp/llama-bench-server.log"))
        procs.append(sc.start(ls_cmd, lsp, env=lib.peer_env(peer), log_path="/tmp/llama-bench-server-spec.log"))
        runs = {
            "sluice_plain": lambda: decode(sp, a.gen, spec="none"),
            "sluice_ngram": lambda: decode(sp, a.gen, spec="ngram", draft_max=a.draft_max),
            "llama_plain": lambda: decode(lp, a.gen),
            "llama_ngram": lambda: decode(lsp, a.gen),
        }
        # A first request each, unmeasured (allocations, page faults).
        for f in runs.values():
            f()
        rounds, texts = [], {k: set() for k in runs}
        for r in range(a.rounds):
            lib.log(f"round {r + 1}/{a.rounds}")
            row = {}
            names = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in names:
                row[name], text = runs[name]()
                texts[name].add(text)
                lib.log(f"  {name}: {row[name]['decode_tok_s']:.2f} tok/s, {row[name]['tokens']} tokens")
            rounds.append(row)
        sp_s = lib.ratio_summary([x["sluice_ngram"]["decode_tok_s"] / x["sluice_plain"]["decode_tok_s"] for x in rounds])
        sp_l = lib.ratio_summary([x["llama_ngram"]["decode_tok_s"] / x["llama_plain"]["decode_tok_s"] for x in rounds])
        med = lambda k: lib.summary([x[k]["decode_tok_s"] for x in rounds])["median"]
        result = lib.header("server_spec-" + os.path.splitext(os.path.basename(a.model))[0], state, a.dry_run)
        result.update(
            {
                "model": lib.model_info(a.model),
                "protocol": {
                    "prompt": "bench/spec.py's code edit (ChatML text, /v1/completions)",
                    "gen_tokens_max": a.gen,
                    "threads": a.threads,
                    "rounds": a.rounds,
                    "clients": 1,
                    "greedy": True,
                    "decode_rate": "(completion tokens - 1) / (last text chunk - first text chunk)",
                    "sluice_draft_max": a.draft_max,
                },
                "sluice": {"version": lib.version(state), "isa": isas["sluice"]["isa"], "command": " ".join(s_cmd)},
                "peer": {
                    "name": "llama.cpp",
                    "version": lib.PEER_VERSION,
                    "isa": isas["llama.cpp"]["isa"],
                    "commands": {"plain": " ".join(l_cmd), "spec": " ".join(ls_cmd)},
                },
                "speculative_text_equals_plain": {
                    "sluice": texts["sluice_ngram"] == texts["sluice_plain"] and len(texts["sluice_plain"]) == 1,
                    "llama.cpp": texts["llama_ngram"] == texts["llama_plain"] and len(texts["llama_plain"]) == 1,
                },
                "decode_tok_s": {k: med(k) for k in runs},
                "speedups": {"sluice": sp_s, "llama.cpp": sp_l},
                "speedup_ratio": sp_s["median"] / sp_l["median"],
                "spec_decode_ratio": med("sluice_ngram") / med("llama_ngram"),
                "rounds": rounds,
            }
        )
        lib.write_result(result["name"], result, lib.out_dir(a))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except Exception:
                p.kill()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Load test of `sluice serve` on loopback: many concurrent streaming clients for a while,
mixed prompt and output lengths, some disconnecting mid-stream. Every request is a greedy
completion whose text is known from a solo run first, so a lost or mixed-up response shows.
Reports errors, mismatches, memory before/after and p50/p99 time to first token and
inter-token latency as JSON, for each of `--rounds` rounds of load on the same server (the
resident memory after each: growth that stops after the first round is the caches filling,
growth that goes on is a leak). Not part of CI.

  python3 bench/server_load.py --model ~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf \\
      --clients 50 --duration 180
"""

import argparse
import json
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lib  # noqa: E402
import server_common as sc  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The three laws of thermodynamics are",
    "# A function that sorts a list of dictionaries by a key\n",
    "Once upon a time, in a small village by the sea,",
    "SELECT name, COUNT(*) FROM",
    "import numpy as np\n\ndef normalize(v):",
    "The capital of France is",
    "class Stack:\n    def __init__(self):",
]


def load_round(a, port, proc, cases, body, expected):
    """`a.clients` clients for `a.duration` seconds; the round's counts, latencies and the
    server's resident memory after it."""
    lock = threading.Lock()
    stats = {"ok": 0, "disconnected": 0, "errors": [], "mismatches": 0, "tokens": 0}
    ttfts, gaps = [], []
    stop_at = time.time() + a.duration

    def client(k):
        i = 0
        while time.time() < stop_at:
            case = (k * 3 + i) % len(cases)
            p, n = cases[case]
            leave = a.disconnect_every > 0 and (k + i) % a.disconnect_every == 0
            try:
                st, text, ttft, g, chunks, gone = sc.stream_completion(port, body(p, n), disconnect_after=2 if leave else None)
            except Exception as e:  # noqa: BLE001 - every failure counts
                st, text, ttft, g, chunks, gone = -1, repr(e), None, [], 0, False
            with lock:
                if st != 200:
                    stats["errors"].append(f"{st}: {text[:200]}")
                elif gone:
                    stats["disconnected"] += 1
                    if not expected[case].startswith(text):
                        stats["mismatches"] += 1
                else:
                    stats["ok"] += 1
                    stats["tokens"] += n
                    if text != expected[case]:
                        stats["mismatches"] += 1
                    if ttft is not None:
                        ttfts.append(ttft)
                    gaps.extend(g)
            i += 1

    t0 = time.time()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(a.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - t0
    time.sleep(1)
    r = {
        "duration_s": round(wall, 1),
        "completed": stats["ok"],
        "disconnected": stats["disconnected"],
        "errors": len(stats["errors"]),
        "error_samples": stats["errors"][:5],
        "mismatches": stats["mismatches"],
        "tokens_per_s": round(stats["tokens"] / wall, 2),
        "rss_after_bytes": sc.rss_bytes(proc.pid),
        "ttft_s": {"p50": sc.percentile(ttfts, 50), "p99": sc.percentile(ttfts, 99)},
        "inter_token_s": {"p50": sc.percentile(gaps, 50), "p99": sc.percentile(gaps, 99)},
    }
    lib.log(f"round: {r['completed']} completed, {r['disconnected']} disconnected, {r['errors']} errors, "
            f"{r['mismatches']} mismatches, RSS {r['rss_after_bytes'] / 2**20:.0f} MiB")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--duration", type=float, default=180, help="seconds of load per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of load, one after the other")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--disconnect-every", type=int, default=7, help="every Nth request disconnects mid-stream")
    ap.add_argument("--port", type=int, default=0)
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    exe = lib.sluice_bin(build=not a.dry_run)
    port = a.port or sc.free_port()
    cmd = [exe, "serve", "--model", a.model, "--port", str(port), "--parallel", str(a.parallel),
           "--ctx-size", "1024", "--max-queue", str(max(64, a.clients)), "--threads", str(a.threads)]
    lib.log("starting: " + " ".join(cmd))
    proc = sc.start(cmd, port, log_path="/tmp/sluice-server-load.log")
    try:
        cases = [(p, 8 + 12 * (i % 4)) for i, p in enumerate(PROMPTS)]
        body = lambda p, n: {"prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        expected = []
        for p, n in cases:
            st, text, *_ = sc.stream_completion(port, body(p, n))
            if st != 200:
                raise SystemExit(f"solo run failed: {st} {text}")
            expected.append(text)
        mem_before = sc.rss_bytes(proc.pid)
        rounds = [load_round(a, port, proc, cases, body, expected) for _ in range(a.rounds)]
        res = lib.header("server_load", state, a.dry_run)
        res.update({
            "command": cmd,
            "clients": a.clients,
            "rss_before_bytes": mem_before,
            "rounds": rounds,
        })
        lib.write_result("server_load", res, lib.out_dir(a))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()

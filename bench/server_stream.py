#!/usr/bin/env python3
"""Serving an MoE model larger than the memory left to it: `sluice serve` (experts streamed
through its cache) and llama-server (the model memory-mapped: the page cache decides), 1 and 8
concurrent streaming clients.

The setting is bench/streaming.py's: a balloon leaves about `--leave` (default 8 GiB)
available, and the page cache is dropped before each server starts. The two servers run one
after the other (both at once would share the memory being measured), each: start, one short
warm-up request, then `--rounds` rounds of each concurrency, every client asking for a greedy
completion of `--tokens` tokens (ignore_eos). A round ends when every client is done or at
`--round-timeout`, when the clients still streaming disconnect; aggregate tok/s = the tokens
the clients received over the round's wall time (a finished stream counts the completion
tokens of its usage chunk, one cut at the deadline the chunks it received). llama-server runs
with `--no-repack` (its CPU repacking copies the weights
into anonymous memory, which cannot fit) and a context of the slots' total.

From sluice's /metrics, per round: bytes read from disk, expert misses and demand accesses,
each per generated token, so the union arithmetic can be checked: k streams that each route
to top-k of E experts per layer need E·(1 − (1 − top_k/E)^k) distinct experts a layer and step
under uniform routing, not k·top_k (the expectation is in the JSON as `uniform_union`).

    sudo python3 bench/server_stream.py --model ~/.cache/sluice/synth/qwen3-30b-a3b-q4_k_m.gguf

`--dry-run` runs without root, balloon or cache drops (e.g. on `sluice synth --shape tiny-moe`
with `--sluice-arg=--expert-cache=32MiB`), and writes outside bench/results.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lib  # noqa: E402
import server_common as sc  # noqa: E402
from streaming import parse_size  # noqa: E402


def sluice_counters(port):
    """sluice's expert-cache counters (summed over models) from /metrics."""
    text = sc.get_text(port, "/metrics")
    out = {}
    for line in text.splitlines():
        if line.startswith("sluice_expert_cache_events_total{"):
            event = line.split('event="', 1)[1].split('"', 1)[0]
            out[event] = out.get(event, 0) + float(line.rsplit(" ", 1)[1])
    return out


def one_round(port, clients, n, timeout):
    """(tokens received, wall seconds, finished clients) of `clients` concurrent streams."""
    deadline = time.time() + timeout
    counts = [{} for _ in range(clients)]
    body = lambda k: sc.story_body(k, n, stream_options={"include_usage": True})  # noqa: E731
    got, wall = sc.concurrent_streams(
        clients, lambda k: sc.stream_completion(port, body(k), deadline=deadline, counts=counts[k]))
    # A finished stream counts its usage; one cut at the deadline its chunks (llama-server sends
    # one a token; sluice none for a token without text of its own: undercounted, never over).
    toks = sum(c["usage_tokens"] if c["usage_tokens"] is not None else c["events"] for c in counts)
    return toks, wall, sum(1 for r in got if not r[5])


def uniform_union(experts, top_k, streams):
    return experts * (1 - (1 - top_k / experts) ** streams)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=16, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--leave", default="8GiB", help="memory left available by the balloon")
    ap.add_argument("--round-timeout", type=float, default=240.0)
    ap.add_argument("--sluice-arg", action="append", default=[], help="extra `sluice serve` argument (repeatable)")
    ap.add_argument("--peer-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    if not a.dry_run and not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root: run as root (or with sudo), or pass --dry-run")
    exe = lib.sluice_bin(build=not a.dry_run)
    peer = lib.peer_dir(a.peer_bin)
    isas = {"sluice": lib.sluice_isa(None, not a.dry_run), "llama.cpp": lib.peer_isa(peer, None)}
    info = lib.last_json(lib.run([exe, "inspect", "--json", a.model])["out"])
    experts, top_k = info["experts"], info["experts_per_token"]
    par, ctx = max(a.concurrency), 256
    port = sc.free_port()
    cmds = {
        "sluice": [exe, "serve", "--model", a.model, "--port", str(port), "--threads", str(a.threads),
                   "--parallel", str(par), "--ctx-size", str(ctx)] + a.sluice_arg,
        "llama.cpp": [os.path.join(peer, "llama-server"), "-m", a.model, "--port", str(port), "-t", str(a.threads),
                      "-np", str(par), "-c", str(ctx * par), "--no-webui", "--no-repack"] + a.peer_arg,
    }
    envs = {"sluice": None, "llama.cpp": lib.peer_env(peer)}
    rows = {name: {c: [] for c in a.concurrency} for name in cmds}
    balloon = lib.Balloon(parse_size(a.leave)) if not a.dry_run else None
    if balloon:
        balloon.__enter__()
    try:
        available = lib.available_bytes()
        for name, cmd in cmds.items():
            if not a.dry_run:
                lib.drop_caches()
            lib.log(f"{name}: " + " ".join(cmd))
            p = sc.start(cmd, port, env=envs[name], log_path=f"/tmp/{name}-stream-server.log", timeout=900)
            try:
                one_round(port, 1, 2, a.round_timeout)  # warm-up
                for r in range(a.rounds):
                    for c in a.concurrency:
                        before = sluice_counters(port) if name == "sluice" else {}
                        toks, wall, finished = one_round(port, c, a.tokens, a.round_timeout)
                        row = {"tok_s": toks / wall, "tokens": toks, "seconds": wall, "clients_finished": finished}
                        if name == "sluice":
                            after = sluice_counters(port)
                            d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                            row["bytes_read_per_token"] = d.get("bytes_read", 0) / max(toks, 1)
                            row["misses_per_token"] = d.get("miss", 0) / max(toks, 1)
                            row["demand_accesses_per_token"] = sum(d.get(k, 0) for k in ("hit", "prefetch_hit", "miss")) / max(toks, 1)
                            row["counters"] = d
                        rows[name][c].append(row)
                        lib.log(f"{name} round {r} concurrency {c}: {row['tok_s']:.2f} tok/s "
                                f"({toks} tokens in {wall:.1f} s, {finished}/{c} finished)"
                                + (f", {row['bytes_read_per_token'] / 2**20:.1f} MiB read a token" if name == "sluice" else ""))
            finally:
                p.terminate()
                p.wait(timeout=120)
        if balloon and not balloon.alive():
            raise SystemExit("the balloon died during the run: the memory setting was not held")
    finally:
        if balloon:
            balloon.__exit__(None, None, None)
    res = lib.header("server-stream", state, a.dry_run)
    cases = []
    for c in a.concurrency:
        s, l = rows["sluice"][c], rows["llama.cpp"][c]
        cases.append({
            "concurrency": c,
            "sluice_tok_s": lib.summary([x["tok_s"] for x in s]),
            "llama_cpp_tok_s": lib.summary([x["tok_s"] for x in l]),
            "ratio": lib.ratio_summary([x["tok_s"] / y["tok_s"] for x, y in zip(s, l) if y["tok_s"] > 0]),
            "sluice_bytes_read_per_token": lib.summary([x["bytes_read_per_token"] for x in s]),
            "sluice_misses_per_token": lib.summary([x["misses_per_token"] for x in s]),
            "sluice_demand_accesses_per_token": lib.summary([x["demand_accesses_per_token"] for x in s]),
            "uniform_union": {"experts_per_layer_step": uniform_union(experts, top_k, c),
                              "of_separate_tokens": uniform_union(experts, top_k, c) / (c * top_k)},
            "rounds": {"sluice": s, "llama.cpp": l},
        })
    lo = min(a.concurrency)
    hi = max(a.concurrency)
    med = {c: lib.summary([x["tok_s"] for x in rows["sluice"][c]])["median"] for c in a.concurrency}
    res.update({
        "model": lib.model_info(a.model),
        "experts": experts, "top_k": top_k,
        "leave_bytes": parse_size(a.leave), "available_bytes_at_start": available,
        "threads": a.threads, "tokens_per_request": a.tokens, "round_timeout_s": a.round_timeout,
        "commands": cmds, "peer": lib.PEER_VERSION,
        "isa": {k: v["isa"] for k, v in isas.items()}, "isa_detail": isas,
        "cases": cases,
        "sluice_scaling": {"streams": [lo, hi], "aggregate_ratio": med[hi] / med[lo] if med[lo] else None},
    })
    lib.write_result("server-stream", res, lib.out_dir(a))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Streaming decode of an MoE model larger than the memory left to it, sluice against llama.cpp.

The setting: a balloon process takes memory away until about `--leave` (default 8 GiB) is
available, and the page cache is dropped before every run. In it, round after round:

  * llama.cpp with its default settings (CPU repacking copies the weights into anonymous
    memory; measured once, reported as it ends: rate, or killed);
  * llama.cpp `--repack 0` (weights stay memory-mapped: the page cache decides what stays);
  * sluice with default settings (streaming: a hard-quota expert cache sized from available
    memory, reads straight from the GGUF file);
  * sluice reading from a pack (`sluice pack`), when `--pack` is given;
  * the disk's O_DIRECT random-read bandwidth at the expert read size and sluice's queue
    depth (`sluice bench-io`), which divided by the bytes sluice missed per token is its IO
    bound.

Then, on the same memory: a routing trace of a generation is replayed through each cache
policy and Belady's optimum at sluice's quota (`sluice trace simulate`). Without the balloon:
the case where the model fits, sluice streaming with a quota holding every expert against
sluice resident (`--fits-model`).

    sudo python3 bench/streaming.py --model qwen3-30b-a3b-q4_k_m.gguf [--pack P] \\
        [--fits-model olmoe-1b-7b-q4_k_m.gguf] [--leave 8GiB] [--rounds 3]
"""

import argparse
import json
import os
import tempfile

import lib

GIB = 1 << 30


def parse_size(s):
    s = s.strip()
    for suf, m in (("GiB", GIB), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * m)
    return int(s)


def disk_read_bytes(path):
    """Bytes read so far from the block device holding `path` (/sys/dev/block/M:m/stat)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    p = f"/sys/dev/block/{dev}/stat"
    if not os.path.exists(p):
        return None
    with open(p) as f:
        return int(f.read().split()[2]) * 512


def cold_run(cmd, model, env=None, timeout=900):
    if not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root: run as root (or with sudo)")
    before = disk_read_bytes(model)
    r = lib.run(cmd, env=env, timeout=timeout, check=False)
    after = disk_read_bytes(model)
    r["disk_bytes"] = None if before is None else after - before
    return r


def peer_decode(peer, model, a, repack, gen, reps):
    cmd = [os.path.join(peer, "llama-bench"), "-m", model, "-t", str(a.threads), "-p", "0", "-n", str(gen), "-r", str(reps), "-o", "json"]
    if repack is not None:
        cmd += ["--repack", str(repack)]
    r = cold_run(cmd, model, env=lib.peer_env(peer), timeout=a.peer_timeout)
    res = {"command": " ".join(cmd), "returncode": r["rc"], "seconds": r["seconds"], "peak_rss": r["peak_rss"]}
    if r["rc"] != 0:
        res["outcome"] = "killed by signal %d" % -r["rc"] if r["rc"] < 0 else "exit %d" % r["rc"]
        res["stderr_tail"] = r["err"][-600:]
        return res
    samples = json.loads(r["out"])[-1]["samples_ts"]
    # The first repetition starts from an empty page cache; the last is the steady state.
    res["decode_tok_s"] = samples[-1]
    res["decode_tok_s_first_run"] = samples[0]
    # Over the whole run: one warm-up token, every timed token, and loading.
    res["disk_bytes_per_token"] = r["disk_bytes"] / (gen * reps + 1) if r["disk_bytes"] is not None else None
    res["outcome"] = "ran"
    return res


def sluice_decode(exe, model, a, extra):
    cmd = [exe, "bench", "-m", model, "-t", str(a.threads), "-p", "0", "-n", str(a.gen), "-r", "2", "--json"] + extra
    r = cold_run(cmd, model)
    res = {"command": " ".join(cmd), "returncode": r["rc"], "seconds": r["seconds"], "peak_rss": r["peak_rss"]}
    if r["rc"] != 0:
        res["outcome"] = "killed by signal %d" % -r["rc"] if r["rc"] < 0 else "exit %d" % r["rc"]
        res["stderr_tail"] = r["err"][-600:]
        return res
    j = lib.last_json(r["out"])
    # The first repetition fills an empty cache; the second is the steady state.
    d = j["experts"]["decode_runs"][-1]
    res.update(
        outcome="ran",
        decode_tok_s=j["decode_runs"][-1],
        decode_tok_s_first_run=j["decode_runs"][0],
        placement=j["experts"]["placement"],
        quota_bytes=d["quota_bytes"],
        hit_rate=d["hit_rate"],
        bytes_read_per_token=d["bytes_read_per_token"],
        loaded_bytes_per_token=d["loaded_bytes"] / a.gen,
        read_amplification=d["read_amplification"],
        misses=d["misses"],
        prefetch_issued=d["prefetch_issued"],
        prefetch_hits=d["prefetch_hits"],
        prefetch_wasted=d["prefetch_wasted"],
        io_stall_ms_per_token=d["io_stall_ms_per_token"],
        prefetch_precision=d["prefetch_precision"],
        quota_changes=j["experts"]["decode"]["quota_changes"],
        disk_bytes_total=r["disk_bytes"],
    )
    return res


def io_bound(exe, model, size, depth, seconds):
    cmd = [exe, "bench-io", "--file", model, "--size", str(size), "--depth", str(depth), "--seconds", str(seconds), "--json"]
    j = lib.last_json(lib.run(cmd)["out"])
    return cmd, j


def disk_best(samples):
    """The disk's bandwidth in a round: the best of its measurements (this disk's rate varies
    by a third from one measurement to the next; the best one gives the strictest bound)."""
    ok = [s for s in samples if s and s.get("gb_s")]
    if not ok:
        return {}
    return dict(max(ok, key=lambda s: s["gb_s"]), samples_gb_s=[s["gb_s"] for s in ok])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF MoE model (larger than --leave)")
    ap.add_argument("--pack", help="a pack of the model's experts (sluice pack) to measure as well")
    ap.add_argument("--fits-model", help="a GGUF MoE model that fits in memory, for the streaming-overhead case")
    ap.add_argument("--leave", default="8GiB", help="memory left available by the balloon")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("-n", "--gen", type=int, default=32, help="decode steps per repetition for sluice (two repetitions)")
    ap.add_argument("--peer-gen", type=int, default=8, help="decode steps per repetition for llama.cpp (two repetitions; slow when thrashing)")
    ap.add_argument("--peer-timeout", type=int, default=900, help="seconds before a llama.cpp run is stopped")
    ap.add_argument("--io-depth", type=int, default=32)
    ap.add_argument("--trace-tokens", type=int, default=64)
    a = ap.parse_args()
    exe = lib.sluice_bin()
    peer = lib.peer_dir()
    info = lib.last_json(lib.run([exe, "inspect", "--json", a.model])["out"])
    n_experts = info["sparse_layers"] * info["experts"]
    expert_bytes = info["expert_bytes"] / n_experts
    # The GGUF store reads each expert as three ranges (gate, up, down); a pack as one record.
    range_size = (int(expert_bytes / 3) + 4095) // 4096 * 4096
    record_size = (int(expert_bytes) + 4095) // 4096 * 4096
    leave = parse_size(a.leave)
    result = {
        "name": "streaming-" + os.path.splitext(os.path.basename(a.model))[0],
        "date": lib.now_iso(),
        "machine": lib.machine(),
        "model": dict(
            lib.model_info(a.model),
            dense_bytes=info["dense_bytes"],
            expert_bytes=info["expert_bytes"],
            mean_expert_bytes=expert_bytes,
            experts_per_token=info["experts_per_token"] * info["sparse_layers"],
        ),
        "protocol": {
            "memory_left_bytes": leave,
            "threads": a.threads,
            "rounds": a.rounds,
            "sluice_gen_tokens": a.gen,
            "peer_gen_tokens": a.peer_gen,
            "repetitions": "two per run from a dropped page cache: the first fills the cache (reported as *_first_run), the second is the steady state (the rate quoted)",
            "io_depth": a.io_depth,
            "page_cache": "dropped before every run",
            "order": "each round: llama.cpp --repack 0, bench-io, sluice (GGUF store), sluice (pack), bench-io",
        },
    }
    rounds = []
    with lib.Balloon(leave) as balloon:
        result["protocol"]["balloon_bytes"] = balloon.size
        result["protocol"]["available_after_balloon"] = balloon.available
        result["peer_default"] = peer_decode(peer, a.model, a, None, 4, 1)
        lib.log(f"llama.cpp default: {result['peer_default']['outcome']}")
        for i in range(a.rounds):
            lib.log(f"round {i + 1}/{a.rounds}")
            rd = {"peer_repack0": peer_decode(peer, a.model, a, 0, a.peer_gen, 2)}
            # The disk measured on both sides of sluice's runs.
            ranges = [io_bound(exe, a.model, range_size, a.io_depth, 10)[1]]
            records = [io_bound(exe, a.pack, record_size, a.io_depth, 10)[1]] if a.pack else []
            rd["sluice"] = sluice_decode(exe, a.model, a, ["--io-depth", str(a.io_depth)])
            if a.pack:
                rd["sluice_pack"] = sluice_decode(exe, a.model, a, ["--io-depth", str(a.io_depth), "--pack", a.pack])
            ranges.append(io_bound(exe, a.model, range_size, a.io_depth, 10)[1])
            rd["io_ranges"] = disk_best(ranges)
            if a.pack:
                records.append(io_bound(exe, a.pack, record_size, a.io_depth, 10)[1])
                rd["io_records"] = disk_best(records)
            rounds.append(rd)
            lib.log(json.dumps({k: v.get("decode_tok_s", v.get("gb_s")) for k, v in rd.items()}))
        # The routing trace of a generation, replayed through the policies at sluice's quota.
        quota = rounds[-1]["sluice"].get("quota_bytes")
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "routing.trace")
            prompt = "Explain how a hard-quota cache differs from the page cache."
            lib.run([exe, "run", "-m", a.model, "-t", str(a.threads), "-p", prompt, "-n", str(a.trace_tokens), "--ignore-eos", "--trace", trace, "--json"])
            quotas = [str(quota)] if quota else []
            quotas += [str(q * GIB) for q in (2, 4, 8)]
            sim = lib.last_json(lib.run([exe, "trace", "simulate", trace, "--json", "--quota"] + quotas)["out"])
        result["trace_simulation"] = sim
        result["balloon_alive_at_end"] = balloon.alive()

    def med(key, metric):
        return lib.summary([r[key].get(metric) for r in rounds if key in r])

    result["sluice"] = {
        "version": lib.git_sha(),
        "command": rounds[0]["sluice"]["command"],
        "metrics": {
            "decode_tok_s": med("sluice", "decode_tok_s"),
            "decode_tok_s_first_run": med("sluice", "decode_tok_s_first_run"),
            "hit_rate": med("sluice", "hit_rate"),
            "bytes_read_per_token": med("sluice", "bytes_read_per_token"),
            "loaded_bytes_per_token": med("sluice", "loaded_bytes_per_token"),
            "read_amplification": med("sluice", "read_amplification"),
            "io_stall_ms_per_token": med("sluice", "io_stall_ms_per_token"),
            "prefetch_precision": med("sluice", "prefetch_precision"),
            "peak_rss": med("sluice", "peak_rss"),
        },
    }
    if a.pack:
        result["sluice_pack"] = {
            "command": rounds[0]["sluice_pack"]["command"],
            "metrics": {
                "decode_tok_s": med("sluice_pack", "decode_tok_s"),
                "hit_rate": med("sluice_pack", "hit_rate"),
                "bytes_read_per_token": med("sluice_pack", "bytes_read_per_token"),
                "read_amplification": med("sluice_pack", "read_amplification"),
                "peak_rss": med("sluice_pack", "peak_rss"),
            },
        }
    result["peer"] = {
        "name": "llama.cpp",
        "version": lib.PEER_VERSION,
        "best_setting": "--repack 0 (mmap)",
        "command": rounds[0]["peer_repack0"]["command"],
        "metrics": {
            "decode_tok_s": med("peer_repack0", "decode_tok_s"),
            "decode_tok_s_first_run": med("peer_repack0", "decode_tok_s_first_run"),
            "disk_bytes_per_token": med("peer_repack0", "disk_bytes_per_token"),
            "peak_rss": med("peer_repack0", "peak_rss"),
        },
    }

    def ratio(num_key, rd):
        p = rd["peer_repack0"].get("decode_tok_s")
        s = rd[num_key].get("decode_tok_s")
        return s / p if p and s else None

    result["ratios"] = {"decode": lib.ratio_summary([ratio("sluice", r) for r in rounds])}
    if a.pack:
        result["ratios"]["decode_pack"] = lib.ratio_summary([ratio("sluice_pack", r) for r in rounds])

    # IO bound of a round: the disk's bandwidth at the read size over the bytes sluice read per token.
    def bound(key, io_key):
        xs = []
        for r in rounds:
            s = r.get(key, {})
            if s.get("bytes_read_per_token"):
                xs.append(r[io_key]["gb_s"] * 1e9 / s["bytes_read_per_token"])
        return lib.summary(xs)

    b = bound("sluice", "io_ranges")
    result["bound"] = {
        "decode_tok_s": b,
        "sluice_fraction": lib.summary(
            [r["sluice"]["decode_tok_s"] * r["sluice"]["bytes_read_per_token"] / (r["io_ranges"]["gb_s"] * 1e9) for r in rounds if r["sluice"].get("bytes_read_per_token")]
        ),
        "basis": f"O_DIRECT random reads of {range_size} bytes at depth {a.io_depth} (sluice bench-io, 10 s before and after sluice's runs in each round, the better of the two) / bytes sluice read per decoded token",
        "disk_gb_s": med("io_ranges", "gb_s"),
    }
    if a.pack:
        result["bound_pack"] = {
            "decode_tok_s": bound("sluice_pack", "io_records"),
            "sluice_fraction": lib.summary(
                [r["sluice_pack"]["decode_tok_s"] * r["sluice_pack"]["bytes_read_per_token"] / (r["io_records"]["gb_s"] * 1e9) for r in rounds if r["sluice_pack"].get("bytes_read_per_token")]
            ),
            "basis": f"O_DIRECT random reads of {record_size} bytes at depth {a.io_depth} on the pack (the better of two per round) / bytes read per decoded token",
            "disk_gb_s": med("io_records", "gb_s"),
        }
    result["rounds"] = rounds

    if a.fits_model:
        result["fits_case"] = fits_case(exe, a)
    lib.write_result(result["name"], result)


FITS_ROUNDS = 6


def fits_case(exe, a):
    """The model fits: streaming with a quota that holds every expert against resident mode."""
    info = lib.last_json(lib.run([exe, "inspect", "--json", a.fits_model])["out"])
    quota = info["expert_bytes"] * 2  # slots are sized for the largest expert; twice is ample
    rows = []
    modes = [("resident", ["--expert-mode", "resident"]), ("stream", ["--expert-mode", "stream", "--expert-cache", str(quota)])]
    for i in range(FITS_ROUNDS):
        row = {}
        # Alternate which goes first, so a drift of the machine's speed does not favour one.
        for name, extra in modes if i % 2 == 0 else modes[::-1]:
            cmd = [exe, "bench", "-m", a.fits_model, "-t", str(a.threads), "-p", "128", "-n", "128", "-r", "3", "--json"] + extra
            j = lib.last_json(lib.run(cmd)["out"])
            row[name] = {"command": " ".join(cmd), "decode_tok_s": j["decode_tok_s"], "prefill_tok_s": j["prefill_tok_s"], "placement": j["experts"]["placement"]}
        rows.append(row)
        lib.log(json.dumps({k: (v["prefill_tok_s"], v["decode_tok_s"]) for k, v in row.items()}))
    return {
        "model": lib.model_info(a.fits_model),
        "protocol": f"{FITS_ROUNDS} rounds of sluice bench -p 128 -n 128 -r 3, resident and streaming with every expert fitting in the quota (warm after the warm-up), alternating which runs first",
        "ratios": {
            "decode_stream_over_resident": lib.ratio_summary([r["stream"]["decode_tok_s"] / r["resident"]["decode_tok_s"] for r in rows]),
            "prefill_stream_over_resident": lib.ratio_summary([r["stream"]["prefill_tok_s"] / r["resident"]["prefill_tok_s"] for r in rows]),
        },
        "rounds": rows,
    }


if __name__ == "__main__":
    main()

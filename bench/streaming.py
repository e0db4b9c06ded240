#!/usr/bin/env python3
"""Streaming decode of an MoE model larger than the memory left to it, sluice against llama.cpp.

The setting: a balloon process takes memory away until about `--leave` (default 8 GiB) is
available, and the page cache is dropped before every run. Every run decodes the same way on
both sides: `-p 0 -n N -r 2` (one `-n` for sluice and llama.cpp), that is one warm-up step,
then two timed repetitions of N steps; the first repetition starts from an empty cache
(reported as *_first_run), the second is the steady state (the rate quoted).

Once, first: llama.cpp with its default settings (CPU repacking copies the weights into
anonymous memory; reported as it ends: rate, OOM-killed, or stopped at --timeout).

Then rounds of the same runs, the order alternating: odd rounds run llama.cpp first and the
sluice block second, even rounds the sluice block first and llama.cpp second.

  * llama.cpp `--repack 0` (weights stay memory-mapped: the page cache decides what stays);
  * the sluice block: the disk's O_DIRECT random-read bandwidth at the expert read size and
    sluice's queue depth (`sluice bench-io`, `--io-seconds` each); sluice with default flags
    (a hard-quota expert cache sized from available memory, reads straight from the GGUF
    file); sluice `--no-prefetch`; sluice reading from a pack (`sluice pack`) when `--pack` is
    given; the disk's bandwidth again. The better of the two disk measurements is the round's
    disk rate.

Bytes read from disk are counted the same way for both tools: the read counters of the block
device(s) holding the files (/sys/dev/block/M:m/stat) before and after each run, over the whole
run (loading, the warm-up step and both repetitions: 2N + 1 decoded tokens). Beside that,
from sluice's own counters, the bytes it read per token in the steady state (the second
repetition), the figure the IO bound uses. llama.cpp has no such counter.

Cache statistics are those of the steady state: `hit_rate` counts only demand accesses that
found the expert resident from earlier demand; `prefetch_hit_rate` the demand accesses a
prefetch served; `miss_rate` the rest (the three add up to one). When the model is synthetic
sluice says so (`routing_note`): its routing is near-uniform and token-driven, so its hit rates
and prefetch precision say nothing about a real model's expert locality; the note travels with
the result.

Then, on the same memory: a routing trace of a generation is replayed through each cache
policy and Belady's optimum at sluice's quota (`sluice trace simulate`). Without the balloon:
the case where the model fits, sluice streaming with a quota holding every expert against
sluice resident (`--fits-model`), alternating which runs first.

    sudo python3 bench/streaming.py --model qwen3-30b-a3b-q4_k_m.gguf [--pack P] \\
        [--fits-model olmoe-1b-7b-q4_k_m.gguf] [--leave 8GiB] [--rounds 3] [-n 16]

`--dry-run` tries the script itself without root: no balloon, no page-cache drops, small
defaults (-n 4, 2 rounds, 1 s of bench-io), the binaries as they are, the result marked
dry_run and written outside bench/results, e.g. on `sluice synth --shape tiny-moe` with
`--expert-cache 32MiB` so that it streams.
"""

import argparse
import json
import os
import tempfile

import lib

GIB = 1 << 30
REPS = 2
PEER = "llama.cpp --repack 0"

DEFINITIONS = {
    "decode_tok_s": "decode rate of the second timed repetition (the steady state)",
    "decode_tok_s_first_run": "decode rate of the first timed repetition, from an empty cache",
    "disk_bytes_per_token": "bytes read from the block device(s) holding the model (and pack) during the whole run, from the device's counters, over the 2N + 1 tokens decoded (loading, the warm-up step and both repetitions charged); the same accounting for sluice and llama.cpp",
    "bytes_read_per_token_steady": "sluice's own counter: bytes it read from disk per token in the second repetition (llama.cpp has no such counter)",
    "loaded_bytes_per_token_steady": "sluice's own counter: bytes of the experts it loaded per token in the second repetition",
    "read_amplification": "bytes read over bytes of the experts loaded (alignment), second repetition",
    "hit_rate": "demand accesses that found the expert resident from an earlier demand access, over all demand accesses; prefetch-served accesses are not hits here; second repetition",
    "prefetch_hit_rate": "demand accesses served by a prefetch, over all demand accesses; second repetition",
    "miss_rate": "demand accesses that had to read the expert, over all demand accesses (hit_rate + prefetch_hit_rate + miss_rate = 1); second repetition",
    "prefetch_precision": "prefetched experts that were used before eviction, over prefetches issued; second repetition",
}


def parse_size(s):
    s = s.strip()
    for suf, m in (("GiB", GIB), ("MiB", 1 << 20), ("GB", 10**9), ("MB", 10**6)):
        if s.endswith(suf):
            return int(float(s[: -len(suf)]) * m)
    return int(s)


def block_stat(path):
    """(device, bytes read so far) of the block device holding `path` (/sys/dev/block/M:m/stat),
    or (device, None) where there is none (tmpfs, overlay without a block device)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    p = f"/sys/dev/block/{dev}/stat"
    if not os.path.exists(p):
        return dev, None
    with open(p) as f:
        return dev, int(f.read().split()[2]) * 512


def disk_read_bytes(paths):
    """Bytes read so far from the block devices holding `paths`, each device once."""
    seen = {}
    for p in paths:
        dev, n = block_stat(p)
        seen[dev] = n
    return seen


def cold_run(cmd, paths, a, env=None, timeout=None):
    """Runs `cmd` from a dropped page cache (not in a dry run), with the read counters of the
    block devices holding `paths` and the kernel's OOM-kill count taken around it."""
    if not a.dry_run and not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root: run as root (or with sudo), or pass --dry-run")
    before = disk_read_bytes(paths)
    ooms = lib.oom_kills()
    r = lib.run(cmd, env=env, timeout=timeout, check=False)
    after = disk_read_bytes(paths)
    ooms_after = lib.oom_kills()
    if any(v is None for v in before.values()) or any(v is None for v in after.values()):
        r["disk_bytes"] = None
    else:
        r["disk_bytes"] = sum(after[d] - before[d] for d in before)
    r["disk_devices"] = sorted(before)
    r["oom_killed"] = r["rc"] == -9 and not r["timed_out"] and ooms is not None and ooms_after > ooms
    return r


def outcome(r):
    if r["rc"] == 0:
        return "ran"
    if r["oom_killed"]:
        return "OOM-killed"
    if r["timed_out"]:
        return "stopped at the timeout"
    return "killed by signal %d" % -r["rc"] if r["rc"] < 0 else "exit %d" % r["rc"]


def tokens_per_run(a):
    """Decode steps of one run on either side: one warm-up step and REPS timed repetitions."""
    return REPS * a.gen + 1


def run_record(cmd, r, a):
    res = {
        "command": " ".join(cmd),
        "returncode": r["rc"],
        "outcome": outcome(r),
        "oom_killed": r["oom_killed"],
        "seconds": r["seconds"],
        "peak_rss": r["peak_rss"],
        "disk_bytes": r["disk_bytes"],
        "disk_devices": r["disk_devices"],
        "disk_bytes_per_token": r["disk_bytes"] / tokens_per_run(a) if r["disk_bytes"] is not None else None,
    }
    if r["rc"] != 0:
        res["stderr_tail"] = r["err"][-600:]
    return res


def peer_decode(peer, a, repack):
    cmd = [os.path.join(peer, "llama-bench"), "-m", a.model, "-t", str(a.threads), "-p", "0", "-n", str(a.gen), "-r", str(REPS), "-o", "json"]
    if repack is not None:
        cmd += ["--repack", str(repack)]
    r = cold_run(cmd, [a.model], a, env=lib.peer_env(peer), timeout=a.timeout)
    res = run_record(cmd, r, a)
    if r["rc"] != 0:
        return res
    samples = json.loads(r["out"])[-1]["samples_ts"]
    # The first repetition starts from an empty page cache; the last is the steady state.
    res["decode_tok_s"] = samples[-1]
    res["decode_tok_s_first_run"] = samples[0]
    return res


def sluice_cmd(exe, a, extra):
    cmd = [exe, "bench", "-m", a.model, "-t", str(a.threads), "-p", "0", "-n", str(a.gen), "-r", str(REPS), "--json", "--io-depth", str(a.io_depth)]
    if a.expert_cache:
        cmd += ["--expert-cache", a.expert_cache]
    return cmd + extra


def sluice_decode(exe, a, extra, paths):
    cmd = sluice_cmd(exe, a, extra)
    r = cold_run(cmd, paths, a, env=lib.sluice_env(a.sluice_isa), timeout=a.timeout)
    res = run_record(cmd, r, a)
    if r["rc"] != 0:
        return res
    j = lib.last_json(r["out"])
    ex = j["experts"]
    d = ex["decode_runs"][-1]
    res.update(
        decode_tok_s=j["decode_runs"][-1],
        decode_tok_s_first_run=j["decode_runs"][0],
        placement=ex["placement"],
        quota_bytes=d["quota_bytes"],
        hit_rate=d["hit_rate"],
        prefetch_hit_rate=d["prefetch_hit_rate"],
        miss_rate=d["miss_rate"],
        prefetch_precision=d["prefetch_precision"],
        bytes_read_per_token_steady=d["bytes_read_per_token"],
        loaded_bytes_per_token_steady=d["loaded_bytes"] / a.gen,
        read_amplification=d["read_amplification"],
        accesses=d["accesses"],
        misses=d["misses"],
        prefetch_issued=d["prefetch_issued"],
        prefetch_hits=d["prefetch_hits"],
        prefetch_wasted=d["prefetch_wasted"],
        io_stall_ms_per_token=d["io_stall_ms_per_token"],
        quota_changes=ex["decode"]["quota_changes"],
        # Cross-check of the device's count: what sluice itself read in both timed repetitions.
        own_bytes_read_timed=ex["decode"]["bytes_read"],
        routing_note=ex.get("routing_note"),
    )
    return res


def io_bound(exe, path, size, a):
    cmd = [exe, "bench-io", "--file", path, "--size", str(size), "--depth", str(a.io_depth), "--seconds", str(a.io_seconds), "--json"]
    return lib.last_json(lib.run(cmd)["out"])


def disk_best(samples):
    """The disk's bandwidth in a round: the best of its measurements (this disk's rate varies
    by a third from one measurement to the next; the best one gives the strictest bound)."""
    ok = [s for s in samples if s and s.get("gb_s")]
    if not ok:
        return {}
    return dict(max(ok, key=lambda s: s["gb_s"]), samples_gb_s=[s["gb_s"] for s in ok])


class NoBalloon:
    """A dry run's stand-in: memory as it is."""

    size = 0

    def __enter__(self):
        self.available = lib.available_bytes()
        return self

    def alive(self):
        return None

    def __exit__(self, *exc):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the GGUF MoE model (larger than --leave)")
    ap.add_argument("--pack", help="a pack of the model's experts (sluice pack) to measure as well")
    ap.add_argument("--fits-model", help="a GGUF MoE model that fits in memory, for the streaming-overhead case")
    ap.add_argument("--leave", default="8GiB", help="memory left available by the balloon")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, help="rounds (default 3; 2 in a dry run)")
    ap.add_argument("-n", "--gen", type=int, help="decode steps per repetition, the same for sluice and llama.cpp (two repetitions after one warm-up step; default 16, 4 in a dry run)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds before a run of either tool is stopped (llama.cpp thrashing the page cache is slow)")
    ap.add_argument("--io-depth", type=int, default=32)
    ap.add_argument("--io-seconds", type=int, help="seconds of each bench-io measurement (default 10; 1 in a dry run)")
    ap.add_argument("--expert-cache", metavar="SIZE", help="passed to sluice's runs (default: sluice sizes its cache from available memory)")
    ap.add_argument("--trace-tokens", type=int, help="tokens of the traced generation (default 64; 8 in a dry run)")
    lib.add_common_args(ap)
    a = ap.parse_args()
    dry = a.dry_run
    a.rounds = a.rounds or (2 if dry else 3)
    a.gen = a.gen or (4 if dry else 16)
    a.io_seconds = a.io_seconds or (1 if dry else 10)
    a.trace_tokens = a.trace_tokens or (8 if dry else 64)
    state = lib.check_tree(a.allow_dirty)
    leave = parse_size(a.leave)
    if not dry and os.path.getsize(a.model) <= leave:
        raise SystemExit(f"{a.model} fits in --leave {a.leave}: this benchmark is about a model larger than the memory left to it (a trial: --dry-run)")
    if not dry and not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root: run as root (or with sudo), or pass --dry-run")
    exe = lib.sluice_bin(not dry)
    peer = lib.peer_dir(a.peer_bin)
    isas = {"sluice": lib.sluice_isa(a.sluice_isa, not dry), "peer": lib.peer_isa(peer, a.fits_model)}
    info = lib.last_json(lib.run([exe, "inspect", "--json", a.model])["out"])
    n_experts = info["sparse_layers"] * info["experts"]
    expert_bytes = info["expert_bytes"] / n_experts
    # The GGUF store reads each expert as three ranges (gate, up, down); a pack as one record.
    range_size = (int(expert_bytes / 3) + 4095) // 4096 * 4096
    record_size = (int(expert_bytes) + 4095) // 4096 * 4096
    arms = [("sluice", []), ("sluice_no_prefetch", ["--no-prefetch"])]
    if a.pack:
        arms.append(("sluice_pack", ["--pack", a.pack]))
    arm_names = {"sluice": "sluice (GGUF store)", "sluice_no_prefetch": "sluice --no-prefetch", "sluice_pack": "sluice (pack)"}
    block = "bench-io, " + ", ".join(arm_names[k] for k, _ in arms) + ", bench-io"
    result = lib.header("streaming-" + os.path.splitext(os.path.basename(a.model))[0], state, dry)
    result["model"] = dict(
        lib.model_info(a.model),
        dense_bytes=info["dense_bytes"],
        expert_bytes=info["expert_bytes"],
        mean_expert_bytes=expert_bytes,
        experts_per_token=info["experts_per_token"] * info["sparse_layers"],
    )
    result["protocol"] = {
        "memory_left_bytes": None if dry else leave,
        "balloon": "none (dry run)" if dry else "allocated and touched until about memory_left_bytes were available",
        "threads": a.threads,
        "rounds": a.rounds,
        "gen_tokens": a.gen,
        "repetitions": REPS,
        "tokens_per_run": tokens_per_run(a),
        "runs": f"-p 0 -n {a.gen} -r {REPS} for sluice and llama.cpp alike: one warm-up step, then {REPS} timed repetitions; the first fills the cache (*_first_run), the second is the steady state (the rate quoted)",
        "io_depth": a.io_depth,
        "io_seconds": a.io_seconds,
        "expert_cache": a.expert_cache or "sluice's default (sized from available memory)",
        "page_cache": "not dropped (dry run)" if dry else "dropped before every run",
        "order": f"odd rounds: {PEER}, then {block}; even rounds: {block}, then {PEER}",
        "disk_bytes": "block device read counters (/sys/dev/block/M:m/stat) before and after each run, for both tools",
    }
    result["definitions"] = DEFINITIONS
    rounds = []
    with NoBalloon() if dry else lib.Balloon(leave) as balloon:
        result["protocol"]["balloon_bytes"] = balloon.size
        result["protocol"]["available_after_balloon"] = balloon.available
        result["peer_default"] = peer_decode(peer, a, None)
        lib.log(f"llama.cpp default: {result['peer_default']['outcome']}")
        for i in range(1, a.rounds + 1):
            peer_first = i % 2 == 1
            lib.log(f"round {i}/{a.rounds} ({'llama.cpp' if peer_first else 'sluice'} first)")
            rd = {"order": []}

            def peer_run():
                rd["peer_repack0"] = peer_decode(peer, a, 0)
                rd["order"].append(PEER)

            def sluice_block():
                # The disk measured on both sides of sluice's runs.
                ranges = [io_bound(exe, a.model, range_size, a)]
                records = [io_bound(exe, a.pack, record_size, a)] if a.pack else []
                rd["order"].append("bench-io")
                for key, extra in arms:
                    paths = [a.model] + ([a.pack] if "--pack" in extra else [])
                    rd[key] = sluice_decode(exe, a, extra, paths)
                    rd["order"].append(arm_names[key])
                ranges.append(io_bound(exe, a.model, range_size, a))
                rd["io_ranges"] = disk_best(ranges)
                if a.pack:
                    records.append(io_bound(exe, a.pack, record_size, a))
                    rd["io_records"] = disk_best(records)
                rd["order"].append("bench-io")

            for step in (peer_run, sluice_block) if peer_first else (sluice_block, peer_run):
                step()
            rounds.append(rd)
            lib.log(json.dumps({k: v.get("decode_tok_s", v.get("gb_s")) for k, v in rd.items() if isinstance(v, dict)}))
        # The routing trace of a generation, replayed through the policies at sluice's quota.
        quota = rounds[-1]["sluice"].get("quota_bytes")
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "routing.trace")
            prompt = "Explain how a hard-quota cache differs from the page cache."
            lib.run(
                [exe, "run", "-m", a.model, "-t", str(a.threads), "--ctx", str(a.trace_tokens + 64), "-p", prompt,
                 "-n", str(a.trace_tokens), "--ignore-eos", "--trace", trace, "--json"],
                env=lib.sluice_env(a.sluice_isa),
            )
            quotas = [str(quota)] if quota else []
            quotas += [str(q * GIB) for q in (2, 4, 8)]
            sim = lib.last_json(lib.run([exe, "trace", "simulate", trace, "--json", "--quota"] + quotas)["out"])
            # Locality of the same trace, and each policy's bytes per token beside Belady's at
            # sluice's quota (policies in the order lru, lfu-aging, then belady).
            st = lib.last_json(lib.run([exe, "trace", "stats", trace, "--json", "--quota"] + quotas[:1])["out"])
        result["trace_simulation"] = sim
        t0 = st["traces"][0]
        result["trace_stats"] = {"overall": {k: v for k, v in t0["stats"]["overall"].items() if k != "coverage"},
                                 "quotas": t0["quotas"]}
        result["balloon_alive_at_end"] = balloon.alive()

    def med(key, metric):
        return lib.summary([r[key].get(metric) for r in rounds if key in r])

    note = next((r[k].get("routing_note") for r in rounds for k, _ in arms if r[k].get("routing_note")), None)
    if note:
        # sluice says so for its synthetic models: hit rates and prefetch precision measured on
        # near-uniform routing say nothing about a real model's.
        result["routing_note"] = note
        result["model"]["synthetic"] = True
    metrics = (
        "decode_tok_s",
        "decode_tok_s_first_run",
        "disk_bytes_per_token",
        "bytes_read_per_token_steady",
        "loaded_bytes_per_token_steady",
        "read_amplification",
        "hit_rate",
        "prefetch_hit_rate",
        "miss_rate",
        "prefetch_precision",
        "io_stall_ms_per_token",
        "peak_rss",
    )
    for key, _ in arms:
        result[key] = {"command": rounds[0][key]["command"], "metrics": {m: med(key, m) for m in metrics}}
        result[key]["outcomes"] = [r[key]["outcome"] for r in rounds]
    result["sluice"] = dict(
        {"version": lib.version(state), "isa": isas["sluice"]["isa"], "isa_detail": isas["sluice"], "routing_note": note},
        **result["sluice"],
    )
    result["peer"] = {
        "name": "llama.cpp",
        "version": lib.PEER_VERSION,
        "bin": peer,
        "isa": isas["peer"]["isa"],
        "isa_detail": isas["peer"],
        "best_setting": "--repack 0 (mmap)",
        "command": rounds[0]["peer_repack0"]["command"],
        "outcomes": [r["peer_repack0"]["outcome"] for r in rounds],
        "metrics": {m: med("peer_repack0", m) for m in ("decode_tok_s", "decode_tok_s_first_run", "disk_bytes_per_token", "peak_rss")},
    }
    pd = result["peer_default"]
    peer_med = (result["peer"]["metrics"]["decode_tok_s"] or {}).get("median")
    if pd.get("decode_tok_s") and peer_med and pd["decode_tok_s"] > peer_med:
        # The default is measured once, --repack 0 every round: the ratios stay over --repack 0,
        # and the result says that the default was faster.
        pd["faster_than_repack0"] = True

    def side_by_side(metric):
        row = {PEER: med("peer_repack0", metric) if metric == "disk_bytes_per_token" else None}
        for key, _ in arms:
            row[key] = med(key, metric)
        return row

    result["disk_bytes_per_token"] = {
        "whole_run": dict(side_by_side("disk_bytes_per_token"), basis=DEFINITIONS["disk_bytes_per_token"]),
        "steady_state": dict(
            side_by_side("bytes_read_per_token_steady"),
            basis=DEFINITIONS["bytes_read_per_token_steady"] + "; llama.cpp's page-cache reads cannot be split by repetition, hence null",
        ),
    }

    def ratio(key, rd):
        p = rd["peer_repack0"].get("decode_tok_s")
        s = rd[key].get("decode_tok_s")
        return s / p if p and s else None

    ratio_names = {"sluice": "decode", "sluice_no_prefetch": "decode_no_prefetch", "sluice_pack": "decode_pack"}
    result["ratios"] = {ratio_names[k]: lib.ratio_summary([ratio(k, r) for r in rounds]) for k, _ in arms}

    # IO bound of a round: the disk's bandwidth at the read size over the bytes sluice read per
    # token in the steady state.
    def bound(key, io_key, size, where):
        rows = [r for r in rounds if r[key].get("bytes_read_per_token_steady") and r[io_key].get("gb_s")]
        return {
            "decode_tok_s": lib.summary([r[io_key]["gb_s"] * 1e9 / r[key]["bytes_read_per_token_steady"] for r in rows]),
            "sluice_fraction": lib.summary([r[key]["decode_tok_s"] * r[key]["bytes_read_per_token_steady"] / (r[io_key]["gb_s"] * 1e9) for r in rows]),
            "basis": f"O_DIRECT random reads of {size} bytes at depth {a.io_depth} on {where} (sluice bench-io, {a.io_seconds} s before and after sluice's runs in each round, the better of the two) / bytes sluice read per decoded token in the steady state (its own counters)",
            "disk_gb_s": med(io_key, "gb_s"),
        }

    result["bound"] = bound("sluice", "io_ranges", range_size, "the GGUF file")
    result["bound_no_prefetch"] = bound("sluice_no_prefetch", "io_ranges", range_size, "the GGUF file")
    if a.pack:
        result["bound_pack"] = bound("sluice_pack", "io_records", record_size, "the pack")
    result["rounds"] = rounds

    if a.fits_model:
        result["fits_case"] = fits_case(exe, a)
    lib.write_result(result["name"], result, lib.out_dir(a))


def fits_case(exe, a):
    """The model fits: streaming with a quota that holds every expert against resident mode."""
    n_rounds, p, n, r = (2, 16, 16, 1) if a.dry_run else (6, 128, 128, 3)
    info = lib.last_json(lib.run([exe, "inspect", "--json", a.fits_model])["out"])
    quota = info["expert_bytes"] * 2  # slots are sized for the largest expert; twice is ample
    rows = []
    synthetic = False
    modes = [("resident", ["--expert-mode", "resident"]), ("stream", ["--expert-mode", "stream", "--expert-cache", str(quota)])]
    for i in range(n_rounds):
        row = {}
        # Alternate which goes first, so a drift of the machine's speed does not favour one.
        for name, extra in modes if i % 2 == 0 else modes[::-1]:
            cmd = [exe, "bench", "-m", a.fits_model, "-t", str(a.threads), "-p", str(p), "-n", str(n), "-r", str(r), "--json"] + extra
            j = lib.last_json(lib.run(cmd, env=lib.sluice_env(a.sluice_isa))["out"])
            synthetic = synthetic or bool(j["experts"].get("routing_note"))
            row[name] = {"command": " ".join(cmd), "decode_tok_s": j["decode_tok_s"], "prefill_tok_s": j["prefill_tok_s"], "placement": j["experts"]["placement"]}
        rows.append(row)
        lib.log(json.dumps({k: (v["prefill_tok_s"], v["decode_tok_s"]) for k, v in row.items()}))
    return {
        "model": dict(lib.model_info(a.fits_model), synthetic=synthetic),
        "protocol": f"{n_rounds} rounds of sluice bench -p {p} -n {n} -r {r}, resident and streaming with every expert fitting in the quota (warm after the warm-up), alternating which runs first",
        "ratios": {
            "decode_stream_over_resident": lib.ratio_summary([r["stream"]["decode_tok_s"] / r["resident"]["decode_tok_s"] for r in rows]),
            "prefill_stream_over_resident": lib.ratio_summary([r["stream"]["prefill_tok_s"] / r["resident"]["prefill_tok_s"] for r in rows]),
        },
        "rounds": rows,
    }


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Self-speculation on a streamed MoE: what drafting from the cached experts does to the
expert bytes read per generated token, the decode rate, and the cost of a verify pass by
draft length, against plain decoding of the same model through the same cache.

The model is a synthetic MoE of a real shape with skewed routing (default: OLMoE-1B-7B's
shape, made with `sluice synth --shape olmoe-1b-7b --routing skewed` if it is missing). Its
weights are random, so its acceptance rate says nothing about a real model's: what this
measures is what the mechanism costs and saves — reads per token, verify cost against k,
drafting time, and the precision of the prefetch hints drafts give — as the cache shrinks.

Reads are slowed to `--read-mbps` (default 300 MB/s) with the blkio controller's read
throttle on the model's block device (cgroup v1; the runs are put in a child group), so that
decode is bound by expert reads as on a slower disk; `--read-mbps 0` leaves the disk as it is.
The throttled rate is measured with `sluice bench-io` in the same group and recorded.

Per cache size and round, each a fresh process, greedy, a one-token prompt (so that almost
all reads are decode's) and `-n N` tokens:

  plain                      sluice run
  self                       --spec self (draft length chosen each round)
  self_k2, self_k4           --spec self --draft-fixed --draft-max 2 / 4
  self_k4_no_prefetch        the same without handing left-out experts to the prefetcher

Every run prints the same tokens (checked). Bytes per generated token are sluice's own read
counter over the run divided by the tokens generated (the prompt token's reads included).

    python3 bench/spec_stream.py [--model PATH] [--caches 256MiB,1GiB,2GiB] [-n 32]
        [--rounds 1] [--read-mbps 300] [--threads 2]
"""

import argparse
import os

import lib

VARIANTS = {
    "plain": [],
    "self": ["--spec", "self", "--draft-p-min", "0"],
    "self_k2": ["--spec", "self", "--draft-fixed", "--draft-max", "2", "--draft-p-min", "0"],
    "self_k4": ["--spec", "self", "--draft-fixed", "--draft-max", "4", "--draft-p-min", "0"],
    "self_k4_no_prefetch": ["--spec", "self", "--draft-fixed", "--draft-max", "4", "--draft-p-min", "0", "--no-draft-prefetch"],
}

CGROUP = "/sys/fs/cgroup/blkio/sluice-bench"


def throttle(model, mbps):
    """Puts a read throttle of `mbps` MB/s on the model's disk in a blkio group; returns a
    description, or None when there is no throttle."""
    if mbps <= 0:
        return None
    st = os.stat(model)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    devs = [f"{major}:{minor}"]
    parent = os.path.realpath(f"/sys/dev/block/{major}:{minor}/..")
    if os.path.exists(os.path.join(parent, "dev")):
        devs.append(open(os.path.join(parent, "dev")).read().strip())
    os.makedirs(CGROUP, exist_ok=True)
    for d in devs:
        try:
            with open(os.path.join(CGROUP, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{d} {int(mbps * 1e6)}\n")
            return {"device": d, "read_bytes_per_s": int(mbps * 1e6), "how": "cgroup v1 blkio.throttle.read_bps_device"}
        except OSError:
            continue
    raise SystemExit(f"could not throttle reads of {devs} (needs root and the cgroup v1 blkio controller); pass --read-mbps 0")


def wrapped(cmd, throttled):
    if not throttled:
        return cmd
    return ["sh", "-c", f'echo $$ > {CGROUP}/cgroup.procs && exec "$@"', "sh"] + cmd


def one(exe, a, cache, extra, throttled):
    cmd = [exe, "run", "-m", a.model, "-t", str(a.threads), "--expert-cache", cache, "--prompt-tokens", "7", "-n", str(a.gen), "--ignore-eos", "--json", "--stats"] + extra
    r = lib.last_json(lib.run(wrapped(cmd, throttled))["out"])
    x, t = r["experts"], r["timings"]
    m = {
        "decode_tok_s": t["decode_tok_s"],
        "bytes_per_generated_token": x["bytes_read"] / len(r["token_ids"]),
        "io_stall_ms_per_token": x["io_stall_ms_per_token"],
        "prefetch_precision": x.get("prefetch_precision"),
    }
    s = r.get("spec")
    if s:
        m.update({k: s[k] for k in ("drafted", "accepted", "rounds", "mean_k", "chosen_k", "draft_s", "verify_s")})
        m["acceptance"] = s["accepted"] / max(1, s["drafted"])
        m["tokens_per_pass"] = (s["accepted"] + s["rounds"]) / max(1, s["rounds"])
        m["verify_ms_by_k"] = s["estimates"].get("verify_ms_by_k")
        m["draft_ms_per_token"] = 1e3 * s["draft_s"] / max(1, s["drafted"])
        m["proposer"] = s.get("proposer")
    return cmd, m, r["token_ids"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/sluice/synth/olmoe-1b-7b-skewed-q4_k_m.gguf"))
    ap.add_argument("--caches", default="256MiB,1GiB,2GiB")
    ap.add_argument("-n", "--gen", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--read-mbps", type=float, default=300)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", help="comma-separated subset of " + ", ".join(VARIANTS))
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty)
    exe = lib.sluice_bin(not a.dry_run)
    if not os.path.exists(a.model):
        lib.run([exe, "synth", "--shape", "olmoe-1b-7b", "--routing", "skewed", "-o", a.model])
    variants = {k: v for k, v in VARIANTS.items() if not a.only or k in a.only.split(",")}
    th = throttle(a.model, a.read_mbps)
    try:
        io = lib.last_json(lib.run(wrapped([exe, "bench-io", "--file", a.model, "--seconds", "5", "--json"], th))["out"])
        results, cmds, same = {}, {}, True
        for cache in a.caches.split(","):
            rounds = []
            for i in range(a.rounds):
                lib.log(f"cache {cache}, round {i + 1}/{a.rounds}")
                r, outs = {}, []
                for name, extra in variants.items():
                    cmd, m, toks = one(exe, a, cache, extra, th)
                    cmds[name] = " ".join(cmd).replace(cache, "$CACHE")
                    r[name] = m
                    outs.append(toks)
                    lib.log(f"  {name}: {m['decode_tok_s']:.2f} tok/s, {m['bytes_per_generated_token'] / 1e6:.1f} MB/token" + (f", acceptance {100 * m['acceptance']:.0f}%, k {m['mean_k']:.2f}" if "acceptance" in m else ""))
                same &= all(o == outs[0] for o in outs)
                rounds.append(r)
            med = lambda k, f: lib.summary([r[k][f] for r in rounds])["median"]
            results[cache] = {
                "decode_tok_s": {k: med(k, "decode_tok_s") for k in variants},
                "mb_per_generated_token": {k: med(k, "bytes_per_generated_token") / 1e6 for k in variants},
                "vs_plain": {k: {"decode": med(k, "decode_tok_s") / med("plain", "decode_tok_s"), "bytes_per_token": med(k, "bytes_per_generated_token") / med("plain", "bytes_per_generated_token")} for k in variants if k != "plain" and "plain" in variants},
                "rounds": rounds,
            }
        result = lib.header("spec-stream-" + os.path.splitext(os.path.basename(a.model))[0], state, a.dry_run)
        result.update(
            {
                "model": dict(lib.model_info(a.model), synthetic=True),
                "note": "random weights with skewed routing: acceptance says nothing about a real model; reads per token, verify cost by k, drafting cost and hint precision are what this measures",
                "protocol": {"prompt": "one token (7)", "gen_tokens": a.gen, "greedy": True, "threads": a.threads, "rounds": a.rounds, "order": ", ".join(variants), "read_throttle": th, "disk_gb_s_throttled": io["gb_s"]},
                "sluice": {"version": lib.version(state), "isa": lib.sluice_isa(a.sluice_isa, not a.dry_run)["isa"], "commands": cmds},
                "speculative_output_equals_plain": same,
                "caches": results,
            }
        )
        lib.write_result(result["name"], result, lib.out_dir(a))
    finally:
        if th:
            with open(os.path.join(CGROUP, "blkio.throttle.read_bps_device"), "w") as f:
                f.write(f"{th['device']} 0\n")


if __name__ == "__main__":
    main()

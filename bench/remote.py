#!/usr/bin/env python3
"""A model served over HTTP with added latency and a bandwidth cap: sluice running it from the
URL against downloading the whole file first.

nginx serves the model's directory on loopback; `tc netem` on the loopback device adds
`--delay-ms` each way (the round trip is twice that) and caps the rate at `--rate`. Then:

  * download first (the peer): `curl -o` of the whole file, then `sluice run -n 1` of the
    local copy; time to first token = download + that run's wall time;
  * sluice from the URL, nothing local: wall time of `sluice run -m URL -n 1` (the header and
    dense weights fetched, the prompt's experts read as the router asks);
  * decode from the URL, cold (dense weights local, disk tier empty) and warm (the same run
    again: the disk tier holds what the cold run fetched): decode tok/s, bytes fetched from
    the server per generated token, and the link's bound for that (link rate / bytes per
    token), where the link rate is the one curl measured;
  * the local copy streamed through the same expert cache, for reference.

The page cache is dropped before every run. Needs root (tc, drop_caches).

    sudo python3 bench/remote.py --model ~/.cache/sluice/synth/qwen3-30b-a3b-q4_k_m.gguf \\
        [--delay-ms 10] [--rate 1gbit] [-n 16] [--expert-cache 4GiB]
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time

import lib

DEFINITIONS = {
    "ttft_s": "wall time from starting the command to the end of a 1-token generation (loading and prefill of the prompt included)",
    "download_s": "wall time of curl downloading the whole file over the shaped link",
    "link_bytes_per_s": "file size / download_s: the rate the shaped link delivered to one TCP stream",
    "remote_bytes_per_token": "bytes sluice fetched from the server during the run (prefill and decode) over the tokens generated",
    "bound_tok_s": "link_bytes_per_s / remote_bytes_per_token: the most tokens per second the link allows at that miss volume",
}


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def start_nginx(root, port, work):
    conf = os.path.join(work, "nginx.conf")
    with open(conf, "w") as f:
        f.write(
            f"daemon off;\nmaster_process off;\nworker_processes 1;\npid {work}/nginx.pid;\nerror_log {work}/error.log;\n"
            f"events {{ worker_connections 512; }}\nhttp {{\n  access_log off;\n  sendfile on;\n"
            f"  server {{\n    listen 127.0.0.1:{port};\n    root {root};\n    location / {{ }}\n  }}\n}}\n"
        )
    p = subprocess.Popen(["nginx", "-c", conf, "-p", work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return p
        except OSError:
            time.sleep(0.05)
    raise SystemExit("nginx did not start: " + open(os.path.join(work, "error.log")).read())


def shape(dev, delay_ms, rate):
    subprocess.check_call(["tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{delay_ms}ms", "rate", rate])


def unshape(dev):
    subprocess.call(["tc", "qdisc", "del", "dev", dev, "root"], stderr=subprocess.DEVNULL)


def cold(a):
    if not a.dry_run and not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root (or pass --dry-run)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local GGUF file to serve")
    ap.add_argument("--delay-ms", type=float, default=10.0, help="added delay each way (round trip: twice this)")
    ap.add_argument("--rate", default="1gbit", help="tc netem rate cap")
    ap.add_argument("-n", "--gen", type=int, default=16, help="tokens to generate in the decode runs")
    ap.add_argument("--prompt-tokens", default="9707,11,1879,0,3555,525,498,3730")
    ap.add_argument("--expert-cache", default="4GiB", help="sluice's expert cache (memory)")
    ap.add_argument("--disk-cache-size", default="16GiB", help="disk tier of the warm runs")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--scratch", default=os.path.expanduser("~/.cache/sluice/remote-bench"), help="where the downloaded copy and the disk tier go")
    ap.add_argument("--no-shape", action="store_true", help="leave the loopback device alone (no tc)")
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    sluice = lib.sluice_bin(build=not a.dry_run)
    model = os.path.abspath(a.model)
    size = os.path.getsize(model)
    os.makedirs(a.scratch, exist_ok=True)
    free = shutil.disk_usage(a.scratch).free
    if free < size * 1.3:
        raise SystemExit(f"{a.scratch}: {free / 2**30:.1f} GiB free, the copy and the disk tier need about {size * 1.3 / 2**30:.1f}")
    work = tempfile.mkdtemp(prefix="sluice-remote-bench-")
    port = free_port()
    server = start_nginx(os.path.dirname(model), port, work)
    url = f"http://127.0.0.1:{port}/{os.path.basename(model)}"
    copy = os.path.join(a.scratch, "copy.gguf")
    tier = os.path.join(a.scratch, "tier")
    env = lib.sluice_env(a.sluice_isa)
    common = ["--prompt-tokens", a.prompt_tokens, "--expert-cache", a.expert_cache, "--threads", str(a.threads), "--no-pressure", "--json"]
    res = lib.header("remote", state, a.dry_run)
    res.update({
        "model": lib.model_info(model),
        "link": {"delay_ms_each_way": None if a.no_shape else a.delay_ms, "rtt_ms": None if a.no_shape else 2 * a.delay_ms, "rate": None if a.no_shape else a.rate, "device": "lo"},
        "settings": {"gen": a.gen, "prompt_tokens": a.prompt_tokens, "expert_cache": a.expert_cache, "disk_cache_size": a.disk_cache_size, "threads": a.threads or os.cpu_count()},
        "definitions": DEFINITIONS,
    })
    try:
        if not a.no_shape:
            shape("lo", a.delay_ms, a.rate)
        for p in (copy, tier):
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)
        # The peer: the whole file first.
        cold(a)
        dl = lib.run(["curl", "-sS", "--fail", "-o", copy, url])
        link = size / dl["seconds"]
        cold(a)
        local1 = lib.run([sluice, "run", "-m", copy, "-n", "1"] + common, env=env)
        # sluice from the URL, nothing local.
        cold(a)
        remote1 = lib.run([sluice, "run", "-m", url, "--disk-cache", tier, "-n", "1"] + common, env=env)
        first = lib.last_json(remote1["out"])
        shutil.rmtree(os.path.join(tier, "experts"), ignore_errors=True)

        def decode(label, cmd):
            cold(a)
            r = lib.run(cmd, env=env)
            j = lib.last_json(r["out"])
            tiers = {t["tier"]: t for t in j["experts"].get("tiers", [])}
            remote = tiers.get("remote", {})
            per = remote.get("bytes", 0) / max(1, len(j["token_ids"]))
            out = {
                "wall_s": r["seconds"],
                "decode_tok_s": j["timings"]["decode_tok_s"],
                "prefill_tok_s": j["timings"]["prefill_tok_s"],
                "generated": len(j["token_ids"]),
                "hit_rate": j["experts"]["hit_rate"],
                "miss_rate": j["experts"]["miss_rate"],
                "expert_bytes_read_per_token": j["experts"]["bytes_read_per_token"],
                "tiers": j["experts"].get("tiers"),
                "remote_bytes_per_token": per if remote else None,
                "bound_tok_s": link / per if remote and per > 0 else None,
                "token_ids": j["token_ids"],
                "command": " ".join(cmd),
            }
            lib.log(f"{label}: {out['decode_tok_s']:.2f} tok/s decode" + (f", {per / 1e6:.1f} MB/token remote, bound {out['bound_tok_s']:.2f} tok/s" if out["bound_tok_s"] else ""))
            return out

        rcmd = [sluice, "run", "-m", url, "--disk-cache", tier, "--disk-cache-size", a.disk_cache_size, "-n", str(a.gen)] + common
        dec_cold = decode("remote cold", rcmd)
        dec_warm = decode("remote warm", rcmd)
        dec_local = decode("local copy", [sluice, "run", "-m", copy, "-n", str(a.gen)] + common)
        same = dec_cold["token_ids"] == dec_warm["token_ids"] == dec_local["token_ids"]
        res["results"] = {
            "download_first": {"download_s": dl["seconds"], "link_bytes_per_s": link, "run_s": local1["seconds"], "ttft_s": dl["seconds"] + local1["seconds"], "command": f"curl -o {copy} {url}; sluice run -m {copy} -n 1"},
            "sluice_from_url": {"ttft_s": remote1["seconds"], "tiers": first["experts"].get("tiers"), "command": " ".join([sluice, "run", "-m", url, "--disk-cache", tier, "-n", "1"] + common)},
            "ttft_ratio": (dl["seconds"] + local1["seconds"]) / remote1["seconds"],
            "decode_cold": dec_cold,
            "decode_warm": dec_warm,
            "decode_local_copy": dec_local,
            "same_tokens": same,
        }
        lib.log(f"time to first token: download first {dl['seconds'] + local1['seconds']:.1f} s, from the URL {remote1['seconds']:.1f} s ({res['results']['ttft_ratio']:.1f}x)")
        if not same:
            raise SystemExit("the remote and local runs generated different tokens")
    finally:
        if not a.no_shape:
            unshape("lo")
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    lib.write_result("remote", res, lib.out_dir(a))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""A model served over HTTP with added latency and a bandwidth cap: sluice running it from the
URL against downloading the whole file first.

nginx serves the model's directory on loopback, behind an emulated link: a proxy in this
script that adds one round trip (`--rtt-ms`) to every request and to every new connection,
and shares one byte rate (`--rate-mbit`) among all connections, as one access link would.
(`tc netem` would be the usual tool; kernels without the netem module, like the VMs this was
first run on, cannot, and the proxy needs no root.) It does not model TCP slow start or
loss. Then:

  * download first (the peer): `curl -o` of the whole file, then `sluice run -n 1` of the
    local copy; time to first token = download + that run's wall time;
  * sluice from the URL, nothing local: wall time of `sluice run -m URL -n 1` (the header and
    dense weights fetched, the prompt's experts read as the router asks);
  * decode from the URL, cold (dense weights local, disk tier empty) and warm (the same run
    again: the disk tier holds what the cold run fetched): decode tok/s, bytes fetched from
    the server per generated token, and the link's bound for that (link rate / bytes per
    token), where the link rate is the one curl measured;
  * the local copy streamed through the same expert cache, for reference.

The page cache is dropped before every run (root).

    sudo python3 bench/remote.py --model ~/.cache/sluice/synth/qwen3-30b-a3b-q4_k_m.gguf \\
        [--rtt-ms 20] [--rate-mbit 1000] [-n 16] [--expert-cache 4GiB]
"""

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import lib

DEFINITIONS = {
    "ttft_s": "wall time from starting the command to the end of a 1-token generation (loading and prefill of the prompt included)",
    "download_s": "wall time of curl downloading the whole file over the shaped link",
    "curl_bytes_per_s": "file size / download_s: the rate curl's one connection got from the emulated link",
    "link_bytes_per_s": "the emulated link's rate (--rate-mbit), which the bounds divide",
    "remote_bytes_per_token": "bytes sluice fetched from the server during the run (prefill and decode) over the tokens processed (prompt and generated)",
    "run_tok_s": "tokens processed (prompt and generated) over the run's prefill and decode time",
    "bound_tok_s": "link_bytes_per_s / remote_bytes_per_token: the most tokens per second the link allows at that miss volume (compare with run_tok_s)",
    "link_utilization": "bytes fetched from the server over the prefill and decode time, as a share of link_bytes_per_s (run_tok_s / bound_tok_s)",
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


class Link:
    """The emulated link: a proxy on loopback in front of `upstream`, one round trip of delay
    per request and per new connection, and one byte rate shared by every connection."""

    def __init__(self, upstream, rtt_s, rate_bytes_s):
        self.upstream, self.rtt, self.rate = upstream, rtt_s, rate_bytes_s
        self.lock = threading.Lock()
        self.next_free = time.monotonic()
        self.bytes = 0
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.port = self.sock.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self):
        self.stopped = True
        self.sock.close()

    def _send(self, c, data):
        """Sends `data` at the link's rate: each chunk waits until the link is free."""
        view = memoryview(data)
        while view:
            part = view[: 256 << 10]
            with self.lock:
                start = max(time.monotonic(), self.next_free)
                self.next_free = start + len(part) / self.rate
                self.bytes += len(part)
            wait = start + len(part) / self.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            c.sendall(part)
            view = view[len(part):]

    def _accept(self):
        while not self.stopped:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            time.sleep(self.rtt)  # the handshake
            u = socket.create_connection(("127.0.0.1", self.upstream))
            cf, uf = c.makefile("rb"), u.makefile("rb")
            while True:
                head = b""
                while not head.endswith(b"\r\n\r\n"):
                    line = cf.readline()
                    if not line:
                        return
                    head += line
                time.sleep(self.rtt)  # the request's round trip
                u.sendall(head)
                status = uf.readline()
                headers, length = [status], 0
                while True:
                    line = uf.readline()
                    headers.append(line)
                    if line in (b"\r\n", b""):
                        break
                    k, _, v = line.decode("latin-1").partition(":")
                    if k.strip().lower() == "content-length":
                        length = int(v.strip())
                if head.startswith(b"HEAD "):
                    length = 0
                self._send(c, b"".join(headers))
                while length > 0:
                    chunk = uf.read(min(length, 1 << 20))
                    if not chunk:
                        return
                    self._send(c, chunk)
                    length -= len(chunk)
        except OSError:
            pass
        finally:
            c.close()


def dense_fetch(stderr):
    """(MB, seconds) of the header and dense weights fetched, from sluice's message."""
    m = re.search(r"fetched the header and dense weights \(([0-9.]+) MB\) in ([0-9.]+) s", stderr)
    return {"mb": float(m.group(1)), "seconds": float(m.group(2))} if m else None


def cold(a):
    if not a.dry_run and not lib.drop_caches():
        raise SystemExit("dropping the page cache needs root (or pass --dry-run)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a local GGUF file to serve")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="round trip added to every request and new connection")
    ap.add_argument("--rate-mbit", type=float, default=1000.0, help="the link's rate, shared by all connections")
    ap.add_argument("-n", "--gen", type=int, default=16, help="tokens to generate in the decode runs")
    ap.add_argument("--prompt-tokens", default="9707,11,1879,0,3555,525,498,3730")
    ap.add_argument("--expert-cache", default="4GiB", help="sluice's expert cache (memory)")
    ap.add_argument("--disk-cache-size", default="16GiB", help="disk tier of the warm runs")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--scratch", default=os.path.expanduser("~/.cache/sluice/remote-bench"), help="where the downloaded copy and the disk tier go (removed before and after the run)")
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty or a.dry_run)
    sluice = lib.sluice_bin(build=not a.dry_run)
    model = os.path.abspath(a.model)
    size = os.path.getsize(model)
    os.makedirs(a.scratch, exist_ok=True)
    copy = os.path.join(a.scratch, "copy.gguf")
    tier = os.path.join(a.scratch, "tier")

    def clean():
        for p in (copy, tier):
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.exists(p):
                os.remove(p)

    clean()
    free = shutil.disk_usage(a.scratch).free
    if free < size * 1.3:
        raise SystemExit(f"{a.scratch}: {free / 2**30:.1f} GiB free, the copy and the disk tier need about {size * 1.3 / 2**30:.1f}")
    work = tempfile.mkdtemp(prefix="sluice-remote-bench-")
    port = free_port()
    server = start_nginx(os.path.dirname(model), port, work)
    link_proxy = Link(port, a.rtt_ms / 1000, a.rate_mbit * 1e6 / 8)
    url = f"http://127.0.0.1:{link_proxy.port}/{os.path.basename(model)}"
    env = lib.sluice_env(a.sluice_isa)
    common = ["--prompt-tokens", a.prompt_tokens, "--expert-cache", a.expert_cache, "--threads", str(a.threads), "--no-pressure", "--json"]
    res = lib.header("remote", state, a.dry_run)
    res.update({
        "model": lib.model_info(model),
        "link": {"rtt_ms": a.rtt_ms, "rate_mbit_s": a.rate_mbit, "emulation": "proxy in bench/remote.py: one RTT per request and per new connection, one shared byte rate; no slow start or loss"},
        "settings": {"gen": a.gen, "prompt_tokens": a.prompt_tokens, "expert_cache": a.expert_cache, "disk_cache_size": a.disk_cache_size, "threads": a.threads or os.cpu_count()},
        "definitions": DEFINITIONS,
    })
    try:
        # The peer: the whole file first.
        cold(a)
        dl = lib.run(["curl", "-sS", "--fail", "-o", copy, url])
        link = a.rate_mbit * 1e6 / 8
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
            tokens = len(a.prompt_tokens.split(",")) + len(j["token_ids"])
            busy = j["timings"]["prefill_s"] + j["timings"]["decode_s"]
            per = remote.get("bytes", 0) / tokens
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
                "run_tok_s": tokens / busy,
                "bound_tok_s": link / per if remote and per > 0 else None,
                "link_utilization": remote.get("bytes", 0) / busy / link if remote else None,
                "token_ids": j["token_ids"],
                "command": " ".join(cmd),
            }
            lib.log(f"{label}: {out['decode_tok_s']:.2f} tok/s decode, {out['run_tok_s']:.2f} tok/s over prompt and generation" + (f"; {per / 1e6:.1f} MB/token from the server, bound {out['bound_tok_s']:.2f} tok/s, link {100 * out['link_utilization']:.0f}% busy" if out["bound_tok_s"] else ""))
            return out

        rcmd = [sluice, "run", "-m", url, "--disk-cache", tier, "--disk-cache-size", a.disk_cache_size, "-n", str(a.gen)] + common
        dec_cold = decode("remote cold", rcmd)
        dec_warm = decode("remote warm", rcmd)
        dec_local = decode("local copy", [sluice, "run", "-m", copy, "-n", str(a.gen)] + common)
        same = dec_cold["token_ids"] == dec_warm["token_ids"] == dec_local["token_ids"]
        res["results"] = {
            "link_bytes_per_s": link,
            "download_first": {"download_s": dl["seconds"], "curl_bytes_per_s": size / dl["seconds"], "run_s": local1["seconds"], "ttft_s": dl["seconds"] + local1["seconds"], "command": f"curl -o {copy} {url}; sluice run -m {copy} -n 1"},
            "sluice_from_url": {"ttft_s": remote1["seconds"], "dense_fetch": dense_fetch(remote1["err"]), "tiers": first["experts"].get("tiers"), "command": " ".join([sluice, "run", "-m", url, "--disk-cache", tier, "-n", "1"] + common)},
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
        link_proxy.stop()
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
        clean()
    lib.write_result("remote", res, lib.out_dir(a))


if __name__ == "__main__":
    main()

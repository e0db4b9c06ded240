"""Helpers for the server benchmarks: start a server, stream a completion over HTTP."""

import http.client
import json
import os
import socket
import subprocess
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_text(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("GET", path)
    return c.getresponse().read().decode(errors="replace")


def wait_health(port, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def start(cmd, port, env=None, log_path=None, timeout=300):
    log = open(log_path or os.devnull, "w")
    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_health(port, p, timeout)
    return p


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def stream_completion(port, body, disconnect_after=None, timeout=600, deadline=None, counts=None):
    """POSTs a streamed /v1/completions request. Returns (status, text, ttft_s, gaps_s, tokens
    seen as chunks with text, disconnected). At `deadline` (a time.time() value) the client
    disconnects. `counts` (a dict), where given, receives `events` (chunks with a choice, text or
    not) and `usage_tokens` (completion_tokens of a usage chunk, None without one)."""
    if counts is not None:
        counts.update(events=0, usage_tokens=None)
    body = dict(body, stream=True)
    if deadline is not None:
        timeout = max(0.1, min(timeout, deadline - time.time()))
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    text, ttft, gaps, last, chunks, done = "", None, [], None, 0, False

    def cut():
        # The client leaves at its deadline: what it received so far is its result.
        c.close()
        return 200, text, ttft, gaps, chunks, True

    t0 = time.time()
    c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    try:
        r = c.getresponse()
    except (TimeoutError, socket.timeout):
        if deadline is None:
            raise
        return cut()
    if r.status != 200:
        return r.status, r.read().decode(errors="replace"), None, [], 0, False
    while True:
        try:
            line = r.readline()
        except (TimeoutError, socket.timeout):
            if deadline is None:
                raise
            return cut()
        if not line:
            break
        if deadline is not None and time.time() >= deadline:
            return cut()
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done = True
            break
        v = json.loads(data)
        if "error" in v:
            return 500, json.dumps(v), ttft, gaps, chunks, False
        ch = v.get("choices") or []
        if counts is not None:
            counts["events"] += 1 if ch else 0
            if v.get("usage"):
                counts["usage_tokens"] = v["usage"].get("completion_tokens")
        if ch and ch[0].get("text"):
            now = time.time()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            text += ch[0]["text"]
            chunks += 1
            if disconnect_after is not None and chunks >= disconnect_after:
                c.sock.shutdown(socket.SHUT_RDWR)
                c.close()
                return 200, text, ttft, gaps, chunks, True
    c.close()
    if not done:
        return 599, "stream ended without [DONE]", ttft, gaps, chunks, False
    return 200, text, ttft, gaps, chunks, False


def story_body(k, n, **extra):
    """The benchmarks' request: a greedy completion of `n` tokens for client `k` (ignore_eos)."""
    return dict({"prompt": f"Write a story about number {k}.", "max_tokens": n, "n_predict": n,
                 "temperature": 0, "ignore_eos": True}, **extra)


def concurrent_streams(clients, request):
    """Runs `request(k)` (a stream_completion) for every client at once on threads of their own;
    returns (results, wall seconds). Exits when a request failed."""
    results = [None] * clients

    def one(k):
        results[k] = request(k)

    t0 = time.time()
    ts = [threading.Thread(target=one, args=(k,)) for k in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.time() - t0
    for r in results:
        if r[0] != 200:
            raise SystemExit(f"request failed: {r[0]} {r[1][:200]}")
    return results, wall


def percentile(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[k]

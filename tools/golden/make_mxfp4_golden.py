#!/usr/bin/env python3
"""Makes tests/golden/gpt_oss_mxfp4: the gpt_oss golden checkpoint with its experts in MXFP4,
stored as the published gpt-oss checkpoints store them (`*_blocks`, U8, two 4-bit codes a
byte; `*_scales`, U8 E8M0 exponents; a `quantization_config` naming mxfp4), and what
transformers computes for it.

The codes and exponents are random. transformers' own MXFP4 unpacking
(`integrations.mxfp4.convert_moe_packed_tensors`) gives the expert matrices; they are
exact in float32 (a 4-bit E2M1 value times a power of two), so the reference runs the
model in float32 with them substituted for the float experts.

    python3 tools/golden/make_mxfp4_golden.py --golden tests/golden
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", required=True)
    args = ap.parse_args()
    src = os.path.join(args.golden, "gpt_oss")
    dst = os.path.join(args.golden, "gpt_oss_mxfp4")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    torch.manual_seed(4)
    sd = load_file(os.path.join(src, "model.safetensors"))
    packed, dense = {}, {}
    for k, v in sd.items():
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
            e, cin, cout = v.shape  # (experts, in, out), as transformers keeps them
            blocks = torch.randint(0, 256, (e, cout, cin // 32, 16), dtype=torch.uint8)
            scales = torch.randint(119, 123, (e, cout, cin // 32), dtype=torch.uint8)
            packed[k + "_blocks"] = blocks
            packed[k + "_scales"] = scales
            dense[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            assert dense[k].shape == v.shape, (dense[k].shape, v.shape)
        else:
            packed[k] = v
    save_file(packed, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(dst, "config.json")))
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"), indent=2)

    # The reference: the same model in float32 with the unpacked experts.
    with tempfile.TemporaryDirectory() as ref:
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), ref)
        save_file({k: dense.get(k, v.float()) for k, v in sd.items()}, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
        model = transformers.GptOssForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
        golden = json.load(open(os.path.join(src, "golden.json")))
        tokens, prompt = golden["tokens"], golden["greedy"]["prompt"]
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
            gen = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=len(golden["greedy"]["tokens"]),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )[0].tolist()[len(prompt):]
    golden.update(
        family="gpt_oss_mxfp4",
        logits=[[float(x) for x in row] for row in logits.tolist()],
        greedy={"prompt": prompt, "tokens": gen},
    )
    json.dump(golden, open(os.path.join(dst, "golden.json"), "w"), separators=(",", ":"))
    print(f"wrote {dst}: |logits|max={logits.abs().max():.3f} greedy={gen[:8]}...")


if __name__ == "__main__":
    sys.exit(main())

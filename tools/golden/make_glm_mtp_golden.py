#!/usr/bin/env python3
"""Makes tests/golden/glm4_moe_mtp: the glm4_moe golden with a multi-token-prediction layer
(`model.layers.{n_layer}.*`, as GLM-4.5's hub checkpoints store it: eh_proj, enorm, hnorm,
shared_head.norm and a whole MoE decoder layer), and what transformers' own MTP module
(`modeling_layers.MtpModel`, which speculative generation uses) computes for it.

    position p:  h = the model's last hidden state at p (final-normed, as generation passes it)
    x = eh_proj([enorm(embed(token p+1)) | hnorm(h)]);  x = decoder layer;  logits = lm_head(shared_head.norm(x))

The layer's weights are random (bf16 on disk, every 1-D parameter and the router's
correction bias off their init constants). `mtp_golden.json` holds the head's logits for every
position of the golden's tokens.

    python3 tools/golden/make_glm_mtp_golden.py --golden tests/golden
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeForCausalLM
from transformers.modeling_layers import MtpModel
from transformers.models.glm4_moe import modeling_glm4_moe as gm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", required=True)
    args = ap.parse_args()
    src = os.path.join(args.golden, "glm4_moe")
    dst = os.path.join(args.golden, "glm4_moe_mtp")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    torch.manual_seed(11)
    torch.use_deterministic_algorithms(True)
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    n = cfg["num_hidden_layers"]
    cfg["num_nextn_predict_layers"] = 1
    json.dump(cfg, open(cfg_path, "w"), indent=2)

    config = Glm4MoeForCausalLM.config_class.from_pretrained(dst)
    H = config.hidden_size
    layer = gm.Glm4MoeDecoderLayer(config, layer_idx=n).float()
    extra = {
        "eh_proj.weight": torch.nn.init.normal_(torch.empty(H, 2 * H), std=0.08),
        "enorm.weight": 1.0 + 0.3 * torch.randn(H),
        "hnorm.weight": 1.0 + 0.3 * torch.randn(H),
        "shared_head.norm.weight": 1.0 + 0.3 * torch.randn(H),
    }
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.08)
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in layer.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    p = f"model.layers.{n}."
    tensors = {p + k: v for k, v in extra.items()}
    state = dict(layer.named_parameters())
    state.update({k: v for k, v in layer.named_buffers() if "e_score_correction_bias" in k})
    for name, t in state.items():
        if name == "mlp.experts.gate_up_proj":
            ff = t.shape[1] // 2
            for e in range(t.shape[0]):
                tensors[f"{p}mlp.experts.{e}.gate_proj.weight"] = t[e, :ff]
                tensors[f"{p}mlp.experts.{e}.up_proj.weight"] = t[e, ff:]
        elif name == "mlp.experts.down_proj":
            for e in range(t.shape[0]):
                tensors[f"{p}mlp.experts.{e}.down_proj.weight"] = t[e]
        else:
            tensors[p + name] = t
    st = os.path.join(dst, "model.safetensors")
    sd = load_file(st)
    keep_f32 = lambda k: k.endswith("e_score_correction_bias")
    sd.update({k: v.detach().to(torch.float32 if keep_f32(k) else torch.bfloat16).contiguous() for k, v in tensors.items()})
    save_file(sd, st, metadata={"format": "pt"})

    main_model = Glm4MoeForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    # MtpModel.from_pretrained finds the layer by the real models' layer numbers (46, 92), so
    # the module is built directly and given the rounded weights by their in-memory names.
    mtp = MtpModel(main_model, 1).float().eval()
    rounded = lambda k, t: sd[k].float() if k in sd else t
    with torch.no_grad():
        mtp.layers[0].eh_proj.weight.copy_(sd[p + "eh_proj.weight"].float())
        mtp.layers[0].enorm.weight.copy_(sd[p + "enorm.weight"].float())
        mtp.layers[0].hnorm.weight.copy_(sd[p + "hnorm.weight"].float())
        mtp.layers[0].post_norm.weight.copy_(sd[p + "shared_head.norm.weight"].float())
        block = dict(mtp.layers[0].mtp_block.named_parameters())
        block.update(dict(mtp.layers[0].mtp_block.named_buffers()))
        for name, t in state.items():
            if name == "mlp.experts.gate_up_proj":
                t = t.to(torch.bfloat16).float()
            elif name == "mlp.experts.down_proj":
                t = t.to(torch.bfloat16).float()
            else:
                t = rounded(p + name, t)
            block[name].copy_(t)

    g = json.load(open(os.path.join(dst, "golden.json")))
    tokens = g["tokens"]
    T = len(tokens)
    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = main_model(ids, output_hidden_states=True).hidden_states[-1]
        x = mtp.forward_layer(
            0,
            hidden[:, : T - 1],
            position_ids=torch.arange(1, T)[None],
            mtp_cache=None,
            input_ids=ids[:, 1:],
        )
        logits = mtp._project_to_logits(x)[0]
    out = {
        "note": "multi-token-prediction head: row p predicts token p+2 from hidden p and token p+1",
        "transformers": __import__("transformers").__version__,
        "tokens": tokens,
        "mtp_logits": [[float(v) for v in row] for row in logits.tolist()],
    }
    json.dump(out, open(os.path.join(dst, "mtp_golden.json"), "w"), separators=(",", ":"))
    print(f"wrote {dst}: {len(tensors)} MTP tensors, logits {tuple(logits.shape)}, |max| {logits.abs().max():.3f}")


if __name__ == "__main__":
    main()

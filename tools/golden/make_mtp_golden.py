#!/usr/bin/env python3
"""Adds a multi-token-prediction head to the Qwen3-Next golden and records what an
independent PyTorch implementation of it computes.

transformers does not run MTP heads (it drops `mtp.*` when loading), so the reference is
written here from the published structure (the model authors' serving code in vLLM and
llama.cpp agree on it), with transformers' own Qwen3-Next modules for the pieces:

    position p:   e = embed_tokens(token[p+1]),  h = the model's final-normed hidden at p
    x = fc([pre_fc_norm_embedding(e) | pre_fc_norm_hidden(h)])        (2H -> H, no bias)
    x = one full-attention Qwen3NextDecoderLayer at position p, causal over the head's inputs
    logits = lm_head(norm(x))                                          (the model's lm_head)

The head's weights are random (bf16 on disk, every 1-D parameter off its init constant) and
saved as `model-mtp.safetensors` beside the golden's weights, in the hub's per-expert names; the
reference logits go to `mtp_golden.json`.

    python3 tools/golden/make_mtp_golden.py --golden tests/golden/qwen3_next
"""
import argparse
import copy
import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3NextForCausalLM
from transformers.models.qwen3_next import modeling_qwen3_next as qn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--golden", required=True)
    args = ap.parse_args()
    torch.manual_seed(7)
    torch.use_deterministic_algorithms(True)
    model = Qwen3NextForCausalLM.from_pretrained(args.golden, dtype=torch.float32).eval()
    cfg = model.config
    H = cfg.hidden_size

    # The head's layer: a full-attention decoder layer with the model's MoE.
    lcfg = copy.deepcopy(cfg)
    lcfg.num_hidden_layers = 1
    lcfg.layer_types = ["full_attention"]
    lcfg._attn_implementation = "eager"
    layer = qn.Qwen3NextDecoderLayer(lcfg, layer_idx=0).float()
    fc = torch.nn.Linear(2 * H, H, bias=False)
    norms = {k: qn.Qwen3NextRMSNorm(H, eps=cfg.rms_norm_eps) for k in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]}
    with torch.no_grad():
        for p in list(layer.parameters()) + list(fc.parameters()):
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.08)
        for name, p in list(layer.named_parameters()) + [(k, n.weight) for k, n in norms.items()]:
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
        # Round to bf16, as the file stores them; the reference runs on the rounded values.
        for p in list(layer.parameters()) + list(fc.parameters()) + [n.weight for n in norms.values()]:
            p.copy_(p.to(torch.bfloat16).float())

    # The tensors in the hub's names (per-expert, as Qwen3-Next's hub checkpoint has them).
    tensors = {"mtp.fc.weight": fc.weight}
    for k, n in norms.items():
        tensors[f"mtp.{k}.weight"] = n.weight
    for name, p in layer.named_parameters():
        if name == "mlp.experts.gate_up_proj":
            I = p.shape[1] // 2
            for e in range(p.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = p[e, :I]
                tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = p[e, I:]
        elif name == "mlp.experts.down_proj":
            for e in range(p.shape[0]):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = p[e]
        else:
            tensors[f"mtp.layers.0.{name}"] = p
    save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}, os.path.join(args.golden, "model-mtp.safetensors"))

    g = json.load(open(os.path.join(args.golden, "golden.json")))
    tokens = g["tokens"]
    with torch.no_grad():
        ids = torch.tensor([tokens])
        hidden = model.model(ids).last_hidden_state[0]  # final-normed, (T, H)
        T = len(tokens)
        e = model.model.embed_tokens(ids[:, 1:])[0]  # token p+1 for p < T-1
        x = fc(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden[: T - 1])], dim=-1))
        x = x.unsqueeze(0)
        pos = torch.arange(T - 1).unsqueeze(0)
        cos_sin = model.model.rotary_emb(x, pos)
        mask = torch.full((T - 1, T - 1), float("-inf")).triu(1)[None, None]
        x = layer(x, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)
        logits = model.lm_head(norms["norm"](x))[0]
    out = {
        "note": "multi-token-prediction head: row p predicts token p+2 from hidden p and token p+1",
        "transformers": __import__("transformers").__version__,
        "tokens": tokens,
        "mtp_logits": [[float(v) for v in row] for row in logits.tolist()],
    }
    with open(os.path.join(args.golden, "mtp_golden.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"))
    print(f"mtp head: {len(tensors)} tensors, logits {tuple(logits.shape)}, |max| {logits.abs().max():.3f}")


if __name__ == "__main__":
    main()

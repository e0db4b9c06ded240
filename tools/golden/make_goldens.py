#!/usr/bin/env python3
"""Builds tiny random Hugging Face checkpoints of every model family sluice supports and
records what Hugging Face transformers computes for them: the oracle for sluice's forward pass.

For each family it writes `<out>/<family>/`:
  config.json, model.safetensors (bf16), tokenizer.json, tokenizer_config.json,
  generation_config.json       -- the checkpoint, as save_pretrained writes it
  golden.json                  -- tokens, teacher-forced float32 logits, greedy continuation

The weights are saved in bf16 and the reference is computed in float32 from the very
bf16 values on disk (the checkpoint is reloaded before it is run).

Run with: python3 tools/golden/make_goldens.py --out tests/golden   (needs torch, transformers,
tokenizers). The output is committed; rerun only to add a family or change a config.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB = 384
SEQ = 40          # teacher-forced sequence length
PROMPT = 12       # greedy prompt length (prefix of the sequence)
NEW = 20          # greedy tokens generated

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,     # GQA ratio 2
    head_dim=24,               # != hidden / heads (16)
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.08,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES = {
    # Qwen3-MoE: per-head QK-norm, top-k renormalized, a dense layer among sparse ones.
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=3,
            intermediate_size=80,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # OLMoE: QK-norm over the whole projection, top-k weights not renormalized.
    "olmoe": (
        "OlmoeForCausalLM",
        dict(
            COMMON,
            head_dim=16,  # OLMoE derives head_dim from hidden / heads
            num_hidden_layers=2,
            intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Mixtral: softmax over the top-k router logits.
    "mixtral": (
        "MixtralForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # Qwen2-MoE: QKV bias, shared expert behind a sigmoid gate, sparse every 2nd layer.
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=4,
            intermediate_size=72,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=56,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            use_sliding_window=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Every layer sparse: llama.cpp's converter and loader take neither Qwen3-MoE's
    # `mlp_only_layers` nor Qwen2-MoE's dense layers, so the GGUF path is checked on these.
    "qwen3_moe_sparse": (
        "Qwen3MoeForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=3,
            intermediate_size=80,
            moe_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    "qwen2_moe_sparse": (
        "Qwen2MoeForCausalLM",
        dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=3,
            intermediate_size=72,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=56,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Qwen3-Next: Gated DeltaNet layers beside gated attention ones (layer 1 full attention),
    # two value heads per key head (so the head order matters), fused per-group input
    # projections, zero-centred norms, partial rotary (a quarter of head_dim), shared expert.
    "qwen3_next": (
        "Qwen3NextForCausalLM",
        dict(
            COMMON,
            head_dim=32,
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
    ),
    # Qwen3.5-MoE as released: an image-text checkpoint (a tiny vision tower that sluice must
    # leave alone), the language model under `model.language_model.`, separate DeltaNet
    # projections, a router that always renormalizes.
    "qwen3_5_moe": (
        "Qwen3_5MoeForConditionalGeneration",
        dict(
            text_config=dict(
                COMMON,
                head_dim=32,
                num_hidden_layers=4,
                layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
                moe_intermediate_size=32,
                shared_expert_intermediate_size=40,
                num_experts=8,
                num_experts_per_tok=3,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                linear_key_head_dim=16,
                linear_value_head_dim=16,
                linear_conv_kernel_dim=4,
                tie_word_embeddings=False,
                # Text positions are the same in every multimodal section: plain partial rotary.
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
            ),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4),
            image_token_id=380,
            video_token_id=381,
            vision_start_token_id=382,
            vision_end_token_id=383,
            tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3: latent attention with a low-rank q, YaRN (with its softmax-scale
    # correction), a dense first layer, grouped sigmoid routing with a correction bias,
    # routed scaling, a shared expert. `scoring_func` is what the hub's configs say (the
    # class ignores it, llama.cpp's converter needs it).
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        dict(
            COMMON,
            num_key_value_heads=4,
            head_dim=8,  # the reference's own head_dim is the rope part
            num_hidden_layers=3,
            intermediate_size=80,
            moe_intermediate_size=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=12,
            rope_interleave=True,
            num_nextn_predict_layers=0,
            scoring_func="sigmoid",
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
    ),
    # gpt-oss: sinks, a sliding window (8) shorter than the sequences on even layers,
    # q/k/v/o biases, YaRN without truncation, a biased router, biased experts with the
    # clamped SwiGLU (gate/up interleaved on disk).
    "gpt_oss": (
        "GptOssForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=4,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        ),
    ),
    # GLM-4.5: q/k/v biases, per-head QK-norm, rotary on half of each head, a dense first
    # layer, grouped sigmoid routing (two groups, one kept), routed scaling, a shared expert.
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=3,
            intermediate_size=80,
            moe_intermediate_size=24,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=3,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            attention_bias=True,
            use_qk_norm=True,
            num_nextn_predict_layers=0,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    ),
    # MiniMax-M2: QK-norm over the whole projections, rotary on half of each head
    # (`rotary_dim`), sigmoid routing with a correction bias, always renormalized.
    "minimax_m2": (
        "MiniMaxM2ForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=32,
            num_local_experts=8,
            num_experts_per_tok=2,
            rotary_dim=12,
            scoring_func="sigmoid",
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
    ),
    # Dense Qwen3 with YaRN RoPE scaling and tied embeddings.
    "qwen3": (
        "Qwen3ForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    # Dense Qwen2: QKV bias.
    "qwen2": (
        "Qwen2ForCausalLM",
        dict(
            COMMON,
            head_dim=16,
            num_hidden_layers=2,
            intermediate_size=96,
            use_sliding_window=False,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
    ),
    # Dense Llama with Llama-3 RoPE scaling.
    "llama": (
        "LlamaForCausalLM",
        dict(
            COMMON,
            num_hidden_layers=2,
            intermediate_size=96,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
}

# Families whose every 1-D parameter (and every bias, and the routers' correction biases)
# is randomized (see build).
HYBRID = {"qwen3_next", "qwen3_5_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "minimax_m2"}

CORPUS = """\
The river carries water from the mountains to the sea. Every spring the snow melts and
the sluice gates open; the miller counts the turns of his wheel and the baker bakes bread.
fn main() { let x = 42; println!("{}", x + 1); }  // code, too: brackets, numbers 0123456789
def f(a, b):\n    return a * b + 3.14\n
Unicode: naïve café, Größe, 東京, Москва, emoji 🙂 and tabs\tand   runs   of   spaces.
"""


def make_tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    assert tok.get_vocab_size() <= VOCAB, tok.get_vocab_size()
    return tok


def rope_cfg(cfg):
    """transformers < 5 takes rope_theta / rope_scaling; 5 takes rope_parameters."""
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        return cfg
    cfg = dict(cfg)
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    if rp["rope_type"] != "default":
        sc = {k: v for k, v in rp.items() if k != "rope_theta"}
        cfg["rope_scaling"] = sc
    return cfg


def build(family, out_dir, tok):
    cls_name, cfg = FAMILIES[family]
    cls = getattr(transformers, cls_name)
    config_cls = cls.config_class
    config = config_cls(**rope_cfg(cfg))
    torch.manual_seed(sum(map(ord, family)))
    model = cls(config).to(torch.float32)
    with torch.no_grad():
        # Random init gives every weight the same spread; widen the embeddings so the logits
        # are O(1) and the argmax is well separated for most positions.
        if not cfg.get("tie_word_embeddings"):
            model.get_input_embeddings().weight.mul_(8.0)
        for name, p in model.named_parameters():
            if family in HYBRID:
                # Every 1-D parameter off its init constant, so that no convention ((1 + w)
                # norms, A_log, dt_bias, the gated norm's plain scale) can hide.
                if name.endswith("A_log"):
                    p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 6.0)))
                elif p.dim() == 1:
                    p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("norm.weight") or "layernorm" in name or "_norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            if family in HYBRID and name.endswith("_bias") and p.dim() > 1:
                p.add_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.1 * torch.randn_like(b))
    d = os.path.join(out_dir, family)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model.to(torch.bfloat16).save_pretrained(d, safe_serialization=True)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            },
            f,
            indent=1,
        )

    # The reference: reload what is on disk, compute in float32.
    ref = cls.from_pretrained(d, dtype=torch.float32).eval()
    rng = random.Random(1234 + len(family))
    tokens = [rng.randrange(5, VOCAB) for _ in range(SEQ)]
    with torch.no_grad():
        logits = ref(torch.tensor([tokens])).logits[0].float()
        prompt = tokens[:PROMPT]
        gen = ref.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )[0].tolist()[len(prompt):]
    top2 = torch.topk(logits, 2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    golden = {
        "family": family,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tokens": tokens,
        "logits": [[float(v) for v in row] for row in logits.tolist()],
        "greedy": {"prompt": prompt, "tokens": gen},
    }
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(golden, f, separators=(",", ":"))
    print(
        f"{family:10s} params={sum(p.numel() for p in ref.parameters()):7d} "
        f"|logits|max={logits.abs().max():.3f} min-top2-gap={min(gaps):.2e} greedy={gen[:8]}..."
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", action="append", help="only these (default: all)")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    tok = make_tokenizer()
    for fam in args.family or FAMILIES:
        build(fam, args.out, tok)


if __name__ == "__main__":
    sys.exit(main())

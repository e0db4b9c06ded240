//! Qwen3-MoE (e.g. Qwen3-30B-A3B): Qwen3's attention (per-head QK-norm) with routed experts;
//! softmax over all experts, top k, renormalized when `norm_topk_prob`; `mlp_only_layers` and
//! `decoder_sparse_step` make some layers dense.

use crate::config::{Arch, Gating, ModelConfig, MoeConfig, QkNorm};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Qwen3Moe)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    cfg.qk_norm = QkNorm::PerHead;
    cfg.moe = Some(MoeConfig {
        n_expert: super::n_expert(c)?,
        n_expert_used: c.usize("num_experts_per_tok")?,
        expert_ff: c.usize("moe_intermediate_size")?,
        gating: Gating::SoftmaxTopK { norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(false) },
        shared_expert_ff: None,
        ..MoeConfig::PLAIN
    });
    let sparse = super::qwen_sparse_layers(c, cfg.n_layer)?;
    super::set_sparse(&mut cfg, &sparse);
    Ok(cfg)
}

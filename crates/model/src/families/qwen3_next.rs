//! Qwen3-Next (e.g. Qwen3-Next-80B-A3B): a hybrid of Gated DeltaNet layers and gated
//! attention layers (every fourth by default), each with a wide MoE (shared expert behind a
//! sigmoid gate). Its RMSNorms are zero-centred (`(1 + w)·x̂`), its attention has per-head
//! QK-norm, partial rotary and an output gate; its DeltaNet input projections are fused and
//! interleaved per key head (`in_proj_qkvz`, `in_proj_ba`).

use crate::config::{Arch, DeltaNetProj, Gating, ModelConfig, MoeConfig, QkNorm};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Qwen3Next)?;
    super::hybrid(c, &mut cfg, DeltaNetProj::FusedPerGroup)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    cfg.qk_norm = QkNorm::PerHead;
    let n_expert = c.opt_usize("num_experts")?.unwrap_or(0);
    if n_expert > 0 {
        cfg.moe = Some(MoeConfig {
            n_expert,
            n_expert_used: c.usize("num_experts_per_tok")?,
            expert_ff: c.usize("moe_intermediate_size")?,
            gating: Gating::SoftmaxTopK { norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(true) },
            shared_expert_ff: c.opt_usize("shared_expert_intermediate_size")?.filter(|s| *s > 0),
            ..MoeConfig::PLAIN
        });
        let sparse = super::qwen_sparse_layers(c, cfg.n_layer)?;
        super::set_sparse(&mut cfg, &sparse);
    }
    Ok(cfg)
}

//! OLMoE: RMSNorm over the whole Q and K projections (not per head), optional clamp of
//! Q/K/V, every layer routed, top-k weights left unnormalized by default.

use crate::config::{Arch, Gating, ModelConfig, MoeConfig, QkNorm};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Olmoe)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    cfg.qk_norm = QkNorm::Full;
    cfg.clip_qkv = c.opt_f64("clip_qkv")?.map(|v| v as f32);
    if cfg.head_dim * cfg.n_head != cfg.hidden {
        return Err(c.error("OLMoE's QK-norm needs head_dim × num_attention_heads = hidden_size").into());
    }
    cfg.moe = Some(MoeConfig {
        n_expert: super::n_expert(c)?,
        n_expert_used: c.usize("num_experts_per_tok")?,
        expert_ff: cfg.ff,
        gating: Gating::SoftmaxTopK { norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(false) },
        shared_expert_ff: None,
        ..MoeConfig::PLAIN
    });
    let all = vec![true; cfg.n_layer];
    super::set_sparse(&mut cfg, &all);
    Ok(cfg)
}

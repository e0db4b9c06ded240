//! Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): QKV bias, routed experts plus an always-on shared
//! expert whose output is scaled by a sigmoid gate.

use crate::config::{Arch, Gating, ModelConfig, MoeConfig};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Qwen2Moe)?;
    cfg.qkv_bias = c.opt_bool("qkv_bias")?.unwrap_or(true);
    let shared = c.opt_usize("shared_expert_intermediate_size")?.filter(|s| *s > 0);
    cfg.moe = Some(MoeConfig {
        n_expert: super::n_expert(c)?,
        n_expert_used: c.usize("num_experts_per_tok")?,
        expert_ff: c.usize("moe_intermediate_size")?,
        gating: Gating::SoftmaxTopK { norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(false) },
        shared_expert_ff: shared,
        ..MoeConfig::PLAIN
    });
    let sparse = super::qwen_sparse_layers(c, cfg.n_layer)?;
    super::set_sparse(&mut cfg, &sparse);
    Ok(cfg)
}

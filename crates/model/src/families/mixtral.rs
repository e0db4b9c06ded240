//! Mixtral: every layer routed; softmax over the router logits, top k renormalized (the same
//! as a softmax over the top-k logits). Its MoE tensors use their own names.

use crate::config::{Arch, Gating, ModelConfig, MoeConfig};
use crate::error::Result;
use crate::weights::ExpertPart;
use sluice_formats::JsonConfig;

pub(crate) const ROUTER: &str = "{p}.block_sparse_moe.gate.weight";

/// Expert `e`'s matrix under layer prefix `p` (`model.layers.N`).
pub fn expert_name(p: &str, part: ExpertPart, e: usize) -> String {
    let w = match part {
        ExpertPart::Gate => "w1",
        ExpertPart::Down => "w2",
        ExpertPart::Up => "w3",
    };
    format!("{p}.block_sparse_moe.experts.{e}.{w}.weight")
}

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Mixtral)?;
    cfg.moe = Some(MoeConfig {
        n_expert: super::n_expert(c)?,
        n_expert_used: c.usize("num_experts_per_tok")?,
        expert_ff: cfg.ff,
        gating: Gating::SoftmaxTopK { norm_topk: true },
        shared_expert_ff: None,
        ..MoeConfig::PLAIN
    });
    let all = vec![true; cfg.n_layer];
    super::set_sparse(&mut cfg, &all);
    Ok(cfg)
}

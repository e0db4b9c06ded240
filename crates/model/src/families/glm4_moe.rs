//! GLM-4.5, GLM-4.5-Air, GLM-4.6/4.7 (`glm4_moe`; GGUF `glm4moe`): attention with q/k/v biases
//! (no output bias), optional per-head QK-norm and rotary on the first half of each head
//! (`partial_rotary_factor`, 0.5 by default); dense FFNs in the first `first_k_dense_replace`
//! layers, then DeepSeek-V3's router (σ scores, selection-only correction bias, groups,
//! normalized top k times `routed_scaling_factor`) with ungated shared experts. Its
//! multi-token-prediction layer (`model.layers.{n_layer}`, GGUF `blk.{n_layer}.nextn.*`) loads
//! as a speculation head.

use crate::config::{Arch, FfnKind, Gating, ModelConfig, MoeConfig, MtpConfig, QkNorm, Score};
use crate::error::Result;
use sluice_formats::gguf::GgufFile;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Glm4Moe)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    if c.opt_bool("use_qk_norm")?.unwrap_or(false) {
        cfg.qk_norm = QkNorm::PerHead;
    }
    // The rotary fraction defaults to one half here, not to the whole head.
    let declared = c.get("partial_rotary_factor").is_some()
        || c.sub("rope_parameters")?.is_some_and(|p| p.get("partial_rotary_factor").is_some());
    if !declared {
        cfg.rope.dim = cfg.head_dim / 2;
    }
    let n_expert = c.opt_usize("n_routed_experts")?.or(c.opt_usize("num_local_experts")?).unwrap_or(0);
    if n_expert > 0 {
        let n_group = c.opt_usize("n_group")?.unwrap_or(1);
        let expert_ff = c.usize("moe_intermediate_size")?;
        cfg.moe = Some(MoeConfig {
            n_expert,
            n_expert_used: c.usize("num_experts_per_tok")?,
            expert_ff,
            gating: Gating::Grouped {
                score: Score::Sigmoid,
                selection_bias: true,
                n_group,
                topk_group: c.opt_usize("topk_group")?.unwrap_or(n_group),
                norm_topk: c.opt_bool("norm_topk_prob")?.unwrap_or(true),
                norm_eps: 1e-20,
                scale: c.opt_f64("routed_scaling_factor")?.unwrap_or(1.0) as f32,
            },
            shared_expert_ff: c.opt_usize("n_shared_experts")?.filter(|n| *n > 0).map(|n| n * expert_ff),
            shared_gated: false,
            ..MoeConfig::PLAIN
        });
        let dense_first = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
        let sparse: Vec<bool> = (0..cfg.n_layer).map(|l| l >= dense_first).collect();
        super::set_sparse(&mut cfg, &sparse);
    }
    Ok(cfg)
}

/// What a `glm4moe` GGUF adds: QK-norm where the file has its weights, the grouped router
/// (llama.cpp defaults its scoring to the sigmoid here), dense leading layers, and the
/// multi-token-prediction blocks counted at the end of `block_count`.
pub fn gguf(f: &GgufFile, key: &dyn Fn(&str) -> String, cfg: &mut ModelConfig, n_mtp: usize) -> Result<()> {
    if f.tensor_info("blk.0.attn_q_norm.weight").is_some() {
        cfg.qk_norm = QkNorm::PerHead;
    }
    let dense_first = f.meta_opt_u64(&key("leading_dense_block_count"))?.unwrap_or(0) as usize;
    if cfg.moe.is_some() {
        let score = match f.meta_opt_u64(&key("expert_gating_func"))? {
            None | Some(2) => Score::Sigmoid,
            Some(1) => Score::Softmax,
            Some(other) => {
                return Err(f
                    .error(format!(
                        "unsupported router type: expert_gating_func = {other} (supported: 1 softmax, 2 sigmoid)"
                    ))
                    .into())
            }
        };
        let at = dense_first.min(cfg.n_layer - 1);
        let biased = f.tensor_info(&format!("blk.{at}.exp_probs_b.bias")).is_some();
        super::grouped_router_from_gguf(f, key, cfg, score, biased, false)?;
        let sparse: Vec<bool> = (0..cfg.n_layer).map(|l| l >= dense_first).collect();
        super::set_sparse(cfg, &sparse);
    }
    if n_mtp > 0 {
        let ffn = if cfg.moe.is_some() { FfnKind::Moe } else { FfnKind::Dense };
        cfg.mtp = Some(MtpConfig { n_layer: n_mtp, ffn });
    }
    Ok(())
}

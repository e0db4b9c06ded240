//! MiniMax-M2 (`minimax_m2`; GGUF `minimax-m2`): attention without biases whose QK-norm spans
//! the whole projected q and k (every head at once, before the head split), rotary on the
//! first `rotary_dim` dimensions of each head; every layer routed (`intermediate_size` is one
//! expert's width) by σ scores with a selection-only correction bias, the top k always
//! renormalized, no shared expert.

use crate::config::{Arch, FfnKind, Gating, ModelConfig, MoeConfig, QkNorm, Score};
use crate::error::Result;
use sluice_formats::gguf::GgufFile;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::MinimaxM2)?;
    if let Some(f) = c.opt_str("scoring_func")? {
        if f != "sigmoid" {
            return Err(c
                .error(format!("key `scoring_func` is `{f}`; MiniMax-M2 routes with a sigmoid (expected sigmoid)"))
                .into());
        }
    }
    // The legacy `rotary_dim` names the rotated width directly.
    if let Some(rd) = c.opt_usize("rotary_dim")? {
        cfg.rope.dim = rd;
    }
    cfg.qk_norm = QkNorm::Full;
    cfg.moe = Some(MoeConfig {
        n_expert: super::n_expert(c)?,
        n_expert_used: c.usize("num_experts_per_tok")?,
        expert_ff: c.usize("intermediate_size")?,
        gating: Gating::Grouped {
            score: Score::Sigmoid,
            selection_bias: true,
            n_group: 1,
            topk_group: 1,
            norm_topk: true,
            norm_eps: 0.0,
            scale: 1.0,
        },
        ..MoeConfig::PLAIN
    });
    cfg.ff = 0;
    cfg.layers.iter_mut().for_each(|s| s.ffn = FfnKind::Moe);
    Ok(cfg)
}

/// What a `minimax-m2` GGUF adds: QK-norm over the whole projections, and the router. A file
/// converted from a config without `scoring_func` names no gating function (llama.cpp then
/// stops with an internal error); MiniMax-M2 has only ever routed with a sigmoid, so sluice
/// reads such a file that way and says so.
pub fn gguf(f: &GgufFile, key: &dyn Fn(&str) -> String, cfg: &mut ModelConfig, notes: &mut Vec<String>) -> Result<()> {
    cfg.qk_norm = QkNorm::Full;
    cfg.ff = 0;
    let score = match f.meta_opt_u64(&key("expert_gating_func"))? {
        Some(2) => Score::Sigmoid,
        Some(1) => Score::Softmax,
        None => {
            notes.push(
                "router: sigmoid scores — the file names no expert_gating_func; MiniMax-M2 routes with a sigmoid"
                    .into(),
            );
            Score::Sigmoid
        }
        Some(other) => {
            return Err(f
                .error(format!(
                    "unsupported router type: expert_gating_func = {other} (supported: 1 softmax, 2 sigmoid)"
                ))
                .into())
        }
    };
    let biased = f.tensor_info("blk.0.exp_probs_b.bias").is_some();
    super::grouped_router_from_gguf(f, key, cfg, score, biased, true)?;
    Ok(())
}

//! Qwen3.5 / Qwen3.6 (`qwen3_5_moe`, e.g. Qwen3.5-35B-A3B; and the dense `qwen3_5`): the
//! Qwen3-Next layer design with four separate DeltaNet input projections (`in_proj_qkv`,
//! `in_proj_z`, `in_proj_b`, `in_proj_a`), a router that always renormalizes its top k, and no
//! dense layers in the MoE models. Released checkpoints are image-text models: their
//! hyper-parameters sit under `text_config`, the language model under
//! `model.language_model.`; sluice runs the language model and leaves the vision tower alone.
//! (Their multimodal RoPE sections reduce to plain rotary for text, where every section sees
//! the same position.)

use super::{HfModel, HfNames};
use crate::config::{Arch, DeltaNetProj, FfnKind, Gating, MoeConfig, QkNorm};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn model(c: &JsonConfig) -> Result<HfModel> {
    let (t, prefix, mut notes) = match c.sub("text_config")? {
        Some(t) => (
            t,
            "model.language_model.",
            vec!["image-text checkpoint: the language model is loaded; the vision tower (model.visual.*) is not"
                .to_string()],
        ),
        None => (c.clone(), "model.", Vec::new()),
    };
    let moe = t.str("model_type")?.contains("moe") || t.opt_usize("num_experts")?.is_some_and(|n| n > 0);
    let mut cfg = super::common(&t, if moe { Arch::Qwen35Moe } else { Arch::Qwen35 })?;
    super::hybrid(&t, &mut cfg, DeltaNetProj::Separate)?;
    cfg.qkv_bias = t.opt_bool("attention_bias")?.unwrap_or(false);
    cfg.qk_norm = QkNorm::PerHead;
    if t.get("tie_word_embeddings").is_none() {
        cfg.tie_embeddings = c.opt_bool("tie_word_embeddings")?.unwrap_or(false);
    }
    if cfg.eos_tokens.is_empty() {
        cfg.eos_tokens = c.opt_usize_list("eos_token_id")?.unwrap_or_default().into_iter().map(|v| v as u32).collect();
    }
    if moe {
        cfg.moe = Some(MoeConfig {
            n_expert: t.usize("num_experts")?,
            n_expert_used: t.usize("num_experts_per_tok")?,
            expert_ff: t.usize("moe_intermediate_size")?,
            gating: Gating::SoftmaxTopK { norm_topk: true },
            shared_expert_ff: t.opt_usize("shared_expert_intermediate_size")?.filter(|s| *s > 0),
            ..MoeConfig::PLAIN
        });
        for spec in &mut cfg.layers {
            spec.ffn = FfnKind::Moe;
        }
    }
    if let Some(n) = t.opt_usize("mtp_num_hidden_layers")?.filter(|n| *n > 0) {
        notes.push(format!("config declares {n} multi-token-prediction layer(s)"));
    }
    Ok(HfModel { names: HfNames::new(&cfg, prefix), config: cfg, notes })
}

//! DeepSeek-V3 / V3.1 / R1 and Kimi-K2 (`deepseek_v3`; GGUF `deepseek2`): multi-head latent
//! attention (mixer/mla.rs) in every layer, dense FFNs in the first `first_k_dense_replace`
//! layers, then routed experts scored by a sigmoid with a selection-only correction bias,
//! group-limited choice, normalized top k times `routed_scaling_factor`, and ungated shared
//! experts.

use crate::config::{Arch, FfnKind, Gating, LayerSpec, MixerKind, MlaConfig, ModelConfig, MoeConfig, Score};
use crate::error::Result;
use crate::rope::{Rope, RopeScaling, RopeStyle};
use sluice_formats::gguf::GgufFile;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::DeepseekV3)?;
    if c.opt_bool("attention_bias")?.unwrap_or(false) {
        return Err(c.error("key `attention_bias` is true: latent attention with biases is not supported").into());
    }
    // transformers' deepseek_v3 always scores with a sigmoid; a config naming another
    // function describes a model that code would not run as written.
    if let Some(f) = c.opt_str("scoring_func")? {
        if f != "sigmoid" {
            return Err(c
                .error(format!("key `scoring_func` is `{f}`; deepseek_v3 routes with a sigmoid (expected sigmoid)"))
                .into());
        }
    }
    let mla = MlaConfig {
        q_lora_rank: c.opt_usize("q_lora_rank")?,
        kv_lora_rank: c.usize("kv_lora_rank")?,
        qk_nope: c.usize("qk_nope_head_dim")?,
        qk_rope: c.usize("qk_rope_head_dim")?,
        v_head: c.usize("v_head_dim")?,
        // The reference builds both latent norms with its RMSNorm's default ε.
        latent_norm_eps: 1e-6,
    };
    let style = if c.opt_bool("rope_interleave")?.unwrap_or(true) { RopeStyle::Interleaved } else { RopeStyle::Neox };
    cfg.rope = super::rope_from_hf(c, mla.qk_rope, style)?;
    cfg.head_dim = mla.qk_rope;
    cfg.attn_scale = softmax_scale(&mla, &cfg.rope.scaling, mscale_all_dim(c)?);
    cfg.mla = Some(mla);
    let n_expert = c.opt_usize("n_routed_experts")?.or(c.opt_usize("num_local_experts")?).unwrap_or(0);
    let dense_first = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
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
    }
    let moe = cfg.moe.is_some();
    cfg.layers = (0..cfg.n_layer)
        .map(|l| LayerSpec {
            mixer: MixerKind::Mla,
            ffn: if moe && l >= dense_first { FfnKind::Moe } else { FfnKind::Dense },
        })
        .collect();
    Ok(cfg)
}

fn mscale_all_dim(c: &JsonConfig) -> Result<Option<f64>> {
    let params = match c.sub("rope_scaling")? {
        Some(s) => Some(s),
        None => c.sub("rope_parameters")?,
    };
    Ok(match params {
        Some(p) => p.opt_f64("mscale_all_dim")?,
        None => None,
    })
}

/// The reference's softmax scale: (nope + rope)^-½, times YaRN's mscale(factor,
/// mscale_all_dim)² when the context is stretched with YaRN.
fn softmax_scale(m: &MlaConfig, scaling: &RopeScaling, mscale_all_dim: Option<f64>) -> f32 {
    let base = 1.0 / ((m.qk_nope + m.qk_rope) as f64).sqrt();
    let ms = match (scaling, mscale_all_dim) {
        (RopeScaling::Yarn { factor, .. }, Some(a)) if a != 0.0 => Rope::yarn_mscale(*factor, a),
        _ => 1.0,
    };
    (base * ms * ms) as f32
}

/// What the GGUF metadata of a `deepseek2` file adds to the common reading: the latent
/// dimensions, dense leading layers, and the router (with the evidence for its scoring).
pub fn gguf(f: &GgufFile, key: &dyn Fn(&str) -> String, cfg: &mut ModelConfig, notes: &mut Vec<String>) -> Result<()> {
    let u = |k: &str| -> Result<usize> { Ok(f.meta_u64(&key(k))? as usize) };
    let ou = |k: &str| -> Result<Option<usize>> { Ok(f.meta_opt_u64(&key(k))?.map(|v| v as usize)) };
    let dr = cfg.rope.dim;
    // Files converted for the absorbed form record the per-head sizes under `*_mla`; their
    // key/value lengths are the latent's. Older files hold the whole kv_b and per-head sizes.
    let (dk, dv) = match (ou("attention.key_length_mla")?, ou("attention.value_length_mla")?) {
        (Some(k), Some(v)) => (k, v),
        _ => (u("attention.key_length")?, u("attention.value_length")?),
    };
    if dk <= dr {
        return Err(f.error(format!("key length {dk} leaves no room beside the rope part {dr}")).into());
    }
    let mla = MlaConfig {
        q_lora_rank: ou("attention.q_lora_rank")?,
        kv_lora_rank: u("attention.kv_lora_rank")?,
        qk_nope: dk - dr,
        qk_rope: dr,
        v_head: dv,
        // llama.cpp normalizes the latents with the model's ε, and so does sluice for its files.
        latent_norm_eps: cfg.rms_eps,
    };
    cfg.head_dim = dr;
    cfg.n_head_kv = cfg.n_head;
    cfg.rope.style = RopeStyle::Interleaved;
    // llama.cpp keeps YaRN's factor off cos/sin here (unless the file sets one) and puts
    // mscale(factor, mscale_all_dim)² into the softmax scale; the converter stores
    // 0.1·mscale_all_dim as the log multiplier.
    let log_mul = f.meta_opt_f64(&key("rope.scaling.yarn_log_multiplier"))?.map(|v| v / 0.1);
    let af = f.meta_opt_f64(&key("rope.scaling.attn_factor"))?.unwrap_or(1.0);
    if let RopeScaling::Yarn { attention_factor, .. } = &mut cfg.rope.scaling {
        *attention_factor = af;
    }
    cfg.attn_scale = softmax_scale(&mla, &cfg.rope.scaling, log_mul) * (af * af) as f32;
    cfg.mla = Some(mla);
    let dense_first = ou("leading_dense_block_count")?.unwrap_or(0);
    if cfg.moe.is_some() {
        let at = dense_first.min(cfg.n_layer - 1);
        let biased = f.tensor_info(&format!("blk.{at}.exp_probs_b.bias")).is_some();
        let (score, why) = gating_of(f, key, biased)?;
        notes.push(why);
        super::grouped_router_from_gguf(f, key, cfg, score, biased, false)?;
    }
    let moe = cfg.moe.is_some();
    cfg.layers = (0..cfg.n_layer)
        .map(|l| LayerSpec {
            mixer: MixerKind::Mla,
            ffn: if moe && l >= dense_first { FfnKind::Moe } else { FfnKind::Dense },
        })
        .collect();
    Ok(())
}

/// The router's scoring function from `expert_gating_func`, or, where the converter wrote
/// none (it does so only when the source config names one), from the file's evidence: a
/// selection bias is DeepSeek-V3's sigmoid routing; without one it is DeepSeek-V2's softmax.
/// Returns it with a sentence for `inspect`.
fn gating_of(f: &GgufFile, key: &dyn Fn(&str) -> String, biased: bool) -> Result<(Score, String)> {
    match f.meta_opt_u64(&key("expert_gating_func"))? {
        Some(1) => Ok((Score::Softmax, "router: softmax scores (expert_gating_func = 1)".into())),
        Some(2) => Ok((Score::Sigmoid, "router: sigmoid scores (expert_gating_func = 2)".into())),
        Some(other) => Err(f
            .error(format!("unsupported router type: expert_gating_func = {other} (supported: 1 softmax, 2 sigmoid)"))
            .into()),
        None if biased => Ok((
            Score::Sigmoid,
            "router: sigmoid scores — the file names no expert_gating_func, and its selection bias (exp_probs_b) marks DeepSeek-V3-style routing (llama.cpp would fall back to softmax here)".into(),
        )),
        None => Ok((
            Score::Softmax,
            "router: softmax scores — the file names no expert_gating_func and has no selection bias (DeepSeek-V2-style routing)".into(),
        )),
    }
}

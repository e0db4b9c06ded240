//! One file per model family: how its Hugging Face config and tensors are named, and what
//! sets it apart. What all of them share (the dense hyper-parameters, RoPE dialects, the
//! llama-style tensor names) lives here.

pub mod gguf_names;
pub mod llama;
pub mod mixtral;
pub mod olmoe;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_moe;

use crate::config::{Activation, Arch, ModelConfig, QkNorm};
use crate::error::{ModelError, Result};
use crate::rope::{Rope, RopeConfig, RopeScaling, RopeStyle};
use crate::weights::{ExpertPart, Key};
use sluice_formats::JsonConfig;

/// Reads a Hugging Face `config.json` into a `ModelConfig`, by `model_type`.
pub fn from_hf_config(c: &JsonConfig) -> Result<ModelConfig> {
    let model_type = c.str("model_type")?;
    let cfg = match model_type {
        "llama" => llama::config(c)?,
        "qwen2" => qwen2::config(c)?,
        "qwen3" => qwen3::config(c)?,
        "mixtral" => mixtral::config(c)?,
        "qwen2_moe" => qwen2_moe::config(c)?,
        "qwen3_moe" => qwen3_moe::config(c)?,
        "olmoe" => olmoe::config(c)?,
        other => {
            return Err(ModelError::Invalid(format!(
                "{}: unsupported architecture: model_type `{other}` (supported: llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, olmoe)",
                c.path.display()
            )))
        }
    };
    cfg.validate().map_err(|e| ModelError::Invalid(format!("{}: {e}", c.path.display())))?;
    Ok(cfg)
}

/// Hugging Face tensor name of `key`, llama-style (all families here share it but for the
/// MoE parts, which each family names itself).
pub fn hf_name(arch: Arch, key: Key, layer: Option<usize>) -> String {
    let l = layer.unwrap_or(0);
    let p = format!("model.layers.{l}");
    match key {
        Key::TokEmbd => "model.embed_tokens.weight".into(),
        Key::OutputNorm => "model.norm.weight".into(),
        Key::Output => "lm_head.weight".into(),
        Key::AttnNorm => format!("{p}.input_layernorm.weight"),
        Key::AttnQ => format!("{p}.self_attn.q_proj.weight"),
        Key::AttnK => format!("{p}.self_attn.k_proj.weight"),
        Key::AttnV => format!("{p}.self_attn.v_proj.weight"),
        Key::AttnO => format!("{p}.self_attn.o_proj.weight"),
        Key::AttnQBias => format!("{p}.self_attn.q_proj.bias"),
        Key::AttnKBias => format!("{p}.self_attn.k_proj.bias"),
        Key::AttnVBias => format!("{p}.self_attn.v_proj.bias"),
        Key::AttnOBias => format!("{p}.self_attn.o_proj.bias"),
        Key::AttnQNorm => format!("{p}.self_attn.q_norm.weight"),
        Key::AttnKNorm => format!("{p}.self_attn.k_norm.weight"),
        Key::AttnPostNorm => format!("{p}.post_attention_norm.weight"),
        Key::FfnNorm => format!("{p}.post_attention_layernorm.weight"),
        Key::FfnPostNorm => format!("{p}.post_feedforward_layernorm.weight"),
        Key::FfnGate => format!("{p}.mlp.gate_proj.weight"),
        Key::FfnUp => format!("{p}.mlp.up_proj.weight"),
        Key::FfnDown => format!("{p}.mlp.down_proj.weight"),
        Key::FfnGateInp => match arch {
            Arch::Mixtral => mixtral::ROUTER.replace("{p}", &p),
            _ => format!("{p}.mlp.gate.weight"),
        },
        Key::ShexpGate => format!("{p}.mlp.shared_expert.gate_proj.weight"),
        Key::ShexpUp => format!("{p}.mlp.shared_expert.up_proj.weight"),
        Key::ShexpDown => format!("{p}.mlp.shared_expert.down_proj.weight"),
        Key::ShexpGateInp => format!("{p}.mlp.shared_expert_gate.weight"),
    }
}

/// Hugging Face name of one expert's matrix.
pub fn hf_expert_name(arch: Arch, part: ExpertPart, l: usize, e: usize) -> String {
    match arch {
        Arch::Mixtral => mixtral::expert_name(part, l, e),
        _ => {
            let m = match part {
                ExpertPart::Gate => "gate_proj",
                ExpertPart::Up => "up_proj",
                ExpertPart::Down => "down_proj",
            };
            format!("model.layers.{l}.mlp.experts.{e}.{m}.weight")
        }
    }
}

/// The dense hyper-parameters every family shares, with the keys both config dialects use.
pub(crate) fn common(c: &JsonConfig, arch: Arch) -> Result<ModelConfig> {
    let hidden = c.usize("hidden_size")?;
    let n_head = c.usize("num_attention_heads")?;
    let n_head_kv = c.opt_usize("num_key_value_heads")?.unwrap_or(n_head);
    if n_head == 0 {
        return Err(c.error("key `num_attention_heads` must be positive").into());
    }
    let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden / n_head);
    let n_layer = c.usize("num_hidden_layers")?;
    let vocab_size = c.usize("vocab_size")?;
    crate::config::check_dims(hidden, n_layer, n_head, n_head_kv, head_dim, vocab_size).map_err(|e| c.error(e))?;
    let max_position = c.opt_usize("max_position_embeddings")?.unwrap_or(4096);
    match c.opt_str("hidden_act")?.unwrap_or("silu") {
        "silu" | "swish" => {}
        other => {
            return Err(c.error(format!("unsupported value `{other}` of key `hidden_act` (expected silu)")).into())
        }
    }
    let rope = rope_from_hf(c, head_dim, RopeStyle::Neox)?;
    let window = sliding_windows(c, n_layer)?;
    Ok(ModelConfig {
        arch,
        vocab_size,
        hidden,
        n_layer,
        n_head,
        n_head_kv,
        head_dim,
        ff: c.usize("intermediate_size")?,
        rms_eps: c.opt_f64("rms_norm_eps")?.unwrap_or(1e-6) as f32,
        rope,
        rope_local: None,
        max_position,
        tie_embeddings: c.opt_bool("tie_word_embeddings")?.unwrap_or(false),
        qkv_bias: false,
        qk_norm: QkNorm::None,
        clip_qkv: None,
        activation: Activation::Silu,
        moe: None,
        sparse_layer: vec![false; n_layer],
        window,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        gemma: false,
        final_logit_softcap: None,
        bos_token: c.opt_usize("bos_token_id")?.map(|v| v as u32),
        eos_tokens: c.opt_usize_list("eos_token_id")?.unwrap_or_default().into_iter().map(|v| v as u32).collect(),
    })
}

/// Per-layer sliding windows: `layer_types` when given, else `sliding_window` for every layer
/// when `use_sliding_window` (Qwen) is on or absent (Mixtral).
fn sliding_windows(c: &JsonConfig, n_layer: usize) -> Result<Vec<Option<usize>>> {
    let size = c.opt_usize("sliding_window")?.filter(|w| *w > 0);
    let enabled = c.opt_bool("use_sliding_window")?.unwrap_or(true);
    let Some(size) = size.filter(|_| enabled) else {
        return Ok(vec![None; n_layer]);
    };
    if let Some(types) = c.get("layer_types").and_then(|v| v.as_array()) {
        if types.len() != n_layer {
            return Err(c.error(format!("key `layer_types` has {} entries for {n_layer} layers", types.len())).into());
        }
        return Ok(types.iter().map(|t| (t.as_str() == Some("sliding_attention")).then_some(size)).collect());
    }
    if let Some(mwl) = c.opt_usize("max_window_layers")? {
        return Ok((0..n_layer).map(|l| (l >= mwl).then_some(size)).collect());
    }
    Ok(vec![Some(size); n_layer])
}

/// RoPE from either dialect: `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`.
pub(crate) fn rope_from_hf(c: &JsonConfig, head_dim: usize, style: RopeStyle) -> Result<RopeConfig> {
    let params = c.sub("rope_parameters")?;
    let scaling = match &params {
        Some(p) if p.get("rope_type").is_some() || p.get("type").is_some() => Some(p.clone()),
        _ => c.sub("rope_scaling")?,
    };
    let theta = params
        .as_ref()
        .map(|p| p.opt_f64("rope_theta"))
        .transpose()?
        .flatten()
        .or(c.opt_f64("rope_theta")?)
        .unwrap_or(10000.0);
    let partial = params
        .as_ref()
        .map(|p| p.opt_f64("partial_rotary_factor"))
        .transpose()?
        .flatten()
        .or(c.opt_f64("partial_rotary_factor")?)
        .unwrap_or(1.0);
    let dim = (head_dim as f64 * partial) as usize;
    let max_pos = c.opt_usize("max_position_embeddings")?.unwrap_or(4096) as f64;
    let scaling = match scaling {
        None => RopeScaling::None,
        Some(s) => {
            let ty = s.opt_str("rope_type")?.or(s.opt_str("type")?).unwrap_or("default").to_string();
            let orig = s
                .opt_f64("original_max_position_embeddings")?
                .or(c.opt_f64("original_max_position_embeddings")?)
                .unwrap_or(max_pos);
            match ty.as_str() {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: s.f64("factor")? },
                "llama3" => RopeScaling::Llama3 {
                    factor: s.f64("factor")?,
                    low_freq_factor: s.f64("low_freq_factor")?,
                    high_freq_factor: s.f64("high_freq_factor")?,
                    original_max_position: orig,
                },
                "yarn" => {
                    let factor = s.opt_f64("factor")?.unwrap_or(max_pos / orig);
                    let attention_factor = match s.opt_f64("attention_factor")? {
                        Some(a) => a,
                        None => match (s.opt_f64("mscale")?, s.opt_f64("mscale_all_dim")?) {
                            (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                                Rope::yarn_mscale(factor, m) / Rope::yarn_mscale(factor, ma)
                            }
                            _ => Rope::yarn_mscale(factor, 1.0),
                        },
                    };
                    RopeScaling::Yarn {
                        factor,
                        original_max_position: orig,
                        beta_fast: s.opt_f64("beta_fast")?.unwrap_or(32.0),
                        beta_slow: s.opt_f64("beta_slow")?.unwrap_or(1.0),
                        attention_factor,
                        truncate: s.opt_bool("truncate")?.unwrap_or(true),
                    }
                }
                other => {
                    return Err(c
                        .error(format!("unsupported RoPE type `{other}` (supported: default, linear, llama3, yarn)"))
                        .into())
                }
            }
        }
    };
    Ok(RopeConfig { theta, dim, style, scaling })
}

/// Routed-expert count under either dialect's key.
pub(crate) fn n_expert(c: &JsonConfig) -> Result<usize> {
    Ok(c.usize_any(&["num_experts", "num_local_experts"])?)
}

/// Layers that are sparse under Qwen's rule: not in `mlp_only_layers`, and every
/// `decoder_sparse_step`-th layer.
pub(crate) fn qwen_sparse_layers(c: &JsonConfig, n_layer: usize) -> Result<Vec<bool>> {
    let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(c.error("key `decoder_sparse_step` must be at least 1").into());
    }
    let dense = c.opt_usize_list("mlp_only_layers")?.unwrap_or_default();
    if let Some(l) = dense.iter().find(|l| **l >= n_layer) {
        return Err(c.error(format!("key `mlp_only_layers` names layer {l} of {n_layer}")).into());
    }
    Ok((0..n_layer).map(|l| !dense.contains(&l) && (l + 1) % step == 0).collect())
}

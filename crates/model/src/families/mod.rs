//! One file per model family: how its Hugging Face config and tensors are named, and what
//! sets it apart. What all of them share (the dense hyper-parameters, RoPE dialects, the
//! llama-style tensor names) lives here.

pub mod deepseek_v3;
pub mod gguf_names;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod llama;
pub mod minimax_m2;
pub mod mixtral;
pub mod olmoe;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_moe;
pub mod qwen3_next;

use crate::config::{Activation, Arch, FfnKind, LayerSpec, MixerKind, ModelConfig, QkNorm};
use crate::error::{ModelError, Result};
use crate::rope::{Rope, RopeConfig, RopeScaling, RopeStyle};
use crate::weights::{ExpertPart, Key};
use sluice_formats::JsonConfig;

/// A Hugging Face checkpoint's config read into a `ModelConfig`, with how its tensors are
/// named.
pub struct HfModel {
    pub config: ModelConfig,
    pub names: HfNames,
    /// What of the checkpoint is not used, for `inspect` (e.g. a vision tower).
    pub notes: Vec<String>,
}

/// Reads a Hugging Face `config.json` into a `ModelConfig`, by `model_type`.
pub fn from_hf_config(c: &JsonConfig) -> Result<ModelConfig> {
    Ok(hf_model(c)?.config)
}

/// Reads a Hugging Face `config.json`: the model's config and its tensor names.
pub fn hf_model(c: &JsonConfig) -> Result<HfModel> {
    let model_type = c.str("model_type")?;
    let plain = |config: ModelConfig| HfModel { names: HfNames::new(&config, "model."), config, notes: Vec::new() };
    let m = match model_type {
        "llama" => plain(llama::config(c)?),
        "qwen2" => plain(qwen2::config(c)?),
        "qwen3" => plain(qwen3::config(c)?),
        "mixtral" => plain(mixtral::config(c)?),
        "qwen2_moe" => plain(qwen2_moe::config(c)?),
        "qwen3_moe" => plain(qwen3_moe::config(c)?),
        "olmoe" => plain(olmoe::config(c)?),
        "qwen3_next" => plain(qwen3_next::config(c)?),
        "qwen3_5" | "qwen3_5_moe" | "qwen3_5_text" | "qwen3_5_moe_text" => qwen3_5::model(c)?,
        // Kimi-K2 ships DeepSeek-V3's architecture under its own model_type.
        "deepseek_v3" | "kimi_k2" => plain(deepseek_v3::config(c)?),
        "gpt_oss" => plain(gpt_oss::config(c)?),
        "glm4_moe" => plain(glm4_moe::config(c)?),
        "minimax_m2" => plain(minimax_m2::config(c)?),
        other => {
            return Err(ModelError::Invalid(format!(
                "{}: unsupported architecture: model_type `{other}` (supported: llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, olmoe, qwen3_next, qwen3_5, qwen3_5_moe, deepseek_v3, kimi_k2, gpt_oss, glm4_moe, minimax_m2)",
                c.path.display()
            )))
        }
    };
    m.config.validate().map_err(|e| ModelError::Invalid(format!("{}: {e}", c.path.display())))?;
    Ok(m)
}

/// How a Hugging Face checkpoint names its tensors: llama-style names under a prefix (`model.`,
/// or `model.language_model.` in an image-text checkpoint), the MoE parts each family names
/// itself, and a multi-token-prediction layer (`mtp.layers.0.*`) as layer `n_layer`.
#[derive(Clone, Debug)]
pub struct HfNames {
    pub arch: Arch,
    pub prefix: String,
    pub n_layer: usize,
}

impl HfNames {
    pub fn new(cfg: &ModelConfig, prefix: &str) -> HfNames {
        HfNames { arch: cfg.arch, prefix: prefix.to_string(), n_layer: cfg.n_layer }
    }

    fn layer(&self, l: usize) -> String {
        // GLM and DeepSeek number their prediction layers after the trunk's.
        if l >= self.n_layer && !self.mtp_in_layers() {
            format!("mtp.layers.{}", l - self.n_layer)
        } else {
            format!("{}layers.{l}", self.prefix)
        }
    }

    /// The tensor name of `key` (of `layer` for per-layer keys).
    pub fn name(&self, key: Key, layer: Option<usize>) -> String {
        let p = self.layer(layer.unwrap_or(0));
        let pre = &self.prefix;
        match key {
            Key::TokEmbd => format!("{pre}embed_tokens.weight"),
            Key::OutputNorm => format!("{pre}norm.weight"),
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
            Key::FfnGateInp => match self.arch {
                Arch::Mixtral => mixtral::ROUTER.replace("{p}", &p),
                Arch::MinimaxM2 => format!("{p}.block_sparse_moe.gate.weight"),
                Arch::GptOss => format!("{p}.mlp.router.weight"),
                _ => format!("{p}.mlp.gate.weight"),
            },
            Key::FfnGateInpBias => format!("{p}.mlp.router.bias"),
            Key::FfnExpProbsB => match self.arch {
                Arch::MinimaxM2 => format!("{p}.block_sparse_moe.e_score_correction_bias"),
                _ => format!("{p}.mlp.gate.e_score_correction_bias"),
            },
            // DeepSeek and GLM call their (ungated) shared experts `shared_experts`.
            Key::ShexpGate if self.plural_shared() => format!("{p}.mlp.shared_experts.gate_proj.weight"),
            Key::ShexpUp if self.plural_shared() => format!("{p}.mlp.shared_experts.up_proj.weight"),
            Key::ShexpDown if self.plural_shared() => format!("{p}.mlp.shared_experts.down_proj.weight"),
            Key::ShexpGate => format!("{p}.mlp.shared_expert.gate_proj.weight"),
            Key::ShexpUp => format!("{p}.mlp.shared_expert.up_proj.weight"),
            Key::ShexpDown => format!("{p}.mlp.shared_expert.down_proj.weight"),
            Key::ShexpGateInp => format!("{p}.mlp.shared_expert_gate.weight"),
            Key::SsmQkvz => format!("{p}.linear_attn.in_proj_qkvz.weight"),
            Key::SsmQkv => format!("{p}.linear_attn.in_proj_qkv.weight"),
            Key::SsmZ => format!("{p}.linear_attn.in_proj_z.weight"),
            Key::SsmBa => format!("{p}.linear_attn.in_proj_ba.weight"),
            Key::SsmBeta => format!("{p}.linear_attn.in_proj_b.weight"),
            Key::SsmAlpha => format!("{p}.linear_attn.in_proj_a.weight"),
            Key::SsmConv1d => format!("{p}.linear_attn.conv1d.weight"),
            Key::SsmDtBias => format!("{p}.linear_attn.dt_bias"),
            Key::SsmALog => format!("{p}.linear_attn.A_log"),
            Key::SsmA => format!("{p}.linear_attn.A"),
            Key::SsmNorm => format!("{p}.linear_attn.norm.weight"),
            Key::SsmOut => format!("{p}.linear_attn.out_proj.weight"),
            Key::AttnQA => format!("{p}.self_attn.q_a_proj.weight"),
            Key::AttnQANorm => format!("{p}.self_attn.q_a_layernorm.weight"),
            Key::AttnQB => format!("{p}.self_attn.q_b_proj.weight"),
            Key::AttnKvAMqa => format!("{p}.self_attn.kv_a_proj_with_mqa.weight"),
            Key::AttnKvANorm => format!("{p}.self_attn.kv_a_layernorm.weight"),
            Key::AttnKvB => format!("{p}.self_attn.kv_b_proj.weight"),
            // HF keeps kv_b whole; the loader splits it.
            Key::AttnKB => format!("{p}.self_attn.k_b_proj.weight"),
            Key::AttnVB => format!("{p}.self_attn.v_b_proj.weight"),
            Key::AttnSinks => format!("{p}.self_attn.sinks"),
            Key::FfnGateExpsBias => format!("{p}.mlp.experts.gate_up_proj_bias"),
            Key::FfnUpExpsBias => format!("{p}.mlp.experts.gate_up_proj_bias"),
            Key::FfnDownExpsBias => format!("{p}.mlp.experts.down_proj_bias"),
            Key::MtpEhProj if self.mtp_in_layers() => format!("{p}.eh_proj.weight"),
            Key::MtpEnorm if self.mtp_in_layers() => format!("{p}.enorm.weight"),
            Key::MtpHnorm if self.mtp_in_layers() => format!("{p}.hnorm.weight"),
            Key::MtpNorm if self.mtp_in_layers() => format!("{p}.shared_head.norm.weight"),
            Key::MtpEhProj => "mtp.fc.weight".into(),
            Key::MtpEnorm => "mtp.pre_fc_norm_embedding.weight".into(),
            Key::MtpHnorm => "mtp.pre_fc_norm_hidden.weight".into(),
            Key::MtpNorm => "mtp.norm.weight".into(),
        }
    }

    /// The prediction layers are `layers.{n_layer}...` rather than `mtp.layers.*`.
    pub fn mtp_in_layers(&self) -> bool {
        matches!(self.arch, Arch::DeepseekV3 | Arch::Glm4Moe)
    }

    fn plural_shared(&self) -> bool {
        matches!(self.arch, Arch::DeepseekV3 | Arch::Glm4Moe)
    }

    /// One expert's matrix, as a tensor of its own (the hub's per-expert layout).
    pub fn expert(&self, part: ExpertPart, l: usize, e: usize) -> String {
        let p = self.layer(l);
        match self.arch {
            Arch::Mixtral | Arch::MinimaxM2 => mixtral::expert_name(&p, part, e),
            _ => {
                let m = match part {
                    ExpertPart::Gate => "gate_proj",
                    ExpertPart::Up => "up_proj",
                    ExpertPart::Down => "down_proj",
                };
                format!("{p}.mlp.experts.{e}.{m}.weight")
            }
        }
    }

    /// The fused tensors some checkpoints keep every expert of a layer in: `gate_up_proj`
    /// (n_expert, 2·ff, hidden), gate rows first, and `down_proj` (n_expert, hidden, ff).
    pub fn fused_experts(&self, l: usize) -> (String, String) {
        let p = self.layer(l);
        (format!("{p}.mlp.experts.gate_up_proj"), format!("{p}.mlp.experts.down_proj"))
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
        ff: c.opt_usize("intermediate_size")?.unwrap_or(0),
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
        delta_net: None,
        mla: None,
        attn_sinks: false,
        layers: window
            .into_iter()
            .map(|window| LayerSpec { mixer: MixerKind::Attention { window }, ffn: FfnKind::Dense })
            .collect(),
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_output_gate: false,
        norm_plus_one: false,
        mtp: None,
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

/// The hybrid layer design of Qwen3-Next and Qwen3.5: Gated DeltaNet dimensions from the
/// `linear_*` keys, layer kinds from `layer_types` (or every `full_attention_interval`-th
/// layer full attention, 4 by default), zero-centred norms, and the attention output gate.
pub(crate) fn hybrid(c: &JsonConfig, cfg: &mut ModelConfig, proj: crate::config::DeltaNetProj) -> Result<()> {
    let n_layer = cfg.n_layer;
    let full: Vec<bool> = match c.get("layer_types").and_then(|v| v.as_array()) {
        Some(types) => {
            if types.len() != n_layer {
                return Err(c
                    .error(format!("key `layer_types` has {} entries for {n_layer} layers", types.len()))
                    .into());
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(true),
                    Some("linear_attention") => Ok(false),
                    _ => Err(c.error(format!(
                        "unknown layer type {t} in `layer_types` (expected \"linear_attention\" or \"full_attention\")"
                    ))),
                })
                .collect::<std::result::Result<_, _>>()?
        }
        None => {
            let every = c.opt_usize("full_attention_interval")?.unwrap_or(4);
            if every == 0 {
                return Err(c.error("key `full_attention_interval` must be at least 1").into());
            }
            (0..n_layer).map(|l| (l + 1) % every == 0).collect()
        }
    };
    for (spec, f) in cfg.layers.iter_mut().zip(full) {
        if !f {
            spec.mixer = MixerKind::GatedDeltaNet;
        }
    }
    let d = crate::config::DeltaNetConfig {
        n_k_heads: c.usize("linear_num_key_heads")?,
        n_v_heads: c.usize("linear_num_value_heads")?,
        d_k: c.usize("linear_key_head_dim")?,
        d_v: c.usize("linear_value_head_dim")?,
        conv_kernel: c.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        head_order: crate::config::HeadOrder::Grouped,
        proj,
    };
    if d.n_k_heads == 0 || !d.n_v_heads.is_multiple_of(d.n_k_heads) {
        return Err(c
            .error(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                d.n_v_heads, d.n_k_heads
            ))
            .into());
    }
    cfg.delta_net = Some(d);
    cfg.norm_plus_one = true;
    cfg.attn_output_gate = c.opt_bool("attn_output_gate")?.unwrap_or(true);
    Ok(())
}

/// The DeepSeek-style router as llama.cpp's GGUF keys describe it (deepseek2, glm4moe,
/// minimax-m2): groups, renormalization (`norm_default` where the file is silent), routed
/// scaling, and ungated shared experts.
pub(crate) fn grouped_router_from_gguf(
    f: &sluice_formats::gguf::GgufFile,
    key: &dyn Fn(&str) -> String,
    cfg: &mut ModelConfig,
    score: crate::config::Score,
    biased: bool,
    norm_default: bool,
) -> Result<()> {
    let ou = |k: &str| -> Result<Option<usize>> { Ok(f.meta_opt_u64(&key(k))?.map(|v| v as usize)) };
    let moe = cfg.moe.as_mut().ok_or_else(|| f.error("a routed model without expert_count"))?;
    let n_group = ou("expert_group_count")?.unwrap_or(1).max(1);
    moe.gating = crate::config::Gating::Grouped {
        score,
        selection_bias: biased,
        n_group,
        topk_group: ou("expert_group_used_count")?.unwrap_or(n_group),
        norm_topk: f.meta_opt_bool(&key("expert_weights_norm"))?.unwrap_or(norm_default),
        norm_eps: 1e-20,
        scale: f.meta_opt_f64(&key("expert_weights_scale"))?.filter(|s| *s != 0.0).unwrap_or(1.0) as f32,
    };
    moe.shared_expert_ff = ou("expert_shared_count")?.filter(|n| *n > 0).map(|n| n * moe.expert_ff);
    moe.shared_gated = false;
    Ok(())
}

/// Sets each layer's FFN: routed experts where `sparse[l]`, dense elsewhere.
pub(crate) fn set_sparse(cfg: &mut ModelConfig, sparse: &[bool]) {
    for (spec, s) in cfg.layers.iter_mut().zip(sparse) {
        spec.ffn = if *s { FfnKind::Moe } else { FfnKind::Dense };
    }
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

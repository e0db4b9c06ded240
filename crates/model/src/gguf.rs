//! A GGUF file as a `TensorSource`: the model's hyper-parameters from its metadata, its
//! tensors by GGUF name, and each routed expert as a slice of the stacked `ffn_*_exps`
//! tensors (expert `e` is rows `e·rows..(e+1)·rows` of a 3-D tensor, one contiguous range).

use crate::config::{
    Activation, Arch, DeltaNetConfig, DeltaNetProj, FfnKind, Gating, HeadOrder, MixerKind, ModelConfig, MoeConfig,
    MtpConfig, QkNorm,
};
use crate::error::{ModelError, Result};
use crate::families::{self, gguf_names};
use crate::rope::{Rope, RopeConfig, RopeScaling, RopeStyle};
use crate::weights::{ExpertPart, Key, TensorSource};
use sluice_formats::gguf::GgufFile;
use sluice_formats::safetensors::TensorData;
use std::path::Path;

pub struct GgufCheckpoint {
    pub file: GgufFile,
    pub config: ModelConfig,
    /// How the reading was decided where the file leaves it open, for `inspect`.
    pub notes: Vec<String>,
}

impl GgufCheckpoint {
    pub fn open(path: &Path) -> Result<GgufCheckpoint> {
        let file = GgufFile::open(path)?;
        let (config, notes) = read_config(&file)?;
        Ok(GgufCheckpoint { file, config, notes })
    }

    fn err(&self, msg: String) -> ModelError {
        ModelError::Invalid(format!("{}: {msg}", self.file.path.display()))
    }
}

/// The byte range of one expert's matrix inside the file (for stores that read it directly).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRange {
    /// Which file of a split model (an index into `GgufFile::files`).
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

impl GgufCheckpoint {
    /// Where expert `e`'s `part` of layer `l` lives in the file.
    pub fn expert_range(
        &self,
        part: ExpertPart,
        l: usize,
        e: usize,
    ) -> Result<(ExpertRange, sluice_kernels::DType, [usize; 2])> {
        let name = gguf_names::experts(part, l);
        let t = self.file.tensor_info(&name).ok_or_else(|| self.err(format!("missing tensor `{name}`")))?;
        let shape = t.shape();
        if shape.len() != 3 {
            return Err(
                self.err(format!("tensor `{name}` has shape {shape:?}; expected 3 dimensions (experts, rows, cols)"))
            );
        }
        let (n_exp, rows, cols) = (shape[0], shape[1], shape[2]);
        if let Some(n) = self.config.moe.as_ref().map(|m| m.n_expert).filter(|n| *n != n_exp) {
            return Err(self.err(format!("tensor `{name}` holds {n_exp} experts, but expert_count is {n}")));
        }
        if e >= n_exp {
            return Err(self.err(format!("tensor `{name}` holds {n_exp} experts; expert {e} requested")));
        }
        let per = t.size / n_exp as u64;
        Ok((ExpertRange { file: t.file, offset: t.offset + per * e as u64, len: per }, t.dtype, [rows, cols]))
    }
}

impl TensorSource for GgufCheckpoint {
    fn describe(&self) -> String {
        self.file.path.display().to_string()
    }

    fn get(&self, key: Key, layer: Option<usize>) -> Result<Option<TensorData>> {
        Ok(gguf_names::name(self.config.arch, key, layer).and_then(|n| self.file.tensor(&n)))
    }

    fn require(&self, key: Key, layer: Option<usize>) -> Result<TensorData> {
        let Some(name) = gguf_names::name(self.config.arch, key, layer) else {
            return Err(self.err(format!("a {} file has no {key:?} tensor", self.config.arch.name())));
        };
        self.file.tensor(&name).ok_or_else(|| self.err(format!("missing tensor `{name}`")))
    }

    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<TensorData> {
        let name = gguf_names::experts(part, layer);
        let (r, dtype, [rows, cols]) = self.expert_range(part, layer, expert)?;
        let whole = self.file.tensor(&name).expect("expert_range found it");
        let start = (r.offset - self.file.tensor_info(&name).expect("found").offset) as usize;
        Ok(TensorData {
            name: format!("{name}[{expert}]"),
            file: whole.file.clone(),
            dtype,
            shape: vec![rows, cols],
            data: whole.data.slice(start, r.len as usize),
        })
    }
}

/// Reads the hyper-parameters of a GGUF model from its metadata.
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
    read_config(f).map(|(c, _)| c)
}

/// The hyper-parameters, and notes on how what the file leaves open was decided.
fn read_config(f: &GgufFile) -> Result<(ModelConfig, Vec<String>)> {
    let mut notes = Vec::new();
    let arch_name = f.meta_str("general.architecture")?.to_string();
    let key = |k: &str| format!("{arch_name}.{k}");
    let u = |k: &str| -> Result<usize> { Ok(f.meta_u64(&key(k))? as usize) };
    let ou = |k: &str| -> Result<Option<usize>> { Ok(f.meta_opt_u64(&key(k))?.map(|v| v as usize)) };
    let of = |k: &str| -> Result<Option<f64>> { Ok(f.meta_opt_f64(&key(k))?) };

    let n_expert = ou("expert_count")?.unwrap_or(0);
    let arch = match arch_name.as_str() {
        "llama" if n_expert > 0 => Arch::Mixtral,
        "llama" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "qwen2moe" => Arch::Qwen2Moe,
        "qwen3moe" => Arch::Qwen3Moe,
        "olmoe" => Arch::Olmoe,
        "gemma3" => Arch::Gemma3,
        "qwen3next" => Arch::Qwen3Next,
        "qwen35" => Arch::Qwen35,
        "qwen35moe" => Arch::Qwen35Moe,
        "deepseek2" => Arch::DeepseekV3,
        "gpt-oss" => Arch::GptOss,
        "glm4moe" => Arch::Glm4Moe,
        "minimax-m2" => Arch::MinimaxM2,
        other => {
            return Err(f
                .error(format!(
                    "unsupported architecture `{other}` (general.architecture); supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma3, qwen3next, qwen35, qwen35moe, deepseek2, gpt-oss, glm4moe, minimax-m2"
                ))
                .into())
        }
    };
    let hidden = u("embedding_length")?;
    let blocks = u("block_count")?;
    // Multi-token-prediction blocks are counted in block_count, after the trunk's.
    let n_mtp = ou("nextn_predict_layers")?.unwrap_or(0);
    if n_mtp >= blocks {
        return Err(f.error(format!("nextn_predict_layers {n_mtp} leaves no trunk layers of {blocks} blocks")).into());
    }
    let n_layer = blocks - n_mtp;
    check_blocks(f, blocks, n_layer)?;
    let n_head = u("attention.head_count")?;
    if n_head == 0 || n_layer == 0 || hidden == 0 {
        return Err(f.error("block_count, embedding_length and attention.head_count must be positive").into());
    }
    let n_head_kv = ou("attention.head_count_kv")?.unwrap_or(n_head);
    let head_dim = ou("attention.key_length")?.unwrap_or(hidden / n_head);
    let embd = f.tensor_info("token_embd.weight").ok_or_else(|| f.error("missing tensor `token_embd.weight`"))?;
    let vocab_size = *embd.shape().first().ok_or_else(|| f.error("tensor `token_embd.weight` has no dimensions"))?;
    crate::config::check_dims(hidden, n_layer, n_head, n_head_kv, head_dim, vocab_size).map_err(|e| f.error(e))?;
    // (deepseek2's key and value lengths are its latent's, read in its family file.)
    if let Some(v) = ou("attention.value_length")?.filter(|_| arch != Arch::DeepseekV3) {
        if v != head_dim {
            return Err(f.error(format!("attention.value_length {v} differs from key_length {head_dim}")).into());
        }
    }
    let ff = ou("feed_forward_length")?.unwrap_or(0);

    let style = if matches!(arch, Arch::Llama | Arch::Mixtral) { RopeStyle::Interleaved } else { RopeStyle::Neox };
    let theta = of("rope.freq_base")?.unwrap_or(10000.0);
    let rope_dim = ou("rope.dimension_count")?.unwrap_or(head_dim);
    if rope_dim > head_dim || rope_dim % 2 != 0 {
        return Err(f.error(format!("rope.dimension_count {rope_dim} does not fit head_dim {head_dim}")).into());
    }
    let scaling = match f.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        None | Some("none") => match f.tensor("rope_freqs.weight") {
            Some(t) => {
                let mut ff = vec![0f32; rope_dim / 2];
                sluice_kernels::quant::dequantize_row(t.dtype, &t.data, &mut ff)
                    .map_err(|e| f.error(format!("tensor `rope_freqs.weight`: {e}")))?;
                RopeScaling::FreqFactors(ff)
            }
            None => RopeScaling::None,
        },
        Some("linear") => RopeScaling::Linear { factor: of("rope.scaling.factor")?.unwrap_or(1.0) },
        Some("yarn") => {
            let factor = of("rope.scaling.factor")?.unwrap_or(1.0);
            RopeScaling::Yarn {
                factor,
                original_max_position: of("rope.scaling.original_context_length")?
                    .unwrap_or(ou("context_length")?.unwrap_or(4096) as f64),
                beta_fast: of("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
                beta_slow: of("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
                // As llama.cpp: YaRN's mscale(factor) — over mscale(factor, mscale_all_dim)
                // where the file has a log multiplier — times the file's own attn_factor.
                attention_factor: match of("rope.scaling.yarn_log_multiplier")?.filter(|m| *m != 0.0) {
                    Some(lm) => Rope::yarn_mscale(factor, 1.0) / Rope::yarn_mscale(factor, lm / 0.1),
                    None => Rope::yarn_mscale(factor, 1.0),
                } * of("rope.scaling.attn_factor")?.unwrap_or(1.0),
                truncate: true,
            }
        }
        Some(other) => return Err(f.error(format!("unsupported RoPE scaling type `{other}`")).into()),
    };
    let rope = RopeConfig { theta, dim: rope_dim, style, scaling };

    let moe = if n_expert > 0 {
        let used = u("expert_used_count")?;
        let expert_ff = match arch {
            Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Moe => u("expert_feed_forward_length")?,
            _ => ou("expert_feed_forward_length")?.unwrap_or(ff),
        };
        // llama.cpp renormalizes the top k of these architectures whatever the source config
        // said (GGUF records no norm_topk_prob); sluice reads the files the same way.
        let norm_topk = matches!(arch, Arch::Mixtral | Arch::Qwen3Moe | Arch::Qwen3Next | Arch::Qwen35Moe);
        let shared = match arch {
            Arch::Qwen2Moe => Some(ou("expert_shared_feed_forward_length")?.unwrap_or(ff)),
            Arch::Qwen3Next | Arch::Qwen35Moe => ou("expert_shared_feed_forward_length")?.filter(|s| *s > 0),
            _ => None,
        };
        Some(MoeConfig {
            n_expert,
            n_expert_used: used,
            expert_ff,
            gating: Gating::SoftmaxTopK { norm_topk },
            shared_expert_ff: shared,
            ..MoeConfig::PLAIN
        })
    } else {
        if matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe | Arch::Qwen3Next | Arch::Qwen35Moe) {
            return Err(f.error(format!("missing metadata key `{}`", key("expert_count"))).into());
        }
        None
    };

    let mut cfg = ModelConfig {
        arch,
        vocab_size,
        hidden,
        n_layer,
        n_head,
        n_head_kv,
        head_dim,
        ff,
        rms_eps: of("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-6) as f32,
        rope,
        rope_local: None,
        max_position: ou("context_length")?.unwrap_or(4096),
        tie_embeddings: f.tensor_info("output.weight").is_none(),
        qkv_bias: false,
        qk_norm: QkNorm::None,
        clip_qkv: None,
        activation: Activation::Silu,
        layers: ModelConfig::uniform_layers(
            n_layer,
            MixerKind::Attention { window: None },
            if moe.is_some() { FfnKind::Moe } else { FfnKind::Dense },
        ),
        moe,
        delta_net: None,
        mla: None,
        attn_sinks: false,
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        attn_output_gate: false,
        norm_plus_one: false,
        mtp: None,
        gemma: false,
        final_logit_softcap: None,
        bos_token: f.meta_opt_u64("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos_tokens: f.meta_opt_u64("tokenizer.ggml.eos_token_id")?.map(|v| vec![v as u32]).unwrap_or_default(),
    };
    match arch {
        Arch::Qwen3 | Arch::Qwen3Moe => cfg.qk_norm = QkNorm::PerHead,
        Arch::Olmoe => {
            cfg.qk_norm = QkNorm::Full;
            cfg.clip_qkv = of("attention.clamp_kqv")?.map(|v| v as f32);
        }
        Arch::Gemma3 => {
            cfg.gemma = true;
            cfg.qk_norm = QkNorm::PerHead;
            cfg.activation = Activation::GeluTanh;
            cfg.final_logit_softcap = of("final_logit_softcapping")?.map(|v| v as f32).filter(|v| *v > 0.0);
            if let Some(w) = ou("attention.sliding_window")?.filter(|w| *w > 0) {
                let pattern = ou("attention.sliding_window_pattern")?.unwrap_or(6).max(1);
                for (l, spec) in cfg.layers.iter_mut().enumerate() {
                    spec.mixer = MixerKind::Attention { window: (l % pattern < pattern - 1).then_some(w) };
                }
                cfg.rope_local = Some(RopeConfig {
                    theta: of("rope.freq_base_swa")?.unwrap_or(10000.0),
                    dim: rope_dim,
                    style,
                    scaling: RopeScaling::None,
                });
            }
        }
        Arch::Qwen3Next | Arch::Qwen35 | Arch::Qwen35Moe => hybrid(f, &key, &mut cfg, n_mtp)?,
        Arch::DeepseekV3 => families::deepseek_v3::gguf(f, &key, &mut cfg, &mut notes)?,
        Arch::GptOss => families::gpt_oss::gguf(f, &key, &mut cfg)?,
        Arch::Glm4Moe => families::glm4_moe::gguf(f, &key, &mut cfg, n_mtp)?,
        Arch::MinimaxM2 => families::minimax_m2::gguf(f, &key, &mut cfg, &mut notes)?,
        _ => {}
    }
    // Attention bias, as the first attention layer has it.
    if let Some(l) = (0..n_layer).find(|l| matches!(cfg.layers[*l].mixer, MixerKind::Attention { .. })) {
        cfg.qkv_bias = f.tensor_info(&format!("blk.{l}.attn_q.bias")).is_some();
    }
    cfg.validate().map_err(|e| f.error(e))?;
    check_layer_tensors(f, &cfg)?;
    Ok((cfg, notes))
}

/// A layer tensor's block and its name within the block: `blk.3.attn_q.bias` → (3, `attn_q.bias`).
fn block_part(name: &str) -> Option<(usize, &str)> {
    let (i, suffix) = name.strip_prefix("blk.")?.split_once('.')?;
    Some((i.parse().ok()?, suffix))
}

/// The layer tensors (`blk.N.…`) against the block counts: every one in a declared block, no
/// multi-token-prediction tensor (`blk.N.nextn.…`) in a trunk block, and every block counted as
/// a prediction block either holding such tensors or none at all (a file whose prediction
/// layers were stripped). A count that disagrees with the tensors would otherwise run a model
/// with layers left out, or with a prediction layer run as a trunk layer, and say nothing.
fn check_blocks(f: &GgufFile, blocks: usize, n_layer: usize) -> Result<()> {
    // Per block holding tensors: whether any of them is a prediction tensor.
    let mut seen = std::collections::BTreeMap::<usize, bool>::new();
    for t in &f.tensors {
        let Some((i, _)) = block_part(&t.name) else { continue };
        let nextn = t.name.contains(".nextn.");
        if i >= blocks {
            return Err(f.error(format!("tensor `{}` is in block {i}, but block_count is {blocks}", t.name)).into());
        }
        if nextn && i < n_layer {
            return Err(f
                .error(format!(
                    "tensor `{}` is a multi-token-prediction tensor, but nextn_predict_layers makes block {i} one of the {n_layer} trunk layers",
                    t.name
                ))
                .into());
        }
        *seen.entry(i).or_default() |= nextn;
    }
    if let Some((i, _)) = seen.range(n_layer..).find(|(_, nextn)| !**nextn) {
        return Err(f
            .error(format!(
                "block {i} is counted as a multi-token-prediction layer (nextn_predict_layers {}), but holds no nextn tensors",
                blocks - n_layer
            ))
            .into());
    }
    Ok(())
}

/// Layers of one kind hold the same tensors: the token mixer's (`attn_*`, `ssm_*`) in every
/// layer of the same mixer, the rest in every layer of the same mixer and FFN. Several choices
/// are read off one layer — attention biases and QK-norm off the first attention layer, a
/// router's correction bias off the first sparse one — so a tensor missing there but present
/// further down (or the reverse) would be skipped in every layer, or looked for where it is
/// not, without a word.
fn check_layer_tensors(f: &GgufFile, cfg: &ModelConfig) -> Result<()> {
    use std::collections::BTreeSet;
    let mixer_part = |t: &str| t.starts_with("attn_") || t.starts_with("ssm_");
    // Per layer: its mixer's tensors, and the others.
    let mut held = vec![(BTreeSet::new(), BTreeSet::new()); cfg.n_layer];
    for t in &f.tensors {
        let Some((i, suffix)) = block_part(&t.name) else { continue };
        if let Some(h) = held.get_mut(i) {
            if mixer_part(suffix) { &mut h.0 } else { &mut h.1 }.insert(suffix);
        }
    }
    let mixer = |l: usize| std::mem::discriminant(&cfg.layers[l].mixer);
    for l in 0..cfg.n_layer {
        let same_mixer = (0..l).find(|k| mixer(*k) == mixer(l)).unwrap_or(l);
        let same_kind = (0..l).find(|k| mixer(*k) == mixer(l) && cfg.layers[*k].ffn == cfg.layers[l].ffn).unwrap_or(l);
        for (first, a, b) in
            [(same_mixer, &held[same_mixer].0, &held[l].0), (same_kind, &held[same_kind].1, &held[l].1)]
        {
            let missing =
                a.difference(b).next().map(|t| (l, first, t)).or_else(|| b.difference(a).next().map(|t| (first, l, t)));
            if let Some((without, with, t)) = missing {
                return Err(f
                    .error(format!(
                        "block {without} has no tensor `blk.{without}.{t}`, which block {with}, a layer of the same kind, has"
                    ))
                    .into());
            }
        }
    }
    Ok(())
}

/// The Qwen hybrids (`qwen3next`, `qwen35`, `qwen35moe`): Gated DeltaNet layers among gated
/// attention ones, from llama.cpp's keys (`ssm.*`, `attention.recurrent_layers` or
/// `full_attention_interval`) and its tensor layout.
fn hybrid(f: &GgufFile, key: &dyn Fn(&str) -> String, cfg: &mut ModelConfig, n_mtp: usize) -> Result<()> {
    let need = |k: &str| -> Result<usize> { Ok(f.meta_u64(&key(k))? as usize) };
    let n_layer = cfg.n_layer;
    let d_k = need("ssm.state_size")?;
    let n_k_heads = need("ssm.group_count")?;
    let n_v_heads = need("ssm.time_step_rank")?;
    let inner = need("ssm.inner_size")?;
    if n_v_heads == 0 || inner % n_v_heads != 0 {
        return Err(f.error(format!("ssm.inner_size {inner} is not a whole number of {n_v_heads} value heads")).into());
    }
    let recurrent: Vec<bool> = match f.meta_array(&key("attention.recurrent_layers")) {
        Some(sluice_formats::gguf::Array::Bool(v)) => {
            if v.len() < n_layer {
                return Err(f
                    .error(format!("attention.recurrent_layers has {} entries for {n_layer} layers", v.len()))
                    .into());
            }
            v[..n_layer].to_vec()
        }
        Some(_) => {
            return Err(f
                .error(format!("metadata key `{}` must be an array of booleans", key("attention.recurrent_layers")))
                .into())
        }
        None => {
            let every = f.meta_opt_u64(&key("full_attention_interval"))?.unwrap_or(4) as usize;
            if every == 0 {
                return Err(f.error("full_attention_interval must be at least 1").into());
            }
            (0..n_layer).map(|l| (l + 1) % every != 0).collect()
        }
    };
    for (spec, rec) in cfg.layers.iter_mut().zip(&recurrent) {
        if *rec {
            spec.mixer = MixerKind::GatedDeltaNet;
        }
    }
    let next = cfg.arch == Arch::Qwen3Next;
    if next && f.tensor_info("blk.0.ssm_in.weight").is_some() {
        return Err(f.error("this qwen3next file stores the DeltaNet input projection fused (`ssm_in`, an early converter's layout); reconvert it with a current convert_hf_to_gguf.py").into());
    }
    cfg.delta_net = Some(DeltaNetConfig {
        n_k_heads,
        n_v_heads,
        d_k,
        d_v: inner / n_v_heads,
        conv_kernel: need("ssm.conv_kernel")?,
        // llama.cpp's converter reorders Qwen3.5's value heads so that broadcasting tiles.
        head_order: if next { HeadOrder::Grouped } else { HeadOrder::Tiled },
        proj: if next { DeltaNetProj::QkvGateBa } else { DeltaNetProj::Separate },
    });
    cfg.qk_norm = QkNorm::PerHead;
    cfg.attn_output_gate = true;
    if n_mtp > 0 {
        cfg.mtp = Some(MtpConfig { n_layer: n_mtp, ffn: cfg.layers[0].ffn });
    }
    Ok(())
}

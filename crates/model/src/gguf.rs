//! A GGUF file as a `TensorSource`: the model's hyper-parameters from its metadata, its
//! tensors by GGUF name, and each routed expert as a slice of the stacked `ffn_*_exps`
//! tensors (expert `e` is rows `e·rows..(e+1)·rows` of a 3-D tensor, one contiguous range).

use crate::config::{Activation, Arch, Gating, ModelConfig, MoeConfig, QkNorm};
use crate::error::{ModelError, Result};
use crate::families::gguf_names;
use crate::rope::{Rope, RopeConfig, RopeScaling, RopeStyle};
use crate::weights::{ExpertPart, Key, TensorSource};
use sluice_formats::gguf::GgufFile;
use sluice_formats::safetensors::TensorData;
use std::path::Path;

pub struct GgufCheckpoint {
    pub file: GgufFile,
    pub config: ModelConfig,
}

impl GgufCheckpoint {
    pub fn open(path: &Path) -> Result<GgufCheckpoint> {
        let file = GgufFile::open(path)?;
        let config = config_from_gguf(&file)?;
        Ok(GgufCheckpoint { file, config })
    }

    fn err(&self, msg: String) -> ModelError {
        ModelError::Invalid(format!("{}: {msg}", self.file.path.display()))
    }
}

/// The byte range of one expert's matrix inside the file (for stores that read it directly).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRange {
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
        if e >= n_exp {
            return Err(self.err(format!("tensor `{name}` holds {n_exp} experts; expert {e} requested")));
        }
        let per = t.size / n_exp as u64;
        Ok((ExpertRange { offset: t.offset + per * e as u64, len: per }, t.dtype, [rows, cols]))
    }
}

impl TensorSource for GgufCheckpoint {
    fn describe(&self) -> String {
        self.file.path.display().to_string()
    }

    fn get(&self, key: Key, layer: Option<usize>) -> Result<Option<TensorData>> {
        Ok(self.file.tensor(&gguf_names::name(key, layer)))
    }

    fn require(&self, key: Key, layer: Option<usize>) -> Result<TensorData> {
        let name = gguf_names::name(key, layer);
        self.file.tensor(&name).ok_or_else(|| self.err(format!("missing tensor `{name}`")))
    }

    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> Result<TensorData> {
        let name = gguf_names::experts(part, layer);
        let (r, dtype, [rows, cols]) = self.expert_range(part, layer, expert)?;
        let whole = self.file.tensor(&name).expect("expert_range found it");
        let start = (r.offset - self.file.tensor_info(&name).expect("found").offset) as usize;
        Ok(TensorData {
            name: format!("{name}[{expert}]"),
            file: self.file.path.clone(),
            dtype,
            shape: vec![rows, cols],
            data: whole.data.slice(start, r.len as usize),
        })
    }
}

/// Reads the hyper-parameters of a GGUF model from its metadata.
pub fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig> {
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
        other => {
            return Err(f
                .error(format!(
                    "unsupported architecture `{other}` (general.architecture); supported: llama, qwen2, qwen3, qwen2moe, qwen3moe, olmoe, gemma3"
                ))
                .into())
        }
    };
    let hidden = u("embedding_length")?;
    let n_layer = u("block_count")?;
    let n_head = u("attention.head_count")?;
    if n_head == 0 || n_layer == 0 || hidden == 0 {
        return Err(f.error("block_count, embedding_length and attention.head_count must be positive").into());
    }
    let n_head_kv = ou("attention.head_count_kv")?.unwrap_or(n_head);
    let head_dim = ou("attention.key_length")?.unwrap_or(hidden / n_head);
    let embd = f.tensor_info("token_embd.weight").ok_or_else(|| f.error("missing tensor `token_embd.weight`"))?;
    let vocab_size = *embd.shape().first().ok_or_else(|| f.error("tensor `token_embd.weight` has no dimensions"))?;
    crate::config::check_dims(hidden, n_layer, n_head, n_head_kv, head_dim, vocab_size).map_err(|e| f.error(e))?;
    if let Some(v) = ou("attention.value_length")? {
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
                attention_factor: of("rope.scaling.attn_factor")?.unwrap_or(Rope::yarn_mscale(factor, 1.0)),
                truncate: true,
            }
        }
        Some(other) => return Err(f.error(format!("unsupported RoPE scaling type `{other}`")).into()),
    };
    let rope = RopeConfig { theta, dim: rope_dim, style, scaling };

    let moe = if n_expert > 0 {
        let used = u("expert_used_count")?;
        let expert_ff = match arch {
            Arch::Qwen2Moe | Arch::Qwen3Moe => u("expert_feed_forward_length")?,
            _ => ou("expert_feed_forward_length")?.unwrap_or(ff),
        };
        let norm_topk = matches!(arch, Arch::Mixtral | Arch::Qwen3Moe);
        let shared =
            if arch == Arch::Qwen2Moe { Some(ou("expert_shared_feed_forward_length")?.unwrap_or(ff)) } else { None };
        Some(MoeConfig {
            n_expert,
            n_expert_used: used,
            expert_ff,
            gating: Gating::SoftmaxTopK { norm_topk },
            shared_expert_ff: shared,
        })
    } else {
        if matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe | Arch::Olmoe) {
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
        qkv_bias: f.tensor_info("blk.0.attn_q.bias").is_some(),
        qk_norm: QkNorm::None,
        clip_qkv: None,
        activation: Activation::Silu,
        sparse_layer: vec![moe.is_some(); n_layer],
        moe,
        window: vec![None; n_layer],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
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
                cfg.window = (0..n_layer).map(|l| (l % pattern < pattern - 1).then_some(w)).collect();
                cfg.rope_local = Some(RopeConfig {
                    theta: of("rope.freq_base_swa")?.unwrap_or(10000.0),
                    dim: rope_dim,
                    style,
                    scaling: RopeScaling::None,
                });
            }
        }
        _ => {}
    }
    cfg.validate().map_err(|e| f.error(e))?;
    Ok(cfg)
}

//! `ModelConfig`: everything the forward pass needs to know about a checkpoint, whatever file
//! format and config dialect it came from. Family files fill it in.

use crate::rope::RopeConfig;

/// Model families sluice runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen2Moe,
    Qwen3Moe,
    Olmoe,
    Gemma3,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mixtral => "mixtral",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Olmoe => "olmoe",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// Where the attention applies RMSNorm to queries and keys, if anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over each head's `head_dim` values (Qwen3, Gemma 3).
    PerHead,
    /// Over the whole projection before it is split into heads (OLMoE).
    Full,
}

/// How router logits become the weights of the chosen experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, take the top k; renormalize them to sum to 1 if `norm_topk`.
    SoftmaxTopK { norm_topk: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// FFN width of one routed expert.
    pub expert_ff: usize,
    pub gating: Gating,
    /// FFN width of the always-on shared expert (Qwen2-MoE), gated by a sigmoid.
    pub shared_expert_ff: Option<usize>,
}

/// Activation of the gated FFN.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Width of the dense FFN (dense layers of MoE models included).
    pub ff: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    /// Gemma 3's local layers rotate with a different base.
    pub rope_local: Option<RopeConfig>,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: QkNorm,
    /// OLMoE's optional clamp of Q, K and V.
    pub clip_qkv: Option<f32>,
    pub activation: Activation,
    pub moe: Option<MoeConfig>,
    /// Per layer: routed experts (true) or a dense FFN (false).
    pub sparse_layer: Vec<bool>,
    /// Per layer: sliding-window size of the attention, if any.
    pub window: Vec<Option<usize>>,
    /// Attention score scale (1/sqrt(head_dim) unless the family says otherwise).
    pub attn_scale: f32,
    /// Gemma: embeddings multiplied by sqrt(hidden), extra post-norms (GGUF stores its norm
    /// weights with Gemma's +1 already added).
    pub gemma: bool,
    pub final_logit_softcap: Option<f32>,
    pub bos_token: Option<u32>,
    pub eos_tokens: Vec<u32>,
}

/// Largest values any real checkpoint comes near (the largest known models are well inside
/// them); a config beyond them is refused before anything is sized from it.
pub mod limits {
    pub const HIDDEN: usize = 1 << 17;
    pub const LAYERS: usize = 1 << 12;
    pub const HEADS: usize = 1 << 12;
    pub const HEAD_DIM: usize = 1 << 12;
    pub const VOCAB: usize = 1 << 23;
    pub const FF: usize = 1 << 20;
    pub const EXPERTS: usize = 1 << 14;
    pub const CONTEXT: usize = 1 << 24;
}

/// Checks the dimensions that size allocations, as soon as a loader has read them: each
/// positive (but the vocabulary, checked against the embedding) and within `limits`.
pub fn check_dims(
    hidden: usize,
    n_layer: usize,
    n_head: usize,
    n_head_kv: usize,
    head_dim: usize,
    vocab: usize,
) -> Result<(), String> {
    let within = |name: &str, v: usize, max: usize| {
        if v == 0 || v > max {
            Err(format!("{name} is {v}; it must be between 1 and {max}"))
        } else {
            Ok(())
        }
    };
    within("the hidden size", hidden, limits::HIDDEN)?;
    within("the number of layers", n_layer, limits::LAYERS)?;
    within("the number of attention heads", n_head, limits::HEADS)?;
    within("the number of key/value heads", n_head_kv, limits::HEADS)?;
    within("head_dim", head_dim, limits::HEAD_DIM)?;
    within("the vocabulary size", vocab, limits::VOCAB)?;
    Ok(())
}

impl ModelConfig {
    /// `f(layer, expert)` for every routed expert, by layer; dense layers (and every layer of
    /// a dense model) get an empty list.
    pub fn map_experts<T, E>(&self, mut f: impl FnMut(usize, usize) -> Result<T, E>) -> Result<Vec<Vec<T>>, E> {
        let n_expert = self.moe.as_ref().map_or(0, |m| m.n_expert);
        (0..self.n_layer)
            .map(|l| if self.sparse_layer[l] { (0..n_expert).map(|e| f(l, e)).collect() } else { Ok(Vec::new()) })
            .collect()
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    pub fn is_moe(&self) -> bool {
        self.moe.is_some()
    }

    /// Checks the invariants the forward pass relies on; `source` names the config for errors.
    pub fn validate(&self) -> Result<(), String> {
        let must = |ok: bool, msg: String| if ok { Ok(()) } else { Err(msg) };
        check_dims(self.hidden, self.n_layer, self.n_head, self.n_head_kv, self.head_dim, self.vocab_size)?;
        must(
            self.ff <= limits::FF,
            format!("the feed-forward width {} is beyond {}", self.ff, limits::FF),
        )?;
        must(
            self.max_position > 0 && self.max_position <= limits::CONTEXT,
            format!("the context length {} must be between 1 and {}", self.max_position, limits::CONTEXT),
        )?;
        must(
            self.window.len() == self.n_layer && self.window.iter().flatten().all(|w| *w > 0),
            "per-layer sliding windows have the wrong length or a zero window".into(),
        )?;
        must(self.rms_eps.is_finite() && self.rms_eps >= 0.0, format!("rms_norm_eps {} is not a number >= 0", self.rms_eps))?;
        must(
            self.n_head.is_multiple_of(self.n_head_kv),
            format!("{} attention heads are not a multiple of {} key/value heads", self.n_head, self.n_head_kv),
        )?;
        must(
            self.rope.dim <= self.head_dim && self.rope.dim.is_multiple_of(2),
            format!("rotary dimension {} does not fit head_dim {}", self.rope.dim, self.head_dim),
        )?;
        must(self.sparse_layer.len() == self.n_layer, "per-layer sparsity has the wrong length".into())?;
        if let Some(m) = &self.moe {
            must(
                m.n_expert_used >= 1 && m.n_expert_used <= m.n_expert && m.n_expert <= limits::EXPERTS,
                format!("{} experts per token out of {} experts", m.n_expert_used, m.n_expert),
            )?;
            must(
                m.expert_ff > 0 && m.expert_ff <= limits::FF && m.shared_expert_ff.is_none_or(|f| f > 0 && f <= limits::FF),
                format!("expert feed-forward width {} (shared {:?}) out of range", m.expert_ff, m.shared_expert_ff),
            )?;
        } else {
            must(!self.sparse_layer.iter().any(|s| *s), "sparse layers without an MoE config".into())?;
        }
        Ok(())
    }
}

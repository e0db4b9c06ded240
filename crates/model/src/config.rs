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
    Qwen3Next,
    Qwen35,
    Qwen35Moe,
    DeepseekV3,
    GptOss,
    Glm4Moe,
    MinimaxM2,
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
            Arch::Qwen3Next => "qwen3_next",
            Arch::Qwen35 => "qwen3_5",
            Arch::Qwen35Moe => "qwen3_5_moe",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::GptOss => "gpt_oss",
            Arch::Glm4Moe => "glm4_moe",
            Arch::MinimaxM2 => "minimax_m2",
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
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Gating {
    /// Softmax over all experts, take the top k; renormalize them to sum to 1 if `norm_topk`.
    SoftmaxTopK { norm_topk: bool },
    /// DeepSeek-V3, GLM-4.5, MiniMax-M2 (σ scores, `selection_bias`), DeepSeek-V2 (softmax
    /// scores): each expert scored; where `selection_bias`, a per-expert correction bias is
    /// added for choosing only (the weights are the unbiased scores); with `n_group` > 1 only
    /// the `topk_group` groups with the best sums of their two best scores compete; the
    /// chosen weights are renormalized (w / (Σw + `norm_eps`)) if `norm_topk`, then
    /// multiplied by `scale`.
    Grouped {
        score: Score,
        selection_bias: bool,
        n_group: usize,
        topk_group: usize,
        norm_topk: bool,
        norm_eps: f32,
        scale: f32,
    },
    /// gpt-oss: the top k of the raw logits, then a softmax over those k.
    TopKSoftmax,
}

/// How `Gating::Grouped` scores an expert from its router logit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Score {
    Sigmoid,
    /// Softmax over all experts.
    Softmax,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// FFN width of one routed expert.
    pub expert_ff: usize,
    pub gating: Gating,
    /// FFN width of the always-on shared expert (all shared experts together).
    pub shared_expert_ff: Option<usize>,
    /// The shared expert's output is scaled by a sigmoid gate (Qwen); DeepSeek and GLM add it
    /// as is.
    pub shared_gated: bool,
    /// The router has a bias (gpt-oss).
    pub router_bias: bool,
    /// Each expert's projections have biases (gpt-oss).
    pub expert_bias: bool,
}

impl MoeConfig {
    /// The common case's switches: a gated shared expert, no biases. Family files spread it
    /// (`..MoeConfig::PLAIN`) after the fields they set.
    pub const PLAIN: MoeConfig = MoeConfig {
        n_expert: 0,
        n_expert_used: 0,
        expert_ff: 0,
        gating: Gating::SoftmaxTopK { norm_topk: true },
        shared_expert_ff: None,
        shared_gated: true,
        router_bias: false,
        expert_bias: false,
    };
}

/// What a layer mixes tokens with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    /// Softmax attention over the KV cache (the model's `n_head`, `head_dim` ...), with a
    /// sliding window if given.
    Attention { window: Option<usize> },
    /// Gated DeltaNet: linear attention with a recurrent state (`ModelConfig::delta_net`).
    GatedDeltaNet,
    /// Multi-head latent attention (`ModelConfig::mla`): one compressed latent per token is
    /// all its KV cache holds.
    Mla,
}

/// What a layer's feed-forward block is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// A gated MLP of width `ModelConfig::ff`.
    Dense,
    /// Routed experts (`ModelConfig::moe`).
    Moe,
}

/// One decoder layer: a mixer and a feed-forward block, each a variant with its own file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub mixer: MixerKind,
    pub ffn: FfnKind,
}

/// Which key (and query) head a value head of a Gated DeltaNet reads, when there are fewer
/// key heads than value heads (`r` = value heads per key head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadOrder {
    /// Value head `h` uses key head `h / r` (consecutive value heads share a key head): the
    /// Hugging Face layout and llama.cpp's `qwen3next` files.
    Grouped,
    /// Value head `h` uses key head `h % n_k_heads`: llama.cpp's `qwen35`/`qwen35moe` files,
    /// whose converter reorders the value side so that broadcasting tiles.
    Tiled,
}

/// How a Gated DeltaNet's input projections are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaNetProj {
    /// Qwen3-Next (Hugging Face): `in_proj_qkvz` and `in_proj_ba`, each interleaved per key
    /// head: `[q | k | v (r heads) | z (r heads)]` and `[b (r) | a (r)]` per group.
    FusedPerGroup,
    /// llama.cpp's `qwen3next`: `attn_qkv` ([q | k | v]) and `attn_gate` (z), with `ssm_ba`
    /// still interleaved per group.
    QkvGateBa,
    /// Qwen3.5: four separate projections, qkv, z, b, a.
    Separate,
}

/// Dimensions of the Gated DeltaNet layers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeltaNetConfig {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    /// Causal depthwise convolution length over the q, k, v channels.
    pub conv_kernel: usize,
    pub head_order: HeadOrder,
    pub proj: DeltaNetProj,
}

impl DeltaNetConfig {
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.d_k
    }
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.d_v
    }
    /// Channels of the convolution: q, k and v.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// The key head value head `h` reads.
    pub fn k_head(&self, h: usize) -> usize {
        match self.head_order {
            HeadOrder::Grouped => h / (self.n_v_heads / self.n_k_heads),
            HeadOrder::Tiled => h % self.n_k_heads,
        }
    }
}

/// Dimensions of multi-head latent attention (DeepSeek-V2/V3, Kimi-K2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaConfig {
    /// Rank of the query's low-rank projection (None: a plain q projection).
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed key/value latent (what the cache holds, with the rope part).
    pub kv_lora_rank: usize,
    /// Per head: query/key dimensions without and with rotary position, value dimension.
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head: usize,
    /// ε of the latent norms (the reference uses 1e-6 whatever `rms_norm_eps` says; llama.cpp
    /// uses `rms_norm_eps`: each dialect loads its own).
    pub latent_norm_eps: f32,
}

impl MlaConfig {
    /// Values a layer caches per token: the latent and the shared rotary key.
    pub fn cache_width(&self) -> usize {
        self.kv_lora_rank + self.qk_rope
    }
}

/// A multi-token-prediction head shipped with the checkpoint: one extra decoder layer (full
/// attention, the model's FFN kind) fed by the next token's embedding and the last hidden state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MtpConfig {
    pub n_layer: usize,
    pub ffn: FfnKind,
}

/// Activation of the gated FFN.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Activation {
    Silu,
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: gate ≤ limit, |up| ≤ limit, out = gate·σ(α·gate)·(up + 1).
    SwigluOai {
        alpha: f32,
        limit: f32,
    },
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
    /// The Gated DeltaNet layers' dimensions (hybrid models).
    pub delta_net: Option<DeltaNetConfig>,
    /// The latent-attention layers' dimensions.
    pub mla: Option<MlaConfig>,
    /// Attention heads have a learned sink logit in their softmax (gpt-oss).
    pub attn_sinks: bool,
    /// Per layer: its mixer and its FFN.
    pub layers: Vec<LayerSpec>,
    /// Attention score scale (1/sqrt(head_dim) unless the family says otherwise).
    pub attn_scale: f32,
    /// The attention's query projection carries a per-head output gate (`[q | gate]` per
    /// head); the output is multiplied by its sigmoid before the output projection.
    pub attn_output_gate: bool,
    /// The checkpoint stores RMSNorm weights as offsets from 1 (`(1 + w) · x̂`); the loader
    /// adds the 1. GGUF conversions store the sum already.
    pub norm_plus_one: bool,
    pub mtp: Option<MtpConfig>,
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
            .map(|l| if self.is_sparse(l) { (0..n_expert).map(|e| f(l, e)).collect() } else { Ok(Vec::new()) })
            .collect()
    }

    /// The layers whose FFN is routed experts, in order.
    pub fn sparse_layers(&self) -> Vec<usize> {
        (0..self.n_layer).filter(|&l| self.is_sparse(l)).collect()
    }

    /// Whether layer `l`'s FFN is routed experts.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.layers.get(l).is_some_and(|s| s.ffn == FfnKind::Moe)
    }

    /// Layer `l`'s sliding window, if it is an attention layer with one.
    pub fn window(&self, l: usize) -> Option<usize> {
        match self.layers.get(l)?.mixer {
            MixerKind::Attention { window } => window,
            MixerKind::GatedDeltaNet | MixerKind::Mla => None,
        }
    }

    /// Layers whose mixer is attention (they keep a KV cache).
    pub fn attention_layers(&self) -> usize {
        self.layers.iter().filter(|s| matches!(s.mixer, MixerKind::Attention { .. })).count()
    }

    /// (key, value) values one token adds to layer `l`'s cache: both `kv_dim` for attention,
    /// the latent and rotary key (and no separate value) for latent attention, none for a
    /// recurrent layer.
    pub fn kv_widths(&self, l: usize) -> (usize, usize) {
        match self.layers.get(l).map(|s| s.mixer) {
            Some(MixerKind::Attention { .. }) | None => (self.kv_dim(), self.kv_dim()),
            Some(MixerKind::Mla) => (self.mla.map_or(0, |m| m.cache_width()), 0),
            Some(MixerKind::GatedDeltaNet) => (0, 0),
        }
    }

    /// Bytes of a sequence's state at `ctx` positions: keys and values (f32) of the attention
    /// layers — a sliding-window layer holds at most two windows' worth between passes — and
    /// the fixed-size state of the recurrent ones (double-buffered).
    pub fn state_bytes(&self, ctx: usize) -> u64 {
        let kv: u64 = (0..self.n_layer)
            .map(|l| {
                let (k, v) = self.kv_widths(l);
                let rows = self.window(l).map_or(ctx, |w| ctx.min(2 * w));
                (k + v) as u64 * rows as u64 * 4
            })
            .sum();
        kv + self.recurrent_bytes()
    }

    /// Bytes of KV cache one more position adds, over the layers that keep every position
    /// (full attention, latent attention).
    pub fn kv_bytes_per_token(&self) -> u64 {
        (0..self.n_layer)
            .filter(|l| self.window(*l).is_none())
            .map(|l| self.kv_widths(l))
            .map(|(k, v)| 4 * (k + v) as u64)
            .sum()
    }

    /// Bytes the sliding-window layers hold at most (two windows each).
    pub fn window_bytes(&self) -> u64 {
        (0..self.n_layer)
            .filter_map(|l| self.window(l).map(|w| (l, w)))
            .map(|(l, w)| {
                let (k, v) = self.kv_widths(l);
                4 * (k + v) as u64 * 2 * w as u64
            })
            .sum()
    }

    /// Bytes of the recurrent layers' state (double-buffered).
    pub fn recurrent_bytes(&self) -> u64 {
        self.delta_net.map_or(0, |d| {
            let layers = self.layers.iter().filter(|s| s.mixer == MixerKind::GatedDeltaNet).count() as u64;
            let per = (d.conv_kernel as u64 - 1) * d.conv_dim() as u64 + (d.n_v_heads * d.d_k * d.d_v) as u64;
            layers * per * 4 * 2
        })
    }

    /// `layers` for `n` layers of one mixer and FFN, with the same window everywhere.
    pub fn uniform_layers(n: usize, mixer: MixerKind, ffn: FfnKind) -> Vec<LayerSpec> {
        vec![LayerSpec { mixer, ffn }; n]
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
        must(self.ff <= limits::FF, format!("the feed-forward width {} is beyond {}", self.ff, limits::FF))?;
        must(
            self.ff > 0 || !self.layers.iter().any(|s| s.ffn == FfnKind::Dense),
            "dense feed-forward layers without a width (intermediate_size / feed_forward_length)".into(),
        )?;
        must(
            self.max_position > 0 && self.max_position <= limits::CONTEXT,
            format!("the context length {} must be between 1 and {}", self.max_position, limits::CONTEXT),
        )?;
        must(
            self.layers.len() == self.n_layer,
            format!("{} layer kinds for {} layers", self.layers.len(), self.n_layer),
        )?;
        must((0..self.n_layer).all(|l| self.window(l) != Some(0)), "a sliding window of zero positions".into())?;
        if self.layers.iter().any(|s| s.mixer == MixerKind::Mla) {
            let m = self.mla.ok_or("latent-attention layers without their dimensions")?;
            let dims = [m.kv_lora_rank, m.qk_nope, m.qk_rope, m.v_head, m.q_lora_rank.unwrap_or(1)];
            must(
                dims.iter().all(|v| *v > 0 && *v <= limits::HIDDEN) && m.qk_rope.is_multiple_of(2),
                format!("latent attention dimensions {dims:?} (kv rank, nope, rope, value, q rank) out of range"),
            )?;
            must(
                self.rope.dim == m.qk_rope,
                format!("latent attention rotates {} dimensions, its rope part has {}", self.rope.dim, m.qk_rope),
            )?;
        }
        let has_delta = self.layers.iter().any(|s| s.mixer == MixerKind::GatedDeltaNet);
        match (&self.delta_net, has_delta) {
            (None, true) => return Err("Gated DeltaNet layers without their dimensions".into()),
            (Some(d), _) => {
                let dims = [d.n_k_heads, d.n_v_heads, d.d_k, d.d_v, d.conv_kernel];
                must(
                    dims.iter().all(|v| *v > 0 && *v <= limits::HEAD_DIM * 4),
                    format!("Gated DeltaNet dimensions {dims:?} (key heads, value heads, key dim, value dim, conv kernel) out of range"),
                )?;
                must(
                    d.n_v_heads.is_multiple_of(d.n_k_heads),
                    format!("{} value heads are not a multiple of {} key heads", d.n_v_heads, d.n_k_heads),
                )?;
            }
            _ => {}
        }
        must(
            self.rms_eps.is_finite() && self.rms_eps >= 0.0,
            format!("rms_norm_eps {} is not a number >= 0", self.rms_eps),
        )?;
        must(
            self.n_head.is_multiple_of(self.n_head_kv),
            format!("{} attention heads are not a multiple of {} key/value heads", self.n_head, self.n_head_kv),
        )?;
        must(
            self.rope.dim <= self.head_dim && self.rope.dim.is_multiple_of(2),
            format!("rotary dimension {} does not fit head_dim {}", self.rope.dim, self.head_dim),
        )?;
        self.rope.check()?;
        // Both clamp values into [−v, v]: a bound that is not a positive number has no such range.
        if let Some(c) = self.clip_qkv {
            must(c.is_finite() && c > 0.0, format!("clip_qkv {c} is not a positive number"))?;
        }
        if let Activation::SwigluOai { alpha, limit } = self.activation {
            must(
                limit.is_finite() && limit > 0.0 && alpha.is_finite(),
                format!("the clamped SwiGLU's limit {limit} (swiglu_limit) and alpha {alpha} are not a positive limit and a number"),
            )?;
        }
        must(
            self.attn_scale.is_finite() && self.attn_scale > 0.0,
            format!("the attention scale {} is not a positive number", self.attn_scale),
        )?;
        if let Some(r) = &self.rope_local {
            r.check().map_err(|e| format!("local layers' {e}"))?;
        }

        if let Some(m) = &self.moe {
            must(
                m.n_expert_used >= 1 && m.n_expert_used <= m.n_expert && m.n_expert <= limits::EXPERTS,
                format!("{} experts per token out of {} experts", m.n_expert_used, m.n_expert),
            )?;
            must(
                m.expert_ff > 0
                    && m.expert_ff <= limits::FF
                    && m.shared_expert_ff.is_none_or(|f| f > 0 && f <= limits::FF),
                format!("expert feed-forward width {} (shared {:?}) out of range", m.expert_ff, m.shared_expert_ff),
            )?;
            if let Gating::Grouped { n_group, topk_group, scale, .. } = m.gating {
                let per = m.n_expert / n_group.max(1);
                must(
                    n_group >= 1
                        && m.n_expert.is_multiple_of(n_group)
                        && (1..=n_group).contains(&topk_group)
                        && m.n_expert_used <= topk_group * per,
                    format!(
                        "expert groups: {} experts in {n_group} groups with {topk_group} kept cannot supply {} experts per token",
                        m.n_expert, m.n_expert_used
                    ),
                )?;
                must(
                    scale.is_finite() && scale > 0.0,
                    format!("routed scaling factor {scale} is not a positive number"),
                )?;
            }
        } else {
            must(!(0..self.n_layer).any(|l| self.is_sparse(l)), "sparse layers without an MoE config".into())?;
        }
        Ok(())
    }
}

//! Synthetic MoE checkpoints of real shapes, written as GGUF files that both sluice and
//! llama.cpp load. No real MoE weights can be downloaded where sluice is measured, so its
//! streaming benchmarks run on these.
//!
//! Two properties make them honest benchmark subjects:
//! * every block is zero-mean (block minimum chosen for it: Q4_K's `dmin = 7.5·d`, alternating
//!   signs for formats whose codes are not centred), so no common offset adds up layer after
//!   layer and collapses the routing onto a few experts;
//! * layer outputs stay small next to the token embedding, so routing is driven by the token:
//!   each token's experts are pseudo-random and uniform over the experts (reproducible, and
//!   pessimistic for a cache).
//!
//! Tensors are laid out as llama.cpp's converter writes each architecture (names, GGML shapes,
//! F32 norms, biases and routers), in the formats its quantizer would choose: where a format's
//! blocks do not divide a tensor's rows, the quantizer's fallback (`fit_rows`).

pub mod routing;

use crate::weights::ExpertPart;
pub use routing::{Routing, Skew};
use sluice_formats::gguf::{Array, Value};
use sluice_kernels::quant::blocks::{pack_scale_min_k4, put_f16};
use sluice_kernels::DType;

/// Metadata key naming how a synthetic model routes (what its cache figures can mean).
pub const ROUTING_KEY: &str = "sluice.synthetic.routing";

/// What to say beside hit rates measured on a synthetic model with `routing`.
pub fn routing_caveat(routing: &str) -> String {
    match routing {
        "uniform" => "synthetic model with uniform, token-driven routing: its hit rates and prefetch precision \
                      say nothing about a real model's expert locality"
            .into(),
        other if other.starts_with("skewed") => format!(
            "synthetic model with {other} routing: popularity skew, topics and persistence made to resemble published \
             measurements of real MoE routing; its cache figures are a model of real locality, not a measurement of it"
        ),
        other => format!("synthetic model ({other} routing): cache figures come from made-up routing"),
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthArch {
    Qwen3Moe,
    Olmoe,
    /// Qwen3-Next: Gated DeltaNet layers and gated attention, MoE with a shared expert.
    Qwen3Next,
    /// Qwen3.5-MoE: as Qwen3-Next, with separate DeltaNet projections (llama.cpp's layout).
    Qwen35Moe,
    /// gpt-oss: attention with q/k/v/o biases and sinks, sliding windows on even layers, YaRN;
    /// a biased router and biased experts in every layer.
    GptOss,
    /// GLM-4.5: q/k/v biases, rotary on half of each head, leading dense layers, then
    /// DeepSeek's router (`SynthGrouped`) and a shared expert.
    Glm4Moe,
    /// DeepSeek-V3: multi-head latent attention (`SynthMla`) in every layer, DeepSeek's
    /// router (`SynthGrouped`), leading dense layers.
    DeepseekV3,
}

impl SynthArch {
    pub fn gguf_name(self) -> &'static str {
        match self {
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::Olmoe => "olmoe",
            SynthArch::Qwen3Next => "qwen3next",
            SynthArch::Qwen35Moe => "qwen35moe",
            SynthArch::GptOss => "gpt-oss",
            SynthArch::Glm4Moe => "glm4moe",
            SynthArch::DeepseekV3 => "deepseek2",
        }
    }

    /// The architecture with GGUF name `name`.
    pub fn from_gguf_name(name: &str) -> Option<SynthArch> {
        [
            SynthArch::Qwen3Moe,
            SynthArch::Olmoe,
            SynthArch::Qwen3Next,
            SynthArch::Qwen35Moe,
            SynthArch::GptOss,
            SynthArch::Glm4Moe,
            SynthArch::DeepseekV3,
        ]
        .into_iter()
        .find(|a| a.gguf_name() == name)
    }

    pub fn is_hybrid(self) -> bool {
        matches!(self, SynthArch::Qwen3Next | SynthArch::Qwen35Moe)
    }

    /// Whether routing is DeepSeek's (leading dense layers, grouped router, shared experts).
    pub fn is_grouped(self) -> bool {
        matches!(self, SynthArch::Glm4Moe | SynthArch::DeepseekV3)
    }

    /// RMSNorm ε of the published models.
    fn rms_eps(self) -> f32 {
        match self {
            SynthArch::GptOss | SynthArch::Glm4Moe => 1e-5,
            _ => 1e-6,
        }
    }
}

/// The Gated DeltaNet part of a hybrid shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthDelta {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    /// Key and value head size (llama.cpp's hybrids need them equal).
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// Every this many layers one is full attention (the last of each group).
    pub full_every: usize,
    /// Rotated dimensions of the attention heads.
    pub rotary_dim: usize,
    /// Width of the shared expert.
    pub shared_ff: usize,
}

/// DeepSeek-style routing (DeepSeek-V3, GLM-4.5): the first `dense_layers` layers have a dense
/// FFN; the others a sigmoid router with a selection-only bias choosing within the best
/// `topk_group` of `n_group` expert groups, weights normalized and scaled, plus shared experts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SynthGrouped {
    pub dense_layers: usize,
    /// Width of the dense layers' FFN.
    pub dense_ff: usize,
    /// Shared experts, each as wide as a routed one.
    pub n_shared: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// The routed experts' weights are multiplied by this (`routed_scaling_factor`).
    pub scale: f32,
}

/// Multi-head latent attention (DeepSeek-V3). The spec's `head_dim` is a query/key head's
/// size (`qk_nope + qk_rope`) and `n_head_kv` is 1: every head attends over one latent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SynthMla {
    pub q_lora_rank: usize,
    pub kv_lora_rank: usize,
    /// The rotated part of each query/key head (the rest, `head_dim − qk_rope`, is not).
    pub qk_rope: usize,
    pub v_head: usize,
}

/// How tensors are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's Q4_K_M recipe: Q4_K, with Q6_K for the output, and for attn_v and
    /// ffn_down in the layers that recipe favours.
    Q4KM,
    /// The published gpt-oss files: routed experts in MXFP4, every other matrix in Q8_0.
    Mxfp4Moe,
    /// Every matrix in one format.
    Uniform(DType),
}

impl QuantMix {
    pub fn parse(s: &str) -> Option<QuantMix> {
        if s.eq_ignore_ascii_case("q4_k_m") {
            return Some(QuantMix::Q4KM);
        }
        if s.eq_ignore_ascii_case("mxfp4_moe") {
            return Some(QuantMix::Mxfp4Moe);
        }
        DType::from_name(s).filter(|d| *d != DType::Q8_K).map(QuantMix::Uniform)
    }

    pub fn name(self) -> String {
        match self {
            QuantMix::Q4KM => "Q4_K_M".into(),
            QuantMix::Mxfp4Moe => "MXFP4_MOE".into(),
            QuantMix::Uniform(d) => d.name().into(),
        }
    }
}

/// The format llama.cpp's quantizer writes where rows of `ne0` elements are not whole blocks
/// of `d`: Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0 (formats of 32-element blocks). Other
/// formats are kept (and `SynthSpec::validate` rejects what does not fit).
pub fn fit_rows(d: DType, ne0: u64) -> DType {
    if ne0.is_multiple_of(d.block_elems() as u64) {
        return d;
    }
    match d {
        DType::Q4_K => DType::Q5_0,
        DType::Q5_K => DType::Q5_1,
        DType::Q6_K => DType::Q8_0,
        other => other,
    }
}

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub name: String,
    pub arch: SynthArch,
    pub n_layer: usize,
    pub hidden: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub expert_ff: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub quant: QuantMix,
    pub seed: u64,
    /// How the routers route (see `routing`).
    pub routing: Routing,
    /// Hybrid shapes: the DeltaNet layers' dimensions.
    pub delta: Option<SynthDelta>,
    /// DeepSeek-style routing (GLM-4.5, DeepSeek-V3).
    pub grouped: Option<SynthGrouped>,
    /// Latent attention (DeepSeek-V3).
    pub mla: Option<SynthMla>,
}

/// gpt-oss's fixed settings: the sliding window of its even layers and its YaRN stretch.
const GPT_OSS_WINDOW: usize = 128;
const GPT_OSS_YARN: Yarn = Yarn { factor: 32.0, original: 4096, log_multiplier: None };
/// DeepSeek-V3's YaRN (mscale_all_dim 1: the converter's log multiplier 0.1).
const DEEPSEEK_YARN: Yarn = Yarn { factor: 40.0, original: 4096, log_multiplier: Some(0.1) };

struct Yarn {
    factor: f32,
    original: usize,
    log_multiplier: Option<f32>,
}

impl SynthSpec {
    /// A named real shape.
    pub fn named(name: &str) -> Option<SynthSpec> {
        let base = SynthSpec {
            name: name.to_string(),
            arch: SynthArch::Qwen3Moe,
            n_layer: 48,
            hidden: 2048,
            n_head: 32,
            n_head_kv: 4,
            head_dim: 128,
            n_expert: 128,
            n_expert_used: 8,
            expert_ff: 768,
            vocab: 151_936,
            context: 40_960,
            rope_theta: 1_000_000.0,
            quant: QuantMix::Q4KM,
            seed: 1,
            routing: Routing::Uniform,
            delta: None,
            grouped: None,
            mla: None,
        };
        let next = SynthSpec {
            arch: SynthArch::Qwen3Next,
            n_layer: 48,
            hidden: 2048,
            n_head: 16,
            n_head_kv: 2,
            head_dim: 256,
            n_expert: 512,
            n_expert_used: 10,
            expert_ff: 512,
            vocab: 151_936,
            context: 32_768,
            rope_theta: 10_000_000.0,
            delta: Some(SynthDelta {
                n_k_heads: 16,
                n_v_heads: 32,
                head_dim: 128,
                conv_kernel: 4,
                full_every: 4,
                rotary_dim: 64,
                shared_ff: 512,
            }),
            ..base.clone()
        };
        // gpt-oss-20b's published config (experts in MXFP4, the rest as ggml-org's GGUFs).
        let oss = SynthSpec {
            arch: SynthArch::GptOss,
            n_layer: 24,
            hidden: 2880,
            n_head: 64,
            n_head_kv: 8,
            head_dim: 64,
            n_expert: 32,
            n_expert_used: 4,
            expert_ff: 2880,
            vocab: 201_088,
            context: 131_072,
            rope_theta: 150_000.0,
            quant: QuantMix::Mxfp4Moe,
            ..base.clone()
        };
        Some(match name {
            "qwen3-30b-a3b" => base,
            "olmoe-1b-7b" => SynthSpec {
                arch: SynthArch::Olmoe,
                n_layer: 16,
                n_head: 16,
                n_head_kv: 16,
                n_expert: 64,
                expert_ff: 1024,
                vocab: 50_304,
                context: 4096,
                rope_theta: 10_000.0,
                ..base
            },
            // A small model for demos and tests: the Qwen3-MoE layout at toy size.
            "tiny-moe" => SynthSpec {
                n_layer: 8,
                hidden: 256,
                n_head: 8,
                n_head_kv: 2,
                head_dim: 32,
                n_expert: 64,
                n_expert_used: 4,
                expert_ff: 512,
                vocab: 512,
                context: 4096,
                ..base
            },
            // The README demo: about 0.6 GB of experts, quick to write, clearly larger than
            // the cache it runs with.
            "demo-moe" => SynthSpec {
                n_layer: 12,
                hidden: 512,
                n_head: 8,
                n_head_kv: 2,
                head_dim: 64,
                n_expert: 64,
                n_expert_used: 4,
                expert_ff: 768,
                vocab: 4096,
                context: 4096,
                ..base
            },
            // Qwen3-Next-80B-A3B's public config.json dimensions.
            "qwen3-next-80b-a3b" => next,
            // Qwen3.5-35B-A3B's (text model).
            "qwen3.5-35b-a3b" => SynthSpec {
                arch: SynthArch::Qwen35Moe,
                n_layer: 40,
                n_expert: 256,
                n_expert_used: 8,
                vocab: 248_320,
                ..next
            },
            "gpt-oss-20b" => oss,
            "gpt-oss-120b" => SynthSpec { n_layer: 36, n_expert: 128, ..oss },
            // GLM-4.5-Air without its multi-token-prediction layer.
            "glm-4.5-air" => SynthSpec {
                arch: SynthArch::Glm4Moe,
                n_layer: 46,
                hidden: 4096,
                n_head: 96,
                n_head_kv: 8,
                head_dim: 128,
                n_expert: 128,
                n_expert_used: 8,
                expert_ff: 1408,
                vocab: 151_552,
                context: 131_072,
                rope_theta: 1_000_000.0,
                grouped: Some(SynthGrouped {
                    dense_layers: 1,
                    dense_ff: 10_944,
                    n_shared: 1,
                    n_group: 1,
                    topk_group: 1,
                    scale: 1.0,
                }),
                ..base
            },
            // DeepSeek-V3 (671B) as llama.cpp converts it (no multi-token-prediction layer).
            "deepseek-v3" => SynthSpec {
                arch: SynthArch::DeepseekV3,
                n_layer: 61,
                hidden: 7168,
                n_head: 128,
                n_head_kv: 1,
                head_dim: 192,
                n_expert: 256,
                n_expert_used: 8,
                expert_ff: 2048,
                vocab: 129_280,
                context: 163_840,
                rope_theta: 10_000.0,
                grouped: Some(SynthGrouped {
                    dense_layers: 3,
                    dense_ff: 18_432,
                    n_shared: 1,
                    n_group: 8,
                    topk_group: 4,
                    scale: 2.5,
                }),
                mla: Some(SynthMla { q_lora_rank: 1536, kv_lora_rank: 512, qk_rope: 64, v_head: 128 }),
                ..base
            },
            _ => return None,
        })
    }

    pub const NAMES: [&'static str; 10] = [
        "qwen3-30b-a3b",
        "olmoe-1b-7b",
        "tiny-moe",
        "demo-moe",
        "qwen3-next-80b-a3b",
        "qwen3.5-35b-a3b",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "glm-4.5-air",
        "deepseek-v3",
    ];

    /// Whether layer `l` is a Gated DeltaNet layer (hybrid shapes).
    pub fn is_delta_layer(&self, l: usize) -> bool {
        self.delta.is_some_and(|d| !(l + 1).is_multiple_of(d.full_every))
    }

    /// Whether layer `l` has a dense FFN instead of routed experts.
    pub fn is_dense_layer(&self, l: usize) -> bool {
        self.grouped.is_some_and(|g| l < g.dense_layers)
    }

    /// Fits the family's structure to dimensions changed after `named` (the `--layers` and
    /// `--experts` shrinks): leading dense layers leave at least one routed layer, a token uses
    /// at most every expert, and the router's groups stay ones llama.cpp accepts (groups
    /// dividing the experts, fewer groups than experts, `0 < topk_group < n_group`, and enough
    /// experts in the chosen groups for a token's top k) — otherwise a single group. Returns
    /// a line for each change.
    pub fn conform(&mut self) -> Vec<String> {
        let mut notes = Vec::new();
        if self.n_expert > 0 && self.n_expert_used > self.n_expert {
            notes.push(format!("experts per token {} → {}", self.n_expert_used, self.n_expert));
            self.n_expert_used = self.n_expert;
        }
        let (ne, used, n_layer) = (self.n_expert, self.n_expert_used, self.n_layer);
        if let Some(g) = &mut self.grouped {
            let dense = g.dense_layers.min(n_layer.saturating_sub(1));
            if dense != g.dense_layers {
                notes.push(format!("leading dense layers {} → {dense}", g.dense_layers));
                g.dense_layers = dense;
            }
            if g.n_group > 1 && !groups_fit(ne, used, g.n_group, g.topk_group) {
                let (n, k) = (2..=g.n_group)
                    .rev()
                    .find_map(|n| (g.topk_group.min(n - 1)..n).find(|k| groups_fit(ne, used, n, *k)).map(|k| (n, k)))
                    .unwrap_or((1, 1));
                notes.push(format!("router groups {} (top {}) → {n} (top {k})", g.n_group, g.topk_group));
                g.n_group = n;
                g.topk_group = k;
            }
        }
        notes
    }

    pub fn validate(&self) -> Result<(), String> {
        if matches!(self.routing, Routing::Skewed(_)) && routing::model_span(self) == 0 {
            return Err(format!(
                "skewed routing needs a hidden size of at least two blocks of the embedding and output formats (hidden {}, {})",
                self.hidden,
                self.quant.name()
            ));
        }
        let pos = [self.n_layer, self.hidden, self.n_head, self.n_head_kv, self.head_dim, self.n_expert, self.vocab];
        if pos.contains(&0) || self.n_expert_used == 0 || self.expert_ff == 0 {
            return Err("every dimension must be positive".into());
        }
        if self.n_expert_used > self.n_expert {
            return Err(format!("{} experts per token out of {}", self.n_expert_used, self.n_expert));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(format!("{} heads are not a multiple of {} KV heads", self.n_head, self.n_head_kv));
        }
        if self.arch == SynthArch::Olmoe && self.n_head * self.head_dim != self.hidden {
            return Err("OLMoE needs heads × head_dim = hidden".into());
        }
        if self.arch.is_hybrid() != self.delta.is_some() {
            return Err("the hybrid architectures (and only they) need DeltaNet dimensions".into());
        }
        if self.arch.is_grouped() != self.grouped.is_some() {
            return Err("glm4moe and deepseek2 (and only they) need DeepSeek-style routing dimensions".into());
        }
        if (self.arch == SynthArch::DeepseekV3) != self.mla.is_some() {
            return Err("deepseek2 (and only it) needs latent-attention dimensions".into());
        }
        if !self.head_dim.is_multiple_of(2) || (self.arch == SynthArch::Glm4Moe && !self.head_dim.is_multiple_of(4)) {
            return Err(format!("head_dim {} leaves no whole rotary pairs", self.head_dim));
        }
        if let Some(d) = &self.delta {
            if [d.n_k_heads, d.n_v_heads, d.head_dim, d.conv_kernel, d.full_every, d.shared_ff].contains(&0) {
                return Err("every DeltaNet dimension must be positive".into());
            }
            if !d.n_v_heads.is_multiple_of(d.n_k_heads) {
                return Err(format!("{} value heads are not a multiple of {} key heads", d.n_v_heads, d.n_k_heads));
            }
            if d.rotary_dim > self.head_dim || !d.rotary_dim.is_multiple_of(2) {
                return Err(format!("rotary dimension {} does not fit head_dim {}", d.rotary_dim, self.head_dim));
            }
            if !(d.n_v_heads * d.head_dim).is_multiple_of(256) || !d.shared_ff.is_multiple_of(256) {
                return Err("the DeltaNet value width and the shared expert width must be multiples of 256".into());
            }
        }
        if let Some(g) = &self.grouped {
            if g.dense_layers >= self.n_layer {
                return Err(format!("{} leading dense layers leave none of {} routed", g.dense_layers, self.n_layer));
            }
            if g.dense_ff == 0 || g.n_shared == 0 || g.n_group == 0 || !(g.scale.is_finite() && g.scale > 0.0) {
                return Err("the dense width, shared experts, router groups and scale must be positive".into());
            }
            if g.n_group == 1 && g.topk_group != 1 {
                return Err("one router group means topk_group 1".into());
            }
            if g.n_group > 1 && !groups_fit(self.n_expert, self.n_expert_used, g.n_group, g.topk_group) {
                return Err(format!(
                    "{} router groups (top {}) do not fit {} experts top-{}: llama.cpp needs groups dividing the experts, fewer groups than experts and 0 < topk_group < groups, and the chosen groups must hold the top k",
                    g.n_group, g.topk_group, self.n_expert, self.n_expert_used
                ));
            }
        }
        if let Some(m) = &self.mla {
            if m.q_lora_rank == 0 || m.kv_lora_rank == 0 || m.v_head == 0 {
                return Err("every latent-attention dimension must be positive".into());
            }
            if m.qk_rope == 0 || !m.qk_rope.is_multiple_of(2) || m.qk_rope >= self.head_dim {
                return Err(format!(
                    "rotary part {} does not fit head_dim {} with a non-rotary part",
                    m.qk_rope, self.head_dim
                ));
            }
            if self.n_head_kv != 1 {
                return Err("latent attention has one KV head".into());
            }
        }
        if self.arch == SynthArch::GptOss && self.n_head_kv > self.n_head {
            return Err("more KV heads than heads".into());
        }
        for t in plan(self) {
            if !WRITABLE.contains(&t.dtype) {
                return Err(format!("tensor {}: random {} blocks cannot be written", t.name, t.dtype.name()));
            }
            let be = t.dtype.block_elems() as u64;
            if !t.dims[0].is_multiple_of(be) {
                return Err(format!(
                    "tensor {}: rows of {} values are not whole {} blocks of {be}",
                    t.name,
                    t.dims[0],
                    t.dtype.name()
                ));
            }
        }
        Ok(())
    }
}

/// The formats `fill_rows` makes random blocks of.
const WRITABLE: [DType; 12] = [
    DType::F32,
    DType::F16,
    DType::BF16,
    DType::Q4_0,
    DType::Q4_1,
    DType::Q5_0,
    DType::Q5_1,
    DType::Q8_0,
    DType::Q4_K,
    DType::Q5_K,
    DType::Q6_K,
    DType::MXFP4,
];

/// Whether `n_group` router groups choosing `topk_group` of them suit `n_expert` experts with
/// top-`used` routing, as llama.cpp requires (and with room for the top k in the chosen groups).
fn groups_fit(n_expert: usize, used: usize, n_group: usize, topk_group: usize) -> bool {
    n_group > 1
        && n_group < n_expert
        && n_expert.is_multiple_of(n_group)
        && topk_group > 0
        && topk_group < n_group
        && topk_group * (n_expert / n_group) >= used
}

/// What a tensor is, which decides its values.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Role {
    Norm,
    /// Every value the same.
    Fill(f32),
    Embedding,
    Output,
    Router,
    /// Random zero-mean values of the tensor's `sigma` (matrices, and biases and sinks).
    Matrix,
}

#[derive(Clone, Debug)]
pub struct TensorPlan {
    pub name: String,
    /// GGML order (`dims[0]` contiguous).
    pub dims: Vec<u64>,
    pub dtype: DType,
    pub role: Role,
    /// Standard deviation of the values.
    pub sigma: f32,
}

impl TensorPlan {
    pub fn bytes(&self) -> u64 {
        self.dims.iter().product::<u64>() / self.dtype.block_elems() as u64 * self.dtype.block_bytes() as u64
    }
}

fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
}

/// The format of a matrix: `role` names it for the Q4_K_M recipe, `expert` says whether it
/// holds routed experts, `ne0` is its row length.
fn matrix_dtype(s: &SynthSpec, layer: Option<usize>, role: &str, expert: bool, ne0: u64) -> DType {
    let d = match s.quant {
        QuantMix::Uniform(d) => d,
        QuantMix::Mxfp4Moe if expert => DType::MXFP4,
        QuantMix::Mxfp4Moe => DType::Q8_0,
        QuantMix::Q4KM => match (role, layer) {
            ("output", _) => DType::Q6_K,
            ("attn_v" | "ffn_down", Some(i)) if use_more_bits(i, s.n_layer) => DType::Q6_K,
            _ => DType::Q4_K,
        },
    };
    fit_rows(d, ne0)
}

/// Every tensor of the model, in file order.
pub fn plan(s: &SynthSpec) -> Vec<TensorPlan> {
    let (h, qd, kvd) = (s.hidden as u64, (s.n_head * s.head_dim) as u64, (s.n_head_kv * s.head_dim) as u64);
    let w_sigma = 0.5 / (s.hidden as f32).sqrt();
    let mat = |layer: Option<usize>, role: &str, ne0: u64| matrix_dtype(s, layer, role, false, ne0);
    let mut v = vec![TensorPlan {
        name: "token_embd.weight".into(),
        dims: vec![h, s.vocab as u64],
        dtype: mat(None, "embd", h),
        role: Role::Embedding,
        sigma: 1.0,
    }];
    let t = |name: String, dims: Vec<u64>, dtype, role, sigma| TensorPlan { name, dims, dtype, role, sigma };
    for l in 0..s.n_layer {
        let b = |n: &str| format!("blk.{l}.{n}");
        v.push(t(b("attn_norm.weight"), vec![h], DType::F32, Role::Norm, 0.0));
        if matches!(s.arch, SynthArch::GptOss | SynthArch::Glm4Moe | SynthArch::DeepseekV3) {
            grouped_or_oss_layer(s, l, &mut v);
            continue;
        }
        if s.is_delta_layer(l) {
            delta_tensors(s, l, &mut v, &|role, ne0| mat(Some(l), role, ne0), w_sigma);
        } else {
            // Hybrids gate the attention output: each head's q projection is [q | gate].
            let q_rows = if s.arch.is_hybrid() { 2 * qd } else { qd };
            v.push(t(b("attn_q.weight"), vec![h, q_rows], mat(Some(l), "attn_q", h), Role::Matrix, w_sigma));
            v.push(t(b("attn_k.weight"), vec![h, kvd], mat(Some(l), "attn_k", h), Role::Matrix, w_sigma));
            v.push(t(b("attn_v.weight"), vec![h, kvd], mat(Some(l), "attn_v", h), Role::Matrix, w_sigma));
            // Attention averages over the same context for every position; at full weight its
            // share of the residual grows with depth until late layers route most tokens alike
            // (measured: expert-usage entropy fell to 0.71 of uniform by layer 48). A quarter
            // keeps routing driven by the token at every depth (≥ 0.99 of uniform).
            v.push(t(b("attn_output.weight"), vec![qd, h], mat(Some(l), "attn_o", qd), Role::Matrix, w_sigma * 0.25));
            let (qn, kn) = match s.arch {
                SynthArch::Olmoe => (qd, kvd),
                _ => (s.head_dim as u64, s.head_dim as u64),
            };
            v.push(t(b("attn_q_norm.weight"), vec![qn], DType::F32, Role::Norm, 0.0));
            v.push(t(b("attn_k_norm.weight"), vec![kn], DType::F32, Role::Norm, 0.0));
        }
        if let Some(d) = &s.delta {
            // The hybrids' converter files the pre-FFN norm as `post_attention_norm`.
            v.push(t(b("post_attention_norm.weight"), vec![h], DType::F32, Role::Norm, 0.0));
            let sf = d.shared_ff as u64;
            v.push(t(
                b("ffn_gate_inp_shexp.weight"),
                vec![h, 1],
                DType::F32,
                Role::Router,
                1.0 / (s.hidden as f32).sqrt(),
            ));
            v.push(t(b("ffn_gate_shexp.weight"), vec![h, sf], mat(Some(l), "ffn_gate", h), Role::Matrix, w_sigma));
            v.push(t(b("ffn_up_shexp.weight"), vec![h, sf], mat(Some(l), "ffn_gate", h), Role::Matrix, w_sigma));
            let down = matrix_dtype(s, Some(l), "ffn_down", false, sf);
            v.push(t(b("ffn_down_shexp.weight"), vec![sf, h], down, Role::Matrix, w_sigma));
        }
        if s.delta.is_none() {
            v.push(t(b("ffn_norm.weight"), vec![h], DType::F32, Role::Norm, 0.0));
        }
        v.push(t(
            b("ffn_gate_inp.weight"),
            vec![h, s.n_expert as u64],
            DType::F32,
            Role::Router,
            2.0 / (s.hidden as f32).sqrt(),
        ));
        expert_tensors(s, l, &mut v, w_sigma);
    }
    v.push(t("output_norm.weight".into(), vec![h], DType::F32, Role::Norm, 0.0));
    v.push(t(
        "output.weight".into(),
        vec![h, s.vocab as u64],
        mat(None, "output", h),
        Role::Output,
        2.0 / (s.hidden as f32).sqrt(),
    ));
    // GGUF stores tensors in the order they are declared; llama.cpp does not mind.
    v
}

/// Layer `l`'s stacked routed experts (`ffn_{gate,up,down}_exps`).
fn expert_tensors(s: &SynthSpec, l: usize, v: &mut Vec<TensorPlan>, w_sigma: f32) {
    let (h, ff, e) = (s.hidden as u64, s.expert_ff as u64, s.n_expert as u64);
    for part in ExpertPart::ALL {
        let name = crate::families::gguf_names::experts(part, l);
        let (dims, role) = match part {
            ExpertPart::Down => (vec![ff, h, e], "ffn_down"),
            _ => (vec![h, ff, e], "ffn_gate"),
        };
        let dtype = matrix_dtype(s, Some(l), role, true, dims[0]);
        v.push(TensorPlan { name, dims, dtype, role: Role::Matrix, sigma: w_sigma });
    }
}

/// A layer after its `attn_norm` in the gpt-oss, GLM-4.5 and DeepSeek-V3 layouts of llama.cpp's
/// converter (gpt-oss and GLM file the pre-FFN norm as `post_attention_norm`).
fn grouped_or_oss_layer(s: &SynthSpec, l: usize, v: &mut Vec<TensorPlan>) {
    let (h, hd) = (s.hidden as u64, s.head_dim as u64);
    let (qd, kvd) = (s.n_head as u64 * hd, s.n_head_kv as u64 * hd);
    let w_sigma = 0.5 / (s.hidden as f32).sqrt();
    // Biases small beside the products they are added to; the router's and the selection
    // bias small enough to leave routing uniform.
    let bias_sigma = w_sigma;
    let b = |n: &str| format!("blk.{l}.{n}");
    let mat = |name: &str, dims: Vec<u64>, role: &str, sigma: f32| {
        let dtype = matrix_dtype(s, Some(l), role, false, dims[0]);
        TensorPlan { name: b(name), dims, dtype, role: Role::Matrix, sigma }
    };
    let f32v = |name: &str, dims: Vec<u64>, role: Role, sigma: f32| TensorPlan {
        name: b(name),
        dims,
        dtype: DType::F32,
        role,
        sigma,
    };
    match (s.arch, s.mla) {
        (SynthArch::DeepseekV3, Some(m)) => {
            let (qr, r, dr, dv) = (m.q_lora_rank as u64, m.kv_lora_rank as u64, m.qk_rope as u64, m.v_head as u64);
            let (dn, nh) = (hd - dr, s.n_head as u64);
            let fan = |n: u64| 0.5 / (n as f32).sqrt();
            v.push(mat("attn_q_a.weight", vec![h, qr], "attn_q", w_sigma));
            v.push(f32v("attn_q_a_norm.weight", vec![qr], Role::Norm, 0.0));
            v.push(mat("attn_q_b.weight", vec![qr, qd], "attn_q", fan(qr)));
            v.push(mat("attn_kv_a_mqa.weight", vec![h, r + dr], "attn_k", w_sigma));
            v.push(f32v("attn_kv_a_norm.weight", vec![r], Role::Norm, 0.0));
            // Per head W_UKᵀ (rank rows of nope values) and W_UV (v_head rows of rank values).
            v.push(mat("attn_k_b.weight", vec![dn, r, nh], "attn_k", fan(dn)));
            v.push(mat("attn_v_b.weight", vec![r, dv, nh], "attn_v_b", fan(r)));
            // A quarter weight, as for the other families' attention output.
            v.push(mat("attn_output.weight", vec![nh * dv, h], "attn_o", w_sigma * 0.25));
            v.push(f32v("ffn_norm.weight", vec![h], Role::Norm, 0.0));
        }
        _ => {
            let oss = s.arch == SynthArch::GptOss;
            v.push(mat("attn_q.weight", vec![h, qd], "attn_q", w_sigma));
            v.push(f32v("attn_q.bias", vec![qd], Role::Matrix, bias_sigma));
            v.push(mat("attn_k.weight", vec![h, kvd], "attn_k", w_sigma));
            v.push(f32v("attn_k.bias", vec![kvd], Role::Matrix, bias_sigma));
            v.push(mat("attn_v.weight", vec![h, kvd], "attn_v", w_sigma));
            v.push(f32v("attn_v.bias", vec![kvd], Role::Matrix, bias_sigma));
            v.push(mat("attn_output.weight", vec![qd, h], "attn_o", w_sigma * 0.25));
            if oss {
                v.push(f32v("attn_output.bias", vec![h], Role::Matrix, bias_sigma));
                // Sink logits: the share of attention that goes nowhere.
                v.push(f32v("attn_sinks.weight", vec![s.n_head as u64], Role::Matrix, 1.0));
            }
            v.push(f32v("post_attention_norm.weight", vec![h], Role::Norm, 0.0));
        }
    }
    let ff = s.expert_ff as u64;
    match s.grouped {
        Some(g) if l < g.dense_layers => {
            let df = g.dense_ff as u64;
            v.push(mat("ffn_gate.weight", vec![h, df], "ffn_gate", w_sigma));
            v.push(mat("ffn_up.weight", vec![h, df], "ffn_gate", w_sigma));
            v.push(mat("ffn_down.weight", vec![df, h], "ffn_down", w_sigma));
        }
        Some(g) => {
            v.push(f32v(
                "ffn_gate_inp.weight",
                vec![h, s.n_expert as u64],
                Role::Router,
                2.0 / (s.hidden as f32).sqrt(),
            ));
            v.push(f32v("exp_probs_b.bias", vec![s.n_expert as u64], Role::Matrix, 0.01));
            expert_tensors(s, l, v, w_sigma);
            let sf = ff * g.n_shared as u64;
            v.push(mat("ffn_gate_shexp.weight", vec![h, sf], "ffn_gate", w_sigma));
            v.push(mat("ffn_up_shexp.weight", vec![h, sf], "ffn_gate", w_sigma));
            v.push(mat("ffn_down_shexp.weight", vec![sf, h], "ffn_down", w_sigma));
        }
        None => {
            v.push(f32v(
                "ffn_gate_inp.weight",
                vec![h, s.n_expert as u64],
                Role::Router,
                2.0 / (s.hidden as f32).sqrt(),
            ));
            v.push(f32v("ffn_gate_inp.bias", vec![s.n_expert as u64], Role::Matrix, 0.02));
            expert_tensors(s, l, v, w_sigma);
            let e = s.n_expert as u64;
            v.push(f32v("ffn_gate_exps.bias", vec![ff, e], Role::Matrix, bias_sigma));
            v.push(f32v("ffn_up_exps.bias", vec![ff, e], Role::Matrix, bias_sigma));
            v.push(f32v("ffn_down_exps.bias", vec![h, e], Role::Matrix, bias_sigma));
        }
    }
}

/// A Gated DeltaNet layer's tensors in llama.cpp's layout.
fn delta_tensors(s: &SynthSpec, l: usize, v: &mut Vec<TensorPlan>, mat: &dyn Fn(&str, u64) -> DType, w_sigma: f32) {
    let d = s.delta.expect("a hybrid shape");
    let (h, nv) = (s.hidden as u64, d.n_v_heads as u64);
    let (kd, vd) = ((d.n_k_heads * d.head_dim) as u64, (d.n_v_heads * d.head_dim) as u64);
    let b = |n: &str| format!("blk.{l}.{n}");
    let t = |name: String, dims: Vec<u64>, dtype, role, sigma| TensorPlan { name, dims, dtype, role, sigma };
    v.push(t(b("attn_qkv.weight"), vec![h, 2 * kd + vd], mat("attn_qkv", h), Role::Matrix, w_sigma));
    v.push(t(b("attn_gate.weight"), vec![h, vd], mat("attn_gate", h), Role::Matrix, w_sigma));
    match s.arch {
        SynthArch::Qwen3Next => v.push(t(b("ssm_ba.weight"), vec![h, 2 * nv], DType::F32, Role::Matrix, w_sigma)),
        _ => {
            v.push(t(b("ssm_beta.weight"), vec![h, nv], DType::F32, Role::Matrix, w_sigma));
            v.push(t(b("ssm_alpha.weight"), vec![h, nv], DType::F32, Role::Matrix, w_sigma));
        }
    }
    v.push(t(b("ssm_conv1d.weight"), vec![d.conv_kernel as u64, 2 * kd + vd], DType::F32, Role::Matrix, 0.5));
    // Decay exp(A · softplus(a + dt_bias)) near exp(−0.5 · 0.7): memory of a few tokens.
    v.push(t(b("ssm_dt.bias"), vec![nv], DType::F32, Role::Fill(0.0), 0.0));
    v.push(t(b("ssm_a"), vec![nv], DType::F32, Role::Fill(-0.5), 0.0));
    v.push(t(b("ssm_norm.weight"), vec![d.head_dim as u64], DType::F32, Role::Norm, 0.0));
    // A quarter weight, like attention's output, keeps routing token-driven.
    v.push(t(b("ssm_out.weight"), vec![vd, h], mat("attn_o", vd), Role::Matrix, w_sigma * 0.25));
}

/// The model's metadata (without tokenizer keys).
pub fn metadata(s: &SynthSpec) -> Vec<(String, Value)> {
    let a = s.arch.gguf_name();
    let k = |n: &str| format!("{a}.{n}");
    let u = |v: usize| Value::U32(v as u32);
    let mut m = vec![
        ("general.architecture".to_string(), Value::String(a.into())),
        ("general.name".to_string(), Value::String(format!("sluice synthetic {} {}", s.name, s.quant.name()))),
        ("general.quantization_version".to_string(), Value::U32(2)),
        (ROUTING_KEY.to_string(), Value::String(s.routing.name())),
        (k("block_count"), u(s.n_layer)),
        (k("context_length"), u(s.context)),
        (k("embedding_length"), u(s.hidden)),
        (k("attention.head_count"), u(s.n_head)),
        (k("attention.head_count_kv"), u(s.n_head_kv)),
        // deepseek2's key and value lengths are its latent's (576, 512 for DeepSeek-V3).
        (k("attention.key_length"), u(s.mla.map_or(s.head_dim, |m| m.kv_lora_rank + m.qk_rope))),
        (k("attention.value_length"), u(s.mla.map_or(s.head_dim, |m| m.kv_lora_rank))),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(s.arch.rms_eps())),
        (k("rope.freq_base"), Value::F32(s.rope_theta)),
        (k("expert_count"), u(s.n_expert)),
        (k("expert_used_count"), u(s.n_expert_used)),
    ];
    match s.arch {
        SynthArch::Qwen3Moe => {
            m.push((k("feed_forward_length"), u(s.expert_ff * 8)));
            m.push((k("expert_feed_forward_length"), u(s.expert_ff)));
        }
        SynthArch::Olmoe => m.push((k("feed_forward_length"), u(s.expert_ff))),
        SynthArch::Qwen3Next | SynthArch::Qwen35Moe => {
            let d = s.delta.expect("a hybrid shape");
            m.push((k("feed_forward_length"), u(s.expert_ff * 10)));
            m.push((k("expert_feed_forward_length"), u(s.expert_ff)));
            m.push((k("expert_shared_feed_forward_length"), u(d.shared_ff)));
            m.push((k("rope.dimension_count"), u(d.rotary_dim)));
            m.push((k("ssm.conv_kernel"), u(d.conv_kernel)));
            m.push((k("ssm.state_size"), u(d.head_dim)));
            m.push((k("ssm.group_count"), u(d.n_k_heads)));
            m.push((k("ssm.time_step_rank"), u(d.n_v_heads)));
            m.push((k("ssm.inner_size"), u(d.n_v_heads * d.head_dim)));
            m.push((k("full_attention_interval"), u(d.full_every)));
            if s.arch == SynthArch::Qwen35Moe {
                // llama.cpp's qwen35 loaders require the (text-trivial) multimodal sections.
                let sec = d.rotary_dim as i32 / 2;
                let sections = vec![(sec + 2) / 3, (sec + 1) / 3, sec / 3, 0];
                m.push((k("rope.dimension_sections"), Value::Array(Array::I32(sections))));
            }
        }
        SynthArch::GptOss => {
            m.push((k("feed_forward_length"), u(s.expert_ff)));
            m.push((k("expert_feed_forward_length"), u(s.expert_ff)));
            m.push((k("attention.sliding_window"), u(GPT_OSS_WINDOW)));
            yarn_keys(&mut m, &k, &GPT_OSS_YARN);
        }
        SynthArch::Glm4Moe | SynthArch::DeepseekV3 => {
            let g = s.grouped.expect("a grouped shape");
            m.push((k("feed_forward_length"), u(g.dense_ff)));
            m.push((k("expert_feed_forward_length"), u(s.expert_ff)));
            m.push((k("expert_shared_count"), u(g.n_shared)));
            m.push((k("leading_dense_block_count"), u(g.dense_layers)));
            m.push((k("expert_group_count"), u(g.n_group)));
            m.push((k("expert_group_used_count"), u(g.topk_group)));
            // Sigmoid scores, normalized top k, scaled.
            m.push((k("expert_gating_func"), u(2)));
            m.push((k("expert_weights_norm"), Value::Bool(true)));
            m.push((k("expert_weights_scale"), Value::F32(g.scale)));
            match s.mla {
                Some(ml) => {
                    m.push((k("vocab_size"), u(s.vocab)));
                    m.push((k("attention.q_lora_rank"), u(ml.q_lora_rank)));
                    m.push((k("attention.kv_lora_rank"), u(ml.kv_lora_rank)));
                    // The per-head sizes; their presence marks the absorbed (split k_b/v_b) layout.
                    m.push((k("attention.key_length_mla"), u(s.head_dim)));
                    m.push((k("attention.value_length_mla"), u(ml.v_head)));
                    m.push((k("rope.dimension_count"), u(ml.qk_rope)));
                    yarn_keys(&mut m, &k, &DEEPSEEK_YARN);
                }
                None => {
                    // Rotary on half of each head, as every GLM-4.5 model; no MTP layer.
                    m.push((k("rope.dimension_count"), u(s.head_dim / 2)));
                    m.push((k("nextn_predict_layers"), u(0)));
                }
            }
        }
    }
    m
}

/// YaRN's keys as llama.cpp's converter writes them.
fn yarn_keys(m: &mut Vec<(String, Value)>, k: &dyn Fn(&str) -> String, y: &Yarn) {
    m.push((k("rope.scaling.type"), Value::String("yarn".into())));
    m.push((k("rope.scaling.factor"), Value::F32(y.factor)));
    m.push((k("rope.scaling.original_context_length"), Value::U32(y.original as u32)));
    m.push((k("rope.scaling.yarn_beta_fast"), Value::F32(32.0)));
    m.push((k("rope.scaling.yarn_beta_slow"), Value::F32(1.0)));
    if let Some(lm) = y.log_multiplier {
        m.push((k("rope.scaling.yarn_log_multiplier"), Value::F32(lm)));
    }
}

/// A byte-level tokenizer for models made without `--tokenizer-from`: the 256 byte tokens,
/// an end-of-text token, and unused fillers up to `vocab` (llama.cpp loads it as well).
pub fn builtin_tokenizer(vocab: usize) -> Vec<(String, Value)> {
    let mut tokens: Vec<String> = byte_level_alphabet();
    let mut types: Vec<i32> = vec![1; tokens.len()];
    tokens.push("<|endoftext|>".into());
    types.push(3);
    while tokens.len() < vocab {
        tokens.push(format!("<unused{}>", tokens.len()));
        types.push(5);
    }
    tokens.truncate(vocab);
    types.truncate(vocab);
    let eos = 256.min(vocab as u32 - 1);
    vec![
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("default".into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.token_type".into(), Value::Array(Array::I32(types))),
        ("tokenizer.ggml.merges".into(), Value::Array(Array::String(Vec::new()))),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ]
}

/// GPT-2's byte → printable character table, as token strings.
fn byte_level_alphabet() -> Vec<String> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut out = vec![String::new(); 256];
    let mut extra = 0;
    for b in 0u32..256 {
        let c = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out[b as usize] = char::from_u32(c).expect("valid char").to_string();
    }
    printable.clear();
    out
}

/// Writes the model described by `s` (with tokenizer metadata `tok`) to `out` as GGUF,
/// calling `progress(bytes)` as tensor data is written. Returns the bytes written.
pub fn write_model(
    s: &SynthSpec,
    tok: Vec<(String, Value)>,
    out: &mut dyn std::io::Write,
    mut progress: impl FnMut(u64),
) -> std::io::Result<u64> {
    let tensors = plan(s);
    let mut w = sluice_formats::gguf::GgufWriter::default();
    for (k, v) in metadata(s).into_iter().chain(tok) {
        w.add(&k, v);
    }
    for t in &tensors {
        w.add_tensor(&t.name, t.dims.clone(), t.dtype);
    }
    let mut buf = Vec::with_capacity(16 << 20);
    w.write(out, |i, o| {
        let t = &tensors[i];
        let rows: usize = t.dims[1..].iter().product::<u64>() as usize;
        let row_bytes = (t.bytes() / rows as u64).max(1) as usize;
        let step = ((8 << 20) / row_bytes).max(1);
        let mut rng = FastRng::new(s.seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
        let mut r = 0;
        while r < rows {
            let n = step.min(rows - r);
            buf.clear();
            fill_rows(t, &mut rng, n, &mut buf);
            if let Routing::Skewed(k) = &s.routing {
                if routing::shapes(t) {
                    routing::reshape_rows(s, k, t, r, n, &mut buf);
                }
            }
            o.write_all(&buf)?;
            progress(buf.len() as u64);
            r += n;
        }
        Ok(())
    })
}

/// wyrand: a fast, good-enough generator for weights.
pub struct FastRng(u64);

impl FastRng {
    pub fn new(seed: u64) -> FastRng {
        FastRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }

    #[inline(always)]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xA076_1D64_78BD_642F);
        let t = (self.0 as u128).wrapping_mul((self.0 ^ 0xE703_7ED1_A0B4_28DB) as u128);
        ((t >> 64) ^ t) as u64
    }

    /// Roughly normal with unit variance (sum of four uniforms, rescaled).
    #[inline(always)]
    pub fn normalish(&mut self) -> f32 {
        let r = self.next_u64();
        let s: u32 = (r & 0xFFFF) as u32 + ((r >> 16) & 0xFFFF) as u32 + ((r >> 32) & 0xFFFF) as u32 + (r >> 48) as u32;
        // Four uniforms on [0, 65535]: mean 131070, variance 4 · 65536² / 12.
        (s as f32 - 131_070.0) / 37_837.0
    }

    fn fill(&mut self, b: &mut [u8]) {
        for c in b.chunks_mut(8) {
            let r = self.next_u64().to_le_bytes();
            c.copy_from_slice(&r[..c.len()]);
        }
    }
}

/// Writes `rows` rows of tensor `t` (each `dims[0]` elements) as random zero-mean data.
pub fn fill_rows(t: &TensorPlan, rng: &mut FastRng, rows: usize, out: &mut Vec<u8>) {
    let cols = t.dims[0] as usize;
    let n = rows * cols;
    match t.role {
        Role::Norm | Role::Fill(_) => {
            let v = if let Role::Fill(v) = t.role { v } else { 1.0 };
            for _ in 0..n {
                out.extend_from_slice(&v.to_le_bytes());
            }
            return;
        }
        _ if t.dtype.is_float() => {
            for _ in 0..n {
                let v = rng.normalish() * t.sigma;
                match t.dtype {
                    DType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                    DType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_bits().to_le_bytes()),
                    _ => out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()),
                }
            }
            return;
        }
        _ => {}
    }
    let (be, bb) = (t.dtype.block_elems(), t.dtype.block_bytes());
    let start = out.len();
    out.resize(start + n / be * bb, 0);
    let sigma = t.sigma;
    let mx = (t.dtype == DType::MXFP4).then(|| mxfp4_exponents(sigma));
    for (i, b) in out[start..].chunks_exact_mut(bb).enumerate() {
        rng.fill(b);
        let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
        match t.dtype {
            // Codes uniform: std of (q − 7.5) is 4.61, of Q8_0's q is 73.3.
            DType::Q4_0 => put_f16(b, 0, sign * sigma / 4.61),
            DType::Q5_0 => put_f16(b, 0, sign * sigma / 9.23),
            DType::Q8_0 => {
                put_f16(b, 0, sigma / 73.3);
                for q in &mut b[2..34] {
                    if *q == 0x80 {
                        *q = 0x81; // keep codes in −127..127, symmetric
                    }
                }
            }
            DType::Q4_1 | DType::Q5_1 => {
                let (d, levels) = if t.dtype == DType::Q4_1 { (sigma / 4.61, 7.5) } else { (sigma / 9.23, 15.5) };
                put_f16(b, 0, d);
                put_f16(b, 2, -d * levels);
            }
            DType::Q4_K | DType::Q5_K => {
                // Every sub-block: scale = min = 32, dmin = levels·d, so x = 32·d·(q − levels).
                let (spread, levels) = if t.dtype == DType::Q4_K { (4.61, 7.5) } else { (9.23, 15.5) };
                let d = sigma / (32.0 * spread);
                put_f16(b, 0, d);
                put_f16(b, 2, d * levels);
                b[4..16].copy_from_slice(&pack_scale_min_k4(&[32; 8], &[32; 8]));
            }
            DType::Q6_K => {
                // Scales alternate in sign so the −0.5 mean of (q − 32) cancels.
                let d = sigma / (32.0 * 18.47);
                for g in 0..16 {
                    b[192 + g] = if g % 2 == 0 { 32u8 } else { (-32i8) as u8 };
                }
                put_f16(b, 208, d);
            }
            DType::MXFP4 => {
                // Random codes (E2M1 is symmetric: zero-mean) under a random exponent of the
                // two around the spread asked for, in the proportion that gives exactly it.
                let (e0, p_up) = mx.expect("set for MXFP4");
                b[0] = if (b[0] as f32 + 0.5) / 256.0 < p_up { e0 + 1 } else { e0 };
            }
            // Refused by `SynthSpec::validate`.
            _ => unreachable!("no random {} blocks", t.dtype.name()),
        }
    }
}

/// MXFP4 block exponents for values of spread `sigma`: E8M0 `e0` or `e0 + 1`, the latter with
/// the returned probability. A block's values are the doubled E2M1 codes (RMS 5.85 over
/// uniform codes) times 2^(e − 128); exponents stay in 1..=254 (0xFF is not a number).
fn mxfp4_exponents(sigma: f32) -> (u8, f32) {
    const CODE_RMS: f64 = 5.852_349_955_359_813; // √(274 / 8)
    let x = (sigma.max(1e-30) as f64 / CODE_RMS).log2() + 128.0;
    let e0 = x.floor().clamp(1.0, 253.0);
    let p_up = ((4f64.powf(x - e0) - 1.0) / 3.0).clamp(0.0, 1.0);
    (e0 as u8, p_up as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_blocks_are_zero_mean_with_the_asked_spread() {
        for dtype in
            [DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::MXFP4, DType::BF16]
        {
            let t = TensorPlan { name: "x".into(), dims: vec![256, 64], dtype, role: Role::Matrix, sigma: 0.1 };
            let mut rng = FastRng::new(7);
            let mut bytes = Vec::new();
            fill_rows(&t, &mut rng, 64, &mut bytes);
            assert_eq!(bytes.len() as u64, t.bytes(), "{dtype}");
            let mut vals = vec![0f32; 256 * 64];
            for (r, row) in vals.chunks_exact_mut(256).enumerate() {
                let rb = dtype.row_bytes(256).unwrap();
                sluice_kernels::quant::dequantize_row(dtype, &bytes[r * rb..(r + 1) * rb], row).unwrap();
            }
            let n = vals.len() as f64;
            let mean = vals.iter().map(|v| *v as f64).sum::<f64>() / n;
            let std = (vals.iter().map(|v| (*v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
            assert!(mean.abs() < 0.004, "{dtype}: mean {mean}");
            assert!((std - 0.1).abs() < 0.02, "{dtype}: std {std}");
        }
    }

    #[test]
    fn named_shapes_are_valid_and_sized_like_the_real_ones() {
        for n in SynthSpec::NAMES {
            SynthSpec::named(n).unwrap().validate().unwrap();
        }
        let q = SynthSpec::named("qwen3-30b-a3b").unwrap();
        let bytes: u64 = plan(&q).iter().map(|t| t.bytes()).sum();
        // The real Qwen3-30B-A3B Q4_K_M is about 17-18 GB.
        assert!(bytes > 16_000_000_000 && bytes < 19_000_000_000, "{bytes}");
        // Qwen3-Next-80B-A3B at Q4_K_M: about 48 GB; Qwen3.5-35B-A3B about 21 GB.
        let n: u64 = plan(&SynthSpec::named("qwen3-next-80b-a3b").unwrap()).iter().map(|t| t.bytes()).sum();
        assert!(n > 44_000_000_000 && n < 52_000_000_000, "{n}");
        let q35: u64 = plan(&SynthSpec::named("qwen3.5-35b-a3b").unwrap()).iter().map(|t| t.bytes()).sum();
        assert!(q35 > 18_000_000_000 && q35 < 24_000_000_000, "{q35}");
    }

    fn size(s: &SynthSpec) -> u64 {
        plan(s).iter().map(|t| t.bytes()).sum()
    }

    #[test]
    fn new_named_shapes_are_sized_like_the_published_files() {
        // (shape, bytes of the published GGUF, its formats): ggml-org's gpt-oss-20b MXFP4 file
        // is 12.1 GB and gpt-oss-120b's 63.4 GB (MXFP4 experts, Q8_0 elsewhere); GLM-4.5-Air
        // and DeepSeek-V3 at Q4_K_M are about 73 GB (with its MTP layer) and 404 GB.
        // Written here: 12.10, 63.37, 70.44 and 404.49 GB.
        for (name, real) in
            [("gpt-oss-20b", 12.1e9), ("gpt-oss-120b", 63.4e9), ("glm-4.5-air", 73.0e9), ("deepseek-v3", 404.0e9)]
        {
            let s = SynthSpec::named(name).unwrap();
            s.validate().unwrap();
            let b = size(&s) as f64;
            assert!((b / real - 1.0).abs() < 0.04, "{name}: {b} bytes against the published {real}");
        }
        // The formats the published files use.
        let oss = plan(&SynthSpec::named("gpt-oss-120b").unwrap());
        let dtype = |n: &str| oss.iter().find(|t| t.name == n).unwrap().dtype;
        assert_eq!(dtype("blk.0.ffn_down_exps.weight"), DType::MXFP4);
        assert_eq!(dtype("blk.0.attn_q.weight"), DType::Q8_0);
        assert_eq!(dtype("output.weight"), DType::Q8_0);
        for n in ["blk.0.attn_sinks.weight", "blk.0.ffn_gate_inp.bias", "blk.0.ffn_up_exps.bias", "blk.0.attn_q.bias"] {
            assert_eq!(dtype(n), DType::F32, "{n}");
        }
        // The shrinks the help suggests for a disk of about 60 GB.
        let ds = |layers: usize, experts: usize| {
            let mut s = SynthSpec::named("deepseek-v3").unwrap();
            (s.n_layer, s.n_expert) = (layers, experts);
            s.conform();
            s.validate().unwrap();
            size(&s)
        };
        assert!((50e9..53e9).contains(&(ds(10, 256) as f64)), "{}", ds(10, 256));
        assert!((46e9..48e9).contains(&(ds(61, 24) as f64)), "{}", ds(61, 24));
    }

    #[test]
    fn shrinking_keeps_the_families_sensible() {
        for name in ["gpt-oss-20b", "gpt-oss-120b", "glm-4.5-air", "deepseek-v3"] {
            let mut s = SynthSpec::named(name).unwrap();
            (s.n_layer, s.n_expert) = (2, 4);
            s.conform();
            s.validate().unwrap();
            assert_eq!(s.n_expert_used, 4, "{name}");
            if let Some(g) = s.grouped {
                // One dense layer, one routed; four experts are too few for router groups.
                assert_eq!((g.dense_layers, g.n_group, g.topk_group), (1, 1, 1), "{name}");
            }
        }
        // DeepSeek-V3's groups survive while they fit: 16 experts keep 8 groups choosing 4.
        let mut s = SynthSpec::named("deepseek-v3").unwrap();
        (s.n_layer, s.n_expert) = (4, 16);
        assert!(s.conform().is_empty());
        s.validate().unwrap();
        let g = s.grouped.unwrap();
        assert_eq!((g.dense_layers, g.n_group, g.topk_group), (3, 8, 4));
        // With 8 experts of which 2 per token: 4 groups, the top 3.
        (s.n_expert, s.n_expert_used) = (8, 2);
        s.conform();
        s.validate().unwrap();
        let g = s.grouped.unwrap();
        assert_eq!((g.n_group, g.topk_group), (4, 3));
        // A single layer is a routed one.
        s.n_layer = 1;
        s.conform();
        assert_eq!(s.grouped.unwrap().dense_layers, 0);
        s.validate().unwrap();
        // Groups llama.cpp would refuse are refused here.
        s.grouped.as_mut().unwrap().topk_group = 4;
        assert!(s.validate().is_err());
    }

    /// `name` shrunk (`layers` layers, `experts` experts) and small enough to run in a test.
    fn tiny(name: &str, layers: usize, experts: usize, used: usize) -> SynthSpec {
        let mut s = SynthSpec::named(name).unwrap();
        (s.n_layer, s.n_expert, s.n_expert_used, s.vocab) = (layers, experts, used, 512);
        match s.arch {
            SynthArch::GptOss => {
                // Rows of 320 values: whole MXFP4 and Q8_0 blocks, not whole K-quant ones.
                (s.hidden, s.n_head, s.n_head_kv, s.head_dim, s.expert_ff) = (320, 4, 2, 64, 320);
            }
            SynthArch::Glm4Moe => {
                (s.hidden, s.n_head, s.n_head_kv, s.head_dim, s.expert_ff) = (256, 4, 2, 64, 128);
                s.grouped.as_mut().unwrap().dense_ff = 384;
            }
            _ => {
                (s.hidden, s.n_head, s.head_dim, s.expert_ff) = (256, 4, 96, 256);
                s.grouped.as_mut().unwrap().dense_ff = 512;
                s.mla = Some(SynthMla { q_lora_rank: 128, kv_lora_rank: 256, qk_rope: 32, v_head: 64 });
            }
        }
        s.conform();
        s.validate().unwrap();
        s
    }

    #[test]
    fn shrunk_new_shapes_load_and_run_in_sluice() {
        use crate::config::{FfnKind, Gating, MixerKind, Score};
        use crate::gguf::GgufCheckpoint;
        use crate::rope::RopeScaling;
        let dir = sluice_formats::scratch_root().join(format!("sluice-synth-new-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (i, s) in [
            tiny("gpt-oss-20b", 2, 4, 4),
            tiny("gpt-oss-120b", 3, 8, 4),
            tiny("glm-4.5-air", 2, 4, 4),
            tiny("deepseek-v3", 2, 8, 2),
            tiny("deepseek-v3", 2, 4, 4),
        ]
        .into_iter()
        .enumerate()
        {
            let path = dir.join(format!("{i}-{}.gguf", s.name));
            let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
            let written = write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
            drop(f);
            assert_eq!(std::fs::metadata(&path).unwrap().len(), written);
            let ck = GgufCheckpoint::open(&path).unwrap();
            let c = ck.config.clone();
            let what = format!("{} {:?}", s.name, s.arch);
            let arch = match s.arch {
                SynthArch::GptOss => crate::Arch::GptOss,
                SynthArch::Glm4Moe => crate::Arch::Glm4Moe,
                _ => crate::Arch::DeepseekV3,
            };
            assert_eq!(c.arch, arch, "{what}");
            assert_eq!(
                (c.hidden, c.n_layer, c.n_head, c.vocab_size),
                (s.hidden, s.n_layer, s.n_head, s.vocab),
                "{what}"
            );
            assert!((c.rms_eps - s.arch.rms_eps()).abs() < 1e-9, "{what}");
            let moe = c.moe.as_ref().unwrap();
            assert_eq!((moe.n_expert, moe.n_expert_used, moe.expert_ff), (s.n_expert, s.n_expert_used, s.expert_ff));
            let dense: Vec<bool> = c.layers.iter().map(|l| l.ffn == FfnKind::Dense).collect();
            let want: Vec<bool> = (0..s.n_layer).map(|l| s.is_dense_layer(l)).collect();
            assert_eq!(dense, want, "{what}");
            match s.arch {
                SynthArch::GptOss => {
                    assert_eq!((c.n_head_kv, c.head_dim, c.rope.dim), (s.n_head_kv, s.head_dim, s.head_dim));
                    assert!(c.attn_sinks && c.qkv_bias && moe.router_bias && moe.expert_bias);
                    assert_eq!(c.layers[0].mixer, MixerKind::Attention { window: Some(128) });
                    assert_eq!(c.layers[1].mixer, MixerKind::Attention { window: None });
                    assert!(matches!(c.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 32.0));
                    assert_eq!(moe.gating, Gating::TopKSoftmax);
                }
                SynthArch::Glm4Moe => {
                    assert_eq!((c.n_head_kv, c.head_dim, c.rope.dim), (s.n_head_kv, s.head_dim, s.head_dim / 2));
                    assert!(c.qkv_bias && c.mtp.is_none());
                    assert_eq!(c.ff, 384);
                    assert_eq!(moe.shared_expert_ff, Some(s.expert_ff));
                    assert!(matches!(
                        moe.gating,
                        Gating::Grouped { score: Score::Sigmoid, selection_bias: true, n_group: 1, topk_group: 1, .. }
                    ));
                }
                _ => {
                    let (m, g) = (c.mla.unwrap(), s.grouped.unwrap());
                    let sm = s.mla.unwrap();
                    assert_eq!(
                        (m.q_lora_rank, m.kv_lora_rank, m.qk_nope, m.qk_rope, m.v_head),
                        (Some(sm.q_lora_rank), sm.kv_lora_rank, s.head_dim - sm.qk_rope, sm.qk_rope, sm.v_head)
                    );
                    assert_eq!(c.ff, 512);
                    assert_eq!(moe.shared_expert_ff, Some(s.expert_ff));
                    assert!(c.layers.iter().all(|l| l.mixer == MixerKind::Mla));
                    match moe.gating {
                        Gating::Grouped { score, selection_bias, n_group, topk_group, norm_topk, scale, .. } => {
                            assert_eq!((score, selection_bias, norm_topk), (Score::Sigmoid, true, true));
                            assert_eq!((n_group, topk_group, scale), (g.n_group, g.topk_group, 2.5));
                        }
                        other => panic!("{other:?}"),
                    }
                    assert!(matches!(c.rope.scaling, RopeScaling::Yarn { factor, .. } if factor == 40.0));
                }
            }
            let experts = std::sync::Arc::new(crate::ResidentExperts::load(&ck, &c, false).unwrap());
            let pool = std::sync::Arc::new(sluice_kernels::ThreadPool::new(1));
            let model = crate::Model::load(c, &ck, experts, pool).unwrap();
            let mut state = model.new_state(32);
            let tokens: Vec<u32> = (0..12).map(|i| (i * 37 + 5) % s.vocab as u32).collect();
            let logits = model.forward(&mut state, &tokens, crate::Logits::All, None).unwrap();
            assert_eq!(logits.len(), tokens.len() * s.vocab);
            assert!(logits.iter().all(|x| x.is_finite()), "{what}: logits not finite");
            let (lo, hi) = logits.iter().fold((f32::MAX, f32::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
            assert!(hi - lo > 1e-3, "{what}: flat logits");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

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

use crate::weights::ExpertPart;
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
}

impl SynthArch {
    pub fn gguf_name(self) -> &'static str {
        match self {
            SynthArch::Qwen3Moe => "qwen3moe",
            SynthArch::Olmoe => "olmoe",
            SynthArch::Qwen3Next => "qwen3next",
            SynthArch::Qwen35Moe => "qwen35moe",
        }
    }

    pub fn is_hybrid(self) -> bool {
        matches!(self, SynthArch::Qwen3Next | SynthArch::Qwen35Moe)
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

/// How tensors are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// llama.cpp's Q4_K_M recipe: Q4_K, with Q6_K for the output, and for attn_v and
    /// ffn_down in the layers that recipe favours.
    Q4KM,
    /// Every matrix in one format.
    Uniform(DType),
}

impl QuantMix {
    pub fn parse(s: &str) -> Option<QuantMix> {
        if s.eq_ignore_ascii_case("q4_k_m") {
            return Some(QuantMix::Q4KM);
        }
        DType::from_name(s).filter(|d| *d != DType::Q8_K).map(QuantMix::Uniform)
    }

    pub fn name(self) -> String {
        match self {
            QuantMix::Q4KM => "Q4_K_M".into(),
            QuantMix::Uniform(d) => d.name().into(),
        }
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
    /// Hybrid shapes: the DeltaNet layers' dimensions.
    pub delta: Option<SynthDelta>,
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
            delta: None,
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
            _ => return None,
        })
    }

    pub const NAMES: [&'static str; 6] =
        ["qwen3-30b-a3b", "olmoe-1b-7b", "tiny-moe", "demo-moe", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b"];

    /// Whether layer `l` is a Gated DeltaNet layer (hybrid shapes).
    pub fn is_delta_layer(&self, l: usize) -> bool {
        self.delta.is_some_and(|d| !(l + 1).is_multiple_of(d.full_every))
    }

    pub fn validate(&self) -> Result<(), String> {
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
        for (what, n) in
            [("hidden", self.hidden), ("expert FFN", self.expert_ff), ("heads × head_dim", self.n_head * self.head_dim)]
        {
            if !n.is_multiple_of(256) {
                return Err(format!("{what} size {n} must be a multiple of 256 (whole K-quant blocks)"));
            }
        }
        Ok(())
    }
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

/// Every tensor of the model, in file order.
pub fn plan(s: &SynthSpec) -> Vec<TensorPlan> {
    let (h, qd, kvd) = (s.hidden as u64, (s.n_head * s.head_dim) as u64, (s.n_head_kv * s.head_dim) as u64);
    let w_sigma = 0.5 / (s.hidden as f32).sqrt();
    let mat = |layer: Option<usize>, role: &str| -> DType {
        match s.quant {
            QuantMix::Uniform(d) => d,
            QuantMix::Q4KM => match (role, layer) {
                ("output", _) => DType::Q6_K,
                ("attn_v" | "ffn_down", Some(i)) if use_more_bits(i, s.n_layer) => DType::Q6_K,
                _ => DType::Q4_K,
            },
        }
    };
    let mut v = vec![TensorPlan {
        name: "token_embd.weight".into(),
        dims: vec![h, s.vocab as u64],
        dtype: mat(None, "embd"),
        role: Role::Embedding,
        sigma: 1.0,
    }];
    let t = |name: String, dims: Vec<u64>, dtype, role, sigma| TensorPlan { name, dims, dtype, role, sigma };
    for l in 0..s.n_layer {
        let b = |n: &str| format!("blk.{l}.{n}");
        v.push(t(b("attn_norm.weight"), vec![h], DType::F32, Role::Norm, 0.0));
        if s.is_delta_layer(l) {
            delta_tensors(s, l, &mut v, &|role| mat(Some(l), role), w_sigma);
        } else {
            // Hybrids gate the attention output: each head's q projection is [q | gate].
            let q_rows = if s.arch.is_hybrid() { 2 * qd } else { qd };
            v.push(t(b("attn_q.weight"), vec![h, q_rows], mat(Some(l), "attn_q"), Role::Matrix, w_sigma));
            v.push(t(b("attn_k.weight"), vec![h, kvd], mat(Some(l), "attn_k"), Role::Matrix, w_sigma));
            v.push(t(b("attn_v.weight"), vec![h, kvd], mat(Some(l), "attn_v"), Role::Matrix, w_sigma));
            // Attention averages over the same context for every position; at full weight its
            // share of the residual grows with depth until late layers route most tokens alike
            // (measured: expert-usage entropy fell to 0.71 of uniform by layer 48). A quarter
            // keeps routing driven by the token at every depth (≥ 0.99 of uniform).
            v.push(t(b("attn_output.weight"), vec![qd, h], mat(Some(l), "attn_o"), Role::Matrix, w_sigma * 0.25));
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
            v.push(t(b("ffn_gate_shexp.weight"), vec![h, sf], mat(Some(l), "ffn_gate"), Role::Matrix, w_sigma));
            v.push(t(b("ffn_up_shexp.weight"), vec![h, sf], mat(Some(l), "ffn_gate"), Role::Matrix, w_sigma));
            v.push(t(b("ffn_down_shexp.weight"), vec![sf, h], mat(Some(l), "ffn_down"), Role::Matrix, w_sigma));
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
        let (ff, e) = (s.expert_ff as u64, s.n_expert as u64);
        for part in ExpertPart::ALL {
            let name = crate::families::gguf_names::experts(part, l);
            let (dims, role) = match part {
                ExpertPart::Down => (vec![ff, h, e], "ffn_down"),
                _ => (vec![h, ff, e], "ffn_gate"),
            };
            v.push(t(name, dims, mat(Some(l), role), Role::Matrix, w_sigma));
        }
    }
    v.push(t("output_norm.weight".into(), vec![h], DType::F32, Role::Norm, 0.0));
    v.push(t(
        "output.weight".into(),
        vec![h, s.vocab as u64],
        mat(None, "output"),
        Role::Output,
        2.0 / (s.hidden as f32).sqrt(),
    ));
    // GGUF stores tensors in the order they are declared; llama.cpp does not mind.
    v
}

/// A Gated DeltaNet layer's tensors in llama.cpp's layout.
fn delta_tensors(s: &SynthSpec, l: usize, v: &mut Vec<TensorPlan>, mat: &dyn Fn(&str) -> DType, w_sigma: f32) {
    let d = s.delta.expect("a hybrid shape");
    let (h, nv) = (s.hidden as u64, d.n_v_heads as u64);
    let (kd, vd) = ((d.n_k_heads * d.head_dim) as u64, (d.n_v_heads * d.head_dim) as u64);
    let b = |n: &str| format!("blk.{l}.{n}");
    let t = |name: String, dims: Vec<u64>, dtype, role, sigma| TensorPlan { name, dims, dtype, role, sigma };
    v.push(t(b("attn_qkv.weight"), vec![h, 2 * kd + vd], mat("attn_qkv"), Role::Matrix, w_sigma));
    v.push(t(b("attn_gate.weight"), vec![h, vd], mat("attn_gate"), Role::Matrix, w_sigma));
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
    v.push(t(b("ssm_out.weight"), vec![vd, h], mat("attn_o"), Role::Matrix, w_sigma * 0.25));
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
        (ROUTING_KEY.to_string(), Value::String("uniform".into())),
        (k("block_count"), u(s.n_layer)),
        (k("context_length"), u(s.context)),
        (k("embedding_length"), u(s.hidden)),
        (k("attention.head_count"), u(s.n_head)),
        (k("attention.head_count_kv"), u(s.n_head_kv)),
        (k("attention.key_length"), u(s.head_dim)),
        (k("attention.value_length"), u(s.head_dim)),
        (k("attention.layer_norm_rms_epsilon"), Value::F32(1e-6)),
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
    }
    m
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
            DType::Q8_K | DType::Q2_K | DType::Q3_K | DType::MXFP4 => {
                // Not offered by `QuantMix::parse` for writing.
                b.fill(0);
            }
            _ => unreachable!(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_blocks_are_zero_mean_with_the_asked_spread() {
        for dtype in [DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q8_0, DType::Q4_0, DType::Q5_0, DType::BF16] {
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
}

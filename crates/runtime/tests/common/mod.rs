//! Shared helpers of the runtime's integration tests.
#![allow(dead_code)]

use sluice_experts::{IoKind, Policy};
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::path::{Path, PathBuf};

pub fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests")
}

pub fn scratch(tag: &str) -> PathBuf {
    let d = sluice_formats::scratch_root().join(format!("sluice-test-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A small synthetic Qwen3-MoE GGUF (4 layers, 16 experts top-4), written once per process.
pub fn synthetic_model(tag: &str, quant: QuantMix) -> PathBuf {
    let path = scratch(tag).join("synthetic.gguf");
    if path.exists() {
        return path;
    }
    let spec = SynthSpec {
        name: "test".into(),
        arch: SynthArch::Qwen3Moe,
        n_layer: 4,
        hidden: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        vocab: 512,
        context: 1024,
        rope_theta: 10000.0,
        quant,
        seed: 3,
        routing: sluice_model::synth::Routing::Uniform,
        delta: None,
        grouped: None,
        mla: None,
    };
    spec.validate().unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&spec, builtin_tokenizer(spec.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    path
}

/// A small synthetic Qwen3-Next GGUF (4 layers, 3 of them Gated DeltaNet; 16 experts top-4,
/// a shared expert), written once per process.
pub fn synthetic_hybrid(tag: &str) -> PathBuf {
    let path = scratch(tag).join("hybrid.gguf");
    if path.exists() {
        return path;
    }
    let spec = SynthSpec {
        name: "test-hybrid".into(),
        arch: SynthArch::Qwen3Next,
        n_layer: 4,
        hidden: 256,
        n_head: 2,
        n_head_kv: 1,
        head_dim: 128,
        n_expert: 16,
        n_expert_used: 4,
        expert_ff: 256,
        vocab: 512,
        context: 1024,
        rope_theta: 10000.0,
        quant: QuantMix::Q4KM,
        seed: 5,
        routing: sluice_model::synth::Routing::Uniform,
        delta: Some(sluice_model::synth::SynthDelta {
            n_k_heads: 2,
            n_v_heads: 4,
            head_dim: 64,
            conv_kernel: 4,
            full_every: 4,
            rotary_dim: 32,
            shared_ff: 256,
        }),
        grouped: None,
        mla: None,
    };
    spec.validate().unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&spec, builtin_tokenizer(spec.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    path
}

/// Placement settings for one run.
#[derive(Clone, Debug)]
pub struct Place {
    pub mode: ExpertMode,
    pub slots: Option<usize>,
    pub policy: Policy,
    pub prefetch: bool,
    pub depth: usize,
    pub io: IoKind,
    pub pack: Option<PathBuf>,
}

impl Place {
    pub fn resident() -> Place {
        Place {
            mode: ExpertMode::Resident,
            slots: None,
            policy: Policy::Lru,
            prefetch: true,
            depth: 32,
            io: IoKind::Uring,
            pack: None,
        }
    }

    pub fn stream(slots: usize) -> Place {
        Place { mode: ExpertMode::Stream, slots: Some(slots), ..Place::resident() }
    }
}

pub fn slot_bytes(model: &Path) -> usize {
    let e = load(model, &Place::stream(usize::MAX / (1 << 24)), 1);
    e.streaming.as_ref().unwrap().slot_bytes()
}

/// The expert slot size of an MoE model, or 0 for a dense one.
pub fn slot_bytes_or_zero(model: &Path) -> usize {
    let e = Engine::load(model, EngineOptions { threads: 1, max_context: 64, ..Default::default() }).unwrap();
    if e.model.cfg.moe.is_none() {
        return 0;
    }
    slot_bytes(model)
}

pub fn load(model: &Path, p: &Place, slot_bytes: usize) -> Engine {
    let experts = ExpertOptions {
        mode: p.mode,
        cache_bytes: p.slots.map(|s| (s.saturating_mul(slot_bytes)) as u64),
        policy: p.policy,
        prefetch: p.prefetch,
        depth: p.depth,
        io: p.io.clone(),
        pack: p.pack.clone(),
        pressure: false,
        ..Default::default()
    };
    Engine::load(model, EngineOptions { threads: 2, max_context: 256, experts, mtp: false }).unwrap()
}

/// Logits of a 16-token prefill then 6 single-token decode steps (all positions).
pub fn run(e: &Engine) -> Vec<f32> {
    let vocab = e.model.cfg.vocab_size as u32;
    let toks: Vec<u32> = (0..22u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut kv = e.new_state();
    let mut out = e.model.forward(&mut kv, &toks[..16], Logits::All, None).unwrap();
    for t in &toks[16..] {
        out.extend(e.model.forward(&mut kv, &[*t], Logits::All, None).unwrap());
    }
    out
}

#[allow(unused_imports)]
pub use sluice_kernels::compare::same_bits;

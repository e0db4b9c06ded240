//! The seam through which the dense products run off the CPU's threads (a GPU in
//! `sluice-cuda`), driven by a stand-in that computes on one thread of its own and declines
//! every call that involves the output head: the logits stay bit-identical to the plain run,
//! every mixer's projections (attention, Gated DeltaNet, latent attention), the dense and
//! shared-expert FFNs and the head reach the seam, products of one input arrive together
//! (q, k and v as one call; gate and up), and whatever it declines the CPU computes.

mod common;

use sluice_kernels::{matmul, ThreadPool};
use sluice_model::dense::DenseCompute;
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthGrouped, SynthMla, SynthSpec};
use sluice_model::weights::Weight;
use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::sync::{Arc, Mutex};

struct StandIn {
    pool: ThreadPool,
    /// The data address of the output head's matrix, declined.
    head: usize,
    /// Weights per call, taken or not.
    calls: Mutex<Vec<(usize, bool)>>,
}

impl DenseCompute for StandIn {
    fn matmul(&self, ws: &[&Weight], x: &[f32], n: usize, outs: &mut [&mut [f32]]) -> bool {
        let take = ws.iter().all(|w| w.data.as_ptr() as usize != self.head);
        self.calls.lock().unwrap().push((ws.len(), take));
        if !take {
            // Scribbles first: a declined call's outputs must be recomputed, not trusted.
            outs.iter_mut().for_each(|o| o.fill(f32::NAN));
            return false;
        }
        for (w, o) in ws.iter().zip(outs.iter_mut()) {
            matmul(&self.pool, w.mat(), x, n, o);
        }
        true
    }

    fn describe(&self) -> String {
        "a CPU stand-in".into()
    }

    fn stats_line(&self) -> String {
        String::new()
    }
}

fn bits(e: &Engine) -> Vec<u32> {
    let mut st = e.new_state();
    let mut v: Vec<u32> = Vec::new();
    v.extend(e.model.forward(&mut st, &[3, 9, 27, 81, 5], Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    for t in [7u32, 49] {
        v.extend(e.model.forward(&mut st, &[t], Logits::Last, None).unwrap().iter().map(|f| f.to_bits()));
    }
    v
}

/// Runs `s` plain and through the stand-in; returns the calls it saw: (weights, taken).
fn through_the_seam(s: &SynthSpec, tag: &str) -> Vec<(usize, bool)> {
    let dir = sluice_formats::scratch_root().join(format!("sluice-dense-seam-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("m.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    let calls = file_through_the_seam(&path, tag);
    std::fs::remove_dir_all(&dir).ok();
    calls
}

fn file_through_the_seam(path: &std::path::Path, tag: &str) -> Vec<(usize, bool)> {
    let mut e = Engine::load(path, EngineOptions { threads: 2, max_context: 32, ..Default::default() }).unwrap();
    let plain = bits(&e);
    let head = e.model.output.data.as_ptr() as usize;
    let c = Arc::new(StandIn { pool: ThreadPool::new(1), head, calls: Mutex::new(Vec::new()) });
    e.model.dense_compute = Some(c.clone());
    let seam = bits(&e);
    let first = plain.iter().zip(&seam).position(|(a, b)| a != b);
    assert_eq!(first, None, "{tag}: logits through the seam differ at {first:?}");
    assert_eq!(plain.len(), seam.len());
    let calls = c.calls.lock().unwrap().clone();
    calls
}

/// Forward passes `bits` runs.
const PASSES: usize = 3;

#[test]
fn attention_projections_and_the_head_through_the_seam_give_the_cpu_bits() {
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.n_layer = 2;
    s.quant = QuantMix::Q4KM;
    let calls = through_the_seam(&s, "qwen3moe");
    // Per layer and pass: q, k and v in one call, then o; and one head call per pass.
    let qkv = calls.iter().filter(|(n, took)| *n == 3 && *took).count();
    let single_taken = calls.iter().filter(|(n, took)| *n == 1 && *took).count();
    let declined = calls.iter().filter(|(_, took)| !*took).count();
    assert_eq!(qkv, PASSES * s.n_layer, "{calls:?}");
    assert_eq!(single_taken, PASSES * s.n_layer, "the o projections: {calls:?}");
    assert_eq!(declined, PASSES, "the output head, once a pass: {calls:?}");
}

#[test]
fn dense_ffn_layers_and_shared_experts_through_the_seam_give_the_cpu_bits() {
    // GLM-4.5's layout: a leading dense layer, then routed layers with a shared expert, and
    // q/k/v biases (added after the seam's products).
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.arch = SynthArch::Glm4Moe;
    s.n_layer = 3;
    s.quant = QuantMix::Q4KM;
    s.grouped =
        Some(SynthGrouped { dense_layers: 1, dense_ff: 512, n_shared: 1, n_group: 1, topk_group: 1, scale: 1.0 });
    let calls = through_the_seam(&s, "glm4moe");
    // gate and up as one call, then down: once per pass in the dense layer and in each
    // routed layer's shared expert.
    let gate_up = calls.iter().filter(|(n, took)| *n == 2 && *took).count();
    assert_eq!(gate_up, PASSES * s.n_layer, "{calls:?}");
}

#[test]
fn delta_net_projections_through_the_seam_give_the_cpu_bits() {
    // 3 Gated DeltaNet layers (q/k/v, z, b/a from one input in one call, then the output
    // projection) and one attention layer.
    let path = common::synthetic_hybrid("dense-seam-hybrid");
    let calls = file_through_the_seam(&path, "qwen3next");
    let in_proj = calls.iter().filter(|(n, took)| *n >= 3 && *took).count();
    // Per pass: 3 DeltaNet input calls + 1 attention q/k/v call.
    assert_eq!(in_proj, PASSES * 4, "{calls:?}");
}

#[test]
fn latent_attention_projections_through_the_seam_give_the_cpu_bits() {
    let mut s = SynthSpec::named("deepseek-v3").expect("built in");
    (s.n_layer, s.n_expert, s.n_expert_used, s.vocab) = (4, 16, 4, 512);
    (s.hidden, s.n_head, s.head_dim, s.expert_ff) = (256, 4, 96, 256);
    s.grouped.as_mut().unwrap().dense_ff = 512;
    s.mla = Some(SynthMla { q_lora_rank: 128, kv_lora_rank: 256, qk_rope: 32, v_head: 64 });
    s.quant = QuantMix::Q4KM;
    s.conform();
    s.validate().unwrap();
    let calls = through_the_seam(&s, "deepseek2");
    // q's down projection and the compressed KV share the layer's input: one call of two
    // per layer and pass, beside the dense layers' and shared experts' gate+up calls.
    let pairs = calls.iter().filter(|(n, took)| *n == 2 && *took).count();
    assert_eq!(pairs, PASSES * s.n_layer * 2, "{calls:?}");
}

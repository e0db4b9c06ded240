//! Peak resident memory while streaming stays within dense weights + expert-cache quota +
//! KV cache + a stated slack. Its own test binary, so no other test shares the process.

mod common;

use common::*;
use sluice_model::synth::{QuantMix, SynthArch, SynthSpec};

/// What the process may hold beyond dense weights, quota and KV: thread stacks, scratch
/// activations, tokenizer tables, allocator slack.
const SLACK: u64 = 48 << 20;

fn vm_hwm() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 =
        s.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn peak_rss_stays_within_dense_plus_quota_plus_kv() {
    // Experts ≈ 150 MB, quota 16 MB: the model is ten times the cache.
    let spec = SynthSpec {
        name: "rss".into(),
        arch: SynthArch::Qwen3Moe,
        n_layer: 8,
        hidden: 512,
        n_head: 8,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 32,
        n_expert_used: 4,
        expert_ff: 512,
        vocab: 1024,
        context: 1024,
        rope_theta: 10000.0,
        quant: QuantMix::Uniform(sluice_kernels::DType::Q8_0),
        seed: 9,
    };
    let path = scratch("rss").join("rss.gguf");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        sluice_model::synth::write_model(&spec, sluice_model::synth::builtin_tokenizer(spec.vocab), &mut f, |_| {})
            .unwrap();
    }
    let quota: u64 = 16 << 20;
    let slot = slot_bytes(&path) as u64;
    let base = vm_hwm();
    let e = load(&path, &Place::stream((quota / slot) as usize), slot as usize);
    let experts_total: u64 = e.streaming.as_ref().unwrap().layout().total_payload();
    for _ in 0..3 {
        run(&e);
    }
    let dense = e.model.dense_bytes() as u64 + 2 * spec.hidden as u64 * 4 * spec.n_layer as u64;
    let kv = (spec.n_layer * spec.n_head_kv * spec.head_dim * 2 * 4 * 256) as u64;
    let peak = vm_hwm().saturating_sub(base);
    let bound = dense + quota + kv + SLACK;
    assert!(experts_total > 8 * quota, "the model must be much larger than the cache");
    assert!(
        peak <= bound,
        "peak RSS grew by {peak} bytes; bound dense {dense} + quota {quota} + KV {kv} + slack {SLACK} = {bound}"
    );
    eprintln!(
        "peak RSS growth {:.1} MiB; bound {:.1} MiB (experts {:.1} MiB)",
        peak as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        experts_total as f64 / 1048576.0
    );
}

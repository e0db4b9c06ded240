//! Peak resident memory while streaming stays within what the design promises: dense
//! weights + expert-cache quota + KV cache + the working memory of one forward pass
//! (`Model::scratch_bytes`) + a fixed slack (`Model::FIXED_SLACK`, 8 MiB). The model's experts
//! are ten times the quota and the quota is several times the slack, so the quota is what
//! the bound is about. Its own test binary, so no other test shares the process.

mod common;

use common::*;
use sluice_model::synth::{QuantMix, SynthArch, SynthSpec};
use sluice_model::Model;

fn vm_hwm() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 =
        s.lines().find(|l| l.starts_with("VmHWM:")).unwrap().split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}

#[test]
fn peak_rss_stays_within_dense_plus_quota_plus_kv_plus_stated_slack() {
    // Experts ≈ 660 MB (8 layers × 48 experts × 1.7 MB, Q8_0); quota 64 MiB.
    let spec = SynthSpec {
        name: "rss".into(),
        arch: SynthArch::Qwen3Moe,
        n_layer: 8,
        hidden: 512,
        n_head: 8,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 48,
        n_expert_used: 4,
        expert_ff: 1024,
        vocab: 1024,
        context: 1024,
        rope_theta: 10000.0,
        quant: QuantMix::Uniform(sluice_kernels::DType::Q8_0),
        seed: 9,
        routing: sluice_model::synth::Routing::Uniform,
        delta: None,
        grouped: None,
        mla: None,
    };
    let path = scratch("rss").join("rss.gguf");
    {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        sluice_model::synth::write_model(&spec, sluice_model::synth::builtin_tokenizer(spec.vocab), &mut f, |_| {})
            .unwrap();
    }
    let quota: u64 = 64 << 20;
    let slot = slot_bytes(&path) as u64;
    let base = vm_hwm();
    let e = load(&path, &Place::stream((quota / slot) as usize), slot as usize);
    let experts_total: u64 = e.streaming.as_ref().unwrap().layout().total_payload();
    for _ in 0..3 {
        run(&e);
    }
    let ctx = 256; // common::load's context
    let dense = e.model.dense_bytes() as u64 + 2 * spec.hidden as u64 * 4 * spec.n_layer as u64;
    let kv = (spec.n_layer * spec.n_head_kv * spec.head_dim * 2 * 4 * ctx) as u64;
    // common::run prefills 16 tokens: the largest forward pass of the test.
    let scratch = e.model.scratch_bytes(16, ctx) as u64;
    let slack = Model::FIXED_SLACK as u64;
    let peak = vm_hwm().saturating_sub(base);
    let bound = dense + quota + kv + scratch + slack;
    assert!(experts_total > 8 * quota, "the model must be much larger than the cache");
    assert!(quota > 4 * (scratch + slack), "the quota must dominate the slack for the bound to mean much");
    let resident = e.model.experts.stats().resident_bytes;
    assert!(resident * 10 >= quota * 9, "the cache should have filled ({resident} of {quota} bytes)");
    eprintln!(
        "peak RSS growth {:.1} MiB; bound {:.1} MiB = dense {:.1} + quota {:.1} + KV {:.1} + scratch {:.2} + slack {:.1} (experts {:.1} MiB)",
        peak as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        dense as f64 / 1048576.0,
        quota as f64 / 1048576.0,
        kv as f64 / 1048576.0,
        scratch as f64 / 1048576.0,
        slack as f64 / 1048576.0,
        experts_total as f64 / 1048576.0
    );
    assert!(peak <= bound, "peak RSS grew by {peak} bytes, beyond the promised {bound}");
    std::fs::remove_file(&path).ok();
}

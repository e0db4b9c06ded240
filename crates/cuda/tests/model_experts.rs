//! A MoE model whose routed experts are computed on the GPU gives the CPU run's logits, bit
//! for bit, for every VRAM quota from one expert to all of them, in prefill and in decode,
//! with experts resident and streamed. Needs an NVIDIA GPU (ignored by default; run with
//! `--ignored` on a CUDA machine).

use sluice_cuda::experts::CudaExperts;
use sluice_cuda::vram_cache::slot_bytes_bound;
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::sync::Arc;

/// A small Qwen3-MoE-shaped model whose matrices are whole K-quant blocks (Q4_K, Q6_K).
fn synth_model(dir: &std::path::Path) -> std::path::PathBuf {
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.hidden = 256;
    s.expert_ff = 256;
    s.n_head = 4;
    s.n_head_kv = 2;
    s.head_dim = 64;
    s.n_layer = 3;
    s.n_expert = 16;
    s.n_expert_used = 4;
    s.quant = QuantMix::Q4KM;
    let path = dir.join("moe.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    path
}

/// Logits of a 6-token prefill, then 3 tokens decoded one at a time.
fn logits(e: &Engine) -> Vec<u32> {
    let mut st = e.new_state();
    let mut bits = Vec::new();
    let prompt = [5u32, 17, 3, 99, 42, 7];
    bits.extend(e.model.forward(&mut st, &prompt, Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    for t in [11u32, 64, 2] {
        bits.extend(e.model.forward(&mut st, &[t], Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    }
    bits
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn gpu_experts_give_the_cpu_logits_at_every_quota() {
    let dir = std::env::temp_dir().join(format!("sluice-gpu-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = synth_model(&dir);
    for mode in [ExpertMode::Resident, ExpertMode::Stream] {
        let experts = ExpertOptions { mode, cache_bytes: Some(1 << 20), ..Default::default() };
        let opts = EngineOptions { threads: 2, max_context: 64, experts, mtp: false };
        let mut e = Engine::load(&path, opts).unwrap();
        let cpu = logits(&e);
        let one = e.model.experts.expert_bytes();
        for slots in [1usize, 3, 48] {
            let c = Arc::new(CudaExperts::open(0, slots * slot_bytes_bound(one, 3), one).unwrap());
            e.model.expert_compute = Some(c.clone());
            let gpu = logits(&e);
            let st = c.tier_stats();
            assert!(st.misses > 0, "{mode:?} {slots} slots: the GPU computed nothing ({st:?})");
            let first = cpu.iter().zip(&gpu).position(|(a, b)| a != b);
            assert_eq!(first, None, "{mode:?} {slots} slots: logits differ from the CPU's at {first:?}");
            assert_eq!(cpu.len(), gpu.len());
            e.model.expert_compute = None;
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

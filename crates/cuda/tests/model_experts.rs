//! A MoE model whose routed experts are computed on the GPU gives the CPU run's logits, bit
//! for bit, for every VRAM quota from one expert to all of them, in prefill and in decode,
//! with experts resident and streamed, with the tier warmed at load (the host copy
//! page-locked) or filled as it goes. Needs an NVIDIA GPU (ignored by default; run with
//! `--ignored` on a CUDA machine).

mod common;

use common::{logits, write_synth};
use sluice_cuda::experts::CudaExperts;
use sluice_cuda::vram_cache::slot_bytes_bound;
use sluice_model::synth::SynthArch;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::sync::Arc;

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn gpu_experts_give_the_cpu_logits_at_every_quota() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-gpu-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = write_synth(SynthArch::Qwen3Moe, &dir);
    for mode in [ExpertMode::Resident, ExpertMode::Stream] {
        let experts = ExpertOptions { mode, cache_bytes: Some(1 << 20), ..Default::default() };
        let opts = EngineOptions { threads: 2, max_context: 64, experts, mtp: false };
        let mut e = Engine::load(&path, opts).unwrap();
        let cpu = logits(&e);
        let one = e.model.experts.expert_bytes();
        for slots in [1usize, 3, 48] {
            for warm in [false, true] {
                let c = Arc::new(CudaExperts::open(0, slots * slot_bytes_bound(one, 3), one).unwrap());
                if warm {
                    // Page-locks the resident copy and fills the tier (3 layers of 16 experts:
                    // 48 slots hold them all) with what host memory holds.
                    let w = c.warm(&*e.model.experts, &e.model.cfg).unwrap();
                    assert_eq!(w.lock_error, None);
                    if mode == ExpertMode::Resident {
                        assert!(w.locked_bytes >= e.model.experts.resident_bytes(), "{w:?}");
                        assert_eq!(w.placed, slots.min(48), "{w:?}");
                    }
                    assert_eq!(c.tier_stats().placed as usize, w.placed);
                }
                e.model.expert_compute = Some(c.clone());
                let gpu = logits(&e);
                let st = c.tier_stats();
                assert!(st.hits + st.misses > 0, "{mode:?} {slots} slots: the GPU computed nothing ({st:?})");
                if warm && slots == 48 && mode == ExpertMode::Resident {
                    assert_eq!(st.misses, 0, "every expert was placed at load: {st:?}");
                }
                let first = cpu.iter().zip(&gpu).position(|(a, b)| a != b);
                assert_eq!(
                    first, None,
                    "{mode:?} {slots} slots, warm {warm}: logits differ from the CPU's at {first:?}"
                );
                assert_eq!(cpu.len(), gpu.len());
                e.model.expert_compute = None;
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

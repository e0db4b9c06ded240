//! A model whose dense matrices live in VRAM (`CudaDense`) gives the CPU run's logits, bit
//! for bit: alone, and beside GPU experts at a tier of a few slots; for a Qwen3-MoE layout
//! (attention projections and the head) and a GLM-4.5 one (q/k/v biases, a dense FFN layer,
//! shared experts). Needs an NVIDIA GPU (ignored by default; run with `--ignored` on a CUDA
//! machine).

mod common;

use common::{logits, write_synth};
use sluice_cuda::dense::CudaDense;
use sluice_cuda::experts::CudaExperts;
use sluice_cuda::vram_cache::slot_bytes_bound;
use sluice_cuda::Gpu;
use sluice_model::synth::SynthArch;
use sluice_runtime::{Engine, EngineOptions};
use std::sync::Arc;

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn dense_weights_in_vram_give_the_cpu_logits() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-gpu-dense-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gpu = Arc::new(Gpu::open(0).unwrap());
    for arch in [SynthArch::Qwen3Moe, SynthArch::Glm4Moe] {
        let path = write_synth(arch, &dir);
        let mut e = Engine::load(&path, EngineOptions { threads: 2, max_context: 64, ..Default::default() }).unwrap();
        let cpu = logits(&e);
        for with_experts in [false, true] {
            let d = Arc::new(CudaDense::upload(gpu.clone(), &e.model, usize::MAX).unwrap());
            assert!(d.held_bytes() > 0, "{arch:?}: nothing uploaded");
            e.model.dense_compute = Some(d.clone());
            if with_experts {
                let one = e.model.experts.expert_bytes();
                let c = CudaExperts::with_gpu(gpu.clone(), 3 * slot_bytes_bound(one, 3), one).unwrap();
                e.model.expert_compute = Some(Arc::new(c));
            }
            let got = logits(&e);
            let (calls, _, errors) = d.counts();
            assert!(calls > 0 && errors == 0, "{arch:?}: {calls} calls, {errors} errors");
            let first = cpu.iter().zip(&got).position(|(a, b)| a != b);
            assert_eq!(
                first, None,
                "{arch:?} experts on GPU {with_experts}: logits differ from the CPU's at {first:?}"
            );
            assert_eq!(cpu.len(), got.len());
            e.model.dense_compute = None;
            e.model.expert_compute = None;
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

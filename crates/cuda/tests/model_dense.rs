//! A model whose dense matrices live in VRAM (`CudaDense`) gives the CPU run's logits, bit
//! for bit: alone, and beside GPU experts at a tier of a few slots; for a Qwen3-MoE layout
//! (attention projections and the head) and a GLM-4.5 one (q/k/v biases, a dense FFN layer,
//! shared experts). Needs an NVIDIA GPU (ignored by default; run with `--ignored` on a CUDA
//! machine).

use sluice_cuda::dense::CudaDense;
use sluice_cuda::experts::CudaExperts;
use sluice_cuda::vram_cache::slot_bytes_bound;
use sluice_cuda::Gpu;
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthGrouped, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::sync::Arc;

fn spec(arch: SynthArch) -> SynthSpec {
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.arch = arch;
    s.hidden = 256;
    s.expert_ff = 256;
    s.n_head = 4;
    s.n_head_kv = 2;
    s.head_dim = 64;
    s.n_layer = 3;
    s.n_expert = 16;
    s.n_expert_used = 4;
    s.quant = QuantMix::Q4KM;
    if arch == SynthArch::Glm4Moe {
        s.grouped =
            Some(SynthGrouped { dense_layers: 1, dense_ff: 512, n_shared: 1, n_group: 1, topk_group: 1, scale: 1.0 });
    }
    s
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
fn dense_weights_in_vram_give_the_cpu_logits() {
    let dir = std::env::temp_dir().join(format!("sluice-gpu-dense-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let gpu = Arc::new(Gpu::open(0).unwrap());
    for arch in [SynthArch::Qwen3Moe, SynthArch::Glm4Moe] {
        let s = spec(arch);
        let path = dir.join(format!("{arch:?}.gguf"));
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
        write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
        drop(f);
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

//! Decode steps run whole on the GPU: within float rounding of the CPU's logits with the
//! same greedy tokens, the same bits at every VRAM quota from one token's experts to all of
//! them (warmed or filled as it goes; a tier holding them all is read without the host), the same bits again after the sequence is cut back
//! and decoded anew, and the host's KV cache kept whole for the CPU passes that follow.
//! Needs an NVIDIA GPU (ignored by default; run with `--ignored` on a CUDA machine).

mod common;

use common::write_synth;
use sluice_cuda::dense::CudaDense;
use sluice_cuda::experts::CudaExperts;
use sluice_cuda::step::CudaStep;
use sluice_cuda::vram_cache::slot_bytes_bound;
use sluice_cuda::Gpu;
use sluice_model::synth::SynthArch;
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::sync::Arc;

const PROMPT: [u32; 6] = [5, 17, 3, 99, 42, 7];
const NEXT: [u32; 5] = [11, 64, 2, 130, 9];

/// Logits of each single-token step after a CPU prefill, then a 2-token CPU pass after them.
fn steps(e: &Engine) -> (Vec<Vec<f32>>, Vec<f32>) {
    let mut st = e.new_state();
    e.model.forward(&mut st, &PROMPT, Logits::Last, None).unwrap();
    let per: Vec<Vec<f32>> =
        NEXT.iter().map(|t| e.model.forward(&mut st, &[*t], Logits::Last, None).unwrap()).collect();
    let after = e.model.forward(&mut st, &[1, 2], Logits::All, None).unwrap();
    (per, after)
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn whole_steps_match_the_cpu_and_their_own_bits_at_every_quota() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-gpu-step-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = write_synth(SynthArch::Qwen3Moe, &dir);
    let experts = ExpertOptions { mode: ExpertMode::Resident, ..Default::default() };
    let opts = EngineOptions { threads: 2, max_context: 64, experts, mtp: false };
    let mut e = Engine::load(&path, opts).unwrap();
    let (cpu, cpu_after) = steps(&e);
    let gpu = Arc::new(Gpu::open(0).unwrap());
    let dense = Arc::new(CudaDense::upload(gpu.clone(), &e.model, 1 << 30).unwrap());
    let one = e.model.experts.expert_bytes();
    let k = e.model.cfg.moe.as_ref().unwrap().n_expert_used;
    let mut reference: Option<Vec<u32>> = None;
    let mut last_step = None;
    // 47 warm slots hold the first layers whole and the last in part: a miss there evicts
    // an expert of a whole layer, so no layer may be read through tables.
    for (slots, warm) in [(48, true), (47, true), (k, false), (k + 1, true), (48, false)] {
        let c = Arc::new(CudaExperts::with_gpu(gpu.clone(), slots * slot_bytes_bound(one, 3), one).unwrap());
        if warm {
            c.warm(&*e.model.experts, &e.model.cfg).unwrap();
        }
        let step = Arc::new(CudaStep::new(&e.model, dense.clone(), Some(c.clone())).unwrap());
        e.model.dense_compute = Some(dense.clone());
        e.model.expert_compute = Some(c.clone());
        e.model.step_compute = Some(step.clone());
        last_step = Some(step.clone());
        let (per, after) = steps(&e);
        let line = sluice_model::step::StepCompute::stats_line(&*step);
        assert!(line.starts_with(&format!("GPU steps: {}", NEXT.len())), "{line}");
        for (i, (g, c)) in per.iter().zip(&cpu).enumerate() {
            let scale = c.iter().map(|v| v.abs()).fold(0.0, f32::max);
            let d = max_diff(g, c);
            assert!(d <= 2e-3 * scale.max(1.0), "{slots} slots, step {i}: logits {d} from the CPU's (scale {scale})");
            assert_eq!(argmax(g), argmax(c), "{slots} slots, step {i}: another greedy token");
        }
        // The CPU pass after the steps reads the keys and values they left on the host.
        let d = max_diff(&after, &cpu_after);
        assert!(d <= 5e-3 * cpu_after.iter().map(|v| v.abs()).fold(1.0, f32::max), "the pass after the steps: {d}");
        let bits: Vec<u32> = per.iter().flatten().map(|v| v.to_bits()).collect();
        match &reference {
            None => reference = Some(bits),
            Some(r) => assert!(r == &bits, "{slots} slots (warm {warm}): other bits than the first quota's"),
        }
        // A tier holding every expert (48 of them, placed at load) is read with no host in
        // between; otherwise the host makes each step's experts resident.
        let layers = NEXT.len() * 3;
        if slots == 48 && warm {
            assert!(line.contains(&format!("routed on the GPU {layers}, on the host 0")), "{line}");
        } else {
            assert!(line.contains(&format!("routed on the GPU 0, on the host {layers}")), "{line}");
            let st = c.tier_stats();
            assert!(st.hits + st.misses >= (layers * k) as u64, "{st:?}");
            if slots == k {
                assert!(st.misses > 0 && st.evictions > 0, "{st:?}");
            }
        }
    }

    // Cut back and decoded again: the device's cache keeps the positions below the cut and
    // copies up only what the host changed (here nothing), with the same bits.
    let step = last_step.expect("the loop ran");
    let copied = || -> u64 {
        let line = sluice_model::step::StepCompute::stats_line(&*step);
        let head = line.split(" positions of KV copied up").next().unwrap();
        head.rsplit(' ').next().unwrap().parse().unwrap_or_else(|_| panic!("no copy count in {line}"))
    };
    let mut st = e.new_state();
    e.model.forward(&mut st, &PROMPT, Logits::Last, None).unwrap();
    let c0 = copied();
    let first: Vec<u32> = NEXT
        .iter()
        .flat_map(|t| e.model.forward(&mut st, &[*t], Logits::Last, None).unwrap())
        .map(|v| v.to_bits())
        .collect();
    let c1 = copied();
    assert_eq!(c1 - c0, PROMPT.len() as u64, "a new sequence's prefill is copied up once");
    st.truncate(PROMPT.len()).unwrap();
    let again: Vec<u32> = NEXT
        .iter()
        .flat_map(|t| e.model.forward(&mut st, &[*t], Logits::Last, None).unwrap())
        .map(|v| v.to_bits())
        .collect();
    assert_eq!(copied(), c1, "a truncation made the device copy positions it already held");
    assert!(first == again, "decoding again after a truncation changed the bits");
    assert!(Some(&first) == reference.as_ref(), "a fresh sequence gave other bits");
    // Cut below what the GPU steps wrote, then a host pass of two tokens: those two, and only
    // those, are copied up before the next step, which gives the bits of a sequence decoded
    // the same way from the start.
    st.truncate(PROMPT.len() + 1).unwrap();
    e.model.forward(&mut st, &[40, 41], Logits::Last, None).unwrap();
    let c2 = copied();
    let tail = e.model.forward(&mut st, &[42], Logits::Last, None).unwrap();
    assert_eq!(copied() - c2, 2, "copied up other than the two positions the host rewrote");
    let mut fresh = e.new_state();
    e.model.forward(&mut fresh, &PROMPT, Logits::Last, None).unwrap();
    e.model.forward(&mut fresh, &NEXT[..1], Logits::Last, None).unwrap();
    e.model.forward(&mut fresh, &[40, 41], Logits::Last, None).unwrap();
    let want = e.model.forward(&mut fresh, &[42], Logits::Last, None).unwrap();
    assert!(
        tail.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
        "after a cut and a host pass, the step's bits differ from a sequence decoded straight"
    );

    // A long sequence: the device's cache grows past its first 256 positions (moving what it
    // holds), and attention over ~300 positions stays within rounding of the CPU's.
    let experts = ExpertOptions { mode: ExpertMode::Resident, ..Default::default() };
    let mut e = Engine::load(&path, EngineOptions { threads: 2, max_context: 320, experts, mtp: false }).unwrap();
    let tokens: Vec<u32> = (0..300u32).map(|i| (i * 37 + 11) % e.model.cfg.vocab_size as u32).collect();
    let run = |e: &Engine| -> Vec<f32> {
        let mut st = e.new_state();
        e.model.forward(&mut st, &tokens[..2], Logits::Last, None).unwrap();
        let mut last = Vec::new();
        for t in &tokens[2..] {
            last = e.model.forward(&mut st, &[*t], Logits::Last, None).unwrap();
        }
        last
    };
    let cpu = run(&e);
    let c = Arc::new(CudaExperts::with_gpu(gpu.clone(), 48 * slot_bytes_bound(one, 3), one).unwrap());
    c.warm(&*e.model.experts, &e.model.cfg).unwrap();
    let dense = Arc::new(CudaDense::upload(gpu.clone(), &e.model, 1 << 30).unwrap());
    let step = Arc::new(CudaStep::new(&e.model, dense.clone(), Some(c.clone())).unwrap());
    e.model.dense_compute = Some(dense);
    e.model.expert_compute = Some(c);
    e.model.step_compute = Some(step.clone());
    let gpu_last = run(&e);
    let scale = cpu.iter().map(|v| v.abs()).fold(1.0, f32::max);
    let d = max_diff(&gpu_last, &cpu);
    assert!(d <= 1e-2 * scale, "after 298 steps: logits {d} from the CPU's (scale {scale})");
    assert_eq!(argmax(&gpu_last), argmax(&cpu));
    let line = sluice_model::step::StepCompute::stats_line(&*step);
    assert!(line.starts_with("GPU steps: 298"), "{line}");
    std::fs::remove_dir_all(&dir).ok();
}

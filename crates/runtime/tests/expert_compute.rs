//! The seam through which routed experts are computed off the CPU's threads (a GPU in
//! `sluice-cuda`), driven here by a stand-in that computes on the CPU and may decline layers:
//! the model's logits stay bit-identical to the plain run, resident and streamed, and the
//! block hands over experts as the seam promises (a resident layer's experts in one call; a
//! streamed layer's one at a time, as they arrive), also when the implementation leaves part
//! of a batch to the CPU's threads.

use sluice_kernels::{matmul, ThreadPool};
use sluice_model::ffn::combine;
use sluice_model::ffn::offload::{CpuWork, ExpertBatch, ExpertCompute};
use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Computes the experts it takes with the CPU's kernels, one expert at a time; declines
/// layer 1; with `split`, takes every other expert of a batch and leaves the rest to the
/// CPU's threads.
struct CpuStandIn {
    pool: ThreadPool,
    split: bool,
    calls: AtomicUsize,
    cpu_reports: AtomicUsize,
    /// Experts handed over per call.
    batch_sizes: Mutex<Vec<usize>>,
}

impl ExpertCompute for CpuStandIn {
    fn assign(&self, b: &ExpertBatch<'_>) -> Vec<bool> {
        (0..b.ids.len()).map(|i| !self.split || i % 2 == 0).collect()
    }

    fn observe_cpu(&self, work: CpuWork) {
        assert!(work.bytes > 0 && work.macs > 0 && work.experts > 0 && work.max_tokens > 0, "{work:?}");
        self.cpu_reports.fetch_add(1, Ordering::Relaxed);
    }

    fn compute(&self, b: &ExpertBatch<'_>, y: &mut [f32]) -> sluice_model::Result<bool> {
        if b.layer == 1 {
            return Ok(false);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.batch_sizes.lock().unwrap().push(b.ids.len());
        let hidden = b.weights[0].gate.cols;
        for (w, slots) in b.weights.iter().zip(b.slots) {
            let ff = w.gate.rows;
            let m = slots.len();
            let xe: Vec<f32> =
                slots.iter().flat_map(|s| b.x[(s / b.k) * hidden..(s / b.k + 1) * hidden].to_vec()).collect();
            let (mut g, mut u, mut o) = (vec![0f32; m * ff], vec![0f32; m * ff], vec![0f32; m * hidden]);
            matmul(&self.pool, w.gate, &xe, m, &mut g);
            matmul(&self.pool, w.up, &xe, m, &mut u);
            combine(b.activation, &mut g, &u);
            matmul(&self.pool, w.down, &g, m, &mut o);
            for (j, s) in slots.iter().enumerate() {
                y[s * hidden..(s + 1) * hidden].copy_from_slice(&o[j * hidden..(j + 1) * hidden]);
            }
        }
        Ok(true)
    }

    fn describe(&self) -> String {
        "CPU stand-in".into()
    }

    fn stats_line(&self) -> String {
        format!("{} calls", self.calls.load(Ordering::Relaxed))
    }
}

fn logits(e: &Engine) -> Vec<u32> {
    let mut st = e.new_state();
    let mut bits: Vec<u32> = e
        .model
        .forward(&mut st, &[5, 17, 3, 99, 42, 7], Logits::All, None)
        .unwrap()
        .iter()
        .map(|f| f.to_bits())
        .collect();
    for t in [11u32, 64] {
        bits.extend(e.model.forward(&mut st, &[t], Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    }
    bits
}

#[test]
fn experts_computed_through_the_seam_give_the_plain_logits() {
    let dir = sluice_formats::scratch_root().join(format!("sluice-expert-compute-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.n_layer = 3;
    s.quant = QuantMix::Q4KM;
    let path = dir.join("moe.gguf");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    for mode in [ExpertMode::Resident, ExpertMode::Stream] {
        let experts = ExpertOptions { mode, cache_bytes: Some(1 << 20), ..Default::default() };
        let opts = EngineOptions { threads: 2, max_context: 64, experts, mtp: false };
        let mut e = Engine::load(&path, opts).unwrap();
        let plain = logits(&e);
        for split in [false, true] {
            let c = Arc::new(CpuStandIn {
                pool: ThreadPool::new(1),
                split,
                calls: AtomicUsize::new(0),
                cpu_reports: AtomicUsize::new(0),
                batch_sizes: Mutex::default(),
            });
            e.model.expert_compute = Some(c.clone());
            let seam = logits(&e);
            e.model.expert_compute = None;
            let first = plain.iter().zip(&seam).position(|(a, b)| a != b);
            assert_eq!(first, None, "{mode:?} split {split}: logits differ at {first:?}");
            assert_eq!(plain.len(), seam.len());
            let sizes = c.batch_sizes.lock().unwrap().clone();
            let reports = c.cpu_reports.load(Ordering::Relaxed);
            if split {
                // Streamed experts come one at a time, and the first of a batch is taken:
                // the CPU gets work only from resident layers.
                assert_eq!(reports > 0, mode == ExpertMode::Resident, "{mode:?}: {reports} CPU reports");
                continue;
            }
            assert_eq!(reports, 0, "nothing was left to the CPU");
            // Layers 0 and 2 of each of the 3 forward calls went through the seam.
            match mode {
                ExpertMode::Resident => {
                    assert_eq!(sizes.len(), 2 * 3, "one call per offloaded layer and forward: {sizes:?}");
                    assert!(sizes.iter().any(|&n| n > 1), "a resident layer's experts come together: {sizes:?}");
                }
                _ => {
                    assert!(sizes.len() > 2 * 3, "streamed experts come one by one: {sizes:?}");
                    assert!(sizes.iter().all(|&n| n == 1), "streamed experts come one by one: {sizes:?}");
                }
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

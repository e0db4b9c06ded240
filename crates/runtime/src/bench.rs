//! `sluice bench`: llama-bench's protocol, so the numbers compare with llama.cpp's.
//!
//! * prefill (`pp`): `p` random tokens run as one batch (in ubatches) from an empty context;
//! * decode (`tg`): `n` steps of one random token each, from an empty context;
//! * each test is repeated `reps` times after a warm-up (one prefill batch, one decode step);
//!   the mean rate is reported.
//!
//! Expert-cache counters are kept per test, over the timed repetitions only (the warm-up's
//! reads are not charged to either).

use crate::engine::Engine;
use crate::error::Result;
use crate::sampler::Rng;
use sluice_model::expert::ExpertStats;
use sluice_model::Logits;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub prompt: usize,
    pub gen: usize,
    pub reps: usize,
    pub ubatch: usize,
    pub seed: u64,
}

impl Default for BenchOptions {
    fn default() -> Self {
        BenchOptions { prompt: 512, gen: 128, reps: 3, ubatch: 512, seed: 1 }
    }
}

#[derive(Clone, Debug, Default)]
pub struct BenchResult {
    pub prefill_tok_s: Vec<f64>,
    pub decode_tok_s: Vec<f64>,
    /// Expert-cache counters of each timed prefill run.
    pub prefill_experts: Vec<ExpertStats>,
    /// Expert-cache counters of each timed decode run.
    pub decode_experts: Vec<ExpertStats>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn stdev(v: &[f64]) -> f64 {
    if v.len() < 2 {
        return 0.0;
    }
    let m = mean(v);
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (v.len() - 1) as f64).sqrt()
}

fn total(v: &[ExpertStats]) -> ExpertStats {
    let mut t = ExpertStats::default();
    for s in v {
        t.add(s);
    }
    t
}

impl BenchResult {
    pub fn prefill_mean(&self) -> f64 {
        mean(&self.prefill_tok_s)
    }
    pub fn decode_mean(&self) -> f64 {
        mean(&self.decode_tok_s)
    }
    pub fn prefill_stdev(&self) -> f64 {
        stdev(&self.prefill_tok_s)
    }
    pub fn decode_stdev(&self) -> f64 {
        stdev(&self.decode_tok_s)
    }
    /// Expert-cache counters of all timed prefill runs together.
    pub fn prefill_experts_total(&self) -> ExpertStats {
        total(&self.prefill_experts)
    }
    /// Expert-cache counters of all timed decode runs together.
    pub fn decode_experts_total(&self) -> ExpertStats {
        total(&self.decode_experts)
    }
}

pub fn bench(engine: &Engine, o: &BenchOptions) -> Result<BenchResult> {
    let vocab = engine.model.cfg.vocab_size as u64;
    let mut rng = Rng::new(o.seed);
    let mut random = |n: usize| -> Vec<u32> { (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect() };
    let mut kv = engine.model.new_state(o.prompt.max(o.gen).max(16) + 1);
    // Warm-up, as llama-bench does it: one full prefill batch (when there is a prefill test),
    // then one decode step.
    if o.prompt > 0 {
        for part in random(o.prompt).chunks(o.ubatch.max(1)) {
            engine.model.forward(&mut kv, part, Logits::Last, None)?;
        }
        kv.reset();
    }
    engine.model.forward(&mut kv, &random(1), Logits::Last, None)?;
    let mut r = BenchResult::default();
    for _ in 0..o.reps {
        if o.prompt > 0 {
            kv.reset();
            let toks = random(o.prompt);
            let before = engine.model.experts.stats();
            let t0 = Instant::now();
            for part in toks.chunks(o.ubatch.max(1)) {
                engine.model.forward(&mut kv, part, Logits::Last, None)?;
            }
            r.prefill_tok_s.push(o.prompt as f64 / t0.elapsed().as_secs_f64());
            r.prefill_experts.push(engine.model.experts.stats().since(&before));
        }
        if o.gen > 0 {
            kv.reset();
            let toks = random(o.gen);
            let before = engine.model.experts.stats();
            let t0 = Instant::now();
            for t in &toks {
                engine.model.forward(&mut kv, &[*t], Logits::Last, None)?;
            }
            r.decode_tok_s.push(o.gen as f64 / t0.elapsed().as_secs_f64());
            r.decode_experts.push(engine.model.experts.stats().since(&before));
        }
    }
    Ok(r)
}

//! Token sampling: greedy, or temperature + top-k + top-p + min-p from a seeded generator, so a
//! given seed always picks the same tokens from the same logits. Presence and frequency
//! penalties (OpenAI's definition) lower the logits of tokens this sampler has already picked;
//! log-probabilities of the pick and of the most likely tokens come from the penalized logits
//! before temperature (the model's own distribution, as the API reports it).
//!
//! A sampler's state is its generator and the counts of the tokens it picked, nothing else: a
//! sequence sampled with its own sampler gets the same tokens whatever else runs beside it.

/// SplitMix64: tiny, fast, and reproducible across platforms.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    pub seed: u64,
    /// Drop tokens whose probability is below `min_p` times the most likely one's (0 = off).
    pub min_p: f32,
    /// Subtracted once from the logit of every token picked before (0 = off).
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was picked before (0 = off).
    pub frequency_penalty: f32,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be a finite number ≥ 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return Err(format!("{name} must be a finite number, got {v}"));
            }
        }
        Ok(())
    }

    fn penalized(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// A token a sampler picked, with log-probabilities when asked for.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log p(token) under the penalized logits before temperature (NaN when not asked for).
    pub logprob: f32,
    /// The most likely tokens and their log-probabilities, best first (ties: lower id first).
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
    /// How often each token was picked (kept only when a penalty is set).
    counts: std::collections::HashMap<u32, u32>,
    /// The penalized logits of the current step.
    scratch: Vec<f32>,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng, counts: Default::default(), scratch: Vec::new() }
    }

    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature == 0.0
    }

    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_full(logits, None).token
    }

    /// Picks a token from `logits` after the penalties; with `logprobs` = Some(n), also
    /// reports the pick's log-probability and the `n` most likely tokens'.
    pub fn sample_full(&mut self, logits: &[f32], logprobs: Option<usize>) -> Sampled {
        let mut scratch = std::mem::take(&mut self.scratch);
        let x = self.penalize(logits, &mut scratch);
        let token = self.pick(x);
        let (logprob, top) = match logprobs {
            Some(n) => log_probs(x, token, n),
            None => (f32::NAN, Vec::new()),
        };
        self.scratch = scratch;
        self.record(token);
        Sampled { token, logprob, top }
    }

    /// `logits` less the penalties of the tokens picked so far (in `scratch` when any apply).
    fn penalize<'a>(&self, logits: &'a [f32], scratch: &'a mut Vec<f32>) -> &'a [f32] {
        if self.cfg.penalized() && !self.counts.is_empty() {
            scratch.clear();
            scratch.extend_from_slice(logits);
            for (&t, &c) in &self.counts {
                if let Some(v) = scratch.get_mut(t as usize) {
                    *v -= self.cfg.presence_penalty + c as f32 * self.cfg.frequency_penalty;
                }
            }
            scratch
        } else {
            logits
        }
    }

    /// `token`, picked elsewhere from `logits` (a speculative verifier's choice), as
    /// `sample_full` reports and records its own picks.
    pub fn take(&mut self, logits: &[f32], token: u32, logprobs: Option<usize>) -> Sampled {
        let mut scratch = std::mem::take(&mut self.scratch);
        let (logprob, top) = match logprobs {
            Some(n) => log_probs(self.penalize(logits, &mut scratch), token, n),
            None => (f32::NAN, Vec::new()),
        };
        self.scratch = scratch;
        self.record(token);
        Sampled { token, logprob, top }
    }

    /// Counts `token` as picked (for the penalties), as `sample` does with its own picks.
    pub fn record(&mut self, token: u32) {
        if self.cfg.penalized() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
    }

    /// The distribution `sample` would draw the next token from, given `logits` and the
    /// tokens recorded so far: penalties, temperature, top-k, top-p and min-p applied. Greedy
    /// sampling is the one-token distribution on the argmax. Nothing is drawn or recorded.
    pub fn candidates(&mut self, logits: &[f32]) -> Candidates {
        let mut scratch = std::mem::take(&mut self.scratch);
        let c = self.candidates_of(self.penalize(logits, &mut scratch));
        self.scratch = scratch;
        c
    }

    /// Draws a token from `c` with this sampler's generator (records nothing; a greedy
    /// sampler takes the first candidate without drawing).
    pub fn draw(&mut self, c: &Candidates) -> u32 {
        if self.is_greedy() {
            return c.ids[0];
        }
        let mut u = self.rng.next_f64() * c.total;
        for (id, w) in c.ids.iter().zip(&c.weights) {
            u -= w;
            if u < 0.0 {
                return *id;
            }
        }
        *c.ids.last().expect("at least one candidate")
    }

    /// A uniform number in [0, 1) from this sampler's generator.
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        let c = self.candidates_of(logits);
        self.draw(&c)
    }

    fn candidates_of(&self, logits: &[f32]) -> Candidates {
        if self.is_greedy() {
            let best = sluice_kernels::ops::argmax(logits) as u32;
            return Candidates { ids: vec![best], weights: vec![1.0], total: 1.0 };
        }
        let t = self.cfg.temperature as f64;
        let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
        idx.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        if self.cfg.top_k > 0 {
            idx.truncate(self.cfg.top_k);
        }
        let max = logits[idx[0] as usize] as f64;
        let mut p: Vec<f64> = idx.iter().map(|i| ((logits[*i as usize] as f64 - max) / t).exp()).collect();
        let sum: f64 = p.iter().sum();
        p.iter_mut().for_each(|v| *v /= sum);
        let mut keep = p.len();
        if self.cfg.top_p < 1.0 {
            let mut c = 0.0;
            for (i, v) in p.iter().enumerate() {
                c += v;
                if c >= self.cfg.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if self.cfg.min_p > 0.0 {
            // p is sorted, best first: keep the head at or above min_p × the best.
            let floor = p[0] * self.cfg.min_p as f64;
            keep = p[..keep].iter().take_while(|v| **v >= floor).count().max(1);
        }
        let total: f64 = p[..keep].iter().sum();
        idx.truncate(keep);
        p.truncate(keep);
        Candidates { ids: idx, weights: p, total }
    }
}

/// The tokens a sampler may pick next and their weights, best first (weights sum to
/// `total`; the probability of a token is its weight over `total`).
#[derive(Clone, Debug, PartialEq)]
pub struct Candidates {
    pub ids: Vec<u32>,
    pub weights: Vec<f64>,
    pub total: f64,
}

impl Candidates {
    /// The probability of `token` (0 when it is not a candidate).
    pub fn prob(&self, token: u32) -> f64 {
        self.ids.iter().position(|t| *t == token).map_or(0.0, |i| self.weights[i] / self.total)
    }

    /// The one-token distribution on `token`.
    pub fn one_hot(token: u32) -> Candidates {
        Candidates { ids: vec![token], weights: vec![1.0], total: 1.0 }
    }
}

/// log-softmax of `logits` at `token`, and the `n` largest entries (best first, ties by id).
pub fn log_probs(logits: &[f32], token: u32, n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max + logits.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln();
    let lp = |i: u32| (logits[i as usize] as f64 - lse) as f32;
    let mut top: Vec<u32> = Vec::with_capacity(n + 1);
    if n > 0 {
        // One pass keeping the n best in order (n is small).
        for i in 0..logits.len() as u32 {
            let better = |a: u32, b: u32| logits[a as usize] > logits[b as usize];
            if top.len() == n && !better(i, top[n - 1]) {
                continue;
            }
            let at = top.iter().position(|&t| better(i, t)).unwrap_or(top.len());
            top.insert(at, i);
            top.truncate(n);
        }
    }
    (lp(token), top.into_iter().map(|t| (t, lp(t))).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax() {
        let mut s = Sampler::new(SamplerConfig::default());
        assert_eq!(s.sample(&[0.1, 3.0, 2.0]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_excludes_tail() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let cfg = SamplerConfig { temperature: 0.8, top_p: 0.9, top_k: 0, seed: 42, ..Default::default() };
        let a: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        let b: Vec<u32> = {
            let mut s = Sampler::new(cfg.clone());
            (0..100).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(a, b);
        // With a tiny top_p only the best token survives.
        let mut s = Sampler::new(SamplerConfig { top_p: 1e-6, ..cfg });
        let best = sluice_kernels::ops::argmax(&logits) as u32;
        assert!((0..50).all(|_| s.sample(&logits) == best));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with probabilities 0.25 / 0.75 at temperature 1.
        let logits = [0.0f32, (3.0f32).ln()];
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, seed: 7, ..Default::default() });
        let n = 20000;
        let ones = (0..n).filter(|_| s.sample(&logits) == 1).count();
        let frac = ones as f64 / n as f64;
        assert!((frac - 0.75).abs() < 0.02, "{frac}");
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(SamplerConfig { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplerConfig { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplerConfig { top_p: 1.5, ..Default::default() }.validate().is_err());
        assert!(SamplerConfig { min_p: -0.1, ..Default::default() }.validate().is_err());
        assert!(SamplerConfig { presence_penalty: f32::NAN, ..Default::default() }.validate().is_err());
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // Probabilities 0.6, 0.3, 0.1 at temperature 1: min_p 0.4 keeps only the first two.
        let logits = [0.6f32.ln(), 0.3f32.ln(), 0.1f32.ln()];
        let cfg = SamplerConfig { temperature: 1.0, min_p: 0.4, seed: 3, ..Default::default() };
        let mut s = Sampler::new(cfg.clone());
        let picks: Vec<u32> = (0..5000).map(|_| s.sample(&logits)).collect();
        assert!(!picks.contains(&2));
        let ones = picks.iter().filter(|t| **t == 1).count() as f64 / 5000.0;
        assert!((ones - 1.0 / 3.0).abs() < 0.03, "{ones}");
        // Without min_p the third token shows up.
        let mut s = Sampler::new(SamplerConfig { min_p: 0.0, ..cfg });
        assert!((0..5000).any(|_| s.sample(&logits) == 2));
    }

    #[test]
    fn penalties_lower_repeated_tokens() {
        let logits = [1.0f32, 0.9, 0.0];
        // Greedy with a presence penalty: the best token once, then the runner-up.
        let mut s = Sampler::new(SamplerConfig { presence_penalty: 0.5, ..Default::default() });
        assert_eq!((0..3).map(|_| s.sample(&logits)).collect::<Vec<_>>(), vec![0, 1, 0]);
        // A frequency penalty grows with each use.
        let mut s = Sampler::new(SamplerConfig { frequency_penalty: 0.06, ..Default::default() });
        assert_eq!((0..4).map(|_| s.sample(&logits)).collect::<Vec<_>>(), vec![0, 0, 1, 0]);
        // Unpenalized, greedy repeats.
        let mut s = Sampler::new(SamplerConfig::default());
        assert!((0..4).all(|_| s.sample(&logits) == 0));
    }

    #[test]
    fn logprobs_are_log_softmax_and_top_is_sorted() {
        let logits = [2.0f32, 0.5, 2.0, -1.0];
        let mut s = Sampler::new(SamplerConfig::default());
        let r = s.sample_full(&logits, Some(3));
        assert_eq!(r.token, 0);
        let z: f64 = logits.iter().map(|v| (*v as f64).exp()).sum();
        assert!((r.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![0, 2, 1]);
        assert_eq!(r.top[0].1, r.logprob);
        // Penalized logits are what the log-probabilities describe.
        let mut s = Sampler::new(SamplerConfig { presence_penalty: 10.0, ..Default::default() });
        s.sample(&logits);
        let r = s.sample_full(&logits, Some(1));
        assert_eq!(r.token, 2);
        assert_eq!(r.top[0].0, 2);
    }
}

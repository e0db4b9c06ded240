//! Token sampling: greedy, or temperature + top-k + top-p from a seeded generator, so a given
//! seed always picks the same tokens from the same logits.

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
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig { temperature: 0.0, top_p: 1.0, top_k: 0, seed: 0 }
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
        Ok(())
    }
}

pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    pub fn new(cfg: SamplerConfig) -> Sampler {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng }
    }

    pub fn is_greedy(&self) -> bool {
        self.cfg.temperature == 0.0
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() {
            return sluice_kernels::ops::argmax(logits) as u32;
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
        let total: f64 = p[..keep].iter().sum();
        let mut u = self.rng.next_f64() * total;
        for i in 0..keep {
            u -= p[i];
            if u < 0.0 {
                return idx[i];
            }
        }
        idx[keep - 1]
    }
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
        let cfg = SamplerConfig { temperature: 0.8, top_p: 0.9, top_k: 0, seed: 42 };
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
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 7 });
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
    }
}

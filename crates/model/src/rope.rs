//! Rotary position embeddings: the frequency table of each scaling variant real checkpoints
//! use (default, linear, Llama-3, YaRN) and the two pairings (NeoX halves, GPT-J interleaved).

/// How the rotated dimensions are paired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Dimension `i` pairs with `i + d/2` (Hugging Face `rotate_half`; GGUF qwen*, olmoe, gemma).
    Neox,
    /// Dimension `2i` pairs with `2i + 1` (GGUF `llama`, whose converter permutes Q and K).
    Interleaved,
}

#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position: f64,
    },
    Yarn {
        factor: f64,
        original_max_position: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
    /// Per-dimension frequency divisors (GGUF's `rope_freqs.weight`, how Llama 3.1 scaling is stored).
    FreqFactors(Vec<f32>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    /// Rotated dimensions per head (≤ head_dim; the rest pass through).
    pub dim: usize,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// Whether the parameters describe a rotation at all: a positive finite base, rotated
    /// dimensions, scaling factors that are positive finite numbers (a NaN, infinite, zero or
    /// negative one — a damaged file — would give every position the same or no angle, or NaN
    /// logits, without an error), and frequencies that come out finite and positive.
    pub fn check(&self) -> Result<(), String> {
        let positive = |v: f64| v.is_finite() && v > 0.0;
        let must = |ok: bool, what: &str, v: f64| {
            if ok {
                Ok(())
            } else {
                Err(format!("RoPE {what} {v} is not a positive number"))
            }
        };
        must(positive(self.theta), "base (rope_theta / rope.freq_base)", self.theta)?;
        if self.dim == 0 {
            return Err("RoPE rotates no dimensions (rotary dimension 0)".into());
        }
        match &self.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => must(positive(*factor), "scaling factor", *factor)?,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                must(positive(*factor), "scaling factor", *factor)?;
                must(positive(*low_freq_factor), "low_freq_factor", *low_freq_factor)?;
                must(positive(*high_freq_factor), "high_freq_factor", *high_freq_factor)?;
                must(positive(*original_max_position), "original context length", *original_max_position)?;
                if high_freq_factor == low_freq_factor {
                    return Err(format!("RoPE high_freq_factor and low_freq_factor are both {low_freq_factor}"));
                }
            }
            RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor, .. } => {
                must(positive(*factor), "scaling factor", *factor)?;
                must(positive(*original_max_position), "original context length", *original_max_position)?;
                must(positive(*attention_factor), "attention factor", *attention_factor)?;
                if !beta_fast.is_finite() || !beta_slow.is_finite() {
                    return Err(format!("YaRN beta_fast {beta_fast} / beta_slow {beta_slow} are not numbers"));
                }
            }
            RopeScaling::FreqFactors(ff) => {
                if let Some(v) = ff.iter().find(|v| !positive(**v as f64)) {
                    return Err(format!("RoPE frequency factor {v} (rope_freqs) is not a positive number"));
                }
            }
        }
        let r = Rope::new(self.clone());
        match r.inv_freq.iter().find(|f| !positive(**f as f64)) {
            Some(f) => Err(format!("RoPE parameters give the frequency {f}")),
            None => Ok(()),
        }
    }
}

/// Precomputed inverse frequencies and the cos/sin scale.
#[derive(Clone, Debug)]
pub struct Rope {
    pub cfg: RopeConfig,
    pub inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
}

impl Rope {
    pub fn new(cfg: RopeConfig) -> Rope {
        let d = cfg.dim;
        let base: Vec<f64> = (0..d / 2).map(|i| 1.0 / cfg.theta.powf((2 * i) as f64 / d as f64)).collect();
        let (inv, af): (Vec<f64>, f64) = match &cfg.scaling {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::FreqFactors(ff) => (base.iter().zip(ff).map(|(f, d)| f / *d as f64).collect(), 1.0),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let low_wl = original_max_position / low_freq_factor;
                let high_wl = original_max_position / high_freq_factor;
                let v = base
                    .iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f64::consts::PI / f;
                        if wl < high_wl {
                            f
                        } else if wl > low_wl {
                            f / factor
                        } else {
                            let s =
                                (original_max_position / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    })
                    .collect();
                (v, 1.0)
            }
            RopeScaling::Yarn { factor, original_max_position, beta_fast, beta_slow, attention_factor, truncate } => {
                let corr = |rot: f64| {
                    (d as f64 * (original_max_position / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * cfg.theta.ln())
                };
                let (mut lo, mut hi) = (corr(*beta_fast), corr(*beta_slow));
                if *truncate {
                    lo = lo.floor();
                    hi = hi.ceil();
                }
                let lo = lo.max(0.0);
                let mut hi = hi.min(d as f64 - 1.0);
                if lo == hi {
                    hi += 0.001;
                }
                let v = base
                    .iter()
                    .enumerate()
                    .map(|(i, &f)| {
                        let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        let extrap = 1.0 - ramp;
                        (f / factor) * (1.0 - extrap) + f * extrap
                    })
                    .collect();
                (v, *attention_factor)
            }
        };
        Rope { cfg, inv_freq: inv.iter().map(|v| *v as f32).collect(), attention_factor: af as f32 }
    }

    /// YaRN's default attention factor for a context extension `factor`.
    pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            0.1 * mscale * factor.ln() + 1.0
        }
    }

    /// cos and sin of every rotated pair at `pos` (`dim / 2` values each).
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for (i, f) in self.inv_freq.iter().enumerate() {
            let a = pos as f32 * f;
            cos[i] = a.cos() * self.attention_factor;
            sin[i] = a.sin() * self.attention_factor;
        }
    }

    /// Rotates one head vector in place.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        let half = self.cfg.dim / 2;
        match self.cfg.style {
            RopeStyle::Neox => {
                for i in 0..half {
                    let (a, b) = (x[i], x[i + half]);
                    x[i] = a * cos[i] - b * sin[i];
                    x[i + half] = b * cos[i] + a * sin[i];
                }
            }
            RopeStyle::Interleaved => {
                for i in 0..half {
                    let (a, b) = (x[2 * i], x[2 * i + 1]);
                    x[2 * i] = a * cos[i] - b * sin[i];
                    x[2 * i + 1] = b * cos[i] + a * sin[i];
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig { theta: 10000.0, dim: 8, style: RopeStyle::Neox, scaling }
    }

    #[test]
    fn default_frequencies_and_rotation_preserve_norm() {
        let r = Rope::new(cfg(RopeScaling::None));
        assert_eq!(r.inv_freq[0], 1.0);
        assert!((r.inv_freq[1] - 0.1).abs() < 1e-7);
        let mut x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let n0: f32 = x.iter().map(|v| v * v).sum();
        let (mut c, mut s) = ([0f32; 4], [0f32; 4]);
        r.cos_sin(7, &mut c, &mut s);
        r.apply(&mut x, &c, &s);
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-3);
        // Position 0 is the identity.
        let mut y = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        r.cos_sin(0, &mut c, &mut s);
        r.apply(&mut y, &c, &s);
        assert_eq!(y, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    }

    #[test]
    fn llama3_scales_only_low_frequencies() {
        let base = Rope::new(cfg(RopeScaling::None));
        let r = Rope::new(cfg(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position: 64.0,
        }));
        // Wavelength 2π < 16: untouched. Wavelength 2π·1000 > 64: divided by 8.
        assert_eq!(r.inv_freq[0], base.inv_freq[0]);
        assert!((r.inv_freq[3] - base.inv_freq[3] / 8.0).abs() < 1e-9);
    }

    #[test]
    fn yarn_interpolates_between_extrapolation_and_interpolation() {
        let base = Rope::new(cfg(RopeScaling::None));
        let r = Rope::new(cfg(RopeScaling::Yarn {
            factor: 4.0,
            original_max_position: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: Rope::yarn_mscale(4.0, 1.0),
            truncate: true,
        }));
        for (a, b) in r.inv_freq.iter().zip(&base.inv_freq) {
            assert!(*a <= *b && *a >= b / 4.0 - 1e-9);
        }
        assert!((r.attention_factor - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    }
}

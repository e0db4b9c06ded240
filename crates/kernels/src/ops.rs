//! Element-wise and row-wise ops on f32 activations. They touch no weights and cost little
//! next to the matmuls; each is written once, plainly, in an order that does not depend on
//! batch or threads (the compiler vectorizes the loops). The gated-linear-unit activations,
//! whose `exp` the compiler cannot vectorize, have vector lanes of their own (`glu`).

/// `out = x / rms(x) * w` over one row (`w` already f32; norms are tiny).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.len());
    let inv = inv_rms(x, eps);
    for ((o, xv), wv) in out.iter_mut().zip(x).zip(w) {
        *o = xv * inv * wv;
    }
}

/// Like `rms_norm` but in place.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let inv = inv_rms(x, eps);
    for (xv, wv) in x.iter_mut().zip(w) {
        *xv = *xv * inv * wv;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, the mean taken in f64 so the result is the correctly rounded
/// value for any length.
pub fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let var = (ss / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// Softmax in place, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Softmax with a sink: a logit `sink` that joins the denominator but takes no share of
/// the output (gpt-oss's learned per-head sinks), so the probabilities sum to less than one.
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let max = x.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - max).exp();
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// σ(z) = 1 / (1 + e^−z), formed from t = e^−|z| (`float::exp_le0`, which never overflows):
/// 1 / (1 + t) for z ≥ 0, t / (1 + t) below, so neither tail cancels.
#[inline]
fn sigma(z: f32) -> f32 {
    let t = crate::float::exp_le0(-z.abs());
    (if z >= 0.0 { 1.0 } else { t }) / (1.0 + t)
}

/// SiLU, x · σ(x) (`sigma`). The vector lanes of `glu` do the same operations, so every ISA
/// level gives these bits.
#[inline]
pub fn silu(x: f32) -> f32 {
    x * sigma(x)
}

/// σ(x) with libm's `exp`, for the routers' scores and the attention and shared-expert gates.
/// It gives other bits than `sigma` (the GLU activations'); moving these callers to `sigma`
/// would change routing and gate bits by about an ulp, so it is left for a change that
/// re-checks the goldens.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// √(2/π), GELU's tanh-approximation constant, doubled: 0.5 · (1 + tanh y) = σ(2y).
pub(crate) const GELU_2C: f32 = 2.0 * 0.797_884_6;
/// The cubic term's factor in GELU's tanh approximation.
pub(crate) const GELU_A: f32 = 0.044715;

/// GELU, tanh approximation (as in Gemma's `gelu_pytorch_tanh`): 0.5 · x · (1 + tanh y) with
/// y = √(2/π) · (x + 0.044715 · x³), computed as x · σ(2y) (`sigma`), which keeps its precision
/// in the negative tail where 1 + tanh y cancels. The vector lanes of `glu` do the same
/// operations.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    x * sigma(GELU_2C * (x + GELU_A * x * x * x))
}

/// The activation of a gated linear unit (`glu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluAct {
    /// SwiGLU: `silu`.
    Silu,
    /// GeGLU: `gelu_tanh`.
    GeluTanh,
}

impl GluAct {
    /// The activation of one value.
    #[inline]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            GluAct::Silu => silu(x),
            GluAct::GeluTanh => gelu_tanh(x),
        }
    }
}

/// `gate = act(gate) * up`, element-wise (the gated-linear-unit combine of a SwiGLU/GeGLU FFN),
/// eight values per vector operation where the CPU has AVX2; the same bits at every level.
pub fn glu(gate: &mut [f32], up: &[f32], act: GluAct) {
    glu_isa(crate::cpu::isa(), gate, up, act)
}

/// `glu` at a chosen ISA level.
pub fn glu_isa(isa: crate::cpu::Isa, gate: &mut [f32], up: &[f32], act: GluAct) {
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    let done = crate::float::glu_lanes(isa, gate, up, act);
    for (g, u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = act.apply(*g) * u;
    }
}

/// `acc += x`
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    for (a, v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// `acc += s * x` (fused multiply-add per element; runtime-dispatched).
pub fn axpy(acc: &mut [f32], s: f32, x: &[f32]) {
    crate::float::axpy(acc, s, x)
}

/// Index of the largest value (first on ties).
pub fn argmax(x: &[f32]) -> usize {
    let mut best = 0;
    for (i, v) in x.iter().enumerate() {
        if *v > x[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let x = vec![3.0f32; 8];
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let mut out = vec![0f32; 8];
        rms_norm(&x, &w, 0.0, &mut out);
        for (o, wv) in out.iter().zip(&w) {
            assert!((o - wv).abs() < 1e-6);
        }
    }

    #[test]
    fn softmax_sums_to_one_and_keeps_order() {
        let mut x = vec![1.0f32, 3.0, 2.0, -1000.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[1] > x[2] && x[2] > x[0] && x[3] == 0.0);
    }

    #[test]
    fn a_sink_takes_its_share_of_the_denominator_only() {
        let mut x = vec![0.0f32, 0.0];
        softmax_with_sink(&mut x, 0.0);
        assert!((x[0] - 1.0 / 3.0).abs() < 1e-7 && (x[1] - 1.0 / 3.0).abs() < 1e-7);
        // A sink far above every score leaves almost nothing; far below, plain softmax.
        let mut y = vec![1.0f32, 2.0];
        softmax_with_sink(&mut y, 50.0);
        assert!(y.iter().sum::<f32>() < 1e-20);
        let (mut a, mut b) = (vec![1.0f32, 3.0, 2.0], vec![1.0f32, 3.0, 2.0]);
        softmax_with_sink(&mut a, f32::NEG_INFINITY);
        softmax(&mut b);
        assert_eq!(a, b);
    }

    /// Values across the activations' range: small, moderate, large, both signs, zeros and
    /// the extremes.
    fn activation_inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (-4000..4000).map(|i| i as f32 * 0.0123).collect();
        v.extend([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 88.0, -88.0, 90.0, -90.0, 1e4, -1e4, f32::MAX, f32::MIN]);
        v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN]);
        v
    }

    #[test]
    fn activations_are_close_to_their_f64_definitions() {
        for x in activation_inputs().into_iter().filter(|x| x.abs() < 1e4) {
            let xd = x as f64;
            let silu_want = xd / (1.0 + (-xd).exp());
            let y = 0.797_884_560_802_865_4 * (xd + 0.044715 * xd * xd * xd);
            let gelu_want = 0.5 * xd * (1.0 + y.tanh());
            for (got, want) in [(silu(x) as f64, silu_want), (gelu_tanh(x) as f64, gelu_want)] {
                // Relative to the value, with an absolute floor where tanh's cancellation
                // meets values near zero.
                assert!((got - want).abs() <= 4e-7 * want.abs() + 1e-7 * xd.abs().min(1.0), "x {x}: {got} vs {want}");
            }
        }
        assert_eq!(silu(f32::INFINITY), f32::INFINITY);
        assert_eq!(gelu_tanh(f32::INFINITY), f32::INFINITY);
        assert_eq!(silu(-90.0), -0.0);
        assert!(silu(f32::NAN).is_nan() && gelu_tanh(f32::NAN).is_nan());
    }

    #[test]
    fn glu_has_the_same_bits_at_every_isa_level() {
        let x = activation_inputs();
        let up: Vec<f32> = (0..x.len()).map(|i| 1.0 - (i % 7) as f32 * 0.37).collect();
        for act in [GluAct::Silu, GluAct::GeluTanh] {
            let want: Vec<u32> = x.iter().zip(&up).map(|(g, u)| (act.apply(*g) * u).to_bits()).collect();
            for isa in crate::cpu::Isa::supported() {
                // Every length's tail, so the vector body and the scalar rest both run.
                for len in [x.len(), x.len() - 3, 5] {
                    let mut g = x[..len].to_vec();
                    glu_isa(isa, &mut g, &up[..len], act);
                    let got: Vec<u32> = g.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want[..len], "{act:?} at {isa:?}, {len} values");
                }
            }
        }
    }

    #[test]
    fn activations_at_known_points() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert_eq!(argmax(&[1.0, 5.0, 5.0, 2.0]), 1);
    }
}

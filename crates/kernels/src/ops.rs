//! Element-wise and row-wise ops on f32 activations. They touch no weights and cost little
//! next to the matmuls; each is written once, plainly, in an order that does not depend on
//! batch or threads (the compiler vectorizes the loops).

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

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as in Gemma's `gelu_pytorch_tanh`).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2/pi)
    0.5 * x * (1.0 + (C * (x + 0.044715 * x * x * x)).tanh())
}

/// `gate = act(gate) * up`, element-wise (the gated-linear-unit combine of a SwiGLU/GeGLU FFN).
pub fn glu(gate: &mut [f32], up: &[f32], act: fn(f32) -> f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
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

    #[test]
    fn activations_at_known_points() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert_eq!(argmax(&[1.0, 5.0, 5.0, 2.0]), 1);
    }
}

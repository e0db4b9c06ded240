//! The ops of a Gated DeltaNet layer: the causal depthwise convolution, the gated delta rule
//! and the gated RMSNorm. Each has a scalar reference (`*_ref`) and a dispatched version that
//! must give the same bits (the kernel lab and the tests check it):
//!
//! * the convolution is one fused multiply-add chain per (token, channel), taps in order, so
//!   vector lanes over channels compute exactly the scalar chain;
//! * the delta rule's dot products follow the float contract of `float` (16 lane
//!   accumulators, tree sum), and its updates are element-wise fused multiply-adds;
//! * everything runs token after token, so a sequence gives the same bits whether it arrives
//!   in one call or many (prefill = decode = any chunking).

use crate::cpu::Isa;
use crate::float::{reduce16, LANES};
use crate::ops;

/// `out[t][c] = silu(Σ_j w[c][j] · x[t + j][c])` for `n` tokens of `c` channels: `x` holds
/// `kernel − 1` earlier rows, then the `n` new ones (`(kernel − 1 + n) × c`); `w` is
/// `c × kernel` (tap `kernel − 1` multiplies the current token).
pub fn conv1d_silu_ref(x: &[f32], w: &[f32], kernel: usize, n: usize, out: &mut [f32]) {
    let c = w.len() / kernel;
    assert_eq!(x.len(), (kernel - 1 + n) * c);
    assert_eq!(out.len(), n * c);
    for t in 0..n {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc = w[ch * kernel + j].mul_add(x[(t + j) * c + ch], acc);
            }
            out[t * c + ch] = ops::silu(acc);
        }
    }
}

/// `conv1d_silu_ref`, vectorized over channels.
pub fn conv1d_silu(x: &[f32], w: &[f32], kernel: usize, n: usize, out: &mut [f32]) {
    conv1d_silu_isa(crate::cpu::isa(), x, w, kernel, n, out)
}

/// `conv1d_silu` at a chosen ISA level.
pub fn conv1d_silu_isa(isa: Isa, x: &[f32], w: &[f32], kernel: usize, n: usize, out: &mut [f32]) {
    let c = w.len() / kernel;
    assert_eq!(x.len(), (kernel - 1 + n) * c);
    assert_eq!(out.len(), n * c);
    // Taps transposed to (kernel, c) so lanes read consecutive channels.
    let mut wt = vec![0f32; kernel * c];
    for ch in 0..c {
        for j in 0..kernel {
            wt[j * c + ch] = w[ch * kernel + j];
        }
    }
    for t in 0..n {
        let o = &mut out[t * c..(t + 1) * c];
        o.fill(0.0);
        for j in 0..kernel {
            // acc = fma(w, x, acc), element-wise: the same chain as the reference.
            fma_rows(isa, o, &wt[j * c..(j + 1) * c], &x[(t + j) * c..(t + j + 1) * c]);
        }
        for v in o.iter_mut() {
            *v = ops::silu(*v);
        }
    }
}

/// `acc[i] = fma(a[i], b[i], acc[i])`.
fn fma_rows(isa: Isa, acc: &mut [f32], a: &[f32], b: &[f32]) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA level was detected on this CPU; the slices have equal lengths.
        Isa::Avx2 | Isa::Avx512 => unsafe { x86::fma_rows(acc, a, b) },
        _ => {
            for ((o, x), y) in acc.iter_mut().zip(a).zip(b) {
                *o = x.mul_add(*y, *o);
            }
        }
    }
}

/// One value head of the gated delta rule over `n` tokens.
///
/// The state S (d_k × d_v) is stored one value column after another (`s[j·d_k + i]` = S[i, j]).
/// `s_old` is the state before the first token; the state after the last one is written to
/// `s_new` (the two never alias). Per token t, with `decay` = exp(g_t):
///
/// ```text
/// S  ← decay · S
/// m  = Sᵀ k_t                 (one dot product per column)
/// δ  = β_t · (v_t − m)
/// S  ← S + k_t δᵀ              (an axpy per column)
/// o_t = Sᵀ q_t                (the updated state)
/// ```
/// `q`, `k` are `n × d_k`, `v` and `out` are `n × d_v`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_ref(
    s_old: &[f32],
    s_new: &mut [f32],
    d_k: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    decay: &[f32],
    out: &mut [f32],
) {
    delta_rule_with(s_old, s_new, d_k, q, k, v, beta, decay, out, dot_ref, |acc, s, x| {
        for (a, xv) in acc.iter_mut().zip(x) {
            *a = s.mul_add(*xv, *a);
        }
    })
}

/// `delta_rule_ref` with the dispatched dot product and axpy.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule(
    s_old: &[f32],
    s_new: &mut [f32],
    d_k: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    decay: &[f32],
    out: &mut [f32],
) {
    delta_rule_isa(crate::cpu::isa(), s_old, s_new, d_k, q, k, v, beta, decay, out)
}

/// `delta_rule` at a chosen ISA level.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_isa(
    isa: Isa,
    s_old: &[f32],
    s_new: &mut [f32],
    d_k: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    decay: &[f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && d_k.is_multiple_of(LANES) {
        check_delta_args(s_old, s_new, d_k, q, k, v, beta, decay, out);
        // SAFETY: AVX2 and FMA were detected (isa ≥ Avx2); the argument lengths were checked
        // and d_k is a whole number of 16-lane chunks.
        unsafe { x86::delta_rule(s_old, s_new, d_k, q, k, v, beta, decay, out) };
        return;
    }
    let dot = |a: &[f32], b: &[f32]| crate::float::dot_f32_isa(isa, a, b);
    let axpy = |acc: &mut [f32], s: f32, x: &[f32]| crate::float::axpy_isa(isa, acc, s, x);
    delta_rule_with(s_old, s_new, d_k, q, k, v, beta, decay, out, dot, axpy)
}

#[allow(clippy::too_many_arguments)]
fn check_delta_args(
    s_old: &[f32],
    s_new: &[f32],
    d_k: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    decay: &[f32],
    out: &[f32],
) {
    let n = beta.len();
    let d_v = s_old.len() / d_k;
    assert!(n > 0 && s_old.len() == s_new.len() && s_old.len() == d_k * d_v);
    assert!(q.len() == n * d_k && k.len() == n * d_k && v.len() == n * d_v && out.len() == n * d_v);
    assert_eq!(decay.len(), n);
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn delta_rule_with(
    s_old: &[f32],
    s_new: &mut [f32],
    d_k: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    beta: &[f32],
    decay: &[f32],
    out: &mut [f32],
    dot: impl Fn(&[f32], &[f32]) -> f32,
    axpy: impl Fn(&mut [f32], f32, &[f32]),
) {
    check_delta_args(s_old, s_new, d_k, q, k, v, beta, decay, out);
    let (n, d_v) = (beta.len(), s_old.len() / d_k);
    for t in 0..n {
        let (qt, kt) = (&q[t * d_k..(t + 1) * d_k], &k[t * d_k..(t + 1) * d_k]);
        for j in 0..d_v {
            let row = &mut s_new[j * d_k..(j + 1) * d_k];
            if t == 0 {
                for (r, o) in row.iter_mut().zip(&s_old[j * d_k..(j + 1) * d_k]) {
                    *r = o * decay[0];
                }
            } else {
                row.iter_mut().for_each(|r| *r *= decay[t]);
            }
            let m = dot(row, kt);
            let delta = beta[t] * (v[t * d_v + j] - m);
            axpy(row, delta, kt);
            out[t * d_v + j] = dot(row, qt);
        }
    }
}

/// f32 dot product in the float contract's order (16 lanes, zero-padded tail, tree sum).
pub fn dot_ref(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    for c in 0..a.len().div_ceil(LANES) {
        for (l, s) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            let (x, y) = if i < a.len() { (a[i], b[i]) } else { (0.0, 0.0) };
            *s = x.mul_add(y, *s);
        }
    }
    reduce16(acc)
}

/// The gated RMSNorm of one head's output: `out = (x / rms(x)) · w · silu(z)`.
pub fn gated_rms_norm(x: &[f32], z: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = ops::inv_rms(x, eps);
    for (((o, xv), zv), wv) in out.iter_mut().zip(x).zip(z).zip(w) {
        *o = *xv * inv * wv * ops::silu(*zv);
    }
}

/// x / sqrt(Σx² + eps), in place (the sum taken in f64, so it is correctly rounded).
pub fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|v| (*v as f64) * (*v as f64)).sum();
    let inv = 1.0 / ((ss as f32) + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

/// PyTorch's softplus (β = 1, threshold 20): ln(1 + eˣ), and x itself above 20.
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The float contract's tree sum of 16 lanes held as (lanes 0..8, lanes 8..16): lane l
    /// adds lane l+8, then l+4, l+2, l+1.
    ///
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked.
    #[inline(always)]
    unsafe fn reduce16(lo: __m256, hi: __m256) -> f32 {
        let a = _mm256_add_ps(lo, hi); // a[l] = lane l + lane l+8
        let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); // + l+4
        let c = _mm_add_ps(b, _mm_movehl_ps(b, b)); // + l+2
        let d = _mm_add_ss(c, _mm_shuffle_ps(c, c, 1)); // + l+1
        _mm_cvtss_f32(d)
    }

    /// The delta rule, one value column at a time in two fused passes over its d_k values:
    /// decay and the dot product with k, then the rank-one update and the dot product with
    /// q. Each dot product keeps the contract's 16 lanes (two 8-lane registers).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (the caller checked `cpu::isa()`); the argument lengths are
    /// consistent (`check_delta_args`) and `d_k` is a multiple of 16.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn delta_rule(
        s_old: &[f32],
        s_new: &mut [f32],
        d_k: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        beta: &[f32],
        decay: &[f32],
        out: &mut [f32],
    ) {
        let n = beta.len();
        let d_v = s_old.len() / d_k;
        for t in 0..n {
            let (qt, kt) = (q.as_ptr().add(t * d_k), k.as_ptr().add(t * d_k));
            let dec = _mm256_set1_ps(decay[t]);
            for j in 0..d_v {
                let row = s_new.as_mut_ptr().add(j * d_k);
                let src = if t == 0 { s_old.as_ptr().add(j * d_k) } else { row as *const f32 };
                let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c < d_k {
                    let r0 = _mm256_mul_ps(_mm256_loadu_ps(src.add(c)), dec);
                    let r1 = _mm256_mul_ps(_mm256_loadu_ps(src.add(c + 8)), dec);
                    _mm256_storeu_ps(row.add(c), r0);
                    _mm256_storeu_ps(row.add(c + 8), r1);
                    lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(kt.add(c)), lo);
                    hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(kt.add(c + 8)), hi);
                    c += 16;
                }
                let m = reduce16(lo, hi);
                let delta = _mm256_set1_ps(beta[t] * (v[t * d_v + j] - m));
                let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c < d_k {
                    let r0 = _mm256_fmadd_ps(delta, _mm256_loadu_ps(kt.add(c)), _mm256_loadu_ps(row.add(c)));
                    let r1 = _mm256_fmadd_ps(delta, _mm256_loadu_ps(kt.add(c + 8)), _mm256_loadu_ps(row.add(c + 8)));
                    _mm256_storeu_ps(row.add(c), r0);
                    _mm256_storeu_ps(row.add(c + 8), r1);
                    lo = _mm256_fmadd_ps(r0, _mm256_loadu_ps(qt.add(c)), lo);
                    hi = _mm256_fmadd_ps(r1, _mm256_loadu_ps(qt.add(c + 8)), hi);
                    c += 16;
                }
                out[t * d_v + j] = reduce16(lo, hi);
            }
        }
    }

    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (the caller checked `cpu::isa()`); the slices have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_rows(acc: &mut [f32], a: &[f32], b: &[f32]) {
        let n = acc.len().min(a.len()).min(b.len());
        let (o, x, y) = (acc.as_mut_ptr(), a.as_ptr(), b.as_ptr());
        let mut i = 0;
        while i + 8 <= n {
            let r = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i)), _mm256_loadu_ps(y.add(i)), _mm256_loadu_ps(o.add(i)));
            _mm256_storeu_ps(o.add(i), r);
            i += 8;
        }
        while i < n {
            *o.add(i) = (*x.add(i)).mul_add(*y.add(i), *o.add(i));
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wave(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.37 + seed).sin() * 0.8).collect()
    }

    #[test]
    fn conv_matches_its_reference_and_a_direct_sum() {
        let (c, kernel, n) = (37, 4, 5);
        let x = wave((kernel - 1 + n) * c, 0.1);
        let w = wave(c * kernel, 0.7);
        let mut a = vec![0f32; n * c];
        let mut b = vec![0f32; n * c];
        conv1d_silu_ref(&x, &w, kernel, n, &mut a);
        conv1d_silu(&x, &w, kernel, n, &mut b);
        assert!(crate::compare::same_bits(&a, &b));
        // Token 2, channel 5, written out.
        let pre: f64 = (0..kernel).map(|j| w[5 * kernel + j] as f64 * x[(2 + j) * c + 5] as f64).sum();
        let want = pre / (1.0 + (-pre).exp());
        assert!((a[2 * c + 5] as f64 - want).abs() < 1e-6);
    }

    /// The delta rule written with plain f64 loops over an explicit d_k × d_v matrix.
    fn naive(
        s0: &[f32],
        d_k: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        beta: &[f32],
        decay: &[f32],
    ) -> (Vec<f64>, Vec<f64>) {
        let d_v = s0.len() / d_k;
        let mut s: Vec<f64> = s0.iter().map(|x| *x as f64).collect(); // [j][i]
        let mut out = Vec::new();
        for t in 0..beta.len() {
            s.iter_mut().for_each(|x| *x *= decay[t] as f64);
            for j in 0..d_v {
                let m: f64 = (0..d_k).map(|i| s[j * d_k + i] * k[t * d_k + i] as f64).sum();
                let delta = beta[t] as f64 * (v[t * d_v + j] as f64 - m);
                for i in 0..d_k {
                    s[j * d_k + i] += k[t * d_k + i] as f64 * delta;
                }
            }
            for j in 0..d_v {
                out.push((0..d_k).map(|i| s[j * d_k + i] * q[t * d_k + i] as f64).sum());
            }
        }
        (s, out)
    }

    #[test]
    fn delta_rule_matches_its_reference_and_the_formula_and_any_chunking() {
        // d_k 20 takes the generic path, 32 the fused 16-lane one.
        for d_k in [20, 32] {
            delta_rule_case(d_k);
        }
    }

    fn delta_rule_case(d_k: usize) {
        let (d_v, n) = (12, 7);
        let s0 = wave(d_k * d_v, 0.3);
        // Unit keys, as the model feeds them (the rule is only stable for ‖k‖ ≤ 1 with β ≤ 1).
        let (q, mut k, v) = (wave(n * d_k, 1.0), wave(n * d_k, 2.0), wave(n * d_v, 3.0));
        k.chunks_mut(d_k).for_each(|r| l2_normalize(r, 1e-6));
        let beta: Vec<f32> = (0..n).map(|t| 0.2 + 0.1 * t as f32).collect();
        let decay: Vec<f32> = (0..n).map(|t| 0.9 - 0.05 * t as f32).collect();
        let (mut s1, mut s2) = (vec![0f32; d_k * d_v], vec![0f32; d_k * d_v]);
        let (mut o1, mut o2) = (vec![0f32; n * d_v], vec![0f32; n * d_v]);
        delta_rule_ref(&s0, &mut s1, d_k, &q, &k, &v, &beta, &decay, &mut o1);
        for isa in crate::cpu::Isa::supported() {
            delta_rule_isa(isa, &s0, &mut s2, d_k, &q, &k, &v, &beta, &decay, &mut o2);
            assert!(crate::compare::same_bits(&s1, &s2) && crate::compare::same_bits(&o1, &o2), "{isa:?}");
        }
        let (sn, on) = naive(&s0, d_k, &q, &k, &v, &beta, &decay);
        for (a, b) in o1.iter().zip(&on).chain(s1.iter().zip(&sn)) {
            assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        // Three tokens, then four: the same bits as seven at once.
        let (mut sa, mut sb) = (vec![0f32; d_k * d_v], vec![0f32; d_k * d_v]);
        let mut o3 = vec![0f32; n * d_v];
        delta_rule(
            &s0,
            &mut sa,
            d_k,
            &q[..3 * d_k],
            &k[..3 * d_k],
            &v[..3 * d_v],
            &beta[..3],
            &decay[..3],
            &mut o3[..3 * d_v],
        );
        delta_rule(
            &sa,
            &mut sb,
            d_k,
            &q[3 * d_k..],
            &k[3 * d_k..],
            &v[3 * d_v..],
            &beta[3..],
            &decay[3..],
            &mut o3[3 * d_v..],
        );
        assert!(crate::compare::same_bits(&o3, &o1) && crate::compare::same_bits(&sb, &s1));
    }

    #[test]
    fn norms_and_softplus() {
        let mut x = vec![3.0f32, 4.0];
        l2_normalize(&mut x, 0.0);
        assert!((x[0] - 0.6).abs() < 1e-7 && (x[1] - 0.8).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        let mut o = vec![0f32; 2];
        gated_rms_norm(&[1.0, -1.0], &[0.0, 50.0], &[2.0, 3.0], 0.0, &mut o);
        assert_eq!(o[0], 0.0); // silu(0) = 0
        assert!((o[1] + 150.0).abs() < 1e-3);
    }
}

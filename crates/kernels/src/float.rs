//! Dot products and matrix-vector tiles for float weights (F32, F16, BF16) against f32
//! activations.
//!
//! The reduction order is part of the contract: a dot product of length `k` keeps 16 lane
//! accumulators, lane `l` accumulates elements `16c + l` with a fused multiply-add, in order of
//! `c`; a final partial chunk is zero-padded; the lanes are then summed as a tree (8, 4, 2, 1).
//! The scalar reference, the AVX2 and the AVX-512 variants all follow it, so they agree to the
//! bit, and a row's result never depends on which other rows or tokens share the tile.

use crate::dtype::DType;
use half::{bf16, f16};

pub const LANES: usize = 16;

/// Tree-sums 16 lane accumulators in the fixed order (8, 4, 2, 1).
#[inline(always)]
pub fn reduce16(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w > 0 {
        for l in 0..w {
            a[l] += a[l + w];
        }
        w /= 2;
    }
    a[0]
}

/// Element `i` of a float row stored as `dtype`.
#[inline(always)]
pub fn load_elem(dtype: DType, row: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([row[4 * i], row[4 * i + 1], row[4 * i + 2], row[4 * i + 3]]),
        DType::BF16 => bf16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32(),
        DType::F16 => f16::from_bits(u16::from_le_bytes([row[2 * i], row[2 * i + 1]])).to_f32(),
        _ => panic!("load_elem on block type {dtype}"),
    }
}

/// Scalar reference: dot product of a stored float row with `x`, in the contract's order.
pub fn dot_ref(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let k = x.len();
    let mut acc = [0f32; LANES];
    for c in 0..k.div_ceil(LANES) {
        for (l, a) in acc.iter_mut().enumerate() {
            let i = c * LANES + l;
            let (w, xv) = if i < k { (load_elem(dtype, row, i), x[i]) } else { (0.0, 0.0) };
            *a = w.mul_add(xv, *a);
        }
    }
    reduce16(acc)
}

/// f32 · f32 in the contract's order (attention scores use it).
#[inline]
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    dot_f32_isa(crate::cpu::isa(), a, b)
}

/// `dot_f32` at a chosen ISA level.
#[inline]
pub fn dot_f32_isa(isa: crate::cpu::Isa, a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    // SAFETY: lengths are equal; the pointers cover `a.len()` f32 each.
    let bytes = unsafe { std::slice::from_raw_parts(a.as_ptr() as *const u8, a.len() * 4) };
    let mut out = [0f32; 1];
    tile(isa, DType::F32, &[bytes], &[b], &mut out, 1);
    out[0]
}

/// `acc[i] = fma(s, x[i], acc[i])`, element by element (the same bits at every ISA level).
pub fn axpy(acc: &mut [f32], s: f32, x: &[f32]) {
    axpy_isa(crate::cpu::isa(), acc, s, x)
}

/// `axpy` at a chosen ISA level (the kernel lab and tests compare the levels).
pub fn axpy_isa(isa: crate::cpu::Isa, acc: &mut [f32], s: f32, x: &[f32]) {
    assert_eq!(acc.len(), x.len());
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA level was detected on this CPU; slices have equal lengths.
        crate::cpu::Isa::Avx512 | crate::cpu::Isa::Avx2 => unsafe { x86::axpy_fma(acc, s, x) },
        _ => {
            for (a, v) in acc.iter_mut().zip(x) {
                *a = s.mul_add(*v, *a);
            }
        }
    }
}

/// Dot products of `q` with `n` rows of `keys` (row `j` starts at `j * stride`), each in the
/// contract's order, scaled by `scale`.
pub fn dots_f32(q: &[f32], keys: &[f32], stride: usize, n: usize, scale: f32, out: &mut [f32]) {
    dots_f32_multi(&[q], keys, stride, n, scale, &mut [out]);
}

/// `dots_f32` for up to four queries at once (`outs[h]` receives `qs[h]`'s scores): each eight
/// keys are read once for all of them. A tile's (row, token) pair never depends on the others
/// that share it, so every score has the bits `dots_f32` gives that query alone.
pub fn dots_f32_multi(qs: &[&[f32]], keys: &[f32], stride: usize, n: usize, scale: f32, outs: &mut [&mut [f32]]) {
    dots_f32_multi_isa(crate::cpu::isa(), qs, keys, stride, n, scale, outs)
}

/// `dots_f32_multi` at a chosen ISA level.
pub fn dots_f32_multi_isa(
    isa: crate::cpu::Isa,
    qs: &[&[f32]],
    keys: &[f32],
    stride: usize,
    n: usize,
    scale: f32,
    outs: &mut [&mut [f32]],
) {
    assert!((1..=4).contains(&qs.len()) && outs.len() == qs.len(), "dots_f32_multi: one to four queries");
    let k = qs[0].len();
    assert!(qs.iter().all(|q| q.len() == k) && outs.iter().all(|o| o.len() >= n));
    assert!(n == 0 || (n - 1) * stride + k <= keys.len(), "dots_f32_multi: keys too short");
    #[cfg(target_arch = "x86_64")]
    if isa >= crate::cpu::Isa::Avx2 && k > 0 && k.is_multiple_of(LANES) {
        // SAFETY: AVX2/FMA were detected (`isa` comes from this CPU); `keys` holds n rows of k
        // from `stride` apart and every output n scores (asserted).
        unsafe {
            match qs.len() {
                1 => x86::scores_avx2(qs[0], keys, stride, n, scale, outs[0]),
                2 => x86::scores_many_avx2::<2>(qs, keys, stride, n, scale, outs),
                3 => x86::scores_many_avx2::<3>(qs, keys, stride, n, scale, outs),
                _ => x86::scores_many_avx2::<4>(qs, keys, stride, n, scale, outs),
            }
        }
        return;
    }
    let mut j = 0;
    let mut buf = [0f32; 32];
    while j < n {
        let m = (n - j).min(8);
        let mut rows: [&[u8]; 8] = [&[]; 8];
        for (r, row) in rows.iter_mut().enumerate().take(m) {
            let kr = &keys[(j + r) * stride..(j + r) * stride + k];
            // SAFETY: reinterpreting an f32 slice as its bytes.
            *row = unsafe { std::slice::from_raw_parts(kr.as_ptr() as *const u8, k * 4) };
        }
        tile(isa, DType::F32, &rows[..m], qs, &mut buf, 8);
        for (h, out) in outs.iter_mut().enumerate() {
            for r in 0..m {
                out[j + r] = buf[h * 8 + r] * scale;
            }
        }
        j += m;
    }
}

/// `out = Σ_j w[j] · row_j` (row `j` is `rows[j * stride..][..out.len()]`) as one fused
/// multiply-add per (row, element), from zero, rows in order: the bits of zeroing `out` and
/// running `axpy(out, w[j], row_j)` for each j in turn, with `out` kept in registers across the
/// rows instead of loaded and stored for each (attention's weighted sum of values).
pub fn weighted_rows(out: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    weighted_rows_isa(crate::cpu::isa(), out, w, rows, stride)
}

/// `weighted_rows` for up to four weight vectors over the same rows (`outs[h]` from `ws[h]`),
/// each row read once for them all where the width is whole 16-element pieces: every output has
/// the bits `weighted_rows` gives it alone.
pub fn weighted_rows_multi(outs: &mut [&mut [f32]], ws: &[&[f32]], rows: &[f32], stride: usize) {
    weighted_rows_multi_isa(crate::cpu::isa(), outs, ws, rows, stride)
}

/// `weighted_rows_multi` at a chosen ISA level.
pub fn weighted_rows_multi_isa(
    isa: crate::cpu::Isa,
    outs: &mut [&mut [f32]],
    ws: &[&[f32]],
    rows: &[f32],
    stride: usize,
) {
    assert!((1..=4).contains(&ws.len()) && outs.len() == ws.len(), "weighted_rows_multi: one to four sums");
    let (d, n) = (outs[0].len(), ws[0].len());
    assert!(outs.iter().all(|o| o.len() == d) && ws.iter().all(|w| w.len() == n));
    assert!(n == 0 || (n - 1) * stride + d <= rows.len(), "weighted_rows_multi: rows too short");
    #[cfg(target_arch = "x86_64")]
    if isa >= crate::cpu::Isa::Avx2 && ws.len() > 1 && d > 0 && d.is_multiple_of(16) {
        // SAFETY: AVX2/FMA were detected (`isa` comes from this CPU); `rows` holds n rows of d
        // from `stride` apart and every weight vector n values (asserted).
        unsafe {
            match ws.len() {
                2 => x86::weighted_rows_many_fma::<2>(outs, ws, rows, stride),
                3 => x86::weighted_rows_many_fma::<3>(outs, ws, rows, stride),
                _ => x86::weighted_rows_many_fma::<4>(outs, ws, rows, stride),
            }
        }
        return;
    }
    for (o, w) in outs.iter_mut().zip(ws) {
        weighted_rows_isa(isa, o, w, rows, stride);
    }
}

/// The attention softmax of a row of scores, in place, with an optional sink (a logit that
/// joins the denominator and takes no share: gpt-oss). The maximum is subtracted first, so
/// `exp` only meets arguments ≤ 0 (`exp_le0`); the exponentials are summed in eight lanes
/// (element i in lane i mod 8), the lanes added as a fixed tree, the sink's term last, and every
/// element multiplied by the reciprocal of the total. Every ISA level does exactly these
/// operations, so a row's probabilities are the same bits at each level, in any batch.
pub fn softmax(x: &mut [f32], sink: Option<f32>) {
    softmax_isa(crate::cpu::isa(), x, sink)
}

/// `softmax` at a chosen ISA level.
pub fn softmax_isa(isa: crate::cpu::Isa, x: &mut [f32], sink: Option<f32>) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().copied().fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
    let lanes = match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA level was detected on this CPU (AVX2 and FMA).
        crate::cpu::Isa::Avx512 | crate::cpu::Isa::Avx2 => unsafe { x86::exp_rows_avx2(x, max) },
        _ => {
            let mut lanes = [0f32; 8];
            for (i, v) in x.iter_mut().enumerate() {
                *v = exp_le0(*v - max);
                lanes[i % 8] += *v;
            }
            lanes
        }
    };
    let l = lanes;
    let mut total = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    if let Some(s) = sink {
        total += exp_le0(s - max);
    }
    let inv = 1.0 / total;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// ln(2⁻¹²⁶): below it `exp_le0` is 0.
const EXP_MIN: f32 = -87.336_55;
/// ln 2 in two parts: the high part has 16 trailing zero bits, so n · `LN2_HI` is exact.
const LN2_HI: f32 = f32::from_bits(0x3f31_7200);
const LN2_LO: f32 = 1.428_606_8e-6;
/// 1/6!, 1/5!, 1/4!, 1/3!, 1/2!: the Taylor polynomial of exp on |r| ≤ ln 2 / 2 (the rest
/// under 2·10⁻⁷ relative).
const EXP_POLY: [f32; 5] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5];

/// e^x for x ≤ 0, within about one ulp: n = round(x · log₂e), r = x − n · ln 2, a degree-6
/// polynomial in r by fused multiply-adds, times 2ⁿ built from its bits; 0 below `EXP_MIN`
/// (and for NaN). The AVX2 lanes (`x86::exp8_le0`) do the same operations.
#[inline]
pub fn exp_le0(x: f32) -> f32 {
    if x.is_nan() || x < EXP_MIN {
        return 0.0;
    }
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p.mul_add(r, *c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// The vector part of `ops::glu_isa`: `gate[i] = act(gate[i]) * up[i]` over the whole
/// vectors of eight values at the front, with `ops::silu`'s or `ops::gelu_tanh`'s operations
/// in each lane; returns how many values it did (none at the scalar level).
pub(crate) fn glu_lanes(isa: crate::cpu::Isa, gate: &mut [f32], up: &[f32], act: crate::ops::GluAct) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA level was detected on this CPU (AVX2 and FMA).
        crate::cpu::Isa::Avx512 | crate::cpu::Isa::Avx2 => unsafe { x86::glu_avx2(gate, up, act) },
        _ => 0,
    }
}

/// `weighted_rows` at a chosen ISA level.
pub fn weighted_rows_isa(isa: crate::cpu::Isa, out: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
    let d = out.len();
    assert!(w.is_empty() || (w.len() - 1) * stride + d <= rows.len(), "weighted_rows: rows too short");
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA level was detected on this CPU; `rows` holds every row (asserted).
        crate::cpu::Isa::Avx512 | crate::cpu::Isa::Avx2 => unsafe { x86::weighted_rows_fma(out, w, rows, stride) },
        _ => {
            out.fill(0.0);
            for (j, s) in w.iter().enumerate() {
                for (o, v) in out.iter_mut().zip(&rows[j * stride..j * stride + d]) {
                    *o = s.mul_add(*v, *o);
                }
            }
        }
    }
}

/// Computes `out[t * ldo + r] = dot(rows[r], xs[t])` for up to 8 rows and 4 tokens.
pub fn tile(isa: crate::cpu::Isa, dtype: DType, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32], ldo: usize) {
    use crate::cpu::Isa;
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa` was detected (or lowered) from this CPU's features.
        Isa::Avx512 => unsafe { x86::tile_avx512(dtype, rows, xs, out, ldo) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { x86::tile_avx2(dtype, rows, xs, out, ldo) },
        _ => {
            for (r, row) in rows.iter().enumerate() {
                for (t, x) in xs.iter().enumerate() {
                    out[t * ldo + r] = dot_ref(dtype, row, x);
                }
            }
        }
    }
}

/// Widens a zero-padded final chunk of a row (fewer than 16 elements) to f32.
#[inline(always)]
fn tail_f32(dtype: DType, row: &[u8], start: usize, k: usize) -> [f32; LANES] {
    let mut t = [0f32; LANES];
    for (l, v) in t.iter_mut().enumerate().take(k - start) {
        *v = load_elem(dtype, row, start + l);
    }
    t
}

#[inline(always)]
fn tail_x(x: &[f32], start: usize) -> [f32; LANES] {
    let mut t = [0f32; LANES];
    t[..x.len() - start].copy_from_slice(&x[start..]);
    t
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// e^x in each lane for x ≤ 0: `exp_le0`'s operations.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn exp8_le0(x: __m256) -> __m256 {
        let ok = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(std::f32::consts::LOG2_E),
        ));
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_HI), x);
        let r = _mm256_fmadd_ps(n, _mm256_set1_ps(-LN2_LO), r);
        let mut p = _mm256_set1_ps(EXP_POLY[0]);
        for c in &EXP_POLY[1..] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let one = _mm256_set1_ps(1.0);
        p = _mm256_fmadd_ps(p, r, one);
        p = _mm256_fmadd_ps(p, r, one);
        // Lanes below EXP_MIN (their n may be out of range) are masked to 0.
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
        _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), ok)
    }

    /// `ops::sigma` in each lane.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn sigma8(z: __m256) -> __m256 {
        let t = exp8_le0(_mm256_or_ps(z, _mm256_set1_ps(-0.0)));
        let one = _mm256_set1_ps(1.0);
        let nonneg = _mm256_cmp_ps::<_CMP_GE_OQ>(z, _mm256_setzero_ps());
        _mm256_div_ps(_mm256_blendv_ps(t, one, nonneg), _mm256_add_ps(one, t))
    }

    /// `ops::silu` in each lane.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn silu8(x: __m256) -> __m256 {
        _mm256_mul_ps(x, sigma8(x))
    }

    /// `ops::gelu_tanh` in each lane.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn gelu8(x: __m256) -> __m256 {
        use crate::ops::{GELU_2C, GELU_A};
        let cube = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(GELU_A), x), x), x);
        _mm256_mul_ps(x, sigma8(_mm256_mul_ps(_mm256_set1_ps(GELU_2C), _mm256_add_ps(x, cube))))
    }

    /// `float::glu_lanes` with AVX2.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`); `up` is at least as long as `gate`.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn glu_avx2(gate: &mut [f32], up: &[f32], act: crate::ops::GluAct) -> usize {
        let n = gate.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let a = match act {
                crate::ops::GluAct::Silu => silu8(g),
                crate::ops::GluAct::GeluTanh => gelu8(g),
            };
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(a, _mm256_loadu_ps(up.as_ptr().add(i))));
        }
        n
    }

    /// `x[i] = exp_le0(x[i] - max)`, returning the eight lane sums of `softmax_isa` (element i
    /// added to lane i mod 8, in order; the last partial vector's missing lanes add zero).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (checked by `cpu::isa()`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_rows_avx2(x: &mut [f32], max: f32) -> [f32; 8] {
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            let e = exp8_le0(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            // Missing lanes are -inf: their exponentials are 0.
            let mut buf = [f32::NEG_INFINITY; 8];
            buf[..rest.len()].copy_from_slice(rest);
            let e = exp8_le0(_mm256_sub_ps(_mm256_loadu_ps(buf.as_ptr()), m));
            _mm256_storeu_ps(buf.as_mut_ptr(), e);
            rest.copy_from_slice(&buf[..rest.len()]);
            acc = _mm256_add_ps(acc, e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        lanes
    }

    macro_rules! dispatch_rt {
        ($f:ident, $dtype:expr, $rows:expr, $xs:expr, $out:expr, $ldo:expr) => {{
            macro_rules! by_t {
                ($r:literal) => {
                    match $xs.len() {
                        1 => $f::<$r, 1>($dtype, $rows, $xs, $out, $ldo),
                        2 => $f::<$r, 2>($dtype, $rows, $xs, $out, $ldo),
                        3 => $f::<$r, 3>($dtype, $rows, $xs, $out, $ldo),
                        4 => $f::<$r, 4>($dtype, $rows, $xs, $out, $ldo),
                        n => panic!("tile of {n} tokens"),
                    }
                };
            }
            match $rows.len() {
                1 => by_t!(1),
                2 => by_t!(2),
                3 => by_t!(3),
                4 => by_t!(4),
                5 => by_t!(5),
                6 => by_t!(6),
                7 => by_t!(7),
                8 => by_t!(8),
                n => panic!("tile of {n} rows"),
            }
        }};
    }

    /// # Safety
    ///
    /// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
    /// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
    /// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy_fma(acc: &mut [f32], s: f32, x: &[f32]) {
        let n = acc.len();
        let sv = _mm256_set1_ps(s);
        let (a, xp) = (acc.as_mut_ptr(), x.as_ptr());
        let mut i = 0;
        while i + 8 <= n {
            _mm256_storeu_ps(a.add(i), _mm256_fmadd_ps(sv, _mm256_loadu_ps(xp.add(i)), _mm256_loadu_ps(a.add(i))));
            i += 8;
        }
        while i < n {
            *a.add(i) = s.mul_add(*xp.add(i), *a.add(i));
            i += 1;
        }
    }

    /// The contract's tree sums of four dot products at once, each held as its two 8-lane
    /// halves (`lo[i]`: lanes 0–7, `hi[i]`: lanes 8–15): step 8 (`lo + hi`), then steps 4, 2 and
    /// 1 for the four side by side in whole-vector shuffles — the additions `hsum256` makes for
    /// each, in its order, so each sum has `tile`'s bits. Returns `[sum 0, 1, 2, 3]`.
    ///
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn tree_sums4(lo: &[__m256; 4], hi: &[__m256; 4]) -> __m128 {
        let s: [__m256; 4] = std::array::from_fn(|i| _mm256_add_ps(lo[i], hi[i]));
        // Step 4, two sums a vector (sum i in a 128-bit half).
        let a = _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20), _mm256_permute2f128_ps(s[0], s[1], 0x31));
        let b = _mm256_add_ps(_mm256_permute2f128_ps(s[2], s[3], 0x20), _mm256_permute2f128_ps(s[2], s[3], 0x31));
        // Step 2: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] in each half.
        let c2 = _mm256_add_ps(_mm256_shuffle_ps(a, b, 0b01_00_01_00), _mm256_shuffle_ps(a, b, 0b11_10_11_10));
        // Step 1: [sum 0, sum 2, sum 0, sum 2 | sum 1, sum 3, sum 1, sum 3].
        let c1 = _mm256_add_ps(_mm256_shuffle_ps(c2, c2, 0b10_00_10_00), _mm256_shuffle_ps(c2, c2, 0b11_01_11_01));
        _mm_unpacklo_ps(_mm256_castps256_ps128(c1), _mm256_extractf128_ps(c1, 1))
    }

    /// `dots_f32_multi` for one query whose length is whole 16-lane chunks, four keys at a
    /// time: per key the contract's two 8-lane halves (lanes 0–7 and 8–15) accumulate chunk by
    /// chunk with fused multiply-adds, and the four keys' tree sums run side by side
    /// (`tree_sums4`), so every score has the tile's bits. A key left over after fours goes
    /// through the same steps alone (`hsum256`).
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; `q.len()` is a positive multiple of 16; `keys` holds `n` rows
    /// of `q.len()` values `stride` apart; `out` holds `n` values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores_avx2(q: &[f32], keys: &[f32], stride: usize, n: usize, scale: f32, out: &mut [f32]) {
        let k = q.len();
        let (qp, kp) = (q.as_ptr(), keys.as_ptr());
        let sv = _mm_set1_ps(scale);
        let mut j = 0;
        while j + 4 <= n {
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < k {
                let (ql, qh) = (_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(qp.add(c + 8)));
                for r in 0..4 {
                    let row = kp.add((j + r) * stride + c);
                    lo[r] = _mm256_fmadd_ps(_mm256_loadu_ps(row), ql, lo[r]);
                    hi[r] = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(8)), qh, hi[r]);
                }
                c += LANES;
            }
            _mm_storeu_ps(out.as_mut_ptr().add(j), _mm_mul_ps(tree_sums4(&lo, &hi), sv));
            j += 4;
        }
        while j < n {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let row = kp.add(j * stride);
            let mut c = 0;
            while c < k {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(c)), _mm256_loadu_ps(qp.add(c)), lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(row.add(c + 8)), _mm256_loadu_ps(qp.add(c + 8)), hi);
                c += LANES;
            }
            out[j] = hsum256(_mm256_add_ps(lo, hi)) * scale;
            j += 1;
        }
    }

    /// `dots_f32_multi` for `Q` (2 to 4) queries whose length is whole 16-lane chunks, one key
    /// at a time for them all (each key read once: a cache of many positions is read from
    /// beyond L2): per (query, key) the contract's two 8-lane halves, then the `Q` tree sums
    /// side by side (`tree_sums4`) — the same bits.
    ///
    /// # Safety
    ///
    /// As `scores_avx2`, for each of the `Q` queries and outputs.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // j indexes the keys (by stride) and every output
    pub unsafe fn scores_many_avx2<const Q: usize>(
        qs: &[&[f32]],
        keys: &[f32],
        stride: usize,
        n: usize,
        scale: f32,
        outs: &mut [&mut [f32]],
    ) {
        let k = qs[0].len();
        let qp: [*const f32; Q] = std::array::from_fn(|h| qs[h].as_ptr());
        let sv = _mm_set1_ps(scale);
        for j in 0..n {
            let row = keys.as_ptr().add(j * stride);
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut c = 0;
            while c < k {
                let (kl, kh) = (_mm256_loadu_ps(row.add(c)), _mm256_loadu_ps(row.add(c + 8)));
                for h in 0..Q {
                    lo[h] = _mm256_fmadd_ps(kl, _mm256_loadu_ps(qp[h].add(c)), lo[h]);
                    hi[h] = _mm256_fmadd_ps(kh, _mm256_loadu_ps(qp[h].add(c + 8)), hi[h]);
                }
                c += LANES;
            }
            // Queries in place of keys (absent ones zero, their sums dropped).
            let mut v = [0f32; 4];
            _mm_storeu_ps(v.as_mut_ptr(), _mm_mul_ps(tree_sums4(&lo, &hi), sv));
            for h in 0..Q {
                outs[h][j] = v[h];
            }
        }
    }

    /// `weighted_rows_multi` for `Q` (2 to 4) sums whose width is whole 16-element pieces: each
    /// piece's `Q` × 2 accumulators run through every row (16 values loaded once for all `Q`
    /// weights), one fused multiply-add per (row, element) in row order, as `weighted_rows_fma`.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA; every output has the same length, a positive multiple of 16;
    /// `rows` holds as many rows of it, `stride` apart, as every weight vector has values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_rows_many_fma<const Q: usize>(
        outs: &mut [&mut [f32]],
        ws: &[&[f32]],
        rows: &[f32],
        stride: usize,
    ) {
        let (d, n) = (outs[0].len(), ws[0].len());
        let rp = rows.as_ptr();
        let wp: [*const f32; Q] = std::array::from_fn(|h| ws[h].as_ptr());
        let mut c = 0;
        while c < d {
            let mut lo = [_mm256_setzero_ps(); Q];
            let mut hi = [_mm256_setzero_ps(); Q];
            for j in 0..n {
                let r = rp.add(j * stride + c);
                let (vl, vh) = (_mm256_loadu_ps(r), _mm256_loadu_ps(r.add(8)));
                for h in 0..Q {
                    let s = _mm256_broadcast_ss(&*wp[h].add(j));
                    lo[h] = _mm256_fmadd_ps(s, vl, lo[h]);
                    hi[h] = _mm256_fmadd_ps(s, vh, hi[h]);
                }
            }
            for h in 0..Q {
                _mm256_storeu_ps(outs[h].as_mut_ptr().add(c), lo[h]);
                _mm256_storeu_ps(outs[h].as_mut_ptr().add(c + 8), hi[h]);
            }
            c += 16;
        }
    }

    /// `weighted_rows` with AVX2: 64 elements at a time in eight accumulators (then 8 at a time,
    /// then one), each running through every row before it is stored.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and FMA (the dispatcher checks `cpu::isa()` first); `rows` holds
    /// `w.len()` rows of `out.len()` elements `stride` apart.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_rows_fma(out: &mut [f32], w: &[f32], rows: &[f32], stride: usize) {
        let d = out.len();
        let (o, rp) = (out.as_mut_ptr(), rows.as_ptr());
        let mut c = 0;
        while c + 64 <= d {
            let mut a = [_mm256_setzero_ps(); 8];
            for (j, s) in w.iter().enumerate() {
                let (sv, r) = (_mm256_set1_ps(*s), rp.add(j * stride + c));
                for (k, acc) in a.iter_mut().enumerate() {
                    *acc = _mm256_fmadd_ps(sv, _mm256_loadu_ps(r.add(8 * k)), *acc);
                }
            }
            for (k, acc) in a.iter().enumerate() {
                _mm256_storeu_ps(o.add(c + 8 * k), *acc);
            }
            c += 64;
        }
        while c + 8 <= d {
            let mut a = _mm256_setzero_ps();
            for (j, s) in w.iter().enumerate() {
                a = _mm256_fmadd_ps(_mm256_set1_ps(*s), _mm256_loadu_ps(rp.add(j * stride + c)), a);
            }
            _mm256_storeu_ps(o.add(c), a);
            c += 8;
        }
        while c < d {
            let mut a = 0f32;
            for (j, s) in w.iter().enumerate() {
                a = s.mul_add(*rp.add(j * stride + c), a);
            }
            *o.add(c) = a;
            c += 1;
        }
    }

    /// # Safety
    ///
    /// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
    /// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
    /// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")]
    pub unsafe fn tile_avx512(dtype: DType, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32], ldo: usize) {
        dispatch_rt!(tile512, dtype, rows, xs, out, ldo)
    }

    /// # Safety
    ///
    /// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
    /// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
    /// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_avx2(dtype: DType, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32], ldo: usize) {
        dispatch_rt!(tile256, dtype, rows, xs, out, ldo)
    }

    /// # Safety
    ///
    /// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
    /// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn load16(dtype: DType, p: *const u8) -> __m512 {
        match dtype {
            DType::F32 => _mm512_loadu_ps(p as *const f32),
            DType::BF16 => {
                let h = _mm256_loadu_si256(p as *const __m256i);
                _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
            }
            DType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _ => unreachable!(),
        }
    }

    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX-512), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn hsum512(v: __m512) -> f32 {
        let s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
        hsum256(s8)
    }

    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn hsum256(s8: __m256) -> f32 {
        let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
        _mm_cvtss_f32(s1)
    }

    /// # Safety
    ///
    /// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
    /// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
    /// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
    #[inline(always)]
    unsafe fn tile512<const R: usize, const T: usize>(
        dtype: DType,
        rows: &[&[u8]],
        xs: &[&[f32]],
        out: &mut [f32],
        ldo: usize,
    ) {
        let k = xs[0].len();
        let esz = dtype.block_bytes();
        let full = k / LANES * LANES;
        let mut acc = [[_mm512_setzero_ps(); T]; R];
        let wp: [*const u8; R] = std::array::from_fn(|r| rows[r].as_ptr());
        let xp: [*const f32; T] = std::array::from_fn(|t| xs[t].as_ptr());
        let mut i = 0;
        while i < full {
            let xv: [__m512; T] = std::array::from_fn(|t| _mm512_loadu_ps(xp[t].add(i)));
            for r in 0..R {
                let w = load16(dtype, wp[r].add(i * esz));
                for t in 0..T {
                    acc[r][t] = _mm512_fmadd_ps(w, xv[t], acc[r][t]);
                }
            }
            i += LANES;
        }
        if full < k {
            for r in 0..R {
                let w = _mm512_loadu_ps(tail_f32(dtype, rows[r], full, k).as_ptr());
                for t in 0..T {
                    let xv = _mm512_loadu_ps(tail_x(xs[t], full).as_ptr());
                    acc[r][t] = _mm512_fmadd_ps(w, xv, acc[r][t]);
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[t * ldo + r] = hsum512(acc[r][t]);
            }
        }
    }

    /// Loads 16 elements as two 8-lane halves (lanes 0..8, 8..16).
    ///
    /// # Safety
    ///
    /// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
    /// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn load8x2(dtype: DType, p: *const u8) -> (__m256, __m256) {
        match dtype {
            DType::F32 => (_mm256_loadu_ps(p as *const f32), _mm256_loadu_ps((p as *const f32).add(8))),
            DType::BF16 => {
                let a = _mm_loadu_si128(p as *const __m128i);
                let b = _mm_loadu_si128(p.add(16) as *const __m128i);
                (
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16)),
                    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16)),
                )
            }
            DType::F16 => (
                _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)),
            ),
            _ => unreachable!(),
        }
    }

    /// # Safety
    ///
    /// The CPU supports the features named in `target_feature` (AVX2; the dispatcher checks
    /// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
    /// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
    #[inline(always)]
    unsafe fn tile256<const R: usize, const T: usize>(
        dtype: DType,
        rows: &[&[u8]],
        xs: &[&[f32]],
        out: &mut [f32],
        ldo: usize,
    ) {
        let k = xs[0].len();
        let esz = dtype.block_bytes();
        let full = k / LANES * LANES;
        let mut lo = [[_mm256_setzero_ps(); T]; R];
        let mut hi = [[_mm256_setzero_ps(); T]; R];
        let mut i = 0;
        while i < full {
            for r in 0..R {
                let (wl, wh) = load8x2(dtype, rows[r].as_ptr().add(i * esz));
                for t in 0..T {
                    let xp = xs[t].as_ptr().add(i);
                    lo[r][t] = _mm256_fmadd_ps(wl, _mm256_loadu_ps(xp), lo[r][t]);
                    hi[r][t] = _mm256_fmadd_ps(wh, _mm256_loadu_ps(xp.add(8)), hi[r][t]);
                }
            }
            i += LANES;
        }
        if full < k {
            for r in 0..R {
                let w = tail_f32(dtype, rows[r], full, k);
                for t in 0..T {
                    let x = tail_x(xs[t], full);
                    lo[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(w.as_ptr()), _mm256_loadu_ps(x.as_ptr()), lo[r][t]);
                    hi[r][t] = _mm256_fmadd_ps(
                        _mm256_loadu_ps(w.as_ptr().add(8)),
                        _mm256_loadu_ps(x.as_ptr().add(8)),
                        hi[r][t],
                    );
                }
            }
        }
        for r in 0..R {
            for t in 0..T {
                out[t * ldo + r] = hsum256(_mm256_add_ps(lo[r][t], hi[r][t]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::Isa;

    fn rand_vec(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn encode(dtype: DType, v: &[f32]) -> Vec<u8> {
        match dtype {
            DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            DType::BF16 => v.iter().flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
            DType::F16 => v.iter().flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
            _ => unreachable!(),
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for k in [1usize, 15, 16, 17, 64, 100, 256] {
                let rows: Vec<Vec<u8>> = (0..8).map(|r| encode(dtype, &rand_vec(k, r as u64 + 1))).collect();
                let xs: Vec<Vec<f32>> = (0..4).map(|t| rand_vec(k, 100 + t as u64)).collect();
                let rr: Vec<&[u8]> = rows.iter().map(|r| r.as_slice()).collect();
                let xr: Vec<&[f32]> = xs.iter().map(|x| x.as_slice()).collect();
                for isa in Isa::supported() {
                    for nr in 1..=8 {
                        for nt in 1..=4 {
                            let mut out = vec![0f32; 4 * 8];
                            tile(isa, dtype, &rr[..nr], &xr[..nt], &mut out, 8);
                            for r in 0..nr {
                                for t in 0..nt {
                                    let want = dot_ref(dtype, rr[r], xr[t]);
                                    assert_eq!(
                                        out[t * 8 + r].to_bits(),
                                        want.to_bits(),
                                        "{dtype} {isa:?} k={k} r={r} t={t}"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn attention_helpers_have_the_one_query_and_axpy_bits() {
        // Scores: four, three, two or one queries together, each against the reference dot of
        // that query alone; keys left over after whole groups of eight, strided rows.
        for (k, n, stride) in [(64usize, 37usize, 128usize), (128, 6, 256), (16, 8, 16), (100, 3, 130), (1, 9, 2)] {
            let keys = rand_vec((n - 1) * stride + k, 7);
            let qs: Vec<Vec<f32>> = (0..4).map(|h| rand_vec(k, 20 + h as u64)).collect();
            let qr: Vec<&[f32]> = qs.iter().map(|q| q.as_slice()).collect();
            for isa in Isa::supported() {
                for nq in 1..=4 {
                    let mut outs = vec![vec![f32::NAN; n]; nq];
                    let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    dots_f32_multi_isa(isa, &qr[..nq], &keys, stride, n, 0.125, &mut or);
                    for (h, out) in outs.iter().enumerate() {
                        for (j, v) in out.iter().enumerate() {
                            let row = encode(DType::F32, &keys[j * stride..j * stride + k]);
                            let want = dot_ref(DType::F32, &row, qr[h]) * 0.125;
                            assert_eq!(v.to_bits(), want.to_bits(), "{isa:?} k={k} query {h} of {nq}, key {j}");
                        }
                    }
                }
            }
        }
        // Weighted sums: lengths with 64-, 8- and 1-element pieces, against zero then one axpy
        // per row at the scalar level.
        for (d, n, stride) in
            [(64usize, 50usize, 128usize), (128, 9, 256), (16, 3, 16), (137, 7, 140), (8, 1, 8), (5, 3, 9), (72, 0, 72)]
        {
            let rows = rand_vec(n.max(1) * stride + d, 3);
            let w = rand_vec(n, 4);
            let mut want = vec![0f32; d];
            for (j, s) in w.iter().enumerate() {
                axpy_isa(Isa::Scalar, &mut want, *s, &rows[j * stride..j * stride + d]);
            }
            for isa in Isa::supported() {
                let mut got = vec![f32::NAN; d];
                weighted_rows_isa(isa, &mut got, &w, &rows, stride);
                assert!(crate::compare::same_bits(&got, &want), "{isa:?} d={d} n={n}");
                // The same sum beside others over the same rows (their weights reversed, scaled).
                for q in 1..=4 {
                    let others: Vec<Vec<f32>> =
                        (1..q).map(|h| w.iter().rev().map(|v| v * h as f32).collect()).collect();
                    let mut ws: Vec<&[f32]> = vec![&w];
                    ws.extend(others.iter().map(|o| o.as_slice()));
                    let mut outs = vec![vec![f32::NAN; d]; q];
                    let mut or: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                    weighted_rows_multi_isa(isa, &mut or, &ws, &rows, stride);
                    assert!(crate::compare::same_bits(&outs[0], &want), "{isa:?} d={d} n={n}, first of {q}");
                    for (h, o) in outs.iter().enumerate().skip(1) {
                        let mut alone = vec![0f32; d];
                        weighted_rows_isa(Isa::Scalar, &mut alone, ws[h], &rows, stride);
                        assert!(crate::compare::same_bits(o, &alone), "{isa:?} d={d} n={n}, sum {h} of {q}");
                    }
                }
            }
        }
    }

    /// The matrix product walks rows and tokens in tiles whose shape depends on the level and
    /// the token count, and prefill in blocks of rows, tokens and k (`float_gemm`: 48 rows, 36
    /// tokens, chunks of 256, from 16 tokens at AVX2 and 64 at AVX-512): rows, tokens and elements left over after whole tiles,
    /// blocks and chunks, at every level, one thread or two, give the reference's bits.
    #[test]
    fn products_of_any_shape_match_the_reference() {
        use crate::matmul::{matmul_ref, matmul_with_isa, MatRef};
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let shapes = [
                (7, 40, 5),
                (10, 33, 7),
                (3, 16, 2),
                (17, 100, 1),
                (5, 17, 9),
                (53, 327, 40),
                (49, 512, 37),
                (50, 300, 16),
            ];
            for (rows, k, n) in shapes {
                let w: Vec<u8> = (0..rows).flat_map(|r| encode(dtype, &rand_vec(k, 7 + r as u64))).collect();
                let m = MatRef::new(dtype, rows, k, &w).unwrap();
                let x = rand_vec(n * k, 99);
                let mut want = vec![0f32; n * rows];
                matmul_ref(m, &x, n, &mut want);
                for isa in Isa::supported() {
                    let got = matmul_with_isa(isa, &crate::pool::ThreadPool::new(2), m, &x, n);
                    assert!(crate::compare::same_bits(&got, &want), "{dtype} {isa:?} {rows}x{k} n={n}");
                }
                let mut two = vec![0f32; n * rows];
                crate::matmul(&crate::pool::ThreadPool::new(2), m, &x, n, &mut two);
                assert!(crate::compare::same_bits(&two, &want), "{dtype} two threads {rows}x{k} n={n}");
            }
        }
    }

    #[test]
    fn axpy_and_dots_agree_with_scalar_definitions() {
        let x = rand_vec(37, 1);
        let mut a = rand_vec(37, 2);
        let mut b = a.clone();
        axpy(&mut a, 0.3, &x);
        for (bv, xv) in b.iter_mut().zip(&x) {
            *bv = 0.3f32.mul_add(*xv, *bv);
        }
        assert!(crate::compare::same_bits(&a, &b));
        let keys = rand_vec(11 * 40, 3);
        let q = rand_vec(32, 4);
        let mut out = vec![0f32; 11];
        dots_f32(&q, &keys, 40, 11, 0.5, &mut out);
        for j in 0..11 {
            assert_eq!(out[j].to_bits(), (dot_f32(&q, &keys[j * 40..j * 40 + 32]) * 0.5).to_bits());
        }
    }

    #[test]
    fn reference_is_close_to_f64_sum() {
        let a = rand_vec(1000, 7);
        let b = rand_vec(1000, 8);
        let exact: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
        assert!((dot_f32(&a, &b) as f64 - exact).abs() < 1e-4);
    }

    #[test]
    fn exp_le0_is_within_two_ulp_of_exp_and_zero_below_its_range() {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -87.0 * i as f32 / 200_000.0;
            let want = (x as f64).exp();
            let got = exp_le0(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.4e-7, "largest relative error {worst:e}");
        assert_eq!(exp_le0(0.0), 1.0);
        assert_eq!(exp_le0(-88.0), 0.0);
        assert_eq!(exp_le0(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_le0(f32::NAN), 0.0);
    }

    #[test]
    fn softmax_is_the_same_bits_at_every_level_and_close_to_the_reference() {
        for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 63, 100, 1031] {
            for (seed, sink) in [(1u64, None), (2, Some(0.7f32)), (3, Some(-40.0))] {
                // Scores spread wide: some exponentials underflow to zero.
                let x: Vec<f32> = rand_vec(n, seed + n as u64).iter().map(|v| v * 30.0).collect();
                let mut want = x.clone();
                softmax_isa(Isa::Scalar, &mut want, sink);
                for isa in Isa::supported() {
                    let mut got = x.clone();
                    softmax_isa(isa, &mut got, sink);
                    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "{isa:?} n={n} {sink:?}");
                }
                let mut r = x.clone();
                match sink {
                    Some(s) => crate::ops::softmax_with_sink(&mut r, s),
                    None => crate::ops::softmax(&mut r),
                }
                for (a, b) in want.iter().zip(&r) {
                    assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-30) + 1e-37, "n={n}: {a} against {b}");
                }
            }
        }
    }
}

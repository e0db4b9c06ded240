//! AVX2 and AVX-512 VNNI integer kernels for the quantized dot products.
//!
//! Each function computes the exact integer sums (`BlockInts`) of one weight block against
//! the activation blocks of up to four tokens, unpacking the weights once for all of them.
//! The float side is `dot_ref::accumulate`, shared with the scalar reference, so every
//! variant gives the reference's bits.
//!
//! The two instruction sets differ only in the u8×i8 → i32 step (`vpdpbusd` with VNNI,
//! `vpmaddubsw` + `vpmaddwd` without), stamped out by the `kernels!` macro. `vpmaddubsw`
//! saturates i16 pairs, so signed 8-bit weights (Q8_0) take the sign-transfer route there,
//! and every other format keeps its weight codes below 64.

use super::act::QuantAct;
use super::dot_ref::LANES32;
use super::x86_512::KAcc;
use crate::DType;
use std::arch::x86_64::*;

/// 32 four-bit codes: low nibbles of `q` then high nibbles (the Q4_0/Q4_1/Q5 order).
#[inline(always)]
unsafe fn nibbles_split16(q: *const u8) -> __m256i {
    let v = _mm_loadu_si128(q as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(v, m);
    let hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    _mm256_set_m128i(hi, lo)
}

/// The fifth bit of 32 codes from a little-endian u32 (bit j → byte j), as 0 or 16.
#[inline(always)]
unsafe fn fifth_bits(qh: u32) -> __m256i {
    // Spread the 32 bits over 32 bytes: byte j takes byte j/8 of qh, then tests bit j%8.
    let v = _mm256_set1_epi32(qh as i32);
    let idx = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(v, idx);
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let hit = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
    _mm256_and_si256(hit, _mm256_set1_epi8(16))
}

/// Eight vectors of 8 partial sums → one vector of their 8 totals, in order.
#[inline(always)]
unsafe fn reduce8x8(a: &[__m256i; 8]) -> __m256i {
    let h1 = _mm256_hadd_epi32(a[0], a[1]);
    let h2 = _mm256_hadd_epi32(a[2], a[3]);
    let h3 = _mm256_hadd_epi32(a[4], a[5]);
    let h4 = _mm256_hadd_epi32(a[6], a[7]);
    let g1 = _mm256_hadd_epi32(h1, h2);
    let g2 = _mm256_hadd_epi32(h3, h4);
    _mm256_add_epi32(_mm256_permute2x128_si256(g1, g2, 0x20), _mm256_permute2x128_si256(g1, g2, 0x31))
}

/// Asks for the cache lines of `len` bytes at `p + PREFETCH_AHEAD`: a single decode stream
/// does not keep enough loads in flight for the hardware prefetcher to reach full bandwidth.
#[inline(always)]
pub(crate) unsafe fn prefetch_ahead(p: *const u8, len: usize) {
    let mut o = 0;
    while o < len {
        _mm_prefetch(p.wrapping_add(PREFETCH_AHEAD + o) as *const i8, _MM_HINT_T0);
        o += 64;
    }
}

const PREFETCH_AHEAD: usize = 1024;

/// Sums 8 float lanes in `dot_ref::reduce8`'s order (4, 2, 1).
#[inline(always)]
pub(crate) unsafe fn hsum_ps8(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    _mm_cvtss_f32(s1)
}

#[inline(always)]
fn f16_bits(w: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([w[o], w[o + 1]])
}

/// Offset of the first f16 scale in a 32-block and of the codes.
#[inline(always)]
fn layout32(dtype: DType) -> (Option<usize>, usize, i32) {
    // (qh offset, qs offset, code offset subtracted from every weight code)
    match dtype {
        DType::Q4_0 => (None, 2, 8),
        DType::Q4_1 => (None, 4, 0),
        DType::Q5_0 => (Some(2), 6, 16),
        DType::Q5_1 => (Some(4), 8, 0),
        _ => (None, 2, 0), // Q8_0
    }
}

/// AVX2 (no VNNI): u8×i8 products through `vpmaddubsw` + `vpmaddwd`.
pub mod avx2 {
    use super::*;

    /// Σ u8·i8 over 32 bytes into 8 lanes.
    #[inline(always)]
    unsafe fn dp(acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)))
    }

    /// Σ (u8·i8 pairs as i16) · scale16 into 8 lanes.
    #[inline(always)]
    unsafe fn dp_scaled(acc: __m256i, u: __m256i, x: __m256i, scale16: __m256i) -> __m256i {
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale16))
    }

    /// The 32 codes of a block: unsigned, except Q8_0's, which stay signed (the sign
    /// moves to the activations at use).
    #[inline(always)]
    unsafe fn codes32(dtype: DType, w: *const u8) -> __m256i {
        let (qh, qs, _) = layout32(dtype);
        if dtype == DType::Q8_0 {
            return _mm256_loadu_si256(w.add(2) as *const __m256i);
        }
        let mut u = nibbles_split16(w.add(qs));
        if let Some(o) = qh {
            let h = u32::from_le_bytes([*w.add(o), *w.add(o + 1), *w.add(o + 2), *w.add(o + 3)]);
            u = _mm256_or_si256(u, fifth_bits(h));
        }
        u
    }

    /// What Σ code·x overshoots by, per unit of Σx.
    #[inline(always)]
    fn bias32(dtype: DType) -> i32 {
        match dtype {
            DType::Q8_0 => 0,
            d => layout32(d).2,
        }
    }

    #[inline(always)]
    unsafe fn dp32(dtype: DType, u: __m256i, x: __m256i) -> __m256i {
        if dtype == DType::Q8_0 {
            // |q| · (x with q's sign): exact, and |q| ≤ 127 keeps pairs inside i16.
            dp(_mm256_setzero_si256(), _mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u))
        } else {
            dp(_mm256_setzero_si256(), u, x)
        }
    }

    /// One row of a 32-block format against every token of `act`; `lanes` is scratch of
    /// `act.rows` lane sets. Blocks go eight at a time (a final partial group is padded
    /// with blocks that add exactly nothing), each unpacked once for all tokens.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row32(
        dtype: DType,
        row: &[u8],
        act: &QuantAct,
        toks: std::ops::Range<usize>,
        lanes: &mut [[f32; LANES32]],
        out: &mut [f32],
    ) {
        let (t0, n) = (toks.start, toks.len());
        let bb = dtype.block_bytes();
        let nb = act.blocks_per_row();
        let bias = bias32(dtype);
        let has_m = matches!(dtype, DType::Q4_1 | DType::Q5_1);
        let lanes = &mut lanes[..n];
        for l in lanes.iter_mut() {
            *l = [0.0; LANES32];
        }
        let biasv = _mm256_set1_epi32(bias);
        let mut b0 = 0;
        while b0 < nb {
            let m = (nb - b0).min(LANES32);
            let base = row.as_ptr().add(b0 * bb);
            if act.rows == 1 {
                prefetch_ahead(base, 8 * bb);
            }
            let mut u = [_mm256_setzero_si256(); 8];
            let mut dbits = [0u16; 8];
            let mut mbits = [0u16; 8];
            for j in 0..m {
                let w = base.add(j * bb);
                u[j] = codes32(dtype, w);
                dbits[j] = u16::from_le_bytes([*w, *w.add(1)]);
                if has_m {
                    mbits[j] = u16::from_le_bytes([*w.add(2), *w.add(3)]);
                }
            }
            // Padding blocks have zero codes and scales: they add (±)0 to their lanes.
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(dbits.as_ptr() as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(mbits.as_ptr() as *const __m128i));
            for t in 0..n {
                // Activation rows are padded to whole groups of eight zero blocks.
                let i0 = act.idx(t0 + t, b0);
                let xq = act.qs.as_ptr().add(i0 * 32);
                let mut a = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    a[j] = dp32(dtype, u[j], _mm256_loadu_si256(xq.add(32 * j) as *const __m256i));
                }
                let mut isum = reduce8x8(&a);
                let xs = _mm256_loadu_si256(act.sum.as_ptr().add(i0) as *const __m256i);
                let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
                let sx = if has_m { _mm256_loadu_ps(act.s.as_ptr().add(i0)) } else { _mm256_setzero_ps() };
                if bias != 0 {
                    isum = _mm256_sub_epi32(isum, _mm256_mullo_epi32(xs, biasv));
                }
                let lp = lanes.as_mut_ptr().add(t) as *mut f32;
                let mut l =
                    _mm256_add_ps(_mm256_loadu_ps(lp), _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum)));
                if has_m {
                    l = _mm256_add_ps(l, _mm256_mul_ps(mw, sx));
                }
                _mm256_storeu_ps(lp, l);
            }
            b0 += m;
        }
        for t in 0..n {
            out[t] = hsum_ps8(_mm256_loadu_ps(lanes.as_ptr().add(t) as *const f32));
        }
    }

    /// One Q4_K or Q5_K row against tokens `toks`, in `dot_ref::kquant_lanes`' lanes
    /// (16 main lanes as two 8-lane halves: even and odd sub-blocks).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_q4k_q5k(q5: bool, row: &[u8], act: &QuantAct, toks: std::ops::Range<usize>, acc: &mut [KAcc], out: &mut [f32]) {
        let (t0, n) = (toks.start, toks.len());
        let dtype = if q5 { DType::Q5_K } else { DType::Q4_K };
        let bb = dtype.block_bytes();
        let mask = _mm256_set1_epi8(0x0F);
        let one = _mm256_set1_epi8(1);
        let acc = &mut acc[..n];
        for a in acc.iter_mut() {
            *a = [0.0; 24];
        }
        for b in 0..act.blocks_per_row() {
            let w = &row[b * bb..(b + 1) * bb];
            if act.rows == 1 {
                prefetch_ahead(w.as_ptr(), bb);
            }
            let sc = &w[4..16];
            let mut s = [0i16; 8];
            let mut m2 = [0i16; 16];
            for j in 0..8 {
                let (a, c) = crate::quant::blocks::scale_min_k4(j, sc);
                s[j] = a as i16;
                m2[2 * j] = c as i16;
                m2[2 * j + 1] = c as i16;
            }
            let mins16 = _mm256_loadu_si256(m2.as_ptr() as *const __m256i);
            let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(u32::from_le_bytes([w[0], w[1], w[2], w[3]]) as i32));
            let (d, dmin) = (_mm_cvtss_f32(dm), _mm_cvtss_f32(_mm_movehdup_ps(dm)));
            let (qh, qs) = if q5 { (w.as_ptr().add(16), w.as_ptr().add(48)) } else { (w.as_ptr(), w.as_ptr().add(16)) };
            let hbits = if q5 { _mm256_loadu_si256(qh as *const __m256i) } else { _mm256_setzero_si256() };
            let mut u = [_mm256_setzero_si256(); 8];
            let mut sv = [_mm256_setzero_si256(); 8];
            for c in 0..4 {
                let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                let mut lo = _mm256_and_si256(q, mask);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
                if q5 {
                    let b0 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32)), one);
                    let b1 = _mm256_and_si256(_mm256_srl_epi16(hbits, _mm_cvtsi32_si128(2 * c as i32 + 1)), one);
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(b0, 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(b1, 4));
                }
                u[2 * c] = lo;
                u[2 * c + 1] = hi;
                sv[2 * c] = _mm256_set1_epi16(s[2 * c]);
                sv[2 * c + 1] = _mm256_set1_epi16(s[2 * c + 1]);
            }
            for t in 0..n {
                let xi = act.idx(t0 + t, b);
                let xq = act.qs.as_ptr().add(xi * 256);
                let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for c in 0..4 {
                    lo = dp_scaled(lo, u[2 * c], _mm256_loadu_si256(xq.add(64 * c) as *const __m256i), sv[2 * c]);
                    hi = dp_scaled(hi, u[2 * c + 1], _mm256_loadu_si256(xq.add(64 * c + 32) as *const __m256i), sv[2 * c + 1]);
                }
                let side = _mm256_madd_epi16(mins16, _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i));
                let dx = *act.d.get_unchecked(xi);
                kacc_add(acc.as_mut_ptr().add(t) as *mut f32, d * dx, lo, hi, dmin * dx, side);
            }
        }
        finish_kacc(acc, out);
    }

    /// One Q6_K row against tokens `toks`, in `dot_ref::kquant_lanes`' lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_q6k(row: &[u8], act: &QuantAct, toks: std::ops::Range<usize>, acc: &mut [KAcc], out: &mut [f32]) {
        let (t0, n) = (toks.start, toks.len());
        let bb = DType::Q6_K.block_bytes();
        let mask = _mm256_set1_epi8(0x0F);
        let three = _mm256_set1_epi8(3);
        let acc = &mut acc[..n];
        for a in acc.iter_mut() {
            *a = [0.0; 24];
        }
        for b in 0..act.blocks_per_row() {
            let w = &row[b * bb..(b + 1) * bb];
            if act.rows == 1 {
                prefetch_ahead(w.as_ptr(), bb);
            }
            let (ql, qh, sc) = (w.as_ptr(), w.as_ptr().add(128), &w[192..208]);
            let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(f16_bits(w, 208) as i32)));
            // u[j]: elements 32j..32j+32, natural order.
            let mut u = [_mm256_setzero_si256(); 8];
            let mut sv = [_mm256_setzero_si256(); 8];
            for nn in 0..2 {
                let a = _mm256_loadu_si256(ql.add(64 * nn) as *const __m256i);
                let bq = _mm256_loadu_si256(ql.add(64 * nn + 32) as *const __m256i);
                let h = _mm256_loadu_si256(qh.add(32 * nn) as *const __m256i);
                u[4 * nn] = _mm256_or_si256(_mm256_and_si256(a, mask), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
                u[4 * nn + 1] = _mm256_or_si256(
                    _mm256_and_si256(bq, mask),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4),
                );
                u[4 * nn + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(a, 4), mask),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4),
                );
                u[4 * nn + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(bq, 4), mask),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4),
                );
                for k in 0..4 {
                    let g = 8 * nn + 2 * k;
                    sv[4 * nn + k] = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1] as i8 as i16), _mm_set1_epi16(sc[g] as i8 as i16));
                }
            }
            let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
            for t in 0..n {
                let xi = act.idx(t0 + t, b);
                let xq = act.qs.as_ptr().add(xi * 256);
                let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for j in 0..4 {
                    lo = dp_scaled(lo, u[2 * j], _mm256_loadu_si256(xq.add(64 * j) as *const __m256i), sv[2 * j]);
                    hi = dp_scaled(hi, u[2 * j + 1], _mm256_loadu_si256(xq.add(64 * j + 32) as *const __m256i), sv[2 * j + 1]);
                }
                let corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i));
                let ddx = d * *act.d.get_unchecked(xi);
                kacc_add(acc.as_mut_ptr().add(t) as *mut f32, ddx, lo, hi, ddx, _mm256_slli_epi32(corr, 5));
            }
        }
        finish_kacc(acc, out);
    }

    /// main[0..8] += s·lo, main[8..16] += s·hi, side += m·side (fused).
    #[inline(always)]
    unsafe fn kacc_add(p: *mut f32, s: f32, lo: __m256i, hi: __m256i, m: f32, side: __m256i) {
        let sv = _mm256_set1_ps(s);
        _mm256_storeu_ps(p, _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(lo), _mm256_loadu_ps(p)));
        _mm256_storeu_ps(p.add(8), _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(hi), _mm256_loadu_ps(p.add(8))));
        _mm256_storeu_ps(p.add(16), _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_cvtepi32_ps(side), _mm256_loadu_ps(p.add(16))));
    }

    /// `reduce16(main) − reduce8(side)` for each token.
    #[inline(always)]
    unsafe fn finish_kacc(acc: &[KAcc], out: &mut [f32]) {
        for (a, o) in acc.iter().zip(out.iter_mut()) {
            let p = a.as_ptr();
            let main = _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            *o = hsum_ps8(main) - hsum_ps8(_mm256_loadu_ps(p.add(16)));
        }
    }
}

/// The unsigned codes of a 32-block as the VNNI kernels use them (Q8_0 offset by 128).
#[inline(always)]
pub(crate) unsafe fn codes32_vnni(dtype: DType, w: *const u8) -> __m256i {
    let (qh, qs, _) = layout32(dtype);
    if dtype == DType::Q8_0 {
        let q = _mm256_loadu_si256(w.add(2) as *const __m256i);
        return _mm256_xor_si256(q, _mm256_set1_epi8(-128));
    }
    let mut u = nibbles_split16(w.add(qs));
    if let Some(o) = qh {
        let h = u32::from_le_bytes([*w.add(o), *w.add(o + 1), *w.add(o + 2), *w.add(o + 3)]);
        u = _mm256_or_si256(u, fifth_bits(h));
    }
    u
}

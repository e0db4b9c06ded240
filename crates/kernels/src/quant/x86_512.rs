//! AVX-512 VNNI row kernels: the same integer sums and float formula as `x86` and the scalar
//! reference (so the same bits), two blocks (or two halves of a superblock) per 512-bit
//! instruction, and an all-vector reduction of eight blocks' sums.

use super::act::QuantAct;
use super::dot_ref::LANES32;
use super::x86::{codes32_vnni, hsum_ps8, prefetch_ahead};
use crate::DType;
use std::arch::x86_64::*;

const FEATURES: &str = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni";

/// Transposes 8×8 dwords: `r[j]` row j → column c in the result's element c.
#[inline(always)]
unsafe fn transpose8x8(r: &[__m256i; 8]) -> [__m256i; 8] {
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    let t4 = _mm256_unpacklo_epi32(r[4], r[5]);
    let t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    let t6 = _mm256_unpacklo_epi32(r[6], r[7]);
    let t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    let s0 = _mm256_unpacklo_epi64(t0, t2);
    let s1 = _mm256_unpackhi_epi64(t0, t2);
    let s2 = _mm256_unpacklo_epi64(t1, t3);
    let s3 = _mm256_unpackhi_epi64(t1, t3);
    let s4 = _mm256_unpacklo_epi64(t4, t6);
    let s5 = _mm256_unpackhi_epi64(t4, t6);
    let s6 = _mm256_unpacklo_epi64(t5, t7);
    let s7 = _mm256_unpackhi_epi64(t5, t7);
    [
        _mm256_permute2x128_si256(s0, s4, 0x20),
        _mm256_permute2x128_si256(s1, s5, 0x20),
        _mm256_permute2x128_si256(s2, s6, 0x20),
        _mm256_permute2x128_si256(s3, s7, 0x20),
        _mm256_permute2x128_si256(s0, s4, 0x31),
        _mm256_permute2x128_si256(s1, s5, 0x31),
        _mm256_permute2x128_si256(s2, s6, 0x31),
        _mm256_permute2x128_si256(s3, s7, 0x31),
    ]
}

#[inline(always)]
unsafe fn pair(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)
}

/// One row of a 32-block format against every token (see `x86::row32`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub unsafe fn row32(
    dtype: DType,
    row: &[u8],
    act: &QuantAct,
    toks: std::ops::Range<usize>,
    lanes: &mut [[f32; LANES32]],
    out: &mut [f32],
) {
    let _ = FEATURES;
    let (t0, n) = (toks.start, toks.len());
    let bb = dtype.block_bytes();
    let nb = act.blocks_per_row();
    let bias: i32 = match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q8_0 => 128,
        _ => 0,
    };
    let has_m = matches!(dtype, DType::Q4_1 | DType::Q5_1);
    let lanes = &mut lanes[..n];
    for l in lanes.iter_mut() {
        *l = [0.0; LANES32];
    }
    // The biases are powers of two: subtract bias·Σx as a shift.
    let bias_shift = _mm_cvtsi32_si128(bias.trailing_zeros() as i32);
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
            u[j] = codes32_vnni(dtype, w);
            dbits[j] = u16::from_le_bytes([*w, *w.add(1)]);
            if has_m {
                mbits[j] = u16::from_le_bytes([*w.add(2), *w.add(3)]);
            }
        }
        // Transpose the eight blocks (rows) by dword (columns) to match `qs_il`: vector k
        // holds dwords 2k (lanes 0..8) and 2k + 1 (lanes 8..16) of blocks 0..8.
        let c = transpose8x8(&u);
        let w4 = [pair(c[0], c[1]), pair(c[2], c[3]), pair(c[4], c[5]), pair(c[6], c[7])];
        // Padding blocks have zero codes and scales: they add (±)0 to their lanes.
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(dbits.as_ptr() as *const __m128i));
        let mw = _mm256_cvtph_ps(_mm_loadu_si128(mbits.as_ptr() as *const __m128i));
        for t in 0..n {
            let i0 = act.idx(t0 + t, b0);
            let xq = act.qs_il.as_ptr().add(i0 * 32);
            // Two chains of two, so the dot products overlap.
            let z = _mm512_setzero_si512();
            let a0 = _mm512_dpbusd_epi32(z, w4[0], _mm512_loadu_si512(xq as *const _));
            let a1 = _mm512_dpbusd_epi32(z, w4[1], _mm512_loadu_si512(xq.add(64) as *const _));
            let a0 = _mm512_dpbusd_epi32(a0, w4[2], _mm512_loadu_si512(xq.add(128) as *const _));
            let a1 = _mm512_dpbusd_epi32(a1, w4[3], _mm512_loadu_si512(xq.add(192) as *const _));
            let acc = _mm512_add_epi32(a0, a1);
            // Lane j + lane j + 8 = block j's whole sum.
            let mut isum = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
            if bias != 0 {
                let xs = _mm256_loadu_si256(act.sum.as_ptr().add(i0) as *const __m256i);
                isum = _mm256_sub_epi32(isum, _mm256_sll_epi32(xs, bias_shift));
            }
            let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
            let lp = lanes.as_mut_ptr().add(t) as *mut f32;
            let mut l =
                _mm256_add_ps(_mm256_loadu_ps(lp), _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(isum)));
            if has_m {
                l = _mm256_add_ps(l, _mm256_mul_ps(mw, _mm256_loadu_ps(act.s.as_ptr().add(i0))));
            }
            _mm256_storeu_ps(lp, l);
        }
        b0 += m;
    }
    for t in 0..n {
        out[t] = hsum_ps8(_mm256_loadu_ps(lanes.as_ptr().add(t) as *const f32));
    }
}

/// Per-token scratch of the K-quant kernels: 16 main lanes then 8 side lanes.
pub type KAcc = [f32; 24];

/// One Q4_K or Q5_K row against tokens `toks`, in `dot_ref::kquant_lanes`' lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
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
        // Each min twice: it multiplies the two 16-value sums of its 32-value sub-block.
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
        let mut u = [_mm512_setzero_si512(); 4];
        let mut sv = [_mm512_setzero_si512(); 4];
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
            u[c] = pair(lo, hi);
            sv[c] = pair(_mm256_set1_epi16(s[2 * c]), _mm256_set1_epi16(s[2 * c + 1]));
        }
        for t in 0..n {
            let xi = act.idx(t0 + t, b);
            let xq = act.qs.as_ptr().add(xi * 256);
            let z = _mm512_setzero_si512();
            let p0 = _mm512_dpwssd_epi32(z, _mm512_maddubs_epi16(u[0], _mm512_loadu_si512(xq as *const _)), sv[0]);
            let p1 = _mm512_dpwssd_epi32(z, _mm512_maddubs_epi16(u[1], _mm512_loadu_si512(xq.add(64) as *const _)), sv[1]);
            let p0 = _mm512_dpwssd_epi32(p0, _mm512_maddubs_epi16(u[2], _mm512_loadu_si512(xq.add(128) as *const _)), sv[2]);
            let p1 = _mm512_dpwssd_epi32(p1, _mm512_maddubs_epi16(u[3], _mm512_loadu_si512(xq.add(192) as *const _)), sv[3]);
            let lanes = _mm512_add_epi32(p0, p1);
            let side = _mm256_madd_epi16(mins16, _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i));
            let dx = *act.d.get_unchecked(xi);
            let ap = acc.as_mut_ptr().add(t) as *mut f32;
            _mm512_storeu_ps(ap, _mm512_fmadd_ps(_mm512_set1_ps(d * dx), _mm512_cvtepi32_ps(lanes), _mm512_loadu_ps(ap)));
            _mm256_storeu_ps(ap.add(16), _mm256_fmadd_ps(_mm256_set1_ps(dmin * dx), _mm256_cvtepi32_ps(side), _mm256_loadu_ps(ap.add(16))));
        }
    }
    finish_kacc(acc, out);
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

/// One Q6_K row against tokens `toks`, in `dot_ref::kquant_lanes`' lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
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
        let d = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([w[208], w[209]]) as i32)));
        let mut u = [_mm512_setzero_si512(); 4];
        let mut sv = [_mm512_setzero_si512(); 4];
        for nn in 0..2 {
            let a = _mm256_loadu_si256(ql.add(64 * nn) as *const __m256i);
            let bq = _mm256_loadu_si256(ql.add(64 * nn + 32) as *const __m256i);
            let h = _mm256_loadu_si256(qh.add(32 * nn) as *const __m256i);
            let q0 = _mm256_or_si256(_mm256_and_si256(a, mask), _mm256_slli_epi16(_mm256_and_si256(h, three), 4));
            let q1 = _mm256_or_si256(_mm256_and_si256(bq, mask), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4));
            let q2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(a, 4), mask),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4),
            );
            let q3 = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(bq, 4), mask),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4),
            );
            u[2 * nn] = pair(q0, q1);
            u[2 * nn + 1] = pair(q2, q3);
            let s = |g: usize| _mm_set1_epi16(sc[g] as i8 as i16);
            let g = 8 * nn;
            sv[2 * nn] = pair(_mm256_set_m128i(s(g + 1), s(g)), _mm256_set_m128i(s(g + 3), s(g + 2)));
            sv[2 * nn + 1] = pair(_mm256_set_m128i(s(g + 5), s(g + 4)), _mm256_set_m128i(s(g + 7), s(g + 6)));
        }
        let sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(sc.as_ptr() as *const __m128i));
        for t in 0..n {
            let xi = act.idx(t0 + t, b);
            let xq = act.qs.as_ptr().add(xi * 256);
            let z = _mm512_setzero_si512();
            let p0 = _mm512_dpwssd_epi32(z, _mm512_maddubs_epi16(u[0], _mm512_loadu_si512(xq as *const _)), sv[0]);
            let p1 = _mm512_dpwssd_epi32(z, _mm512_maddubs_epi16(u[1], _mm512_loadu_si512(xq.add(64) as *const _)), sv[1]);
            let p0 = _mm512_dpwssd_epi32(p0, _mm512_maddubs_epi16(u[2], _mm512_loadu_si512(xq.add(128) as *const _)), sv[2]);
            let p1 = _mm512_dpwssd_epi32(p1, _mm512_maddubs_epi16(u[3], _mm512_loadu_si512(xq.add(192) as *const _)), sv[3]);
            let lanes = _mm512_add_epi32(p0, p1);
            let corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256(act.bsums.as_ptr().add(xi * 16) as *const __m256i));
            let side = _mm256_slli_epi32(corr, 5);
            let ddx = d * *act.d.get_unchecked(xi);
            let ap = acc.as_mut_ptr().add(t) as *mut f32;
            _mm512_storeu_ps(ap, _mm512_fmadd_ps(_mm512_set1_ps(ddx), _mm512_cvtepi32_ps(lanes), _mm512_loadu_ps(ap)));
            _mm256_storeu_ps(ap.add(16), _mm256_fmadd_ps(_mm256_set1_ps(ddx), _mm256_cvtepi32_ps(side), _mm256_loadu_ps(ap.add(16))));
        }
    }
    finish_kacc(acc, out);
}

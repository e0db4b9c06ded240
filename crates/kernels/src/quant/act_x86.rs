//! Activation quantization with AVX2 (which serves the AVX-512 level too): the values, scales
//! and sums of `act`'s scalar code, eight lanes at a time.
//!
//! Prefill quantizes every token row for every matrix (each expert's gathered rows included),
//! and the scalar code's search for Q8_K's signed maximum is one long compare-and-select chain:
//! it was 6.7% of OLMoE-1B-7B's prefill on an AVX-512 Xeon.
//!
//! Every operation is the scalar one, lane by lane (no fused multiply-add, the same rounding
//! tricks), so the bits are the same. Only blocks whose values and scales are finite take this
//! path: a block holding an infinity or a NaN, or whose maximum is so small that its inverse
//! scale overflows, goes back to the scalar code, whose casts saturate where the vector
//! conversions would not, and whose maximum skips NaNs the way it does.

use super::act::{ActKind, QuantAct};
use half::f16;
use std::arch::x86_64::*;

/// Quantizes block `b` (values `xs`) of `a` into its slots, unless the block holds a value that
/// is not finite or its inverse scale overflows: then it returns false and writes nothing (the
/// scalar code takes the block).
///
/// # Safety
///
/// The CPU has AVX2 (checked by `cpu::isa()`); `xs` holds one block of `a.kind`, and block `b`
/// is in range of `a`'s per-block arrays.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_block(a: &mut QuantAct, xs: &[f32], b: usize) -> bool {
    let bl = a.kind.block();
    debug_assert_eq!(xs.len(), bl);
    let Some(amax) = abs_max(xs) else {
        return false;
    };
    match a.kind {
        ActKind::Q8_K => {
            if amax == 0.0 {
                return true;
            }
            // The first value of the largest magnitude, with its sign.
            let target = _mm256_set1_ps(amax);
            let mut max = 0f32;
            for (i, c) in xs.chunks_exact(8).enumerate() {
                let m = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs(ld(c)), target));
                if m != 0 {
                    max = xs[8 * i + m.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            if !iscale.is_finite() {
                // A maximum so small that 127 over it overflows.
                return false;
            }
            let q = &mut a.qs[b * 256..(b + 1) * 256];
            let (vs, magic) = (_mm256_set1_ps(iscale), _mm256_set1_ps(12_582_912.0));
            let (mask, half) = (_mm256_set1_epi32(0x007f_ffff), _mm256_set1_epi32(0x0040_0000));
            let cap = _mm256_set1_epi32(127);
            let mut sum = 0i32;
            for (g, (xc, qc)) in xs.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
                // nearest_int(iscale · x), capped at 127, as the scalar code computes it.
                let mut iv = [_mm256_setzero_si256(); 4];
                for (k, v) in iv.iter_mut().enumerate() {
                    let t = _mm256_add_ps(_mm256_mul_ps(vs, ld(&xc[8 * k..])), magic);
                    let n = _mm256_sub_epi32(_mm256_and_si256(_mm256_castps_si256(t), mask), half);
                    *v = _mm256_min_epi32(n, cap);
                }
                let bytes = pack_i8(iv);
                _mm256_storeu_si256(qc.as_mut_ptr() as *mut __m256i, bytes);
                for (h, s) in sums16(bytes).into_iter().enumerate() {
                    a.bsums[b * 16 + 2 * g + h] = s as i16;
                    sum += s;
                }
            }
            a.sum[b] = sum;
            a.d[b] = 1.0 / iscale;
        }
        ActKind::Q8_0 | ActKind::Q8_1 => {
            let d = amax / 127.0;
            let Some(id) = inverse(d) else {
                return false;
            };
            let mut iv = [_mm256_setzero_si256(); 4];
            for (k, v) in iv.iter_mut().enumerate() {
                *v = round_away(_mm256_mul_ps(ld(&xs[8 * k..]), id));
            }
            let bytes = pack_i8(iv);
            _mm256_storeu_si256(a.qs[b * 32..].as_mut_ptr() as *mut __m256i, bytes);
            let sum: i32 = sums16(bytes).iter().sum();
            a.d[b] = f16::from_f32(d).to_f32();
            a.sum[b] = sum;
            if a.kind == ActKind::Q8_1 {
                a.s[b] = f16::from_f32(d * sum as f32).to_f32();
            }
        }
        ActKind::Q16 => {
            let d = amax / 32767.0;
            let Some(id) = inverse(d) else {
                return false;
            };
            let (lo, hi) = (_mm256_set1_epi32(-32767), _mm256_set1_epi32(32767));
            let mut sum = _mm256_setzero_si256();
            for k in 0..2 {
                let r0 = round_away(_mm256_mul_ps(ld(&xs[16 * k..]), id));
                let r1 = round_away(_mm256_mul_ps(ld(&xs[16 * k + 8..]), id));
                let (r0, r1) =
                    (_mm256_max_epi32(_mm256_min_epi32(r0, hi), lo), _mm256_max_epi32(_mm256_min_epi32(r1, hi), lo));
                sum = _mm256_add_epi32(sum, _mm256_add_epi32(r0, r1));
                // packs works within 128-bit halves: [r0 0-3, r1 0-3 | r0 4-7, r1 4-7].
                let w = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packs_epi32(r0, r1));
                _mm256_storeu_si256(a.qs16[b * 32 + 16 * k..].as_mut_ptr() as *mut __m256i, w);
            }
            a.d[b] = d;
            a.sum[b] = hsum(sum);
        }
    }
    true
}

/// The scalar code's `1 / d` (0 for d = 0) in every lane, unless it overflows (a subnormal d).
///
/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn inverse(d: f32) -> Option<__m256> {
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // No closure here: it would not inherit the target feature.
    if id.is_finite() {
        Some(_mm256_set1_ps(id))
    } else {
        None
    }
}

/// # Safety
///
/// AVX2; `x` holds at least 8 values.
#[inline(always)]
unsafe fn ld(x: &[f32]) -> __m256 {
    debug_assert!(x.len() >= 8);
    _mm256_loadu_ps(x.as_ptr())
}

/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn abs(v: __m256) -> __m256 {
    _mm256_andnot_ps(_mm256_set1_ps(-0.0), v)
}

/// The largest |x| of a block of finite values; `None` if one is infinite or NaN.
///
/// # Safety
///
/// AVX2; `xs.len()` is a multiple of 32.
#[inline(always)]
unsafe fn abs_max(xs: &[f32]) -> Option<f32> {
    let inf = _mm256_set1_ps(f32::INFINITY);
    let mut m = [_mm256_setzero_ps(); 4];
    let mut bad = _mm256_setzero_ps();
    for c in xs.chunks_exact(32) {
        for (k, mk) in m.iter_mut().enumerate() {
            let a = abs(ld(&c[8 * k..]));
            *mk = _mm256_max_ps(a, *mk);
            // Not less than infinity: infinite, or unordered (NaN).
            bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_NLT_UQ>(a, inf));
        }
    }
    if _mm256_movemask_ps(bad) != 0 {
        return None;
    }
    // A maximum of finite, non-negative values: the order of the reduction does not matter.
    let v = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
    let h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
    Some(_mm_cvtss_f32(h))
}

/// `blocks::round_away` lane by lane (half away from zero), for finite values below 2^31.
///
/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn round_away(v: __m256) -> __m256i {
    let a = abs(v);
    let i = _mm256_cvttps_epi32(a);
    let up = _mm256_cmp_ps::<_CMP_GE_OQ>(_mm256_sub_ps(a, _mm256_cvtepi32_ps(i)), _mm256_set1_ps(0.5));
    // i + 1 where the fraction is at least a half (the mask is −1 there), negated where v < 0.
    let r = _mm256_sub_epi32(i, _mm256_castps_si256(up));
    _mm256_sign_epi32(r, _mm256_castps_si256(v))
}

/// 32 i32 values in −128..=127 (four vectors, in order) as 32 bytes, in order.
///
/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn pack_i8(v: [__m256i; 4]) -> __m256i {
    // Within 128-bit halves: [v0 0-3, v1 0-3 | v0 4-7, v1 4-7], then bytes
    // [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, v1 4-7, v2 4-7, v3 4-7].
    let w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Sums of the signed bytes 0–15 and 16–31.
///
/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn sums16(bytes: __m256i) -> [i32; 2] {
    // Bytes + 128 are unsigned; the sum of absolute differences from zero adds each 8.
    let s = _mm256_sad_epu8(_mm256_xor_si256(bytes, _mm256_set1_epi8(-128)), _mm256_setzero_si256());
    let mut q = [0i64; 4];
    _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, s);
    [(q[0] + q[1]) as i32 - 16 * 128, (q[2] + q[3]) as i32 - 16 * 128]
}

/// # Safety
///
/// AVX2.
#[inline(always)]
unsafe fn hsum(v: __m256i) -> i32 {
    let h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
    let h = _mm_add_epi32(h, _mm_shuffle_epi32::<1>(h));
    _mm_cvtsi128_si32(h)
}

//! AVX2 kernels of MXFP4 weights against Q8_0 activations: decode (one token, several rows at
//! once) and small batches (several rows against a few tokens), each group of eight blocks
//! unpacked once for all the tokens. They run at the AVX2 and the AVX-512 levels alike; larger
//! batches go to the tiled kernels (`tiled_avx2`, `x86_512`), which take the codes this file
//! unpacks (`codes`).
//!
//! A block is an E8M0 exponent and 32 four-bit codes indexing the doubled FP4 table
//! (`MXFP4_VALUES`, −12..12). The codes are looked up with `vpshufb` in that table plus 12, so
//! they come out as unsigned bytes 0..24 that `vpmaddubsw` takes as they are (a pair of
//! products is at most 2·24·127 = 6096: no saturation); 12·Σx, the activation block's code sum,
//! comes off the block's i32 sum. That leaves Σ value·x, the exact integer of
//! `dot_ref::block_ints`, and the float side is `dot_ref::accumulate`'s
//! `fma(e8m0_half(e)·dx, isum, acc)` block after block, so every result equals the scalar
//! reference to the bit, whatever the batch or the thread count.

// Index loops over blocks, rows and tokens read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::act::QuantAct;
use super::blocks::MXFP4_VALUES;
use super::x86::{blocks8, by_groups, half, prefetch_rows, rows4, transpose4};
use super::{BatchOut, BatchScratch, SMALL_BATCH};
use crate::cpu::Isa;
use crate::dtype::DType;
use crate::matmul::{MatRef, SendPtr};
use crate::pool::ThreadPool;
use std::arch::x86_64::*;

/// Bytes per block: the exponent, then 16 bytes of codes.
const BB: usize = 17;

/// What the lookup table adds to each FP4 value so that codes are unsigned.
pub(crate) const OFFSET: i32 = 12;

/// The doubled FP4 values plus `OFFSET` (0..24), in both 128-bit lanes: a `vpshufb` table.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn table() -> __m256i {
    const T: [u8; 16] = {
        let mut t = [0u8; 16];
        let mut i = 0;
        while i < 16 {
            t[i] = (MXFP4_VALUES[i] as i32 + OFFSET) as u8;
            i += 1;
        }
        t
    };
    let t = _mm_loadu_si128(T.as_ptr() as *const __m128i);
    _mm256_set_m128i(t, t)
}

/// The 32 offset codes (0..24) of the block at `b`, in element order: low nibbles (elements
/// 0..16) in the low 128-bit lane, high nibbles (elements 16..32) in the high one — the 16
/// bytes loaded into both lanes and the high lane's shifted down by a nibble.
///
/// # Safety
///
/// `b` is valid for reading one block (17 bytes); the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(crate) unsafe fn codes(t: __m256i, b: *const u8) -> __m256i {
    let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(1) as *const __m128i));
    let n = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    _mm256_shuffle_epi8(t, _mm256_and_si256(n, _mm256_set1_epi8(0x0F)))
}

/// Products of a block's offset codes with its 32 activation codes, summed in pairs (16 i16
/// lanes, each at most 2·24·127 = 6096 in magnitude).
///
/// # Safety
///
/// `x` is valid for reading 32 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn pairs(u: __m256i, x: *const i8) -> __m256i {
    _mm256_maddubs_epi16(u, _mm256_loadu_si256(x as *const __m256i))
}

/// Eight blocks' pair sums (`pairs`), already added in pairs of blocks by a first `vphaddw`
/// (`h[k]`: blocks 2k and 2k + 1) → their eight i32 totals, in order. The second `vphaddw`
/// leaves sums of 8 products (at most 8·24·127 = 24384: no i16 wraps), `vpmaddwd` widens them to
/// sums of 16 (one 128-bit lane's), and the two lanes are added.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn reduce8(h: &[__m256i; 4]) -> __m256i {
    let ones = _mm256_set1_epi16(1);
    let s0 = _mm256_madd_epi16(_mm256_hadd_epi16(h[0], h[1]), ones);
    let s1 = _mm256_madd_epi16(_mm256_hadd_epi16(h[2], h[3]), ones);
    _mm256_add_epi32(_mm256_permute2x128_si256(s0, s1, 0x20), _mm256_permute2x128_si256(s0, s1, 0x31))
}

/// `e8m0_half(e)` of eight exponents (in i32 lanes), exactly: for e ≥ 2 the normal number whose
/// biased exponent is e − 1, `(e − 1)·2^23` as bits; for e = 0 and 1 the subnormals 2^−128 and
/// 2^−127, `2^(21 + e)` as bits. The second form taken at min(e, 2) is at most the first for
/// e ≥ 2 (both are 2^23 at e = 2) and above it for e < 2 (where the first is 0 or negative),
/// so the larger of the two is the scale.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn e8m0_half8(e: __m256i) -> __m256 {
    let normal = _mm256_sub_epi32(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(1 << 23));
    let small = _mm256_sllv_epi32(_mm256_set1_epi32(1 << 21), _mm256_min_epi32(e, _mm256_set1_epi32(2)));
    _mm256_castsi256_ps(_mm256_max_epi32(normal, small))
}

/// The block scales of the eight exponent bytes in the low 8 bytes of `e`.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn scales8(e: __m128i) -> __m256 {
    e8m0_half8(_mm256_cvtepu8_epi32(e))
}

/// The scales of the eight blocks from `b`, their exponents fetched with four 32-byte loads
/// instead of eight byte inserts. Exponent j sits at byte 17j: for j = 2i at byte 0 of dword i
/// of the load at 30i, for j = 2i + 1 at byte 1 of dword i + 4 of the same load; the blends
/// take lanes i and i + 4 from load i, a shift by 8 in the high lanes and a mask leave the
/// exponents as [e0, e2, e4, e6 | e1, e3, e5, e7], and a permutation puts them in order.
///
/// # Safety
///
/// `b` is valid for reading eight whole blocks (136 bytes; the last load ends at byte 122);
/// AVX2.
#[inline(always)]
unsafe fn group_scales(b: *const u8) -> __m256 {
    let l = |o: usize| _mm256_loadu_si256(b.add(o) as *const __m256i);
    let v = _mm256_blend_epi32(l(0), l(30), 0b0010_0010);
    let v = _mm256_blend_epi32(v, l(60), 0b0100_0100);
    let v = _mm256_blend_epi32(v, l(90), 0b1000_1000);
    // [e0, e2, e4, e6 | e1, e3, e5, e7]
    let v = _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8)), _mm256_set1_epi32(0xFF));
    e8m0_half8(_mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)))
}

/// The scales of the `m` blocks from `b` (lanes past `m` zero): `group_scales` for a whole
/// group, the exponents one by one for a row's last, shorter one (whose loads could pass the
/// row's end).
///
/// # Safety
///
/// `b` is valid for reading `m` ≤ 8 blocks; AVX2.
#[inline(always)]
unsafe fn block_scales(b: *const u8, m: usize) -> __m256 {
    if m == 8 {
        return group_scales(b);
    }
    let mut e = [0u8; 16];
    for j in 0..m {
        e[j] = *b.add(j * BB);
    }
    scales8(_mm_loadu_si128(e.as_ptr() as *const __m128i))
}

/// Byte `J` of `e` replaced by the exponent of the block at `b`.
///
/// # Safety
///
/// `b` is valid for reading one byte; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn with_exponent<const J: i32>(e: __m128i, b: *const u8) -> __m128i {
    _mm_insert_epi8(e, *b as i32, J)
}

/// 12·Σx of eight activation blocks from `i`: what the offset codes add to their sums.
///
/// # Safety
///
/// `act.sum` holds eight blocks from `i` (rows are padded to whole groups of eight); AVX2.
#[inline(always)]
unsafe fn offset_sums(act: &QuantAct, i: usize) -> __m256i {
    let s = _mm256_loadu_si256(act.sum.as_ptr().add(i) as *const __m256i);
    _mm256_add_epi32(_mm256_slli_epi32(s, 3), _mm256_slli_epi32(s, 2))
}

/// `acc` (lane r: row r's sum) after the `m` blocks' fused steps of `accumulate`, block after
/// block: lane r of step j is `fma(d[r][j], s[r][j], acc[r])`. `d` and `s` (block j in lane j)
/// are transposed so that one `vfmadd` serves the four rows.
///
/// # Safety
///
/// The CPU has AVX2 and FMA (checked by `cpu::isa()`); `m ≤ 8`.
#[inline(always)]
unsafe fn accumulate4(acc: __m128, d: &[__m256; 4], s: &[__m256; 4], m: usize) -> __m128 {
    let (dt, st) = (transpose4(d), transpose4(s));
    let mut acc = acc;
    blocks8!(m, J, {
        acc = _mm_fmadd_ps(half::<J>(dt[J % 4]), half::<J>(st[J % 4]), acc);
    });
    acc
}

/// One token's activation codes regrouped for `rows_decode`: in each group of eight blocks,
/// for k in 0..4, the first halves of blocks k and k + 4 (32 bytes), then their second halves
/// — the order in which `rows_decode` lays out a pair of blocks' low and high nibbles.
pub(crate) struct DecodeAct(Vec<i8>);

impl DecodeAct {
    /// Token 0 of `act` (padded to whole groups of eight blocks, as `QuantAct` pads them).
    pub(crate) fn new(act: &QuantAct) -> DecodeAct {
        let nb = act.blocks_per_row().next_multiple_of(8);
        let x = &act.qs[act.idx(0, 0) * 32..][..nb * 32];
        let mut v = vec![0i8; nb * 32];
        for (src, dst) in x.chunks_exact(256).zip(v.chunks_exact_mut(256)) {
            for k in 0..4 {
                let (lo, hi) = (&src[32 * k..32 * k + 32], &src[32 * (k + 4)..32 * (k + 4) + 32]);
                let d = &mut dst[64 * k..64 * k + 64];
                d[..16].copy_from_slice(&lo[..16]);
                d[16..32].copy_from_slice(&hi[..16]);
                d[32..48].copy_from_slice(&lo[16..]);
                d[48..].copy_from_slice(&hi[16..]);
            }
        }
        DecodeAct(v)
    }
}

/// Decode (one token) over R ≤ 4 rows at once, eight blocks at a time. Blocks k and k + 4 of a
/// group share a vector, one per 128-bit lane, so the low nibbles of both make one lookup and
/// the high nibbles another, and their products with the regrouped activations (`DecodeAct`)
/// come out already separated by block: three `vphaddd` leave the eight blocks' sums in order,
/// with no per-block reduction. With `VNNI`, `vpdpbusd` forms the products and their sums of
/// four in one step (AVX-512 VNNI on 256-bit vectors); without, `vpmaddubsw` and `vpmaddwd`
/// (a pair of products is at most 2·24·127 = 6096, the two halves' pairs at most 12192: no i16
/// wraps). The scale products are formed eight at a time, and the rows' per-block float
/// additions run in the lanes of one vector — the operations of `accumulate`, in its order,
/// for each row.
///
/// # Safety
///
/// The CPU has AVX2 and FMA, and with `VNNI` AVX-512 VNNI and VL (the callers are compiled for
/// them and dispatched after `cpu::isa()` and `cpu::has_vnni()`); `w` holds R whole MXFP4 rows
/// of `row_bytes`; `act` is one token's Q8_0 activations for rows of this width, padded to
/// whole groups of eight blocks (as `QuantAct` pads them), and `xp` their regrouping.
#[inline(always)]
unsafe fn decode<const R: usize, const VNNI: bool>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    xp: &DecodeAct,
    out: &mut [f32; 4],
) {
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * BB);
    let mut acc = _mm_setzero_ps();
    /// # Safety
    ///
    /// As `decode`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group<const R: usize, const VNNI: bool>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        xp: &DecodeAct,
        b0: usize,
        m: usize,
        acc: __m128,
    ) -> __m128 {
        let i0 = act.idx(0, b0);
        let xg = xp.0.as_ptr().add(b0 * 32);
        let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
        let xs = offset_sums(act, i0);
        let (t, mask) = (table(), _mm256_set1_epi8(0x0F));
        // Rows past R stay zero, and so do their lanes of `acc`.
        let mut ddx = [_mm256_setzero_ps(); 4];
        let mut isf = [_mm256_setzero_ps(); 4];
        rows4!(R, r, {
            let base = w.as_ptr().add(r * row_bytes + b0 * BB);
            let (scales, sums) = row_terms::<VNNI>(base, R * row_bytes, xg, m, t, mask);
            ddx[r] = _mm256_mul_ps(scales, dx);
            isf[r] = _mm256_cvtepi32_ps(_mm256_sub_epi32(sums, xs));
        });
        accumulate4(acc, &ddx, &isf, m)
    }
    by_groups!(nb, |b0, m| acc = group::<R, VNNI>(w, row_bytes, act, xp, b0, m, acc));
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    out[..R].copy_from_slice(&v[..R]);
}

/// One row's part of `decode`'s group: the scales of its `m` blocks at `base` and their eight
/// integer sums, in block order (before the offset comes off).
///
/// # Safety
///
/// As `decode`'s, for the `m` blocks at `base`, whose regrouped activations are at `xg`;
/// `ahead` bytes on are the same blocks of the row the next pass reads (prefetched only).
#[inline(always)]
unsafe fn row_terms<const VNNI: bool>(
    base: *const u8,
    ahead: usize,
    xg: *const i8,
    m: usize,
    t: __m256i,
    mask: __m256i,
) -> (__m256, __m256i) {
    prefetch_rows(base.wrapping_add(ahead), 8 * BB);
    let mut y = [_mm256_setzero_si256(); 4];
    for k in 0..4 {
        // Blocks past the row's end read as zero codes (their activations are zero).
        let ld = |j: usize| {
            if j < m {
                _mm_loadu_si128(base.add(j * BB + 1) as *const __m128i)
            } else {
                _mm_setzero_si128()
            }
        };
        let v = _mm256_set_m128i(ld(k + 4), ld(k));
        let lo = _mm256_shuffle_epi8(t, _mm256_and_si256(v, mask));
        let hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), mask));
        let xl = _mm256_loadu_si256(xg.add(64 * k) as *const __m256i);
        let xh = _mm256_loadu_si256(xg.add(64 * k + 32) as *const __m256i);
        y[k] = if VNNI {
            _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh)
        } else {
            let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        };
    }
    let sums = _mm256_hadd_epi32(_mm256_hadd_epi32(y[0], y[1]), _mm256_hadd_epi32(y[2], y[3]));
    (block_scales(base, m), sums)
}

/// `decode` with `vpmaddubsw` (AVX2).
///
/// # Safety
///
/// As `decode`'s without `VNNI`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rows_decode<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    xp: &DecodeAct,
    out: &mut [f32; 4],
) {
    decode::<R, false>(w, row_bytes, act, xp, out)
}

/// `decode` with `vpdpbusd` (AVX-512 VNNI).
///
/// # Safety
///
/// As `decode`'s with `VNNI`.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn rows_decode_vnni<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    xp: &DecodeAct,
    out: &mut [f32; 4],
) {
    decode::<R, true>(w, row_bytes, act, xp, out)
}

/// Tokens `t0..t0 + n` (n ≤ `SMALL_BATCH`) over R ≤ 4 rows at once (small batches): each group
/// of eight blocks of a row is unpacked once for all the tokens, and each token then runs
/// `rows_decode`'s operations — so every value has the decode kernel's bits. `out[t][r]`
/// receives row r, token t0 + t.
///
/// # Safety
///
/// As `rows_decode`, with tokens `t0..t0 + n` rows of `act`.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn rows_batch<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * BB);
    debug_assert!((1..=SMALL_BATCH).contains(&n) && t0 + n <= act.rows);
    let t = table();
    let mut acc = [_mm_setzero_ps(); SMALL_BATCH];
    // Per token (`s.terms`); lanes of rows past R are not written (their results are dropped).
    by_groups!(nb, |b0, m| {
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * BB);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), 8 * BB);
            // Blocks past the row's end stay zero (their activations are zero padding).
            let mut u = [_mm256_setzero_si256(); 8];
            let mut e = _mm_setzero_si128();
            blocks8!(m, J, {
                let blk = base.add(J * BB);
                u[J] = codes(t, blk);
                e = with_exponent::<{ J as i32 }>(e, blk);
            });
            let dw = scales8(e);
            for i in 0..n {
                let i0 = act.idx(t0 + i, b0);
                let xq = act.qs.as_ptr().add(i0 * 32);
                let mut h = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    h[k] = _mm256_hadd_epi16(pairs(u[2 * k], xq.add(64 * k)), pairs(u[2 * k + 1], xq.add(64 * k + 32)));
                }
                s.terms[i].ddx[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(act.d.as_ptr().add(i0)));
                s.terms[i].isf[r] = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(&h), offset_sums(act, i0)));
            }
        }
        for i in 0..n {
            acc[i] = accumulate4(acc[i], &s.terms[i].ddx, &s.terms[i].isf, m);
        }
    });
    for i in 0..n {
        let mut v = [0f32; 4];
        _mm_storeu_ps(v.as_mut_ptr(), acc[i]);
        out[i][..R].copy_from_slice(&v[..R]);
    }
}

/// `out = x · Wᵀ` for MXFP4 weights with AVX2: the caller checked the CPU (`isa() ≥ Avx2`), and
/// `act` holds `n` tokens quantized for `w` (Q8_0); `o` is `n × w.rows`.
pub(crate) fn matmul(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    assert!(w.dtype == DType::MXFP4 && act.rows == n && act.cols == w.cols);
    let rb = w.row_bytes();
    if n == 1 {
        // Decode: four rows at a time (fewer at a range's end).
        let xp = DecodeAct::new(act);
        /// One of the decode kernels, by count of rows (1 to 4).
        ///
        /// # Safety
        ///
        /// Calling one has `decode`'s contract.
        type Decode = unsafe fn(&[u8], usize, &QuantAct, &DecodeAct, &mut [f32; 4]);
        let kernels: [Decode; 4] = if isa.uses_vnni() {
            [rows_decode_vnni::<1>, rows_decode_vnni::<2>, rows_decode_vnni::<3>, rows_decode_vnni::<4>]
        } else {
            [rows_decode::<1>, rows_decode::<2>, rows_decode::<3>, rows_decode::<4>]
        };
        return super::rows_by(pool, w, 4, o, |wr, k, vals| {
            // SAFETY: AVX2/FMA were detected (the caller's contract), AVX-512 VNNI where
            // `uses_vnni`; `wr` holds k (1 to 4) whole rows (MatRef::new checked the size);
            // `act` is padded by QuantAct and `xp` regroups it.
            unsafe { kernels[k.clamp(1, 4) - 1](wr, rb, act, &xp, vals) }
        });
    }
    // Batches of more tokens go to the tiled kernels (`tiled_avx2`, `x86_512`).
    debug_assert!(n < super::ROW_KERNEL_MIN_TOKENS);
    super::small_batches(pool, w, n, o, |wr, k, t0, nt, vals, s| {
        // SAFETY: AVX2/FMA were detected (the caller's contract); `wr` holds k whole rows;
        // tokens t0..t0 + nt are rows of `act`, padded by QuantAct.
        unsafe {
            match k {
                4 => rows_batch::<4>(wr, rb, act, t0, nt, vals, s),
                3 => rows_batch::<3>(wr, rb, act, t0, nt, vals, s),
                2 => rows_batch::<2>(wr, rb, act, t0, nt, vals, s),
                _ => rows_batch::<1>(wr, rb, act, t0, nt, vals, s),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::cpu::Isa;
    use crate::matmul::matmul_with_isa;
    use crate::quant::blocks::e8m0_half;
    use crate::{DType, MatRef, ThreadPool};

    fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// Random codes; exponents mostly in a realistic range (110..=140), and where `edges`, one
    /// block in five at an extreme one (0, 1, 254 or 255).
    fn random_rows(rows: usize, cols: usize, seed: u64, edges: bool) -> Vec<u8> {
        let mut next = lcg(seed);
        let mut v: Vec<u8> = (0..rows * DType::MXFP4.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        for b in v.chunks_exact_mut(17) {
            b[0] = 110 + (next() % 31) as u8;
            if edges && next().is_multiple_of(5) {
                b[0] = [0, 1, 254, 255][(next() % 4) as usize];
            }
        }
        v
    }

    /// Rows quantized from smooth values (the codes a real quantizer picks).
    fn quantized_rows(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let v: Vec<f32> =
            (0..rows * cols).map(|i| (i as f32 * 0.37 + seed as f32).sin() * (1.0 + (i % 97) as f32 * 0.02)).collect();
        crate::quant::quantize_rows(DType::MXFP4, &v, cols)
    }

    fn xs(n: usize, seed: u64) -> Vec<f32> {
        let mut next = lcg(seed);
        (0..n).map(|i| (next() as f32 / (1u64 << 31) as f32 - 1.0) * [1.0, 0.02, 7.0][i / 96 % 3]).collect()
    }

    fn check(w: &[u8], rows: usize, cols: usize, n: usize, pool: &ThreadPool) {
        let m = MatRef::new(DType::MXFP4, rows, cols, w).unwrap();
        let x = xs(n * cols, 9 + n as u64);
        let mut want = vec![0f32; n * rows];
        crate::matmul_ref(m, &x, n, &mut want);
        for isa in Isa::supported() {
            let got = matmul_with_isa(isa, pool, m, &x, n);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{isa:?} {rows}x{cols} n={n} element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn scales_of_every_exponent_equal_the_reference() {
        if !Isa::supported().contains(&Isa::Avx2) {
            return;
        }
        for e0 in (0..256).step_by(8) {
            let e: [u8; 8] = std::array::from_fn(|j| (e0 + j) as u8);
            let mut got = [0f32; 8];
            // SAFETY: AVX2 is present (checked above).
            unsafe {
                use std::arch::x86_64::*;
                let v = _mm_loadl_epi64(e.as_ptr() as *const __m128i);
                _mm256_storeu_ps(got.as_mut_ptr(), super::scales8(v))
            };
            for j in 0..8 {
                assert_eq!(got[j].to_bits(), e8m0_half(e[j]).to_bits(), "exponent {}", e[j]);
            }
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let pool = ThreadPool::new(2);
        // Rows left over after groups of four; blocks left over after groups of eight.
        for rows in 1..=17 {
            for cols in [32, 416, 2560] {
                for edges in [false, true] {
                    let w = random_rows(rows, cols, rows as u64 * 31 + cols as u64 + edges as u64, edges);
                    for n in [1, 3, 7, 33] {
                        check(&w, rows, cols, n, &pool);
                    }
                }
            }
        }
        let w = quantized_rows(6, 1280, 4);
        for n in [1, 3, 7, 33] {
            check(&w, 6, 1280, n, &pool);
        }
    }

    #[test]
    fn batch_and_threads_do_not_change_a_row() {
        let (rows, cols) = (13, 800);
        let w = random_rows(rows, cols, 77, true);
        let m = MatRef::new(DType::MXFP4, rows, cols, &w).unwrap();
        let x = xs(7 * cols, 1);
        let mut all = vec![0f32; 7 * rows];
        crate::matmul(&ThreadPool::new(2), m, &x, 7, &mut all);
        for t in 0..7 {
            let mut one = vec![0f32; rows];
            crate::matmul(&ThreadPool::new(1), m, &x[t * cols..(t + 1) * cols], 1, &mut one);
            assert!(crate::compare::same_bits(&one, &all[t * rows..(t + 1) * rows]), "token {t}");
            let mut two = vec![0f32; rows];
            crate::matmul(&ThreadPool::new(2), m, &x[t * cols..(t + 1) * cols], 1, &mut two);
            assert!(crate::compare::same_bits(&one, &two), "token {t}, 2 threads");
        }
    }
}

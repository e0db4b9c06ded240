//! AVX2 kernels of the 32-element block formats Q4_0, Q4_1, Q5_0 and Q5_1 (against Q8_0 or Q8_1
//! activations) and Q8_0 (against Q16 activations): decode (one token, several rows at once),
//! small batches (several rows against a few tokens) and prefill (one row against a range of
//! tokens), each group of eight blocks unpacked once for all the tokens. They run at the AVX2
//! and the AVX-512 levels alike.
//!
//! Four- and five-bit codes are taken unsigned (Q4: 0..15, Q5: 0..31) into `vpmaddubsw`, whose
//! pairs stay far from saturation (at most 2·31·127 = 7874); two `vphaddw` steps leave sums of 8
//! products (at most 31496: no i16 wraps) before `vpmaddwd` widens them. Q4_0's and Q5_0's
//! stored offsets (8 and 16) come off the block's i32 sum as offset·Σx, Σx being the activation
//! block's code sum. Q8_0 weights are sign-extended to i16 and multiplied with the 16-bit
//! activations by `vpmaddwd` (a pair is at most 2·128·32767 in magnitude). Either way each
//! block's sum is the exact integer of `dot_ref::block_ints` (or `block_ints_q16`), and the float
//! side is `dot_ref::accumulate` block after block — `fma(d·dx, isum, acc)`, then for Q4_1 and
//! Q5_1 `fma(m, sx, acc)` — with rows (decode) or tokens (prefill) in the lanes of one vector, so
//! every result equals the scalar reference to the bit, whatever the batch or the thread count.

// Index loops over blocks, rows and tokens read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::act::QuantAct;
use super::x86::{accumulate4, blocks8, by_groups, prefetch_rows, reduce8x8, Terms};
use super::{BatchOut, BatchScratch, SMALL_BATCH};
use crate::dtype::DType;
use crate::matmul::{MatRef, SendPtr};
use crate::pool::ThreadPool;
use std::arch::x86_64::*;

/// GGML ids of the formats, the const parameter of the kernels.
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q5_0: u32 = 6;
const Q5_1: u32 = 7;
const Q8_0: u32 = 8;

/// Bytes per block.
const fn block_bytes(dt: u32) -> usize {
    match dt {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// Byte offset of the 16 nibble bytes in a block.
const fn qs_at(dt: u32) -> usize {
    match dt {
        Q4_0 => 2,
        Q4_1 => 4,
        Q5_0 => 6,
        _ => 8,
    }
}

/// Byte offset of the fifth bits (a little-endian u32) in a Q5 block.
const fn qh_at(dt: u32) -> usize {
    if dt == Q5_0 {
        2
    } else {
        4
    }
}

/// Whether the format has a fifth bit per code.
const fn five(dt: u32) -> bool {
    matches!(dt, Q5_0 | Q5_1)
}

/// Whether the format has a block minimum (`m`, after `d`).
const fn has_min(dt: u32) -> bool {
    matches!(dt, Q4_1 | Q5_1)
}

/// Whether codes carry a stored offset (Q4_0: 8, Q5_0: 16).
const fn has_offset(dt: u32) -> bool {
    matches!(dt, Q4_0 | Q5_0)
}

/// The 32 unsigned codes of the block at `b`, in element order: low nibbles (elements 0..16) in
/// the low 128-bit lane, high nibbles (elements 16..32) in the high one — the 16 bytes loaded
/// into both lanes and the high lane's shifted down by a nibble — and for Q5, bit j of the u32
/// `qh` as 16 in byte j.
///
/// # Safety
///
/// `b` is valid for reading one block of the format; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn codes<const DT: u32>(b: *const u8) -> __m256i {
    let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(b.add(qs_at(DT)) as *const __m128i));
    let n = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    let u = _mm256_and_si256(n, _mm256_set1_epi8(0x0F));
    if !five(DT) {
        return u;
    }
    let h = (b.add(qh_at(DT)) as *const u32).read_unaligned();
    _mm256_or_si256(u, super::x86::fifth_bits(h))
}

/// Products of a block's codes with its 32 activation codes, summed in pairs (16 i16 lanes,
/// each at most 2·31·127 = 7874 in magnitude).
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
/// leaves sums of 8 products (at most 8·31·127 = 31496: no i16 wraps), `vpmaddwd` widens them to
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

/// Block `J`'s pair sums `p` into `h` (see `reduce8`): an even block alone (its odd partner,
/// if any, overwrites it), an odd one added to its even partner `prev`.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn add_block<const J: usize>(h: &mut [__m256i; 4], prev: &mut __m256i, p: __m256i) {
    if J.is_multiple_of(2) {
        *prev = p;
        h[J / 2] = _mm256_hadd_epi16(p, _mm256_setzero_si256());
    } else {
        h[J / 2] = _mm256_hadd_epi16(*prev, p);
    }
}

/// The f16 scale fields of up to eight blocks, gathered: `d` (bytes 0..2), and for a format
/// with a minimum, `m` (bytes 2..4) too. Blocks are inserted one by one (`add`), absent ones
/// stay zero.
struct Scales<const DT: u32> {
    /// Without a minimum: eight f16 `d`s. With one: (d, m) pairs of blocks 0..4.
    lo: __m128i,
    /// With a minimum: (d, m) pairs of blocks 4..8.
    hi: __m128i,
}

impl<const DT: u32> Scales<DT> {
    /// # Safety
    ///
    /// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
    #[inline(always)]
    unsafe fn new() -> Self {
        Scales { lo: _mm_setzero_si128(), hi: _mm_setzero_si128() }
    }

    /// Block `J`'s scale fields, from the block at `b` (`K` is `J % 4`).
    ///
    /// # Safety
    ///
    /// `b` is valid for reading 4 bytes (2 without a minimum); the CPU has AVX2.
    #[inline(always)]
    unsafe fn add<const J: i32, const K: i32>(&mut self, b: *const u8) {
        if !has_min(DT) {
            self.lo = _mm_insert_epi16(self.lo, (b as *const u16).read_unaligned() as i32, J);
        } else if J < 4 {
            self.lo = _mm_insert_epi32(self.lo, (b as *const i32).read_unaligned(), K);
        } else {
            self.hi = _mm_insert_epi32(self.hi, (b as *const i32).read_unaligned(), K);
        }
    }

    /// (the eight `d`s, the eight `m`s — zero without a minimum) as f32.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and F16C (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn get(&self) -> (__m256, __m256) {
        if !has_min(DT) {
            return (_mm256_cvtph_ps(self.lo), _mm256_setzero_ps());
        }
        // Each half: its four d's, then its four m's.
        let sep = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
        let (lo, hi) = (_mm_shuffle_epi8(self.lo, sep), _mm_shuffle_epi8(self.hi, sep));
        (_mm256_cvtph_ps(_mm_unpacklo_epi64(lo, hi)), _mm256_cvtph_ps(_mm_unpackhi_epi64(lo, hi)))
    }
}

/// offset·Σx of eight activation blocks from `i`: what the unsigned codes add to their sums
/// (zero for formats without an offset).
///
/// # Safety
///
/// `act.sum` holds eight blocks from `i` (rows are padded to whole groups of eight); AVX2.
#[inline(always)]
unsafe fn offset_sums<const DT: u32>(act: &QuantAct, i: usize) -> __m256i {
    if !has_offset(DT) {
        return _mm256_setzero_si256();
    }
    let s = _mm256_loadu_si256(act.sum.as_ptr().add(i) as *const __m256i);
    if DT == Q4_0 {
        _mm256_slli_epi32(s, 3)
    } else {
        _mm256_slli_epi32(s, 4)
    }
}

/// Decode (one token) over R ≤ 4 rows of Q4_0, Q4_1, Q5_0 or Q5_1 at once, eight blocks at a
/// time: each block's integer sums stay in vector lanes until the eight are reduced together,
/// the scale products are formed eight at a time, and the rows' per-block float additions run in
/// the lanes of one vector — the operations of `accumulate`, in its order, for each row.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `w` holds R whole rows of the format
/// of `row_bytes`; `act` is one token's Q8_0 (Q8_1 for Q4_1, Q5_1) activations for rows of this
/// width, padded to whole groups of eight blocks (as `QuantAct` pads them).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_decode<const R: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * block_bytes(DT));
    let mut acc = _mm_setzero_ps();
    /// # Safety
    ///
    /// As `rows_decode`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group<const R: usize, const DT: u32>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        b0: usize,
        m: usize,
        acc: __m128,
    ) -> __m128 {
        let bb = block_bytes(DT);
        let i0 = act.idx(0, b0);
        let xq = act.qs.as_ptr().add(i0 * 32);
        let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
        let xs = offset_sums::<DT>(act, i0);
        // Rows past R stay zero, and so do their lanes of `acc`.
        let mut t = Terms::new();
        if has_min(DT) {
            // The activation sums are the same for every row.
            let sx = _mm256_loadu_ps(act.s.as_ptr().add(i0));
            t.sx = [sx; 4];
        }
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * bb);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), 8 * bb);
            let (mut h, mut prev) = ([_mm256_setzero_si256(); 4], _mm256_setzero_si256());
            let mut sc = Scales::<DT>::new();
            blocks8!(m, J, {
                let blk = base.add(J * bb);
                add_block::<J>(&mut h, &mut prev, pairs(codes::<DT>(blk), xq.add(32 * J)));
                sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
            });
            let (dw, mw) = sc.get();
            t.ddx[r] = _mm256_mul_ps(dw, dx);
            t.isf[r] = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(&h), xs));
            t.m[r] = mw;
        }
        accumulate4(has_min(DT), acc, &t, m)
    }
    by_groups!(nb, |b0, m| acc = group::<R, DT>(w, row_bytes, act, b0, m, acc));
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    out[..R].copy_from_slice(&v[..R]);
}

/// One row of Q4_0, Q4_1, Q5_0 or Q5_1 against tokens `t0..t0 + out.len()` of `act` (prefill):
/// eight blocks unpacked once, then for every token their sums reduced together and their scale
/// products formed together, and four tokens' additions, block after block as `accumulate` makes
/// them, in the lanes of one vector.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `row` is one whole row of the
/// format for `act`'s width; tokens `t0..t0 + out.len()` are rows of `act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_tokens<const DT: u32>(row: &[u8], act: &QuantAct, t0: usize, out: &mut [f32]) {
    let nb = act.blocks_per_row();
    debug_assert!(row.len() == nb * block_bytes(DT) && t0 + out.len() <= act.rows);
    out.fill(0.0);
    /// # Safety
    ///
    /// As `row_tokens`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group<const DT: u32>(row: &[u8], act: &QuantAct, t0: usize, out: &mut [f32], b0: usize, m: usize) {
        let bb = block_bytes(DT);
        // Blocks past the row's end stay zero (their activations are zero padding).
        let mut u = [_mm256_setzero_si256(); 8];
        let mut sc = Scales::<DT>::new();
        blocks8!(m, J, {
            let blk = row.as_ptr().add((b0 + J) * bb);
            u[J] = codes::<DT>(blk);
            sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
        });
        let (dw, mw) = sc.get();
        // Four tokens at a time in the lanes of `accumulate4` (absent ones left zero).
        /// # Safety
        ///
        /// As `row_tokens`'s; tokens `t..t + o.len()` (at most four) are rows of `act`.
        #[inline(always)]
        unsafe fn tokens<const DT: u32>(
            act: &QuantAct,
            u: &[__m256i; 8],
            (dw, mw): (__m256, __m256),
            t: usize,
            b0: usize,
            m: usize,
            o: &mut [f32],
        ) {
            let mut tm = Terms::new();
            for i in 0..o.len() {
                let i0 = act.idx(t + i, b0);
                let xq = act.qs.as_ptr().add(i0 * 32);
                let mut h = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    h[k] = _mm256_hadd_epi16(pairs(u[2 * k], xq.add(64 * k)), pairs(u[2 * k + 1], xq.add(64 * k + 32)));
                }
                tm.isf[i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(&h), offset_sums::<DT>(act, i0)));
                tm.ddx[i] = _mm256_mul_ps(dw, _mm256_loadu_ps(act.d.as_ptr().add(i0)));
                if has_min(DT) {
                    tm.m[i] = mw;
                    tm.sx[i] = _mm256_loadu_ps(act.s.as_ptr().add(i0));
                }
            }
            let mut v = [0f32; 4];
            v[..o.len()].copy_from_slice(o);
            let acc = accumulate4(has_min(DT), _mm_loadu_ps(v.as_ptr()), &tm, m);
            _mm_storeu_ps(v.as_mut_ptr(), acc);
            o.copy_from_slice(&v[..o.len()]);
        }
        let mut chunks = out.chunks_exact_mut(4);
        let mut t = t0;
        for o in &mut chunks {
            tokens::<DT>(act, &u, (dw, mw), t, b0, m, o);
            t += 4;
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            tokens::<DT>(act, &u, (dw, mw), t, b0, m, rest);
        }
    }
    by_groups!(nb, |b0, m| group::<DT>(row, act, t0, out, b0, m));
}

/// Σ q·x of a Q8_0 block's codes (sign-extended to i16: `lo` elements 0..16, `hi` 16..32)
/// against 32 Q16 activations at `x`, in 8 i32 lanes (exact: a pair is at most 2·128·32767).
///
/// # Safety
///
/// `x` is valid for reading 32 i16; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn dot_q16(lo: __m256i, hi: __m256i, x: *const i16) -> __m256i {
    let a = _mm256_madd_epi16(lo, _mm256_loadu_si256(x as *const __m256i));
    let b = _mm256_madd_epi16(hi, _mm256_loadu_si256(x.add(16) as *const __m256i));
    _mm256_add_epi32(a, b)
}

/// The codes of the Q8_0 block at `b`, sign-extended: (elements 0..16, elements 16..32).
///
/// # Safety
///
/// `b` is valid for reading one block (34 bytes); the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn codes_q8(b: *const u8) -> (__m256i, __m256i) {
    (
        _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(2) as *const __m128i)),
        _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(18) as *const __m128i)),
    )
}

/// Decode (one token) over R ≤ 4 rows of Q8_0 against Q16 activations, eight blocks at a time:
/// eight blocks' sums reduced together, the scale products formed eight at a time, and the rows'
/// `fma(d·dx, isum, acc)` steps, block after block, in the lanes of one vector.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `w` holds R whole Q8_0 rows of
/// `row_bytes`; `act` is one token's Q16 activations for rows of this width, padded to whole
/// groups of eight blocks (as `QuantAct` pads them).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_decode_q8<const R: usize>(w: &[u8], row_bytes: usize, act: &QuantAct, out: &mut [f32; 4]) {
    const BB: usize = 34;
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * BB);
    let mut acc = _mm_setzero_ps();
    /// # Safety
    ///
    /// As `rows_decode_q8`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group<const R: usize>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        b0: usize,
        m: usize,
        acc: __m128,
    ) -> __m128 {
        let i0 = act.idx(0, b0);
        let xq = act.qs16.as_ptr().add(i0 * 32);
        let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
        let mut t = Terms::new();
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * BB);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), 8 * BB);
            let mut a = [_mm256_setzero_si256(); 8];
            let mut sc = Scales::<Q8_0>::new();
            blocks8!(m, J, {
                let blk = base.add(J * BB);
                let (lo, hi) = codes_q8(blk);
                a[J] = dot_q16(lo, hi, xq.add(32 * J));
                sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
            });
            t.ddx[r] = _mm256_mul_ps(sc.get().0, dx);
            t.isf[r] = _mm256_cvtepi32_ps(reduce8x8(&a));
        }
        accumulate4(false, acc, &t, m)
    }
    by_groups!(nb, |b0, m| acc = group::<R>(w, row_bytes, act, b0, m, acc));
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    out[..R].copy_from_slice(&v[..R]);
}

/// One Q8_0 row against tokens `t0..t0 + out.len()` of Q16 activations (prefill): eight blocks
/// sign-extended once, then for every token their sums reduced together and their scale
/// products formed together, and four tokens' `fma(d·dx, isum, acc)` steps, block after block,
/// in the lanes of one vector.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `row` is one whole Q8_0 row for
/// `act`'s width; tokens `t0..t0 + out.len()` are rows of `act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn row_tokens_q8(row: &[u8], act: &QuantAct, t0: usize, out: &mut [f32]) {
    const BB: usize = 34;
    let nb = act.blocks_per_row();
    debug_assert!(row.len() == nb * BB && t0 + out.len() <= act.rows);
    out.fill(0.0);
    /// # Safety
    ///
    /// As `row_tokens_q8`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group(row: &[u8], act: &QuantAct, t0: usize, out: &mut [f32], b0: usize, m: usize) {
        // Blocks past the row's end stay zero (their activations are zero padding).
        let mut u = [_mm256_setzero_si256(); 16];
        let mut sc = Scales::<Q8_0>::new();
        blocks8!(m, J, {
            let blk = row.as_ptr().add((b0 + J) * BB);
            (u[2 * J], u[2 * J + 1]) = codes_q8(blk);
            sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
        });
        let dw = sc.get().0;
        /// # Safety
        ///
        /// As `row_tokens_q8`'s; tokens `t..t + o.len()` (at most four) are rows of `act`.
        #[inline(always)]
        unsafe fn tokens(act: &QuantAct, u: &[__m256i; 16], dw: __m256, t: usize, b0: usize, m: usize, o: &mut [f32]) {
            let mut tm = Terms::new();
            for i in 0..o.len() {
                let i0 = act.idx(t + i, b0);
                let xq = act.qs16.as_ptr().add(i0 * 32);
                let mut a = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    a[j] = dot_q16(u[2 * j], u[2 * j + 1], xq.add(32 * j));
                }
                tm.isf[i] = _mm256_cvtepi32_ps(reduce8x8(&a));
                tm.ddx[i] = _mm256_mul_ps(dw, _mm256_loadu_ps(act.d.as_ptr().add(i0)));
            }
            let mut v = [0f32; 4];
            v[..o.len()].copy_from_slice(o);
            _mm_storeu_ps(v.as_mut_ptr(), accumulate4(false, _mm_loadu_ps(v.as_ptr()), &tm, m));
            o.copy_from_slice(&v[..o.len()]);
        }
        let mut chunks = out.chunks_exact_mut(4);
        let mut t = t0;
        for o in &mut chunks {
            tokens(act, &u, dw, t, b0, m, o);
            t += 4;
        }
        let rest = chunks.into_remainder();
        if !rest.is_empty() {
            tokens(act, &u, dw, t, b0, m, rest);
        }
    }
    by_groups!(nb, |b0, m| group(row, act, t0, out, b0, m));
}

/// Tokens `t0..t0 + n` (n ≤ `SMALL_BATCH`) over R ≤ 4 rows of Q4_0, Q4_1, Q5_0 or Q5_1 (small
/// batches: verify passes, a few streams): each group of eight blocks of a row is unpacked
/// once for all the tokens, and each token then runs `rows_decode`'s operations — its eight
/// blocks' sums reduced together, the scale products formed eight at a time, the rows'
/// per-block float additions in the lanes of one vector — so every value has the decode
/// kernel's bits. `out[t][r]` receives row r, token t0 + t.
///
/// # Safety
///
/// As `rows_decode`, with tokens `t0..t0 + n` rows of `act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_batch<const R: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * block_bytes(DT));
    debug_assert!((1..=SMALL_BATCH).contains(&n) && t0 + n <= act.rows);
    let mut acc = [_mm_setzero_ps(); SMALL_BATCH];
    // Per token; lanes of rows past R are not written (their results are dropped).
    let terms = &mut s.terms;
    /// # Safety
    ///
    /// As `rows_batch`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group<const R: usize, const DT: u32>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        (t0, n): (usize, usize),
        b0: usize,
        m: usize,
        terms: &mut [Terms; SMALL_BATCH],
        acc: &mut [__m128; SMALL_BATCH],
    ) {
        let bb = block_bytes(DT);
        if has_min(DT) {
            for t in 0..n {
                // The activation sums are the same for every row.
                terms[t].sx = [_mm256_loadu_ps(act.s.as_ptr().add(act.idx(t0 + t, b0))); 4];
            }
        }
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * bb);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), 8 * bb);
            // Blocks past the row's end stay zero (their activations are zero padding).
            let mut u = [_mm256_setzero_si256(); 8];
            let mut sc = Scales::<DT>::new();
            blocks8!(m, J, {
                let blk = base.add(J * bb);
                u[J] = codes::<DT>(blk);
                sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
            });
            let (dw, mw) = sc.get();
            for t in 0..n {
                let i0 = act.idx(t0 + t, b0);
                let xq = act.qs.as_ptr().add(i0 * 32);
                let mut h = [_mm256_setzero_si256(); 4];
                for k in 0..4 {
                    h[k] = _mm256_hadd_epi16(pairs(u[2 * k], xq.add(64 * k)), pairs(u[2 * k + 1], xq.add(64 * k + 32)));
                }
                terms[t].ddx[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(act.d.as_ptr().add(i0)));
                terms[t].isf[r] = _mm256_cvtepi32_ps(_mm256_sub_epi32(reduce8(&h), offset_sums::<DT>(act, i0)));
                terms[t].m[r] = mw;
            }
        }
        for t in 0..n {
            acc[t] = accumulate4(has_min(DT), acc[t], &terms[t], m);
        }
    }
    by_groups!(nb, |b0, m| group::<R, DT>(w, row_bytes, act, (t0, n), b0, m, terms, &mut acc));
    for t in 0..n {
        let mut v = [0f32; 4];
        _mm_storeu_ps(v.as_mut_ptr(), acc[t]);
        out[t][..R].copy_from_slice(&v[..R]);
    }
}

/// `rows_batch` for Q8_0 against Q16 activations: each group of eight blocks of a row
/// sign-extended once for all the tokens, then per token `rows_decode_q8`'s operations.
///
/// # Safety
///
/// As `rows_decode_q8`, with tokens `t0..t0 + n` rows of `act`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_batch_q8<const R: usize>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    const BB: usize = 34;
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && row_bytes == nb * BB);
    debug_assert!((1..=SMALL_BATCH).contains(&n) && t0 + n <= act.rows);
    let mut acc = [_mm_setzero_ps(); SMALL_BATCH];
    let terms = &mut s.terms;
    /// # Safety
    ///
    /// As `rows_batch_q8`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn group<const R: usize>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        (t0, n): (usize, usize),
        b0: usize,
        m: usize,
        terms: &mut [Terms; SMALL_BATCH],
        acc: &mut [__m128; SMALL_BATCH],
    ) {
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * BB);
            prefetch_rows(base.wrapping_add(R * row_bytes), 8 * BB);
            let mut u = [_mm256_setzero_si256(); 16];
            let mut sc = Scales::<Q8_0>::new();
            blocks8!(m, J, {
                let blk = base.add(J * BB);
                (u[2 * J], u[2 * J + 1]) = codes_q8(blk);
                sc.add::<{ J as i32 }, { (J % 4) as i32 }>(blk);
            });
            let dw = sc.get().0;
            for t in 0..n {
                let i0 = act.idx(t0 + t, b0);
                let xq = act.qs16.as_ptr().add(i0 * 32);
                let mut a = [_mm256_setzero_si256(); 8];
                for j in 0..8 {
                    a[j] = dot_q16(u[2 * j], u[2 * j + 1], xq.add(32 * j));
                }
                terms[t].ddx[r] = _mm256_mul_ps(dw, _mm256_loadu_ps(act.d.as_ptr().add(i0)));
                terms[t].isf[r] = _mm256_cvtepi32_ps(reduce8x8(&a));
            }
        }
        for t in 0..n {
            acc[t] = accumulate4(false, acc[t], &terms[t], m);
        }
    }
    by_groups!(nb, |b0, m| group::<R>(w, row_bytes, act, (t0, n), b0, m, terms, &mut acc));
    for t in 0..n {
        let mut v = [0f32; 4];
        _mm_storeu_ps(v.as_mut_ptr(), acc[t]);
        out[t][..R].copy_from_slice(&v[..R]);
    }
}

/// `out = x · Wᵀ` for Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0 weights with AVX2: the caller checked the
/// CPU (`isa() ≥ Avx2`), and `act` holds `n` tokens quantized for `w` (Q8_0, Q8_1 or Q16); `o` is
/// `n × w.rows`.
pub(crate) fn matmul(pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    assert!(
        matches!(w.dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0)
            && act.rows == n
            && act.cols == w.cols
            && act.kind == super::act::ActKind::for_weights(w.dtype).expect("a block format")
    );
    let rb = w.row_bytes();
    if n == 1 {
        // Decode: four rows at a time (fewer at a range's end).
        return super::rows_by(pool, w, 4, o, |wr, k, vals| {
            macro_rules! go {
                ($f:ident $(, $dt:expr)?) => {
                    match k {
                        4 => $f::<4 $(, $dt)?>(wr, rb, act, vals),
                        3 => $f::<3 $(, $dt)?>(wr, rb, act, vals),
                        2 => $f::<2 $(, $dt)?>(wr, rb, act, vals),
                        _ => $f::<1 $(, $dt)?>(wr, rb, act, vals),
                    }
                };
            }
            // SAFETY: AVX2/FMA/F16C were detected (the caller's contract); `wr` holds k whole
            // rows (MatRef::new checked the size); `act` is padded by QuantAct and of the kind
            // the format pairs with (asserted above).
            unsafe {
                match w.dtype {
                    DType::Q4_0 => go!(rows_decode, Q4_0),
                    DType::Q4_1 => go!(rows_decode, Q4_1),
                    DType::Q5_0 => go!(rows_decode, Q5_0),
                    DType::Q5_1 => go!(rows_decode, Q5_1),
                    _ => go!(rows_decode_q8),
                }
            }
        });
    }
    if n < super::ROW_KERNEL_MIN_TOKENS {
        return batch(pool, w, act, n, o);
    }
    // Prefill: rows in blocks of ROWS, tokens in chunks of TOKENS, so a block of weight rows
    // and a chunk of activations stay in cache while every pair is computed.
    const ROWS: usize = 16;
    const TOKENS: usize = 32;
    pool.for_ranges(w.rows, 4, &|rows| {
        let mut vals = [0f32; TOKENS];
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + ROWS).min(rows.end);
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TOKENS).min(n);
                for r in r0..r1 {
                    let (row, v) = (w.row(r), &mut vals[..t1 - t0]);
                    // SAFETY: AVX2/FMA/F16C were detected (the caller's contract); the row is
                    // whole (MatRef::new), tokens t0..t1 are rows of `act`, of the kind the
                    // format pairs with (asserted above).
                    unsafe {
                        match w.dtype {
                            DType::Q4_0 => row_tokens::<Q4_0>(row, act, t0, v),
                            DType::Q4_1 => row_tokens::<Q4_1>(row, act, t0, v),
                            DType::Q5_0 => row_tokens::<Q5_0>(row, act, t0, v),
                            DType::Q5_1 => row_tokens::<Q5_1>(row, act, t0, v),
                            _ => row_tokens_q8(row, act, t0, v),
                        }
                    }
                    for (i, v) in vals[..t1 - t0].iter().enumerate() {
                        // SAFETY: this thread owns row r's column of the n × rows output.
                        unsafe { *o.get().add((t0 + i) * w.rows + r) = *v };
                    }
                }
                t0 = t1;
            }
            r0 = r1;
        }
    });
}

/// Small batches (`super::small_batches` on `rows_batch` / `rows_batch_q8`).
fn batch(pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    let rb = w.row_bytes();
    super::small_batches(pool, w, n, o, |wr, k, t0, nt, vals, s| {
        macro_rules! go {
            ($f:ident $(, $dt:expr)?) => {
                match k {
                    4 => $f::<4 $(, $dt)?>(wr, rb, act, t0, nt, vals, s),
                    3 => $f::<3 $(, $dt)?>(wr, rb, act, t0, nt, vals, s),
                    2 => $f::<2 $(, $dt)?>(wr, rb, act, t0, nt, vals, s),
                    _ => $f::<1 $(, $dt)?>(wr, rb, act, t0, nt, vals, s),
                }
            };
        }
        // SAFETY: AVX2/FMA/F16C were detected (the caller's contract); `wr` holds k whole rows;
        // tokens t0..t0 + nt are rows of `act`, padded by QuantAct and of the kind the format
        // pairs with (asserted by `matmul`).
        unsafe {
            match w.dtype {
                DType::Q4_0 => go!(rows_batch, Q4_0),
                DType::Q4_1 => go!(rows_batch, Q4_1),
                DType::Q5_0 => go!(rows_batch, Q5_0),
                DType::Q5_1 => go!(rows_batch, Q5_1),
                _ => go!(rows_batch_q8),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use crate::cpu::Isa;
    use crate::matmul::matmul_with_isa;
    use crate::{DType, MatRef, ThreadPool};

    const TYPES: [DType; 5] = [DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0];

    fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// A finite f16 (as bits): mostly a realistic scale (either sign, magnitude 2^−10..2^1),
    /// and where `edges`, one in five an extreme (±0, the smallest subnormal, the largest normal,
    /// the smallest normal).
    fn f16_bits(next: &mut impl FnMut() -> u32, edges: bool) -> u16 {
        if edges && next().is_multiple_of(5) {
            return [0x0000, 0x8000, 0x0001, 0x8001, 0x7BFF, 0xFBFF, 0x0400][(next() % 7) as usize];
        }
        let sign = ((next() & 1) as u16) << 15;
        sign | ((5 + next() % 11) as u16) << 10 | (next() & 0x3FF) as u16
    }

    /// Random rows of `dtype`: random bytes with finite f16 scales (and minima); where `edges`,
    /// one block in four with its codes and its fifth bits all set or all clear (Q8_0: all
    /// −128, all 127 or all 0).
    fn random_rows(dtype: DType, rows: usize, cols: usize, seed: u64, edges: bool) -> Vec<u8> {
        let mut next = lcg(seed);
        let bb = dtype.block_bytes();
        let mut v: Vec<u8> = (0..rows * dtype.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        // (start, end) of the codes, and of the fifth bits.
        let (f16s, parts): (&[usize], &[(usize, usize)]) = match dtype {
            DType::Q4_0 => (&[0], &[(2, 18)]),
            DType::Q4_1 => (&[0, 2], &[(4, 20)]),
            DType::Q5_0 => (&[0], &[(2, 6), (6, 22)]),
            DType::Q5_1 => (&[0, 2], &[(4, 8), (8, 24)]),
            _ => (&[0], &[(2, 34)]),
        };
        for b in v.chunks_exact_mut(bb) {
            for &o in f16s {
                let bits = f16_bits(&mut next, edges);
                b[o..o + 2].copy_from_slice(&bits.to_le_bytes());
            }
            if edges && next().is_multiple_of(4) {
                for &(s, e) in parts {
                    match next() % 4 {
                        0 => b[s..e].fill(0xFF),
                        1 => b[s..e].fill(0),
                        2 => b[s..e].fill(if dtype == DType::Q8_0 { 0x80 } else { 0xFF }),
                        _ => b[s..e].fill(if dtype == DType::Q8_0 { 0x7F } else { 0 }),
                    }
                }
            }
        }
        v
    }

    /// Rows quantized from smooth values (the codes a real quantizer picks).
    fn quantized_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let v: Vec<f32> =
            (0..rows * cols).map(|i| (i as f32 * 0.37 + seed as f32).sin() * (1.0 + (i % 97) as f32 * 0.02)).collect();
        crate::quant::quantize_rows(dtype, &v, cols)
    }

    /// Activations of varied magnitude; every third token all ±1 (codes all ±127, or ±32767:
    /// the largest integer sums), and one block in every token's row all zero.
    fn xs(n: usize, cols: usize, seed: u64) -> Vec<f32> {
        let mut next = lcg(seed);
        (0..n * cols)
            .map(|i| {
                let r = next();
                if (i % cols) / 32 == 3 {
                    0.0
                } else if (i / cols) % 3 == 2 {
                    if r & 1 == 0 {
                        1.0
                    } else {
                        -1.0
                    }
                } else {
                    (r as f32 / (1u64 << 31) as f32 - 1.0) * [1.0, 0.02, 7.0][i / 96 % 3]
                }
            })
            .collect()
    }

    fn check(dtype: DType, w: &[u8], rows: usize, cols: usize, n: usize, pools: &[ThreadPool]) {
        let m = MatRef::new(dtype, rows, cols, w).unwrap();
        let x = xs(n, cols, 9 + n as u64);
        let mut want = vec![0f32; n * rows];
        crate::matmul_ref(m, &x, n, &mut want);
        for pool in pools {
            for isa in Isa::supported() {
                let got = matmul_with_isa(isa, pool, m, &x, n);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{dtype} {isa:?} {rows}x{cols} n={n} threads={} element {i}: {a} vs {b}",
                        pool.n_threads()
                    );
                }
            }
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
        for dtype in TYPES {
            // Rows left over after groups of four; blocks left over after groups of eight.
            for (rows, cols) in [(1, 32), (3, 96), (4, 256), (5, 896), (7, 288), (9, 4096), (17, 1216), (6, 4064)] {
                for edges in [false, true] {
                    let w = random_rows(dtype, rows, cols, rows as u64 * 31 + cols as u64 + edges as u64, edges);
                    for n in 1..=9 {
                        check(dtype, &w, rows, cols, n, &pools);
                    }
                }
            }
            // More tokens than a chunk of the prefill loop.
            let w = quantized_rows(dtype, 6, 2048, 4);
            for n in [1, 2, 5, 9, 33, 70] {
                check(dtype, &w, 6, 2048, n, &pools);
            }
        }
    }

    #[test]
    fn batch_and_threads_do_not_change_a_row() {
        for dtype in TYPES {
            let (rows, cols) = (13, 1248);
            let w = random_rows(dtype, rows, cols, 77, true);
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            let n = 9;
            let x = xs(n, cols, 1);
            let mut all = vec![0f32; n * rows];
            crate::matmul(&ThreadPool::new(2), m, &x, n, &mut all);
            for threads in 1..=3 {
                let pool = ThreadPool::new(threads);
                // Each token alone (decode), and the batch split at every point.
                for t in 0..n {
                    let mut one = vec![0f32; rows];
                    crate::matmul(&pool, m, &x[t * cols..(t + 1) * cols], 1, &mut one);
                    assert!(crate::compare::same_bits(&one, &all[t * rows..(t + 1) * rows]), "{dtype} token {t}");
                    let mut tail = vec![0f32; (n - t) * rows];
                    crate::matmul(&pool, m, &x[t * cols..], n - t, &mut tail);
                    assert!(crate::compare::same_bits(&tail, &all[t * rows..]), "{dtype} tokens {t}..");
                }
            }
        }
    }
}

//! Decode (one token) and small batches of the codebook IQ formats — IQ3_S, IQ3_XXS, IQ2_S,
//! IQ2_XS, IQ2_XXS, IQ1_S, IQ1_M — and IQ4_XS at the AVX-512 level: a block is unpacked once (`unpack`)
//! for all the tokens, its codebook entries 64 values at a time by one gather,
//! where the AVX2 kernel (`iq_x86::for_groups`) reads each entry with a scalar load and moves
//! it into a vector with an insert (an operation each on the shuffle port, which bounds those
//! kernels). Signs are byte masks of a masked subtract on the activations (the stored sign
//! bits in value order, or the 7-bit fields widened with their parity bit), scales i16 lanes
//! of `vpmaddwd`. IQ1's codes go in offset by 9 with their deltas added per entry (a masked
//! move of u64 lanes), and the offset comes off as in `iq_x86::block_dot`.
//!
//! The products are those of `iq_x86::group_dot` — magnitude · signed activation by
//! `vpmaddubsw`, times the group's scale by `vpmaddwd` — summed in other lanes; they are
//! integers, so a block's total is the same integer, and `iq_x86::rows_decode`'s float steps
//! follow unchanged: the same bits as the AVX2 kernel and the scalar reference.
//!
//! Kernel lab, Intel Xeon (AVX-512), one thread, 113×4096, one token, GMAC per CPU second,
//! the AVX2 kernel → this one: IQ3_S 8.1 → 14.5, IQ3_XXS 9.5 → 13.5, IQ2_S 12.5 → 18.0,
//! IQ2_XS 12.6 → 16.4, IQ2_XXS 11.9 → 15.3, IQ1_S 11.1 → 15.8, IQ1_M 12.8 → 16.5. Four tokens:
//! IQ3_S 17.4 → 27.9, IQ2_XS 21.8 → 31.5, IQ1_M 24.1 → 32.5. The gathers are not free: with
//! plain loads in their place (wrong results, timing only) IQ3_S ran at 24.9 and IQ2_XS at
//! 20.7, so sixteen-entry gathers cost IQ3_S about 40% of its time, eight-entry ones IQ2_XS
//! about 20%; the rest is the unpacking and products, on the two ports that run 512-bit
//! operations. No AMD CPU was measured with this kernel.

// Index loops over the four 64-value parts of a block read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::iq_tables::*;
use super::iq_x86::{
    dtype_const, iq1_scales16, iq1s_indices, iq4xs_scales, offset_sums, sign_words, signed, with_parity,
};
use crate::dtype::DType;
use std::arch::x86_64::*;

/// Whether the format is unpacked here: the codebook formats and IQ4_XS (IQ4_NL's 32-value
/// blocks stay with the AVX2 kernel).
pub(super) const fn unpacked_here(dt: DType) -> bool {
    matches!(
        dt,
        DType::IQ3_S
            | DType::IQ3_XXS
            | DType::IQ2_S
            | DType::IQ2_XS
            | DType::IQ2_XXS
            | DType::IQ1_S
            | DType::IQ1_M
            | DType::IQ4_XS
    )
}

/// The little-endian u64 at `p`.
///
/// # Safety
///
/// `p` is valid for reading 8 bytes.
#[inline(always)]
unsafe fn rd_u64(p: *const u8) -> u64 {
    (p as *const u64).read_unaligned()
}

/// The little-endian u32 at `p`.
///
/// # Safety
///
/// `p` is valid for reading 4 bytes.
#[inline(always)]
unsafe fn rd_u32(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

/// A vector's four u64 lanes.
///
/// # Safety
///
/// Needs only AVX (the caller's target features include it).
#[inline(always)]
unsafe fn lanes64(v: __m256i) -> [u64; 4] {
    let mut a = [0u64; 4];
    _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, v);
    a
}

/// The odd scales `2·nibble + 1` of the nibbles of `bits` (low nibble first), as i16 lanes
/// 0..16 of a vector (for `scales_of`; IQ3_S passes eight nibbles, the rest zero).
///
/// # Safety
///
/// The CPU has AVX-512 F/BW (checked by `cpu::isa()`); inlined only into functions compiled
/// for them.
#[inline(always)]
unsafe fn odd_scales16(bits: u64) -> __m512i {
    _mm512_castsi256_si512(_mm256_cvtepu8_epi16(odd_scale_bytes(bits)))
}

/// The sixteen odd scales 2·nibble + 1 of the nibbles of `bits`, low nibble first, as bytes.
///
/// # Safety
///
/// Needs only SSE2 (the callers' target features include it).
#[inline(always)]
pub(super) unsafe fn odd_scale_bytes(bits: u64) -> __m128i {
    let v = _mm_cvtsi64_si128(bits as i64);
    let m = _mm_set1_epi8(0x0f);
    let n = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
    _mm_add_epi8(_mm_add_epi8(n, n), _mm_set1_epi8(1))
}

/// The i16 scales of values 64c..64c+64 from `sc` (i16 lanes: one scale per S values, S 16
/// or 32): lane l (values 64c + 2l, +1) takes scale (64c + 2l) / S — one `vpermw`.
///
/// # Safety
///
/// The CPU has AVX-512 F/BW (checked by `cpu::isa()`); inlined only into functions compiled
/// for them.
#[inline(always)]
unsafe fn scales_of<const S: usize>(sc: __m512i, c: usize) -> __m512i {
    let mut idx = [0i16; 32];
    for (l, v) in idx.iter_mut().enumerate() {
        *v = ((64 * c + 2 * l) / S) as i16;
    }
    _mm512_permutexvar_epi16(_mm512_loadu_si512(idx.as_ptr() as *const _), sc)
}

/// Eight eight-value codebook entries (indices in i32 lanes) by one 64-bit gather.
///
/// # Safety
///
/// Every index is below N; the CPU has AVX-512 F (checked by `cpu::isa()`); inlined only into
/// functions compiled for it.
#[inline(always)]
unsafe fn entries8<const N: usize>(grid: &[u64; N], i: __m256i) -> __m512i {
    _mm512_i32gather_epi64::<8>(i, grid.as_ptr() as *const i64)
}

/// Sixteen four-value codebook entries (indices in i32 lanes) by one 32-bit gather.
///
/// # Safety
///
/// Every index is below N; the CPU has AVX-512 F (checked by `cpu::isa()`); inlined only into
/// functions compiled for it.
#[inline(always)]
unsafe fn entries16<const N: usize>(grid: &[u32; N], i: __m512i) -> __m512i {
    _mm512_i32gather_epi32::<4>(i, grid.as_ptr() as *const i32)
}

/// The ten-bit codebook indices of IQ2_S entries 8c..8c + 8 (u32 lanes): `qs` byte e, with bits
/// 2e..2e + 2 of the `qh` bytes (read as one little-endian u64) as its bits 8..10.
///
/// # Safety
///
/// `b` points to one whole IQ2_S block and c < 4; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn iq2s_indices(b: *const u8, c: usize) -> __m256i {
    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * c) as *const __m128i));
    let qh = (b.add(66 + 2 * c) as *const u16).read_unaligned() as i32;
    let hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(qh), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3),
    );
    _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8))
}

/// An IQ4_XS block's 4-bit codes in value order, 64 to a vector (per 32 values the block
/// holds 16 bytes, low nibbles values 0..16, high nibbles 16..32), and its eight scales
/// ls − 32 as i16 (4 low bits from `scales_l`, 2 high bits from `scales_h`).
///
/// # Safety
///
/// `b` points to one whole IQ4_XS block; the CPU has AVX-512 F/BW/VL (checked by
/// `cpu::isa()`); inlined only into functions compiled for them.
#[inline(always)]
pub(super) unsafe fn iq4xs_parts(b: *const u8) -> ([__m512i; 4], __m128i) {
    let sc8 = _mm256_cvtepi32_epi16(iq4xs_scales(b));
    let m = _mm256_set1_epi8(0x0f);
    // 128-bit pieces in value order: group 2c's low and high nibbles, then 2c + 1's.
    let order = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    let mut n = [_mm512_setzero_si512(); 4];
    for (c, v) in n.iter_mut().enumerate() {
        let q = _mm256_loadu_si256(b.add(8 + 32 * c) as *const __m256i);
        let lo = _mm512_castsi256_si512(_mm256_and_si256(q, m));
        let hi = _mm512_castsi256_si512(_mm256_and_si256(_mm256_srli_epi16(q, 4), m));
        *v = _mm512_permutex2var_epi64(lo, order, hi);
    }
    (n, sc8)
}

/// The odd scales 2·s + 1 of the 4-bit fields s in bits 28..32 of eight u32 (IQ3_XXS's and
/// IQ2_XXS's words of sign fields and scale, one per 32 values), as i32 lanes; callers narrow
/// them to the width they multiply with (`aux_scales` here, bytes in the prefill).
///
/// # Safety
///
/// Needs only AVX2 (the callers' target features include it).
#[inline(always)]
pub(super) unsafe fn aux_odd_scales(aux: __m256i) -> __m256i {
    let ls = _mm256_srli_epi32(aux, 28);
    _mm256_add_epi32(_mm256_add_epi32(ls, ls), _mm256_set1_epi32(1))
}

/// `aux_odd_scales` as i16 lanes 0..8.
///
/// # Safety
///
/// The CPU has AVX-512 F/VL (checked by `cpu::isa()`); inlined only into functions compiled for
/// them.
#[inline(always)]
unsafe fn aux_scales(aux: __m256i) -> __m512i {
    _mm512_castsi128_si512(_mm256_cvtepi32_epi16(aux_odd_scales(aux)))
}

/// A block unpacked for `dot`: values 64c..64c+64 are codes `u[c]` (unsigned bytes), negated
/// where bit l of `signs[c]` is set (signed formats), times the i16 scales `scl[c]` (one per
/// pair of values); IQ1's codes are offset by 9, and for them `s16` holds the sixteen scales,
/// one per 16 values, as i16 (the offset comes off with them; the tiled prefill kernel takes
/// them too).
pub(super) struct Block {
    pub(super) u: [__m512i; 4],
    pub(super) signs: [u64; 4],
    scl: [__m512i; 4],
    pub(super) s16: __m256i,
}

/// Block `b` of format `DT` (one of `unpacked_here`'s), unpacked.
///
/// # Safety
///
/// `b` points to one whole block of the format; the CPU has AVX-512 F/BW/VL (checked by
/// `cpu::isa()`); inlined only into functions compiled for them.
#[inline(always)]
pub(super) unsafe fn unpack<const DT: u32>(b: *const u8) -> Block {
    let dt = const { dtype_const(DT) };
    let z = _mm512_setzero_si512();
    let mut k = Block { u: [z; 4], signs: [0; 4], scl: [z; 4], s16: _mm256_setzero_si256() };
    match dt {
        DType::IQ3_S => {
            // Nine-bit indices: qs byte i, bit i of the qh bytes (as one u64) its bit 8.
            let qh = rd_u64(b.add(66));
            let sc = odd_scales16(rd_u32(b.add(106)) as u64);
            let bit8 = _mm512_set1_epi32(256);
            for c in 0..4 {
                let lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(2 + 16 * c) as *const __m128i));
                let idx = _mm512_mask_or_epi32(lo, (qh >> (16 * c)) as u16, lo, bit8);
                let mag = entries16(&IQ3S_GRID, idx);
                (k.u[c], k.signs[c], k.scl[c]) = (mag, rd_u64(b.add(74 + 8 * c)), scales_of::<32>(sc, c));
            }
        }
        DType::IQ3_XXS => {
            // After qs, eight u32 of four 7-bit sign fields and a 4-bit scale (bits 28..32).
            let aux = _mm256_loadu_si256(b.add(66) as *const __m256i);
            let signs = lanes64(sign_words(aux));
            let sc = aux_scales(aux);
            for c in 0..4 {
                let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.add(2 + 16 * c) as *const __m128i));
                let mag = entries16(&IQ3XXS_GRID, idx);
                (k.u[c], k.signs[c], k.scl[c]) = (mag, signs[c], scales_of::<32>(sc, c));
            }
        }
        DType::IQ2_XXS => {
            // Per group a u32 of four 8-bit indices, then a u32 of sign fields and scale.
            let v = _mm512_loadu_si512(b.add(2) as *const _);
            let idx8 = _mm512_cvtepi64_epi32(v);
            let aux = _mm512_cvtepi64_epi32(_mm512_srli_epi64(v, 32));
            let signs = lanes64(sign_words(aux));
            let sc = aux_scales(aux);
            let idx = [_mm256_castsi256_si128(idx8), _mm256_extracti128_si256(idx8, 1)];
            for c in 0..4 {
                let i = _mm256_cvtepu8_epi32(if c % 2 == 0 { idx[c / 2] } else { _mm_srli_si128(idx[c / 2], 8) });
                let mag = entries8(&IQ2XXS_GRID, i);
                (k.u[c], k.signs[c], k.scl[c]) = (mag, signs[c], scales_of::<32>(sc, c));
            }
        }
        DType::IQ2_XS => {
            // u16 per eight values: a 9-bit index, a 7-bit sign field; a 4-bit scale per 16.
            let q = _mm512_loadu_si512(b.add(2) as *const _);
            let idx = _mm512_and_si512(q, _mm512_set1_epi16(511));
            let signs = lanes64(with_parity(_mm512_cvtepi16_epi8(_mm512_srli_epi16(q, 9))));
            let sc = odd_scales16(rd_u64(b.add(66)));
            for c in 0..4 {
                let h = if c < 2 { _mm512_castsi512_si256(idx) } else { _mm512_extracti64x4_epi64(idx, 1) };
                let h = if c % 2 == 0 { _mm256_castsi256_si128(h) } else { _mm256_extracti128_si256(h, 1) };
                let mag = entries8(&IQ2XS_GRID, _mm256_cvtepu16_epi32(h));
                (k.u[c], k.signs[c], k.scl[c]) = (mag, signs[c], scales_of::<16>(sc, c));
            }
        }
        DType::IQ2_S => {
            // Ten-bit indices: qs byte e, bits 2e..2e+2 of the qh bytes (as one u64) its bits
            // 8..10; the sign bits as stored; a 4-bit scale per 16 values.
            let sc = odd_scales16(rd_u64(b.add(74)));
            for c in 0..4 {
                let mag = entries8(&IQ2S_GRID, iq2s_indices(b, c));
                (k.u[c], k.signs[c], k.scl[c]) = (mag, rd_u64(b.add(34 + 8 * c)), scales_of::<16>(sc, c));
            }
        }
        DType::IQ4_XS => {
            // The magnitude as the code, its sign as the sign bit: IQ4's levels are negative
            // exactly for codes 0..8 (bit 3 clear).
            let (n, sc8) = iq4xs_parts(b);
            let sc = _mm512_castsi128_si512(sc8);
            let levels =
                _mm512_abs_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i)));
            for c in 0..4 {
                let minus = _mm512_testn_epi8_mask(n[c], _mm512_set1_epi8(8));
                (k.u[c], k.signs[c], k.scl[c]) = (_mm512_shuffle_epi8(levels, n[c]), minus, scales_of::<32>(sc, c));
            }
        }
        DType::IQ1_S => {
            // Group k's u16 qh word: three high index bits per eight values (bits 3l..3l+3),
            // the scale in bits 12..15, the delta's sign in bit 15 (clear: +1, code + 2).
            let sc = _mm512_castsi256_si512(iq1_scales16::<DT>(b));
            let two = _mm512_set1_epi8(2);
            for c in 0..4 {
                let (idx, h) = iq1s_indices(b, c);
                let mag = entries8(&IQ1S_GRID8, idx);
                // Entry l's delta from its group's word (lanes 0..4: group 2c, 4..8: 2c + 1).
                let plus = _mm256_testn_epi32_mask(h, _mm256_set1_epi32(0x8000));
                let u = _mm512_add_epi8(mag, _mm512_maskz_mov_epi64(plus, two));
                (k.u[c], k.scl[c]) = (u, scales_of::<16>(sc, c));
            }
        }
        DType::IQ1_M => {
            // A nibble per eight values (qh byte j/2, low nibble for even j): three high index
            // bits and the delta's sign (bit 3 clear: +1, code + 2); a 3-bit scale per 16.
            let sc = _mm512_castsi256_si512(iq1_scales16::<DT>(b));
            let shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
            let two = _mm512_set1_epi8(2);
            for c in 0..4 {
                let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(8 * c) as *const __m128i));
                let nib = _mm256_srlv_epi32(_mm256_set1_epi32(rd_u32(b.add(32 + 4 * c)) as i32), shifts);
                let hi = _mm256_and_si256(nib, _mm256_set1_epi32(7));
                let mag = entries8(&IQ1S_GRID8, _mm256_or_si256(lo, _mm256_slli_epi32(hi, 8)));
                let plus = _mm256_testn_epi32_mask(nib, _mm256_set1_epi32(8));
                let u = _mm512_add_epi8(mag, _mm512_maskz_mov_epi64(plus, two));
                (k.u[c], k.scl[c]) = (u, scales_of::<16>(sc, c));
            }
        }
        _ => unreachable!(),
    }
    if !signed(dt) {
        k.s16 = iq1_scales16::<DT>(b);
    }
    k
}

/// An unpacked block against its 256 activation codes at `xq` (`bs`: their 16-value sums,
/// read by the IQ1 formats): its integer sum spread over 8 i32 lanes (the same total as
/// `iq_x86::block_dot`'s).
///
/// # Safety
///
/// `xq` points to 256 activation codes, `bs` (IQ1 formats) to their sixteen sums; the CPU has
/// AVX-512 F/BW (checked by `cpu::isa()`); inlined only into functions compiled for them.
#[inline(always)]
pub(super) unsafe fn dot<const DT: u32>(k: &Block, xq: *const i8, bs: *const i16) -> __m256i {
    let mut acc = _mm512_setzero_si512();
    for c in 0..4 {
        let x = _mm512_loadu_si512(xq.add(64 * c) as *const _);
        // Signs as `vpsignb` by a −1 byte: 0 − x (wrapping, as it does).
        let xs = if signed(const { dtype_const(DT) }) {
            _mm512_mask_sub_epi8(x, k.signs[c], _mm512_setzero_si512(), x)
        } else {
            x
        };
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(k.u[c], xs), k.scl[c]));
    }
    let v = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
    if signed(const { dtype_const(DT) }) {
        v
    } else {
        _mm256_sub_epi32(v, offset_sums(k.s16, bs))
    }
}

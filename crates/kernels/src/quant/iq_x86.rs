//! AVX2 kernels of the IQ formats: decode (one token, several rows at once) and small batches
//! (several rows against a few tokens), each block unpacked once for all the tokens. They run
//! at the AVX2 and the AVX-512 levels alike, except that at the AVX-512 level the codebook
//! formats unpack their blocks with gathers (`iq512_x86`) inside the same loops; larger
//! batches go to the tiled kernels (`tiled_avx2`, `x86_512`), which unpack blocks through
//! `for_groups`.
//!
//! Each format unpacks a 32-value group into byte magnitudes, a sign source and sixteen i16
//! scales (`for_groups`); a group's contribution is then `vpmaddubsw` of the magnitudes with the
//! activations (signs moved onto the activations with `vpsignb`) and `vpmaddwd` with the
//! scales. The sums are the exact integers of `iq::block_isum`; the float side is
//! `dot_ref::accumulate`'s `fma(D·dx, isum, acc)` block after block, so every result equals
//! the scalar reference to the bit, whatever the batch or the thread count.
//!
//! Decode of these formats is bound by vector operations, not by memory: a block's sign bytes
//! and scales stay in registers (one vector per four groups) and each group takes its own with
//! one shuffle (`group_signs`, `pick_scale`), rather than through lane extractions and
//! broadcasts. Codebook indices reach the integer side without a lane extraction each: read
//! from the block with scalar loads where they sit whole in it (`ld_index!`: IQ2_XS,
//! IQ2_XXS; the compiler keeps IQ3_XXS's byte loads as they are), else assembled in vectors
//! and moved over 64 bits at a time (`fields16`, `fields32`: IQ2_S, IQ3_S, IQ1_S, IQ1_M).
//!
//! Magnitudes stay where `vpmaddubsw` cannot saturate: a pair of products is at most
//! 2·127·127 = 32258 (IQ4's levels), 2·62·127 (IQ3_XXS), less for the others. IQ1_S/IQ1_M codes
//! `8·grid ± 1` go in offset by 9 (0..18, no signs needed) and `9·Σ s·(16-value sums)` comes off.

// Index loops over groups, rows and blocks read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::act::QuantAct;
use super::iq::scale_factor;
use super::iq_tables::*;
use super::x86::{accumulate4, by_groups, prefetch_rows, reduce8x8, Terms};
use super::{BatchOut, BatchScratch, SMALL_BATCH};
use crate::cpu::Isa;
use crate::dtype::DType;
use crate::matmul::{MatRef, SendPtr};
use crate::pool::ThreadPool;
use std::arch::x86_64::*;

/// The IQ format with GGML id `id`, at compile time.
pub(super) const fn dtype_const(id: u32) -> DType {
    match id {
        16 => DType::IQ2_XXS,
        17 => DType::IQ2_XS,
        18 => DType::IQ3_XXS,
        19 => DType::IQ1_S,
        20 => DType::IQ4_NL,
        21 => DType::IQ3_S,
        22 => DType::IQ2_S,
        23 => DType::IQ4_XS,
        29 => DType::IQ1_M,
        _ => panic!("not an IQ format"),
    }
}

/// Whether the format's codes carry signs (moved onto the activations); IQ1's are offset instead.
pub(super) const fn signed(dt: DType) -> bool {
    !matches!(dt, DType::IQ1_S | DType::IQ1_M)
}

/// 32-value groups per block.
const fn groups(dt: DType) -> usize {
    dt.block_elems() / 32
}

/// The little-endian u16 at `p`.
///
/// # Safety
///
/// `p` is valid for reading 2 bytes (callers pass pointers inside a block of the format).
#[inline(always)]
unsafe fn rd_u16(p: *const u8) -> u32 {
    (p as *const u16).read_unaligned() as u32
}

/// The codebook index at byte `$o` (a constant) from `$p` — a little-endian u16 (`word`) or a
/// byte (`byte`) — as a usize, read by one scalar load that the compiler keeps as one. Left to
/// itself, it takes such reads out of a vector load of the same bytes with `vpextrw`/`vpextrb`
/// — two operations per index on the vector ports that bound these kernels, where one integer
/// load does. Safety: `$p + $o` is valid for reading the index's bytes.
macro_rules! ld_index {
    ($size:ident, $p:expr, $o:expr) => {{
        let v: u32;
        // SAFETY: a read the caller vouches for (see above); nothing written, no stack used.
        std::arch::asm!(
            concat!("movzx {v:e}, ", stringify!($size), " ptr [{p} + {o}]"),
            v = out(reg) v,
            p = in(reg) $p,
            o = const $o,
            options(pure, readonly, nostack, preserves_flags)
        );
        v as usize
    }};
}

/// u64 lane `lane` (0 or 1) of `v`, moved to an integer register as a whole and opaque to the
/// compiler, which would otherwise fold the shifts that split it into u16 fields back into one
/// `vpextrw` per field (two operations each on the vector ports; a shift and a mask are integer
/// ones).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn words64(v: __m128i, lane: usize) -> u64 {
    let mut x = if lane == 0 { _mm_cvtsi128_si64(v) } else { _mm_extract_epi64(v, 1) } as u64;
    // SAFETY: an empty instruction that only hides where the value came from.
    std::arch::asm!("/* {x} */", x = inout(reg) x, options(pure, nomem, nostack, preserves_flags));
    x
}

/// The four u16 fields of u64 lane `Q` (0..4) of `v` — one group's codebook indices where a
/// vector holds four groups' — through `words64`.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn fields16<const Q: usize>(v: __m256i) -> [usize; 4] {
    let h = if Q < 2 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256(v, 1) };
    let w = words64(h, Q % 2);
    [(w & 0xffff) as usize, ((w >> 16) & 0xffff) as usize, ((w >> 32) & 0xffff) as usize, (w >> 48) as usize]
}

/// The four u32 fields of 128-bit half `H` of `v` — one group's codebook indices where a
/// vector holds two groups' — through `words64`.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn fields32<const H: usize>(v: __m256i) -> [usize; 4] {
    let h = if H == 0 { _mm256_castsi256_si128(v) } else { _mm256_extracti128_si256(v, 1) };
    let (a, b) = (words64(h, 0), words64(h, 1));
    [(a & 0xffff_ffff) as usize, (a >> 32) as usize, (b & 0xffff_ffff) as usize, (b >> 32) as usize]
}

/// The little-endian u32 at `p`.
///
/// # Safety
///
/// `p` is valid for reading 4 bytes (callers pass pointers inside a block of the format).
#[inline(always)]
unsafe fn rd_u32(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

/// Eight words of four 7-bit sign fields each (bits 0..28; the rest ignored) → eight words of
/// 32 sign bits: each field widened to a byte whose bit 7 is the parity of its low seven (the
/// eighth sign, which makes the count of minus signs even).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn sign_words(s: __m256i) -> __m256i {
    let f = |sh: i32, m: i32| _mm256_and_si256(_mm256_sllv_epi32(s, _mm256_set1_epi32(sh)), _mm256_set1_epi32(m));
    let x =
        _mm256_or_si256(_mm256_or_si256(f(0, 0x7f), f(1, 0x7f00)), _mm256_or_si256(f(2, 0x7f_0000), f(3, 0x7f00_0000)));
    with_parity(x)
}

/// Bytes whose bit 7 is clear get bit 7 = the parity of their low seven bits. Shifts run over
/// 32-bit lanes: bits a byte receives from its neighbour land above bit 3, above bit 1 and
/// above bit 0 after the three steps, so bit 0 of each byte ends up its own parity.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn with_parity(x: __m256i) -> __m256i {
    let mut p = _mm256_xor_si256(x, _mm256_srli_epi32(x, 4));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 2));
    p = _mm256_xor_si256(p, _mm256_srli_epi32(p, 1));
    _mm256_or_si256(x, _mm256_slli_epi32(_mm256_and_si256(p, _mm256_set1_epi8(1)), 7))
}

/// A vector's eight u32 lanes.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn words(v: __m256i) -> [u32; 8] {
    let mut a = [0u32; 8];
    _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, v);
    a
}

/// An IQ4_XS block's eight scales ls − 32, in u32 lanes (4 low bits from `scales_l`, 2 high
/// bits from `scales_h`).
///
/// # Safety
///
/// `b` points to one whole IQ4_XS block; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn iq4xs_scales(b: *const u8) -> __m256i {
    let sl =
        _mm256_srlv_epi32(_mm256_set1_epi32(rd_u32(b.add(4)) as i32), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    let sh =
        _mm256_srlv_epi32(_mm256_set1_epi32(rd_u16(b.add(2)) as i32), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    let ls = _mm256_or_si256(
        _mm256_and_si256(sl, _mm256_set1_epi32(0xf)),
        _mm256_slli_epi32(_mm256_and_si256(sh, _mm256_set1_epi32(3)), 4),
    );
    _mm256_sub_epi32(ls, _mm256_set1_epi32(32))
}

/// The eight codebook indices of IQ1_S groups 2p and 2p + 1 (u32 lanes: the `qs` byte with 3
/// bits of its group's qh word, bits 3l..3l + 3 for sub-block l, above it), and the two groups'
/// qh words, group 2p's in lanes 0..4 and 2p + 1's in lanes 4..8.
///
/// # Safety
///
/// `b` points to one whole IQ1_S block and p < 4; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn iq1s_indices(b: *const u8, p: usize) -> (__m256i, __m256i) {
    let lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(b.add(2 + 8 * p) as *const __m128i));
    let h = _mm256_set_m128i(
        _mm_set1_epi32(rd_u16(b.add(36 + 4 * p)) as i32),
        _mm_set1_epi32(rd_u16(b.add(34 + 4 * p)) as i32),
    );
    let hi = _mm256_and_si256(_mm256_srlv_epi32(h, _mm256_set_epi32(9, 6, 3, 0, 9, 6, 3, 0)), _mm256_set1_epi32(7));
    (_mm256_or_si256(lo, _mm256_slli_epi32(hi, 8)), h)
}

/// Sixteen odd scales `2·nibble + 1` of 8 bytes at `p` (low nibble first), as bytes, the same
/// sixteen in both 128-bit lanes (a `vpshufb` table for `pick_scales`).
///
/// # Safety
///
/// `p` is valid for reading 8 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn odd_scale_bytes(p: *const u8) -> __m256i {
    let v = _mm_loadl_epi64(p as *const __m128i);
    let m = _mm_set1_epi8(0x0f);
    let n = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
    let s = _mm_add_epi8(_mm_add_epi8(n, n), _mm_set1_epi8(1));
    _mm256_set_m128i(s, s)
}

/// Eight odd scales `2·nibble + 1` of the u32 `w` (low nibble first), as bytes 0..8 of both
/// 128-bit lanes (a `vpshufb` table for `pick_scale`).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn odd_scale_bytes4(w: u32) -> __m256i {
    let v = _mm_cvtsi32_si128(w as i32);
    let m = _mm_set1_epi8(0x0f);
    let n = _mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
    let s = _mm_add_epi8(_mm_add_epi8(n, n), _mm_set1_epi8(1));
    _mm256_set_m128i(s, s)
}

/// Byte B of each 128-bit lane of `bytes` as sixteen i16 lanes (one shuffle).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn pick_scale<const B: usize>(bytes: __m256i) -> __m256i {
    _mm256_shuffle_epi8(bytes, _mm256_set1_epi16(B as i16 | (0x80 << 8)))
}

/// Each 128-bit half of `v` in both halves: `[low, low]`, `[high, high]` (the shuffles of
/// `group_signs` and `pick_scale` stay inside a half).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn halves_twice(v: __m256i) -> [__m256i; 2] {
    [_mm256_permute2x128_si256(v, v, 0x00), _mm256_permute2x128_si256(v, v, 0x11)]
}

/// Group K's i16 scales from `odd_scale_bytes`: byte 2K in lanes 0..8, byte 2K + 1 in lanes
/// 8..16 — one shuffle.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn pick_scales<const K: usize>(bytes: __m256i) -> __m256i {
    let (a, c) = (2 * K as i16, 2 * K as i16 + 1);
    // Each i16 lane's low byte takes the scale, its high byte zero (index with bit 7 set).
    let lo = a | (0x80 << 8);
    let hi = c | (0x80 << 8);
    _mm256_shuffle_epi8(bytes, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi))
}

/// ±1 bytes of group K from a vector holding the sign bytes of groups 4⌊K/4⌋..4⌊K/4⌋+4 (four
/// per group, 32 bits) in both 128-bit lanes: bit j of byte l of the group's word → byte
/// 8l + j, −1 where set — a shuffle and three logic operations, in registers.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn group_signs<const K: usize>(lane: __m256i) -> __m256i {
    let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
    let m = _mm256_cmpeq_epi8(_mm256_and_si256(spread4::<K>(lane), bit), bit);
    _mm256_or_si256(m, _mm256_set1_epi8(1))
}

/// Entry `i` of a codebook whose index was assembled from as many bits as the book has
/// entries (see `iq`: 8, 9, 10 or 11 bits into 256, 512, 1024 or 2048 entries), so it is in
/// range by construction and the bounds check is left out.
///
/// # Safety
///
/// `i < N`.
#[inline(always)]
unsafe fn entry<T: Copy, const N: usize>(t: &[T; N], i: usize) -> T {
    debug_assert!(i < N);
    *t.get_unchecked(i)
}

/// Four eight-byte codebook entries as one vector (entry l → bytes 8l..8l+8).
///
/// # Safety
///
/// Every index is below N (see `entry`); the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn grid4<const N: usize>(t: &[u64; N], i0: usize, i1: usize, i2: usize, i3: usize) -> __m256i {
    let lo = _mm_set_epi64x(entry(t, i1) as i64, entry(t, i0) as i64);
    let hi = _mm_set_epi64x(entry(t, i3) as i64, entry(t, i2) as i64);
    _mm256_set_m128i(hi, lo)
}

/// Eight four-byte codebook entries as one vector (entry j → bytes 4j..4j+4).
///
/// # Safety
///
/// Every index `i(j)` is below N (see `entry`); the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn grid8<const N: usize>(t: &[u32; N], i: impl Fn(usize) -> usize) -> __m256i {
    let e = |j: usize| entry(t, i(j)) as i32;
    _mm256_set_m128i(_mm_set_epi32(e(7), e(6), e(5), e(4)), _mm_set_epi32(e(3), e(2), e(1), e(0)))
}

/// 32 four-bit codes of 16 bytes at `q`: low nibbles (values 0..16), then high nibbles.
///
/// # Safety
///
/// `q` is valid for reading 16 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn nibbles(q: *const u8) -> __m256i {
    let v = _mm_loadu_si128(q as *const __m128i);
    let m = _mm_set1_epi8(0x0F);
    _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m))
}

/// IQ4's levels in both 128-bit lanes (a `vpshufb` table).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn iq4_table() -> __m256i {
    let t = _mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i);
    _mm256_set_m128i(t, t)
}

/// Byte l of group K's word (u32 lane K % 4 of `lane`, which holds its 128-bit half in both
/// halves) repeated over bytes 8l..8l+8.
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn spread4<const K: usize>(lane: __m256i) -> __m256i {
    let o = (4 * (K % 4)) as i64 * 0x0101010101010101;
    let spread = _mm256_set_epi64x(o + 0x0303030303030303, o + 0x0202020202020202, o + 0x0101010101010101, o);
    _mm256_shuffle_epi8(lane, spread)
}

/// Runs `$body` eight times with `$k` the constants 0..8.
macro_rules! unroll8 {
    ($k:ident, $body:block) => {{
        {
            const $k: usize = 0;
            $body
        }
        {
            const $k: usize = 1;
            $body
        }
        {
            const $k: usize = 2;
            $body
        }
        {
            const $k: usize = 3;
            $body
        }
        {
            const $k: usize = 4;
            $body
        }
        {
            const $k: usize = 5;
            $body
        }
        {
            const $k: usize = 6;
            $body
        }
        {
            const $k: usize = 7;
            $body
        }
    }};
}

/// Calls `f(k, magnitudes, sign source, scales)` for each 32-value group k of block `b`: what
/// serves all eight groups (indices, sign words, scales) is unpacked for the block at once.
///
/// # Safety
///
/// `b` points to one whole block of the format; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn for_groups<const DT: u32>(b: *const u8, mut f: impl FnMut(usize, __m256i, __m256i, __m256i)) {
    let dt = const { dtype_const(DT) };
    let one = _mm256_set1_epi8(1);
    match dt {
        DType::IQ4_NL => {
            let c = _mm256_shuffle_epi8(iq4_table(), nibbles(b.add(2)));
            f(0, _mm256_abs_epi8(c), c, _mm256_set1_epi16(1));
        }
        DType::IQ4_XS => {
            let t = iq4_table();
            let ls = words(iq4xs_scales(b));
            // Two groups' 32 bytes at once: low nibbles are values 0..16 of each, high 16..32.
            let m = _mm256_set1_epi8(0x0f);
            for p in 0..4 {
                let q = _mm256_loadu_si256(b.add(8 + 32 * p) as *const __m256i);
                let lo = _mm256_shuffle_epi8(t, _mm256_and_si256(q, m));
                let hi = _mm256_shuffle_epi8(t, _mm256_and_si256(_mm256_srli_epi16(q, 4), m));
                let c0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                let c1 = _mm256_permute2x128_si256(lo, hi, 0x31);
                f(2 * p, _mm256_abs_epi8(c0), c0, _mm256_set1_epi16(ls[2 * p] as i16));
                f(2 * p + 1, _mm256_abs_epi8(c1), c1, _mm256_set1_epi16(ls[2 * p + 1] as i16));
            }
        }
        DType::IQ2_XXS => {
            // Per group a word of four 8-bit indices, then a word of sign fields and scale.
            let v0 = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let v1 = _mm256_loadu_si256(b.add(34) as *const __m256i);
            let odd = _mm256_castps_si256(_mm256_shuffle_ps(_mm256_castsi256_ps(v0), _mm256_castsi256_ps(v1), 0xDD));
            let aux = _mm256_permute4x64_epi64(odd, 0xD8);
            let sg = halves_twice(sign_words(aux));
            // Group K's scale in byte 0 of u32 lane K.
            let ls =
                halves_twice(_mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1)));
            unroll8!(K, {
                let i = [
                    ld_index!(byte, b, 2 + 8 * K),
                    ld_index!(byte, b, 3 + 8 * K),
                    ld_index!(byte, b, 4 + 8 * K),
                    ld_index!(byte, b, 5 + 8 * K),
                ];
                let mag = grid4(&IQ2XXS_GRID, i[0], i[1], i[2], i[3]);
                f(K, mag, group_signs::<K>(sg[K / 4]), pick_scale::<{ 4 * (K % 4) }>(ls[K / 4]));
            });
        }
        DType::IQ2_XS => {
            // u16 per sub-block: 9-bit index, 7-bit sign field. The indices are read as scalars
            // (a load and a mask each, on the integer ports) rather than extracted from a vector.
            let v0 = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let v1 = _mm256_loadu_si256(b.add(34) as *const __m256i);
            // Sign fields as bytes, groups in order (packus interleaves the 128-bit halves).
            let s7 = _mm256_packus_epi16(_mm256_srli_epi16(v0, 9), _mm256_srli_epi16(v1, 9));
            let sg = halves_twice(with_parity(_mm256_permute4x64_epi64(s7, 0xD8)));
            let sc = odd_scale_bytes(b.add(66));
            unroll8!(K, {
                let i = [
                    ld_index!(word, b, 2 + 8 * K),
                    ld_index!(word, b, 4 + 8 * K),
                    ld_index!(word, b, 6 + 8 * K),
                    ld_index!(word, b, 8 + 8 * K),
                ];
                let mag = grid4(&IQ2XS_GRID, i[0] & 511, i[1] & 511, i[2] & 511, i[3] & 511);
                f(K, mag, group_signs::<K>(sg[K / 4]), pick_scales::<K>(sc));
            });
        }
        DType::IQ2_S => {
            // Index = qs byte | 2 bits of the group's qh byte (bits 2l, 2l+1 for sub-block l):
            // in u16 lanes, qh · 2^(8 − 2l) masked to bits 8..10.
            let qh = _mm_loadl_epi64(b.add(66) as *const __m128i);
            let qh = _mm256_set_m128i(qh, qh);
            // Lane j of the first vector takes qh byte j/4 (j < 16), of the second j/4 + 4.
            let pick = |a: i8| {
                let (c, e, g, z) = (a + 1, a + 2, a + 3, -1i8);
                _mm256_setr_epi8(
                    a, z, a, z, a, z, a, z, c, z, c, z, c, z, c, z, e, z, e, z, e, z, e, z, g, z, g, z, g, z, g, z,
                )
            };
            let mul = _mm256_set_epi16(4, 16, 64, 256, 4, 16, 64, 256, 4, 16, 64, 256, 4, 16, 64, 256);
            let m3 = _mm256_set1_epi16(0x300);
            let hi = |sel: __m256i| _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(qh, sel), mul), m3);
            let lo0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(b.add(2) as *const __m128i));
            let lo1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(b.add(18) as *const __m128i));
            // Groups 0..4, then 4..8, four u16 indices each.
            let idx = [_mm256_or_si256(lo0, hi(pick(0))), _mm256_or_si256(lo1, hi(pick(4)))];
            let sg = halves_twice(_mm256_loadu_si256(b.add(34) as *const __m256i));
            let sc = odd_scale_bytes(b.add(74));
            unroll8!(K, {
                let i = fields16::<{ K % 4 }>(idx[K / 4]);
                let mag = grid4(&IQ2S_GRID, i[0], i[1], i[2], i[3]);
                f(K, mag, group_signs::<K>(sg[K / 4]), pick_scales::<K>(sc));
            });
        }
        DType::IQ3_XXS => {
            let aux = _mm256_loadu_si256(b.add(66) as *const __m256i);
            let sg = halves_twice(sign_words(aux));
            // Group K's scale in byte 0 of u32 lane K.
            let ls =
                halves_twice(_mm256_or_si256(_mm256_slli_epi32(_mm256_srli_epi32(aux, 28), 1), _mm256_set1_epi32(1)));
            unroll8!(K, {
                // Eight 8-bit indices into a table of 256 entries.
                let q = b.add(2 + 8 * K);
                let mag = grid8(&IQ3XXS_GRID, |j| *q.add(j) as usize);
                f(K, mag, group_signs::<K>(sg[K / 4]), pick_scale::<{ 4 * (K % 4) }>(ls[K / 4]));
            });
        }
        DType::IQ3_S => {
            // Index j of group k: qs byte 8k + j, its 9th bit bit j of qh byte k; in u16 lanes,
            // qh byte k · 2^(8 − j) masked to bit 8. Two groups per vector.
            let qh = _mm_loadl_epi64(b.add(66) as *const __m128i);
            let qh = _mm256_set_m128i(qh, qh);
            let pick = |a: i8| {
                let (c, z) = (a + 1, -1i8);
                _mm256_setr_epi8(
                    a, z, a, z, a, z, a, z, a, z, a, z, a, z, a, z, c, z, c, z, c, z, c, z, c, z, c, z, c, z, c, z,
                )
            };
            let mul = _mm256_setr_epi16(256, 128, 64, 32, 16, 8, 4, 2, 256, 128, 64, 32, 16, 8, 4, 2);
            let m1 = _mm256_set1_epi16(0x100);
            // Not `array::from_fn`: its closure would not inherit the caller's target features.
            let mut idx = [_mm256_setzero_si256(); 4];
            for (p, v) in idx.iter_mut().enumerate() {
                let lo = _mm256_cvtepu8_epi16(_mm_loadu_si128(b.add(2 + 16 * p) as *const __m128i));
                let hi = _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(qh, pick(2 * p as i8)), mul), m1);
                *v = _mm256_or_si256(lo, hi);
            }
            let sg = halves_twice(_mm256_loadu_si256(b.add(74) as *const __m256i));
            let sc = odd_scale_bytes4(rd_u32(b.add(106)));
            unroll8!(K, {
                // Group K's eight indices: 128-bit half K % 2 of vector K / 2.
                let lo = fields16::<{ 2 * (K % 2) }>(idx[K / 2]);
                let hi = fields16::<{ 2 * (K % 2) + 1 }>(idx[K / 2]);
                let mag = grid8(&IQ3S_GRID, |j| if j < 4 { lo[j] } else { hi[j - 4] });
                f(K, mag, group_signs::<K>(sg[K / 4]), pick_scale::<K>(sc));
            });
        }
        DType::IQ1_S => {
            // Index = qs byte | 3 bits of the group's qh word (bits 3l..3l+3 for sub-block l),
            // in u32 lanes two groups at a time.
            // Not `array::from_fn`: its closure would not inherit the caller's target features.
            let mut idx = [_mm256_setzero_si256(); 4];
            for (p, v) in idx.iter_mut().enumerate() {
                *v = iq1s_indices(b, p).0;
            }
            // Per group the odd scale (lanes 0..8) and 2 where the delta is +1 (bit 15 clear),
            // 0 where −1 (lanes 8..16).
            let qh = _mm_loadu_si128(b.add(34) as *const __m128i);
            let dpos = _mm_cmpgt_epi16(qh, _mm_set1_epi16(-1));
            // As bytes, in both 128-bit lanes: the scales are bytes 0..8, the deltas 8..16.
            let dl = _mm_packus_epi16(
                _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qh, 11), _mm_set1_epi16(0xe)), _mm_set1_epi16(1)),
                _mm_and_si128(dpos, _mm_set1_epi16(2)),
            );
            let dl = _mm256_set_m128i(dl, dl);
            unroll8!(K, {
                let i = fields32::<{ K % 2 }>(idx[K / 2]);
                let g = grid4(&IQ1S_GRID8, i[0], i[1], i[2], i[3]);
                let u = _mm256_add_epi8(g, _mm256_shuffle_epi8(dl, _mm256_set1_epi8(8 + K as i8)));
                f(K, u, one, pick_scale::<K>(dl));
            });
        }
        DType::IQ1_M => {
            // A nibble per sub-block (qh byte j/2, low nibble for even j): 3 high index bits
            // and the delta's sign. Index in u16 lanes: qs | (nibble · 2^8 or 2^4) & 0x700.
            let qh = _mm_loadu_si128(b.add(32) as *const __m128i);
            let dup = _mm256_set_m128i(_mm_unpackhi_epi8(qh, qh), _mm_unpacklo_epi8(qh, qh));
            let lo0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(b as *const __m128i));
            let lo1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(b.add(16) as *const __m128i));
            let mul = _mm256_set1_epi32(0x0010_0100);
            let m7 = _mm256_set1_epi16(0x700);
            let h0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(dup));
            let h1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(dup, 1));
            // Groups 0..4, then 4..8, four u16 indices each.
            let idx = [
                _mm256_or_si256(lo0, _mm256_and_si256(_mm256_mullo_epi16(h0, mul), m7)),
                _mm256_or_si256(lo1, _mm256_and_si256(_mm256_mullo_epi16(h1, mul), m7)),
            ];
            // 2 where the delta is +1 (its sign bit clear), 0 where −1: a byte per sub-block.
            let dbit = _mm256_and_si256(dup, _mm256_set1_epi16(0x8008u16 as i16));
            let dsub =
                halves_twice(_mm256_and_si256(_mm256_cmpeq_epi8(dbit, _mm256_setzero_si256()), _mm256_set1_epi8(2)));
            let sc = scale_bytes16(iq1m_scales(b));
            unroll8!(K, {
                let i = fields16::<{ K % 4 }>(idx[K / 4]);
                let g = grid4(&IQ1S_GRID8, i[0], i[1], i[2], i[3]);
                let u = _mm256_add_epi8(g, spread4::<K>(dsub[K / 4]));
                f(K, u, one, pick_scales::<K>(sc));
            });
        }
        _ => unreachable!(),
    }
}

/// IQ1_M's sixteen odd scales `2s + 1` (3-bit fields 0..4 of each of its four scale words).
///
/// # Safety
///
/// `b` points to one whole IQ1_M block; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn iq1m_scales(b: *const u8) -> __m256i {
    // Word w to lanes 4w..4w+4, then field j of lane 4w+j to bits 12..15 through a multiply by
    // 2^(12 − 3j), and down by 12.
    let w = _mm_loadl_epi64(b.add(48) as *const __m128i);
    let w = _mm256_set_m128i(w, w);
    let sel = _mm256_setr_epi8(
        0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7,
    );
    let mul = _mm256_setr_epi16(4096, 512, 64, 8, 4096, 512, 64, 8, 4096, 512, 64, 8, 4096, 512, 64, 8);
    let f = _mm256_and_si256(_mm256_mullo_epi16(_mm256_shuffle_epi8(w, sel), mul), _mm256_set1_epi16(0x7000));
    let s = _mm256_srli_epi16(f, 12);
    _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1))
}

/// Sixteen i16 lanes (each below 256) as bytes 0..16 of both 128-bit lanes (for `pick_scales`).
///
/// # Safety
///
/// Needs only the instruction set it is compiled for (AVX2), which the caller checked (`cpu::isa()`).
#[inline(always)]
unsafe fn scale_bytes16(v: __m256i) -> __m256i {
    let b = _mm_packus_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    _mm256_set_m128i(b, b)
}

/// IQ1_S/IQ1_M: the sixteen scales (one per 16 values) as i16 lanes, to take the offset off.
///
/// # Safety
///
/// `b` points to one whole block of the format; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn iq1_scales16<const DT: u32>(b: *const u8) -> __m256i {
    if const { dtype_const(DT) } == DType::IQ1_S {
        // Group k's scale, bits 12..15 of its qh word, for both of its sixteen-value halves.
        let qh = _mm_loadu_si128(b.add(34) as *const __m128i);
        let s = _mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7));
        let s = _mm_add_epi16(_mm_add_epi16(s, s), _mm_set1_epi16(1));
        _mm256_set_m128i(_mm_unpackhi_epi16(s, s), _mm_unpacklo_epi16(s, s))
    } else {
        iq1m_scales(b)
    }
}

/// Eight blocks' f16 scale fields, gathered four to a u64 (16-bit stores read back as one
/// vector would stall store forwarding); blocks not set stay zero.
#[derive(Default)]
struct Scales8([u64; 2]);

impl Scales8 {
    /// Block j's field.
    #[inline(always)]
    fn set(&mut self, j: usize, bits: u16) {
        self.0[j / 4] |= (bits as u64) << (16 * (j % 4));
    }

    /// The eight `D` = f16 · 2^-k (exact: `scale_factor` is a power of two), as f32 — what
    /// `accumulate` multiplies by dx.
    ///
    /// # Safety
    ///
    /// The CPU has AVX2 and F16C (checked by `cpu::isa()`).
    #[inline(always)]
    unsafe fn get<const DT: u32>(&self) -> __m256 {
        let d = _mm256_cvtph_ps(_mm_set_epi64x(self.0[1] as i64, self.0[0] as i64));
        _mm256_mul_ps(d, _mm256_set1_ps(scale_factor(const { dtype_const(DT) })))
    }
}

/// The f16 bits of the block's `d`.
///
/// # Safety
///
/// `b` points to one whole block of the format.
#[inline(always)]
pub(super) unsafe fn d_bits<const DT: u32>(b: *const u8) -> u16 {
    if const { dtype_const(DT) } == DType::IQ1_M {
        super::iq::iq1m_d_bits(std::slice::from_raw_parts(b, 56))
    } else {
        rd_u16(b) as u16
    }
}

/// One group's contribution: Σ scale·magnitude·(signed) activation, in 8 i32 lanes.
///
/// # Safety
///
/// `x` is valid for reading 32 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn group_dot<const DT: u32>(mag: __m256i, sgn: __m256i, scl: __m256i, x: *const i8) -> __m256i {
    let x = _mm256_loadu_si256(x as *const __m256i);
    let xs = if const { signed(dtype_const(DT)) } { _mm256_sign_epi8(x, sgn) } else { x };
    _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), scl)
}

/// The offset correction of IQ1 formats: 9·Σ scale·(16-value sum), in 8 i32 lanes.
///
/// # Safety
///
/// `bs` is valid for reading 16 i16; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
pub(super) unsafe fn offset_sums(sc16: __m256i, bs: *const i16) -> __m256i {
    let v = _mm256_madd_epi16(sc16, _mm256_loadu_si256(bs as *const __m256i));
    _mm256_add_epi32(_mm256_slli_epi32(v, 3), v)
}

/// A whole block against activation block `xq` (`bs`: its 16-value sums), in 8 i32 lanes.
///
/// # Safety
///
/// `b` is one whole block, `xq` its activation codes, `bs` (IQ1 formats) their sums; AVX2.
#[inline(always)]
unsafe fn block_dot<const DT: u32>(b: *const u8, xq: *const i8, bs: *const i16) -> __m256i {
    let mut acc = _mm256_setzero_si256();
    for_groups::<DT>(b, |k, mag, sgn, scl| {
        acc = _mm256_add_epi32(acc, group_dot::<DT>(mag, sgn, scl, xq.add(32 * k)));
    });
    if const { !signed(dtype_const(DT)) } {
        acc = _mm256_sub_epi32(acc, offset_sums(iq1_scales16::<DT>(b), bs));
    }
    acc
}

/// Decode (one token) over R rows at once, eight blocks at a time: each block's integer sums
/// stay in vector lanes until the eight are reduced together, the scale products are formed
/// eight at a time, and the R rows' per-block float additions run in the lanes of one vector
/// (`accumulate4`) — the operations of `accumulate`, in its order, for each row.
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `w` holds R whole rows of
/// `row_bytes` of the format; `act` is one token's activations for rows of this width, padded
/// to whole groups of eight blocks (as `QuantAct` pads them).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn rows_decode<const R: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    decode_body::<R, DT, false>(w, row_bytes, act, out)
}

/// `rows_decode` with each block's integer sums from `iq512_x86::block_dot` (codebooks read by
/// AVX-512 gathers): the same integers, the same float steps, the same bits.
///
/// # Safety
///
/// As `rows_decode`, and the CPU has AVX-512 F/BW (checked by `cpu::isa()`); DT is one of
/// `iq512_x86::unpacked_here`'s formats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn rows_decode_zmm<const R: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    decode_body::<R, DT, true>(w, row_bytes, act, out)
}

/// The body of `rows_decode` (Z = false) and `rows_decode_zmm` (Z = true), inlined into each
/// with its instruction set.
///
/// # Safety
///
/// As `rows_decode` (and `rows_decode_zmm` where Z); only called from those two.
#[inline(always)]
unsafe fn decode_body<const R: usize, const DT: u32, const Z: bool>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    out: &mut [f32; 4],
) {
    let dt = const { dtype_const(DT) };
    let (bb, bl) = (dt.block_bytes(), dt.block_elems());
    let nb = act.blocks_per_row();
    debug_assert!(R <= 4 && w.len() >= R * row_bytes && act.cols == row_bytes / bb * bl);
    let mut acc = _mm_setzero_ps();
    /// # Safety
    ///
    /// As `decode_body`'s, for the eight blocks from `b0` (`m` of them inside the row).
    #[inline(always)]
    unsafe fn group<const R: usize, const DT: u32, const Z: bool>(
        w: &[u8],
        row_bytes: usize,
        act: &QuantAct,
        b0: usize,
        m: usize,
        acc: __m128,
    ) -> __m128 {
        let dt = const { dtype_const(DT) };
        let (bb, bl) = (dt.block_bytes(), dt.block_elems());
        let i0 = act.idx(0, b0);
        let dx = _mm256_loadu_ps(act.d.as_ptr().add(i0));
        // Rows past R stay zero, and so do their lanes of `acc`.
        let mut t = Terms::new();
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * bb);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), m * bb);
            let mut a = [_mm256_setzero_si256(); 8];
            let mut d = Scales8::default();
            for j in 0..m {
                let blk = base.add(j * bb);
                let xi = i0 + j;
                let xq = act.qs.as_ptr().add(xi * bl);
                let bs = if signed(dt) { std::ptr::null() } else { act.bsums.as_ptr().add(xi * 16) };
                a[j] = if Z {
                    super::iq512_x86::dot::<DT>(&super::iq512_x86::unpack::<DT>(blk), xq, bs)
                } else {
                    block_dot::<DT>(blk, xq, bs)
                };
                d.set(j, d_bits::<DT>(blk));
            }
            t.ddx[r] = _mm256_mul_ps(d.get::<DT>(), dx);
            t.isf[r] = _mm256_cvtepi32_ps(reduce8x8(&a));
        }
        accumulate4(false, acc, &t, m)
    }
    by_groups!(nb, |b0, m| acc = group::<R, DT, Z>(w, row_bytes, act, b0, m, acc));
    let mut v = [0f32; 4];
    _mm_storeu_ps(v.as_mut_ptr(), acc);
    out[..R].copy_from_slice(&v[..R]);
}

/// Tokens `t0..t0 + n` (n ≤ `SMALL_BATCH`) over R rows at once (small batches): each block's
/// groups are unpacked once for all the tokens, and each token then runs `rows_decode`'s
/// operations — its eight blocks' sums reduced together, the scale products formed eight at a
/// time, one float chain per (row, token) through the blocks in order — so every value has the
/// decode kernel's bits. `out[t][r]` receives row r, token t0 + t.
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
    batch_body::<R, DT, false>(w, row_bytes, act, t0, n, out, s)
}

/// `rows_batch` with blocks unpacked by `iq512_x86::unpack` (codebooks read by AVX-512
/// gathers) and each token's integer sums by `iq512_x86::dot`: the same integers, the same
/// float steps, the same bits.
///
/// # Safety
///
/// As `rows_batch`, and the CPU has AVX-512 F/BW/VL (checked by `cpu::isa()`); DT is one of
/// `iq512_x86::unpacked_here`'s formats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn rows_batch_zmm<const R: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    batch_body::<R, DT, true>(w, row_bytes, act, t0, n, out, s)
}

/// The body of `rows_batch` (Z = false) and `rows_batch_zmm` (Z = true), inlined into each
/// with its instruction set.
///
/// # Safety
///
/// As `rows_batch` (and `rows_batch_zmm` where Z); only called from those two.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn batch_body<const R: usize, const DT: u32, const Z: bool>(
    w: &[u8],
    row_bytes: usize,
    act: &QuantAct,
    t0: usize,
    n: usize,
    out: &mut BatchOut,
    s: &mut BatchScratch,
) {
    let dt = const { dtype_const(DT) };
    let (bb, bl, ng) = (dt.block_bytes(), dt.block_elems(), groups(dt));
    let nb = act.blocks_per_row();
    debug_assert!(w.len() >= R * row_bytes && act.cols == row_bytes / bb * bl);
    debug_assert!((1..=SMALL_BATCH).contains(&n) && t0 + n <= act.rows);
    let mut acc = [[0f32; SMALL_BATCH]; R];
    // Scratch of the thread: every group of blocks overwrites what it reads (zero lanes are
    // only needed past the row's last block).
    let BatchScratch { a, ddx, isf, .. } = s;
    let mut b0 = 0;
    while b0 < nb {
        let m = (nb - b0).min(8);
        if m < 8 {
            for t in 0..n {
                a[t][m..].fill(_mm256_setzero_si256());
            }
        }
        for r in 0..R {
            let base = w.as_ptr().add(r * row_bytes + b0 * bb);
            // The same blocks of the row R rows further down: the next pass reads them.
            prefetch_rows(base.wrapping_add(R * row_bytes), m * bb);
            let mut d = Scales8::default();
            for j in 0..m {
                let blk = base.add(j * bb);
                if Z {
                    let k = super::iq512_x86::unpack::<DT>(blk);
                    for t in 0..n {
                        let xi = act.idx(t0 + t, b0 + j);
                        let bs = if signed(dt) { std::ptr::null() } else { act.bsums.as_ptr().add(xi * 16) };
                        a[t][j] = super::iq512_x86::dot::<DT>(&k, act.qs.as_ptr().add(xi * bl), bs);
                    }
                    d.set(j, d_bits::<DT>(blk));
                    continue;
                }
                let mut mag = [_mm256_setzero_si256(); 8];
                let mut sgn = [_mm256_setzero_si256(); 8];
                let mut scl = [_mm256_setzero_si256(); 8];
                for_groups::<DT>(blk, |k, g_mag, g_sgn, g_scl| {
                    (mag[k], sgn[k], scl[k]) = (g_mag, g_sgn, g_scl);
                });
                let off16 = if signed(dt) { _mm256_setzero_si256() } else { iq1_scales16::<DT>(blk) };
                for t in 0..n {
                    let xi = act.idx(t0 + t, b0 + j);
                    let xq = act.qs.as_ptr().add(xi * bl);
                    let mut v = _mm256_setzero_si256();
                    for k in 0..ng {
                        v = _mm256_add_epi32(v, group_dot::<DT>(mag[k], sgn[k], scl[k], xq.add(32 * k)));
                    }
                    if !signed(dt) {
                        v = _mm256_sub_epi32(v, offset_sums(off16, act.bsums.as_ptr().add(xi * 16)));
                    }
                    a[t][j] = v;
                }
                d.set(j, d_bits::<DT>(blk));
            }
            let dw = d.get::<DT>();
            for t in 0..n {
                let dx = _mm256_loadu_ps(act.d.as_ptr().add(act.idx(t0 + t, b0)));
                _mm256_storeu_ps(ddx[r][t].as_mut_ptr(), _mm256_mul_ps(dw, dx));
                _mm256_storeu_ps(isf[r][t].as_mut_ptr(), _mm256_cvtepi32_ps(reduce8x8(&a[t])));
            }
        }
        for j in 0..m {
            for r in 0..R {
                for t in 0..n {
                    acc[r][t] = ddx[r][t][j].mul_add(isf[r][t][j], acc[r][t]);
                }
            }
        }
        b0 += m;
    }
    for r in 0..R {
        for t in 0..n {
            out[t][r] = acc[r][t];
        }
    }
}

/// `$go!(id)` with the GGML id of IQ format `$dtype` (a literal, for const generics).
macro_rules! by_dtype {
    ($dtype:expr, $go:ident) => {
        match $dtype {
            DType::IQ2_XXS => $go!(16),
            DType::IQ2_XS => $go!(17),
            DType::IQ3_XXS => $go!(18),
            DType::IQ1_S => $go!(19),
            DType::IQ4_NL => $go!(20),
            DType::IQ3_S => $go!(21),
            DType::IQ2_S => $go!(22),
            DType::IQ4_XS => $go!(23),
            DType::IQ1_M => $go!(29),
            d => unreachable!("{d} is not an IQ format"),
        }
    };
}
pub(super) use by_dtype;

/// `out = x · Wᵀ` for IQ weights with AVX2: the caller checked the CPU (`isa() ≥ Avx2`), and
/// `act` holds `n` tokens quantized for `w` (`ActKind::for_weights`); `o` is `n × w.rows`.
pub(crate) fn matmul(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    assert!(super::iq::is_iq(w.dtype) && act.rows == n && act.cols == w.cols);
    let rb = w.row_bytes();
    // At the AVX-512 level the codebook formats read their entries by gathers (`iq512_x86`).
    let zmm = isa == Isa::Avx512 && super::iq512_x86::unpacked_here(w.dtype);
    if n == 1 {
        // Decode: four rows at a time (fewer at a range's end).
        pool.for_ranges(w.rows, 4, &|rows| {
            let mut vals = [0f32; 4];
            let mut r = rows.start;
            while r < rows.end {
                let k = (rows.end - r).min(4);
                let wr = &w.data[r * rb..(r + k) * rb];
                macro_rules! go {
                    ($dt:literal) => {
                        match (zmm, k) {
                            (true, 4) => rows_decode_zmm::<4, $dt>(wr, rb, act, &mut vals),
                            (true, 3) => rows_decode_zmm::<3, $dt>(wr, rb, act, &mut vals),
                            (true, 2) => rows_decode_zmm::<2, $dt>(wr, rb, act, &mut vals),
                            (true, _) => rows_decode_zmm::<1, $dt>(wr, rb, act, &mut vals),
                            (false, 4) => rows_decode::<4, $dt>(wr, rb, act, &mut vals),
                            (false, 3) => rows_decode::<3, $dt>(wr, rb, act, &mut vals),
                            (false, 2) => rows_decode::<2, $dt>(wr, rb, act, &mut vals),
                            (false, _) => rows_decode::<1, $dt>(wr, rb, act, &mut vals),
                        }
                    };
                }
                // SAFETY: AVX2/FMA/F16C were detected (the caller's contract), AVX-512 F/BW
                // where `zmm`; `wr` holds k whole rows (MatRef::new checked the size); `act`
                // is padded by QuantAct.
                unsafe { by_dtype!(w.dtype, go) };
                for (i, v) in vals.iter().enumerate().take(k) {
                    // SAFETY: this thread owns rows `rows` of the single output row.
                    unsafe { *o.get().add(r + i) = *v };
                }
                r += k;
            }
        });
        return;
    }
    // Batches of more tokens go to the tiled kernels (`tiled_avx2`, `x86_512`).
    debug_assert!(n < super::ROW_KERNEL_MIN_TOKENS);
    super::small_batches(pool, w, n, o, |wr, k, t0, nt, vals, s| {
        macro_rules! go {
            ($dt:literal) => {
                match (zmm, k) {
                    (true, 4) => rows_batch_zmm::<4, $dt>(wr, rb, act, t0, nt, vals, s),
                    (true, 3) => rows_batch_zmm::<3, $dt>(wr, rb, act, t0, nt, vals, s),
                    (true, 2) => rows_batch_zmm::<2, $dt>(wr, rb, act, t0, nt, vals, s),
                    (true, _) => rows_batch_zmm::<1, $dt>(wr, rb, act, t0, nt, vals, s),
                    (false, 4) => rows_batch::<4, $dt>(wr, rb, act, t0, nt, vals, s),
                    (false, 3) => rows_batch::<3, $dt>(wr, rb, act, t0, nt, vals, s),
                    (false, 2) => rows_batch::<2, $dt>(wr, rb, act, t0, nt, vals, s),
                    (false, _) => rows_batch::<1, $dt>(wr, rb, act, t0, nt, vals, s),
                }
            };
        }
        // SAFETY: AVX2/FMA/F16C were detected (the caller's contract), AVX-512 F/BW/VL where
        // `zmm`; `wr` holds k whole rows; tokens t0..t0 + nt are rows of `act`, padded by
        // QuantAct.
        unsafe { by_dtype!(w.dtype, go) };
    });
}

#[cfg(test)]
mod tests {
    use crate::cpu::Isa;
    use crate::matmul::matmul_with_isa;
    use crate::{DType, MatRef, ThreadPool};

    const IQ: [DType; 9] = [
        DType::IQ4_NL,
        DType::IQ4_XS,
        DType::IQ3_XXS,
        DType::IQ3_S,
        DType::IQ2_XXS,
        DType::IQ2_XS,
        DType::IQ2_S,
        DType::IQ1_S,
        DType::IQ1_M,
    ];

    fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    /// Random bytes (every index, sign and scale pattern) with a sane f16 scale.
    fn random_rows(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
        let mut next = lcg(seed);
        let mut v: Vec<u8> = (0..rows * dtype.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        for b in v.chunks_exact_mut(dtype.block_bytes()) {
            let d = half::f16::from_f32(((next() % 1000) as f32 + 1.0) * 1e-5).to_bits();
            if dtype == DType::IQ1_M {
                for w in 0..4 {
                    b[49 + 2 * w] = (b[49 + 2 * w] & 0x0f) | ((((d >> (4 * w)) & 0xf) as u8) << 4);
                }
            } else {
                b[0..2].copy_from_slice(&d.to_le_bytes());
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

    fn xs(n: usize, seed: u64) -> Vec<f32> {
        let mut next = lcg(seed);
        (0..n).map(|i| (next() as f32 / (1u64 << 31) as f32 - 1.0) * [1.0, 0.02, 7.0][i / 256 % 3]).collect()
    }

    fn check(dtype: DType, w: &[u8], rows: usize, cols: usize, n: usize, pool: &ThreadPool) {
        let m = MatRef::new(dtype, rows, cols, w).unwrap();
        let x = xs(n * cols, 9 + n as u64);
        let mut want = vec![0f32; n * rows];
        crate::matmul_ref(m, &x, n, &mut want);
        for isa in Isa::supported() {
            let got = matmul_with_isa(isa, pool, m, &x, n);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{dtype} {isa:?} {rows}x{cols} n={n} element {i}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let pool = ThreadPool::new(2);
        for dtype in IQ {
            // Rows left over after groups of four; blocks left over after groups of eight.
            for (rows, cols) in [(1, 256), (5, 512), (9, 2304), (17, 768)] {
                let w = random_rows(dtype, rows, cols, rows as u64 * 31 + cols as u64);
                for n in [1, 3, 7, 33] {
                    check(dtype, &w, rows, cols, n, &pool);
                }
            }
            let w = quantized_rows(dtype, 6, 1280, 4);
            for n in [1, 3, 7, 33] {
                check(dtype, &w, 6, 1280, n, &pool);
            }
        }
    }

    #[test]
    fn the_largest_indices_match_the_reference() {
        // Every byte 0xFF but the scale: each index field at its maximum (the last codebook
        // entry), every sign and scale bit set.
        let pool = ThreadPool::new(1);
        for dtype in IQ {
            let (rows, cols) = (3, 512);
            let mut w = random_rows(dtype, rows, cols, 5);
            for b in w.chunks_exact_mut(dtype.block_bytes()) {
                let keep: Vec<u8> = b.to_vec();
                b.fill(0xff);
                if dtype == DType::IQ1_M {
                    for i in 0..4 {
                        b[49 + 2 * i] = 0x0f | (keep[49 + 2 * i] & 0xf0);
                    }
                } else {
                    b[0..2].copy_from_slice(&keep[0..2]);
                }
            }
            for n in [1, 3] {
                check(dtype, &w, rows, cols, n, &pool);
            }
        }
    }

    #[test]
    fn batch_and_threads_do_not_change_a_row() {
        for dtype in IQ {
            let (rows, cols) = (13, 512);
            let w = random_rows(dtype, rows, cols, 77);
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            let x = xs(7 * cols, 1);
            let mut all = vec![0f32; 7 * rows];
            crate::matmul(&ThreadPool::new(2), m, &x, 7, &mut all);
            for t in 0..7 {
                let mut one = vec![0f32; rows];
                crate::matmul(&ThreadPool::new(1), m, &x[t * cols..(t + 1) * cols], 1, &mut one);
                assert!(crate::compare::same_bits(&one, &all[t * rows..(t + 1) * rows]), "{dtype} token {t}");
            }
        }
    }
}

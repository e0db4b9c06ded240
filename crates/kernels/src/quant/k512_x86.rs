//! K-quant blocks unpacked straight into 512-bit vectors, for the decode and small-batch
//! kernels of `x86` at the AVX-512 level: vector c holds the codes of elements 64c..64c+64 in
//! order (unsigned bytes) and, in its i16 lanes, the scale of each lane's pair of codes — the
//! layout `x86_512::dot_unpacked` multiplies with one token's activations. The codes and
//! scales are those of `x86::unpack` (the AVX2 kernels'), joined two by two; the integer sums
//! built from them are the same integers, so the kernels' bits do not change.
//!
//! Q6_K and Q3_K are unpacked here with 512-bit operations: their codes cost the AVX2
//! unpacking a shift, mask and merge per 32 values, here per 64 (Q3_K decode, 113×4096, one
//! thread: 20.1 → 23.2 GMAC per CPU second against the AVX2 kernel). Q2_K takes the AVX2
//! unpacking and joins its halves. Q4_K and Q5_K, unpacked natively (a broadcast chunk per 64
//! values, the upper half shifted) and multiplied as above, decoded no faster than the AVX2
//! kernel (kernel lab, Intel Xeon, one thread: Q4_K 23.9 against 25.1 GMAC per CPU second,
//! Q5_K 19.8 against 19.6): 512-bit operations issue on two ports, 256-bit ones on three, so
//! halving the instructions gains only where it more than halves them.
//!
//! Where the CPU has VNNI, the decode takes each block's products unscaled, one `vpdpbusd` per
//! 64 values, narrows two vectors of sums to i16 with one `vpackssdw`, and applies their
//! sub-block scales with one `vpdpwssd` (`Packed`): ten operations per block
//! (four products, two packs, two scale vectors, two scalings) where `vpmaddubsw`, `vpmaddwd`,
//! an add and a scale vector per 64 values took sixteen.
//! 400×4096 in L2, one thread, fastest of ten alternated runs, µs per product before → after:
//! Q4_K 62.6 → 54.0 (medians 67.3 → 63.6), Q5_K 81.5 → 68.5 (89.7 → 76.2), Q6_K 61.6 → 54.5
//! (68.3 → 64.2), Q3_K 65.7 → 59.8 (68.0 → 62.3), Q2_K 55.6 → 53.4 (58.3 → 54.8); at an OLMoE
//! expert's 1024×2048 (eight runs) Q4_K 73.4 → 67.8, Q6_K 78.0 → 71.4. Fusing only the
//! scaling (`vpdpwssd` in place of `vpmaddwd` and an add, scale vectors kept) gained about
//! half of that for Q5_K and 0–3% for the others. The small-batch kernel takes the same
//! products, each block unpacked once for all its tokens: 400×4096, fastest of five or six
//! alternated runs, µs, before → after: 4 tokens Q4_K 157.0 → 150.0, Q5_K 179.7 → 157.9, Q6_K
//! 143.2 → 131.8; 6 tokens Q3_K 200.5 → 181.6.

// Index loops over the four 64-value parts of a block read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::x86;
use std::arch::x86_64::*;

/// The block at `blk` of K-quant `K` (GGML ids: Q2_K = 10 … Q6_K = 14): four 64-value code
/// vectors, their scale vectors, and the i16 factors of the block's 16-value activation sums
/// (`x86::unpack`'s third part, unchanged).
///
/// # Safety
///
/// `blk` points to one whole block; the CPU has AVX-512 F and BW (checked by `cpu::isa()`);
/// inlined only into functions compiled for them.
#[inline(always)]
pub(crate) unsafe fn unpack<const K: u32>(blk: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
    match K {
        11 => unpack_q3k(blk),
        14 => unpack_q6k(blk),
        _ => {
            let (u, sv, sums16) = x86::unpack::<K>(blk);
            let (u, sv) = super::x86_512::widen_unpacked(&u, &sv);
            (u, sv, sums16)
        }
    }
}

/// Upper 256 bits of a 512-bit vector, as a mask of its 32 i16 lanes.
const UPPER16: __mmask32 = 0xFFFF_0000;

/// i16 lanes `[a; 16] ++ [b; 16]` as `vpermw` indices.
///
/// # Safety
///
/// AVX-512 F is present (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn halves16(a: i16, b: i16) -> __m512i {
    _mm512_mask_mov_epi16(_mm512_set1_epi16(a), UPPER16, _mm512_set1_epi16(b))
}

/// A Q3_K block. Element 32k + i (k = 4n + j) has its two low bits at bits 2j..2j + 2 of `qs`
/// byte 32n + i and its third, taken as +4 (the stored −4 comes off through the 16-value
/// sums, as in `k23_x86`), at bit k of `hmask` byte i. Vector c holds k = 2c and 2c + 1: `qs`'s
/// 32 bytes n = c / 2 broadcast to both halves, each half shifted by its own 2j, and `hmask`
/// broadcast likewise, each half's bit k moved to bit 2 by its own shift. One scale per 16
/// values (`k23_x86::q3_scales`). Q2_K unpacked the same way (its two low bits only) decoded
/// no faster than its widened AVX2 unpacking (113×4096, one thread: 26.9 against 27.5 GMAC per
/// CPU second), so it keeps that.
///
/// # Safety
///
/// As `unpack`.
#[inline(always)]
unsafe fn unpack_q3k(blk: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
    let three = _mm512_set1_epi8(3);
    let four = _mm512_set1_epi8(4);
    let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk as *const __m256i));
    let mut u = [_mm512_setzero_si512(); 4];
    for (c, uc) in u.iter_mut().enumerate() {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(32 + 32 * (c / 2)) as *const __m256i));
        let j = 2 * (c % 2) as i16;
        // i16 shifts; the byte masks drop what crosses from the neighbouring byte.
        let lo = _mm512_and_si512(_mm512_srlv_epi16(q, halves16(2 * j, 2 * j + 2)), three);
        let (k0, k1) = (2 * c as i16, 2 * c as i16 + 1);
        let h = if c == 0 {
            _mm512_sllv_epi16(hm, halves16(2 - k0, 2 - k1))
        } else {
            _mm512_srlv_epi16(hm, halves16(k0 - 2, k1 - 2))
        };
        *uc = _mm512_or_si512(lo, _mm512_and_si512(h, four));
    }
    let s16 = _mm256_cvtepi8_epi16(super::k23_x86::q3_scales(blk.add(96)));
    (u, scale_vectors16(s16), s16)
}

/// The scale vectors of a block with one i16 scale per 16 values (`s16`): 128-bit lane q of
/// vector c takes scale 4c + q — one `vpermw` per vector.
///
/// # Safety
///
/// AVX-512 F/BW are present (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn scale_vectors16(s16: __m256i) -> [__m512i; 4] {
    let s16 = _mm512_castsi256_si512(s16);
    let mut sv = [_mm512_setzero_si512(); 4];
    for (c, v) in sv.iter_mut().enumerate() {
        let q = 4 * c as i16;
        let idx = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(q + 1), _mm_set1_epi16(q))),
            _mm256_set_m128i(_mm_set1_epi16(q + 3), _mm_set1_epi16(q + 2)),
            1,
        );
        *v = _mm512_permutexvar_epi16(idx, s16);
    }
    sv
}

/// A Q6_K block. Each half n of it (128 values) takes 64 bytes of low nibbles, `ql`, and 32
/// bytes of two-bit tops, `qh`: elements 128n + l and 128n + 32 + l (l < 32) are the low
/// nibbles of `ql` bytes l and 32 + l with `qh` bits 0–1 and 2–3 on top; elements 128n + 64 + l
/// and 128n + 96 + l their high nibbles with bits 4–5 and 6–7. So `ql`'s 64 bytes give
/// vector 2n from their low nibbles and 2n + 1 from their high ones, `qh` broadcast to both
/// halves and each half's two bits moved to bits 4–5 by a shift of its own.
///
/// # Safety
///
/// As `unpack`.
#[inline(always)]
unsafe fn unpack_q6k(blk: *const u8) -> ([__m512i; 4], [__m512i; 4], __m256i) {
    let nib = _mm512_set1_epi8(0x0F);
    let top = _mm512_set1_epi8(0x30);
    // i16 shifts; the byte mask drops what crosses from the neighbouring byte.
    let left = halves16(4, 2);
    let right = halves16(0, 2);
    let mut u = [_mm512_setzero_si512(); 4];
    for n in 0..2 {
        let ql = _mm512_loadu_si512(blk.add(64 * n) as *const _);
        let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(128 + 32 * n) as *const __m256i));
        let lo = _mm512_and_si512(ql, nib);
        let hi = _mm512_and_si512(_mm512_srli_epi16(ql, 4), nib);
        u[2 * n] = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(qh, left), top));
        u[2 * n + 1] = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(qh, right), top));
    }
    // One i8 scale per 16 values: 128-bit lane q of vector c takes scale 4c + q.
    let sums16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(192) as *const __m128i));
    (u, scale_vectors16(sums16), sums16)
}

/// A Q4_K/Q5_K block's codes, its scale bytes (`x86::k4_scale_bytes`) and its mins each twice
/// (as `x86::unpack`'s third part). Element 64c + i (i < 32) is the low nibble of `qs` byte
/// 32c + i and element 64c + 32 + i its high nibble (Q5_K: fifth bit at bits 2c and 2c + 1 of
/// `qh` byte i). So vector c is `qs`'s 32 bytes c broadcast to both halves, the upper half
/// shifted by 4, and for Q5_K `qh` broadcast likewise, each half's own bit tested into a mask
/// that adds 16.
///
/// # Safety
///
/// As `unpack`.
#[inline(always)]
unsafe fn unpack_q4k_codes(q5: bool, blk: *const u8) -> ([__m512i; 4], __m256i, __m256i) {
    let nib = _mm512_set1_epi8(0x0F);
    let upper = halves16(0, 4);
    let sb = x86::k4_scale_bytes(blk);
    let qs = blk.add(if q5 { 48 } else { 16 });
    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(16) as *const __m256i));
    let mut u = [_mm512_setzero_si512(); 4];
    for c in 0..4 {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * c) as *const __m256i));
        u[c] = _mm512_and_si512(_mm512_srlv_epi16(q, upper), nib);
        if q5 {
            let bits = _mm512_mask_mov_epi8(
                _mm512_set1_epi8(1 << (2 * c)),
                0xFFFF_FFFF_0000_0000,
                _mm512_set1_epi8(1 << (2 * c + 1)),
            );
            let k = _mm512_test_epi8_mask(qh, bits);
            u[c] = _mm512_mask_add_epi8(u[c], k, u[c], _mm512_set1_epi8(16));
        }
    }
    let mins2 = _mm256_shuffle_epi8(sb, _mm256_loadu_si256(x86::MINS_TWICE.as_ptr() as *const __m256i));
    (u, sb, mins2)
}

/// The `vpshufb` control that gives, in each 128-bit lane k of a vector of `vpackssdw`-packed
/// sums, i16 lanes 0..4 the scale byte `a` (k < 2) or `a + 1`, and lanes 4..8 the scale byte
/// `b` or `b + 1` (odd bytes cleared): see `Packed`.
const fn packed_scale_ctrl(a: i8, b: i8) -> [i8; 64] {
    let mut c = [-1i8; 64];
    let mut k = 0;
    while k < 4 {
        let up = if k >= 2 { 1 } else { 0 };
        let mut i = 0;
        while i < 8 {
            c[16 * k + 2 * i] = if i < 4 { a } else { b } + up;
            i += 1;
        }
        k += 1;
    }
    c
}

const SCALES_01: [i8; 64] = packed_scale_ctrl(0, 2);
const SCALES_23: [i8; 64] = packed_scale_ctrl(4, 6);

/// `vpermw` indices that give, in each 128-bit lane k of a vector of `vpackssdw`-packed sums of
/// 16-value groups, i16 lanes 0..4 scale `a + k` and lanes 4..8 scale `b + k`: see `Packed`.
const fn packed_group_idx(a: i16, b: i16) -> [i16; 32] {
    let mut c = [0i16; 32];
    let mut k = 0;
    while k < 4 {
        let mut i = 0;
        while i < 8 {
            c[8 * k + i] = if i < 4 { a } else { b } + k as i16;
            i += 1;
        }
        k += 1;
    }
    c
}

const GROUPS_01: [i16; 32] = packed_group_idx(0, 4);
const GROUPS_23: [i16; 32] = packed_group_idx(8, 12);

/// A K-quant block unpacked for the VNNI kernels, which take each block's products unscaled
/// and apply its scales to the sums: codes in value order (`u`, 64 to a vector), the scales of
/// two vectors' `vpackssdw`-packed sums (`s01` for vectors 0 and 1, `s23` for 2 and 3), and
/// the i16 factors of the 16-value activation sums (`x86::unpack`'s third part).
///
/// Vector c's `vpdpbusd` sums hold values 64c + 4l..+4 in i32 lane l, so each 128-bit lane is
/// one 16-value group and each 256-bit half one 32-value sub-block; packed two vectors
/// together, 128-bit lane k holds vector 2c's lane k in its i16 lanes 0..4 and vector 2c + 1's
/// in 4..8, whose scales `s01`/`s23` place there. The sums are at most 4·63·127 = 32,004 in
/// magnitude (Q6_K's codes against Q8_K's, which are at most 127): exact in i16. Per block and
/// token this takes four `vpdpbusd`, two `vpackssdw` and two `vpdpwssd`, where a
/// `vpmaddubsw`, a `vpmaddwd` and an add per 64 values took twelve.
pub(crate) struct Packed {
    u: [__m512i; 4],
    s01: __m512i,
    s23: __m512i,
    sums16: __m256i,
}

/// Block `blk` of K-quant `K` (GGML ids, Q2_K = 10 … Q6_K = 14) for `Packed::dot`.
///
/// # Safety
///
/// As `unpack`, and the CPU has AVX-512 VNNI (checked by `Isa::uses_vnni`).
#[inline(always)]
pub(crate) unsafe fn unpack_packed<const K: u32>(blk: *const u8) -> Packed {
    if K == 12 || K == 13 {
        // One scale per 32 values: placed from the block's scale bytes by one `vpshufb` each.
        let (u, sb, mins2) = unpack_q4k_codes(K == 13, blk);
        let sb512 = _mm512_broadcast_i64x4(sb);
        let s01 = _mm512_shuffle_epi8(sb512, _mm512_loadu_si512(SCALES_01.as_ptr() as *const _));
        let s23 = _mm512_shuffle_epi8(sb512, _mm512_loadu_si512(SCALES_23.as_ptr() as *const _));
        return Packed { u, s01, s23, sums16: mins2 };
    }
    // One scale per 16 values, placed by one `vpermw` each. The scale vectors `unpack` also
    // makes go unused, and the compiler drops them. Its third part is Q2_K's mins, the others'
    // scales; Q2_K's scales are the low nibbles of its bytes 0..16.
    let (u, _, sums16) = unpack::<K>(blk);
    let scales = if K == 10 {
        let sc = _mm_loadu_si128(blk as *const __m128i);
        _mm256_cvtepu8_epi16(_mm_and_si128(sc, _mm_set1_epi8(0x0F)))
    } else {
        sums16
    };
    let s = _mm512_castsi256_si512(scales);
    let s01 = _mm512_permutexvar_epi16(_mm512_loadu_si512(GROUPS_01.as_ptr() as *const _), s);
    let s23 = _mm512_permutexvar_epi16(_mm512_loadu_si512(GROUPS_23.as_ptr() as *const _), s);
    Packed { u, s01, s23, sums16 }
}

impl Packed {
    /// The block against one token's codes `xq` and 16-value sums `bs`, as
    /// `x86_512::dot_unpacked` gives it: the scaled sums in 8 i32 lanes, and the min sums (Q2_K,
    /// Q4_K, Q5_K) or zero (the stored offset of Q3_K and Q6_K, `offset_shift`, taken off the
    /// first through the sums, `x86::offset_or_mins`) — the same totals.
    ///
    /// # Safety
    ///
    /// `xq` points to the block's 256 activation codes; the CPU has AVX-512 F, BW and VNNI;
    /// inlined only into functions compiled for them.
    #[inline(always)]
    pub(crate) unsafe fn dot(&self, offset_shift: Option<i32>, xq: *const i8, bs: __m256i) -> (__m256i, __m256i) {
        let z = _mm512_setzero_si512();
        let mut d = [z; 4];
        for c in 0..4 {
            d[c] = _mm512_dpbusd_epi32(z, self.u[c], _mm512_loadu_si512(xq.add(64 * c) as *const _));
        }
        let v = _mm512_dpwssd_epi32(z, _mm512_packs_epi32(d[0], d[1]), self.s01);
        let v = _mm512_dpwssd_epi32(v, _mm512_packs_epi32(d[2], d[3]), self.s23);
        let v = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
        x86::offset_or_mins(offset_shift, v, _mm256_madd_epi16(self.sums16, bs))
    }
}

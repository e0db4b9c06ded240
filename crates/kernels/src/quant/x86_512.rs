//! The AVX-512 VNNI prefill kernel: tokens in lanes.
//!
//! Activations of up to 16 tokens are regrouped into a `Panel` (`panel`): for every 4
//! consecutive values of the reduction dimension, one 64-byte vector holding those 4 bytes of
//! each of the 16 tokens. A weight row's block is unpacked to bytes once for up to four panels,
//! and each 4-byte group of it is broadcast against a panel: one `vpdpbusd` does 64
//! multiply-adds for 16 tokens, and the integer sums of a block come out already separated by
//! token, with no horizontal reduction. Four rows run together so their dependency chains
//! overlap.
//!
//! Formats: Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, Q4_K, Q5_K, Q6_K, Q2_K, Q3_K and the IQ formats.
//! Q2_K, Q3_K, IQ3_S, IQ3_XXS and the IQ2 formats are unpacked with AVX-512 here (codebooks by
//! gathers, signs as byte masks); IQ4_XS and the IQ1 formats by the decode kernels' 512-bit
//! unpacking (`iq512_x86`), IQ4_NL by the AVX2 kernels' `iq_x86::for_groups`. Q2_K's and Q3_K's codes are multiplied by their 16-value group's scale
//! while unpacking (the products still bytes), so their blocks need no multiply per group.
//!
//! Each lane then applies `dot_ref::accumulate`'s operations for its (row, token) pair, block
//! after block, so results equal the scalar reference to the bit.

// Index loops over lanes, rows and blocks read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::blocks::e8m0_half;
use super::iq512_x86::odd_scale_bytes;
use super::x86::{codes32, codes_q4k, codes_q6k, f16_bits, f16_to_f32};
use crate::DType;
use std::arch::x86_64::*;

use super::panel::{Panel, ROWS, TILE};

/// Most panels one call takes: each block of the R rows is unpacked once for all of them.
pub const PANELS: usize = 4;

/// One call's results: `[panel][row][token]`.
pub type Out = [[[f32; TILE]; ROWS]; PANELS];

/// Float accumulators of R rows for each panel.
type Acc<const R: usize> = [[__m512; R]; PANELS];

/// Stores the accumulators of the `n` panels into `out`.
///
/// # Safety
///
/// The CPU has AVX-512 F (the caller, compiled for it, checked `cpu::isa()`).
#[inline(always)]
unsafe fn store<const R: usize>(accf: &Acc<R>, n: usize, out: &mut Out) {
    for (pi, o) in out.iter_mut().enumerate().take(n) {
        for r in 0..R {
            _mm512_storeu_ps(o[r].as_mut_ptr(), accf[pi][r]);
        }
    }
}

/// # Safety
///
/// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
/// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
#[inline(always)]
unsafe fn ld(p: *const u32) -> __m512i {
    _mm512_loadu_si512(p as *const _)
}

/// # Safety
///
/// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
/// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
#[inline(always)]
unsafe fn ldf(p: *const f32) -> __m512 {
    _mm512_loadu_ps(p)
}

/// # Safety
///
/// The pointer must be valid for reading one block (or vector) of the format at hand; the CPU
/// has the instruction set this is compiled for ({isa}, checked by `cpu::isa()`).
#[inline(always)]
unsafe fn bcast(p: *const u8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

/// A 64-byte array (of bytes or u16) as a vector.
///
/// # Safety
///
/// The CPU has AVX-512 F (checked by `cpu::isa()`); inlined only into functions compiled for it.
#[inline(always)]
unsafe fn ld_bytes<T: Copy, const N: usize>(a: &[T; N]) -> __m512i {
    const { assert!(std::mem::size_of::<[T; N]>() == 64) };
    _mm512_loadu_si512(a.as_ptr() as *const _)
}

/// The `vpsrlvw` counts that take bits 2j..2j + 2 of each `qs` byte of a Q2_K/Q3_K half block
/// to its bits 0..2, for a 64-value chunk c with c % 2 = m: j = 2m in its first 32 bytes, 2m + 1
/// in the next 32.
fn qs_shifts(m: usize) -> [u16; 32] {
    std::array::from_fn(|i| if i < 16 { 4 * m as u16 } else { 4 * m as u16 + 2 })
}

/// Two dot-product chains per row (even and odd dwords, so four rows keep eight `vpdpbusd` in
/// flight) over a block's 256 codes against the panel's 64 dwords at `xc`, summed. Codes are
/// unsigned against signed activations, or with `SIGNED` signed against a flipped panel's
/// activations plus 128 (`flips`).
///
/// # Safety
///
/// `xc` is valid for 64 · TILE dwords; the CPU has AVX-512 VNNI (checked by `cpu::isa()` and
/// `cpu::has_vnni()`).
#[inline(always)]
unsafe fn dot_block<const R: usize, const SIGNED: bool>(codes: &[[u8; 256]; R], xc: *const u32) -> [__m512i; R] {
    let mut s0 = [_mm512_setzero_si512(); R];
    let mut s1 = [_mm512_setzero_si512(); R];
    for g in 0..32 {
        let (x0, x1) = (ld(xc.add(2 * g * TILE)), ld(xc.add((2 * g + 1) * TILE)));
        for r in 0..R {
            let (w0, w1) = (bcast(codes[r].as_ptr().add(8 * g)), bcast(codes[r].as_ptr().add(8 * g + 4)));
            (s0[r], s1[r]) = (dp::<SIGNED>(s0[r], w0, x0), dp::<SIGNED>(s1[r], w1, x1));
        }
    }
    for r in 0..R {
        s0[r] = _mm512_add_epi32(s0[r], s1[r]);
    }
    s0
}

/// `acc` plus the 4-byte dot products of weight codes `w` and panel activations `x`: codes
/// unsigned and activations signed, or with `SIGNED` codes signed and activations flipped
/// (unsigned, plus 128).
///
/// # Safety
///
/// The CPU has AVX-512 VNNI (checked by `cpu::isa()` and `cpu::has_vnni()`); inlined only into
/// functions compiled for it.
#[inline(always)]
unsafe fn dp<const SIGNED: bool>(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    if SIGNED {
        _mm512_dpbusd_epi32(acc, x, w)
    } else {
        _mm512_dpbusd_epi32(acc, w, x)
    }
}

/// Whether the kernel for `dtype` takes its panels flipped (`Panel::new`): activations plus
/// 128, unsigned, against the format's signed codes. The correction that then comes off,
/// 128 · Σ scale · code, belongs to the weight row alone, so it is formed once per block and
/// row (`signed_offset`), where codes offset to unsigned would need one per token: the
/// activations' 16-value sums times each group's scale, eight `vpdpwssd` more per block, row
/// and panel.
pub fn flips(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q3_K
            | DType::Q6_K
            | DType::IQ2_XXS
            | DType::IQ2_XS
            | DType::IQ2_S
            | DType::IQ3_XXS
            | DType::IQ3_S
            | DType::IQ1_S
            | DType::IQ1_M
            | DType::IQ4_XS
    )
}

/// Q2_K's and Q3_K's 2-bit codes of 64-value chunk c (0..4) of a block whose `qs` start at `qs`:
/// value 128h + 32j + l's is bits 2j..2j + 2 of `qs` byte 32h + l (h = c / 2; j = 2(c % 2) in the
/// chunk's first 32 bytes, j + 1 in the next 32), one per byte.
///
/// # Safety
///
/// `qs` is valid for 64 bytes; the CPU has AVX-512 F/BW (checked by `cpu::isa()`); inlined only
/// into functions compiled for them.
#[inline(always)]
unsafe fn low2(qs: *const u8, c: usize, shift: &[__m512i; 2]) -> __m512i {
    let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * (c / 2)) as *const __m256i));
    _mm512_and_si512(_mm512_srlv_epi16(q, shift[c % 2]), _mm512_set1_epi8(3))
}

/// Per lane (token): Σ over a 256-value block's N groups (16 of 16 values or 8 of 32) of the
/// group's scale · (its codes · the panel's activation codes), for R rows (`codes[r]`; the
/// scales `sc[r]`, S of them evenly spread, so group g's is `sc[r][g · S / N]`); `xc` points
/// to the block's 64 panel dwords. Codes and activations as `dp` takes them (`SIGNED`). The
/// formats with one scale per 32 values take N = 8: half the multiplies and adds.
///
/// # Safety
///
/// `xc` is valid for 64 · TILE dwords; the CPU has AVX-512 VNNI (checked by `cpu::isa()` and
/// `cpu::has_vnni()`).
#[inline(always)]
unsafe fn groups<const R: usize, const N: usize, const S: usize, const SIGNED: bool>(
    codes: &[[u8; 256]; R],
    sc: &[[i32; S]; R],
    xc: *const u32,
) -> [__m512i; R] {
    let dwords = 64 / N;
    let mut s1 = [_mm512_setzero_si512(); R];
    for gi in 0..N {
        let mut raw = [_mm512_setzero_si512(); R];
        for g in 0..dwords {
            let xv = ld(xc.add((dwords * gi + g) * TILE));
            for r in 0..R {
                raw[r] = dp::<SIGNED>(raw[r], bcast(codes[r].as_ptr().add(4 * (dwords * gi + g))), xv);
            }
        }
        for r in 0..R {
            s1[r] = _mm512_add_epi32(s1[r], _mm512_mullo_epi32(raw[r], _mm512_set1_epi32(sc[r][gi * S / N])));
        }
    }
    s1
}

/// Per lane (token): Σ over block `b`'s eight pairs of 16-value activation sums of each sum ·
/// its factor, the two factors of pair j packed as i16 in `pair[r][j]` (a min or a scale).
///
/// # Safety
///
/// The panel holds Q8_K activations (its pairs of sums) and `b < p.nb`; the CPU has AVX-512
/// VNNI (checked by `cpu::isa()` and `cpu::has_vnni()`).
#[inline(always)]
unsafe fn pair_sums<const R: usize>(p: &Panel, b: usize, pair: &[[i32; 8]; R]) -> [__m512i; R] {
    let mut s2 = [_mm512_setzero_si512(); R];
    for j in 0..8 {
        let pv = ld(p.bpairs.as_ptr().add((b * 8 + j) * TILE));
        for r in 0..R {
            s2[r] = _mm512_dpwssd_epi32(s2[r], pv, _mm512_set1_epi32(pair[r][j]));
        }
    }
    s2
}

/// Rows `w` (R of them, `row_bytes` apart) against panels `ps` (1 to `PANELS`, of the same
/// width), each block of the rows unpacked once for all of them; `out[i][r][c]` receives the
/// dot product of row r with token c of panel i (tokens past a panel's `n` are left
/// unspecified).
///
/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")]
pub unsafe fn gemm<const R: usize>(dtype: DType, w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    debug_assert!((1..=PANELS).contains(&ps.len()));
    // The panel count a constant: a loop over a count known only at run time costs a single
    // panel about a tenth (IQ3_S, 16 tokens).
    match ps.len() {
        1 => by_format::<R, 1>(dtype, w, row_bytes, ps, out),
        2 => by_format::<R, 2>(dtype, w, row_bytes, ps, out),
        3 => by_format::<R, 3>(dtype, w, row_bytes, ps, out),
        _ => by_format::<R, 4>(dtype, w, row_bytes, ps, out),
    }
}

/// `gemm` for P panels.
///
/// # Safety
///
/// As `gemm`, and `ps` holds at least P panels.
#[inline(always)]
unsafe fn by_format<const R: usize, const P: usize>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    ps: &[Panel],
    out: &mut Out,
) {
    match dtype {
        DType::Q4_K | DType::Q5_K => gemm_q4k::<R, P>(dtype == DType::Q5_K, w, row_bytes, ps, out),
        DType::Q6_K => gemm_q6k::<R, P>(w, row_bytes, ps, out),
        DType::Q2_K => gemm_q2k::<R, P>(w, row_bytes, ps, out),
        DType::Q3_K => gemm_q3k::<R, P>(w, row_bytes, ps, out),
        DType::IQ2_XXS => gemm_iq2xxs::<R, P>(w, row_bytes, ps, out),
        DType::IQ2_XS => gemm_iq2xs::<R, P>(w, row_bytes, ps, out),
        DType::IQ3_XXS => gemm_iq3::<R, P, true>(w, row_bytes, ps, out),
        DType::IQ1_S => gemm_iq::<R, P, 19>(w, row_bytes, ps, out),
        DType::IQ3_S => gemm_iq3::<R, P, false>(w, row_bytes, ps, out),
        DType::IQ2_S => gemm_iq2s::<R, P>(w, row_bytes, ps, out),
        DType::IQ4_XS => gemm_iq::<R, P, 23>(w, row_bytes, ps, out),
        DType::IQ1_M => gemm_iq::<R, P, 29>(w, row_bytes, ps, out),
        _ => gemm32::<R, P>(dtype, w, row_bytes, ps, out),
    }
}

/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[inline(always)]
unsafe fn gemm32<const R: usize, const P: usize>(
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    ps: &[Panel],
    out: &mut Out,
) {
    let bb = dtype.block_bytes();
    let has_m = matches!(dtype, DType::Q4_1 | DType::Q5_1);
    // Q8_0's and IQ4_NL's signed codes become unsigned by +128, MXFP4's doubled values by +12
    // (its lookup table's offset); the others are already unsigned.
    let bias: i32 = match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q8_0 | DType::IQ4_NL => 128,
        DType::MXFP4 => super::mxfp4_x86::OFFSET,
        _ => 0,
    };
    let mxfp4 = super::mxfp4_x86::table();
    let mut accf: Acc<R> = [[_mm512_setzero_ps(); R]; PANELS];
    let mut codes = [[0u8; 32]; R];
    let mut d = [0f32; R];
    let mut m = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let mut u = _mm256_setzero_si256();
            if dtype == DType::IQ4_NL {
                // The block's 32 levels (signed), as the AVX2 kernels unpack them.
                super::iq_x86::for_groups::<20>(blk, |_, _, levels, _| u = levels);
            } else if dtype == DType::MXFP4 {
                u = super::mxfp4_x86::codes(mxfp4, blk);
            } else {
                u = codes32(dtype, blk);
            }
            if bias == 128 {
                u = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
            }
            _mm256_storeu_si256(codes[r].as_mut_ptr() as *mut __m256i, u);
            let wb = std::slice::from_raw_parts(blk, bb);
            d[r] = if dtype == DType::MXFP4 { e8m0_half(wb[0]) } else { f16_to_f32(f16_bits(wb, 0)) };
            if has_m {
                m[r] = f16_to_f32(f16_bits(wb, 2));
            }
        }
        for (pi, p) in ps[..P].iter().enumerate() {
            let accf = &mut accf[pi];
            let mut acc = [_mm512_setzero_si512(); R];
            let xc = p.codes.as_ptr().add(b * 8 * TILE);
            for g in 0..8 {
                let xv = ld(xc.add(g * TILE));
                for r in 0..R {
                    acc[r] = _mm512_dpbusd_epi32(acc[r], bcast(codes[r].as_ptr().add(4 * g)), xv);
                }
            }
            let dx = ldf(p.dx.as_ptr().add(b * TILE));
            let xs = _mm512_mullo_epi32(ld(p.xsum.as_ptr().add(b * TILE) as *const u32), _mm512_set1_epi32(bias));
            for r in 0..R {
                let isum = if bias != 0 { _mm512_sub_epi32(acc[r], xs) } else { acc[r] };
                let ddx = _mm512_mul_ps(_mm512_set1_ps(d[r]), dx);
                accf[r] = _mm512_fmadd_ps(ddx, _mm512_cvtepi32_ps(isum), accf[r]);
                if has_m {
                    accf[r] = _mm512_fmadd_ps(_mm512_set1_ps(m[r]), ldf(p.sx.as_ptr().add(b * TILE)), accf[r]);
                }
            }
        }
    }
    store(&accf, P, out);
}

/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[inline(always)]
unsafe fn gemm_q4k<const R: usize, const P: usize>(q5: bool, w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let dtype = if q5 { DType::Q5_K } else { DType::Q4_K };
    let bb = dtype.block_bytes();
    let mut accf: Acc<R> = [[_mm512_setzero_ps(); R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut sc = [[0i32; 8]; R];
    let mut mp = [[0i32; 8]; R];
    let mut d = [0f32; R];
    let mut dmin = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = std::slice::from_raw_parts(w.as_ptr().add(r * row_bytes + b * bb), bb);
            for c in 0..4 {
                let (lo, hi) = codes_q4k(q5, blk, c);
                _mm256_storeu_si256(codes[r].as_mut_ptr().add(64 * c) as *mut __m256i, lo);
                _mm256_storeu_si256(codes[r].as_mut_ptr().add(64 * c + 32) as *mut __m256i, hi);
            }
            for j in 0..8 {
                let (s, mn) = crate::quant::blocks::scale_min_k4(j, &blk[4..16]);
                sc[r][j] = s as i32;
                // The min against the pair (Σ of values 32j..32j+16, Σ of 32j+16..32j+32).
                mp[r][j] = (mn as i32) | (mn as i32) << 16;
            }
            d[r] = f16_to_f32(f16_bits(blk, 0));
            dmin[r] = f16_to_f32(f16_bits(blk, 2));
        }
        for (pi, p) in ps[..P].iter().enumerate() {
            let accf = &mut accf[pi];
            let xc = p.codes.as_ptr().add(b * 64 * TILE);
            let s1 = if q5 {
                groups::<R, 8, 8, false>(&codes, &sc, xc)
            } else {
                let mut s1 = [_mm512_setzero_si512(); R];
                // Q4_K: a 16-value sum of 4-bit codes times activations is within ±15·128·16 =
                // ±30720, an i16, so the two halves of each 32-value group are packed into the
                // i16 halves of each lane and one `vpdpwssd` against the scale in both halves
                // adds scale · (both sums): one operation where `vpmulld` and `vpaddd` were three
                // (two of them on the port the dot products use). The same integer.
                for j in 0..8 {
                    let mut lo = [_mm512_setzero_si512(); R];
                    let mut hi = [_mm512_setzero_si512(); R];
                    for g in 0..4 {
                        let xa = ld(xc.add((8 * j + g) * TILE));
                        let xb = ld(xc.add((8 * j + 4 + g) * TILE));
                        for r in 0..R {
                            let c = codes[r].as_ptr().add(32 * j + 4 * g);
                            lo[r] = _mm512_dpbusd_epi32(lo[r], bcast(c), xa);
                            hi[r] = _mm512_dpbusd_epi32(hi[r], bcast(c.add(16)), xb);
                        }
                    }
                    for r in 0..R {
                        let both = _mm512_mask_blend_epi16(0xAAAA_AAAA, lo[r], _mm512_slli_epi32(hi[r], 16));
                        s1[r] = _mm512_dpwssd_epi32(s1[r], both, _mm512_set1_epi32(sc[r][j] * 0x1_0001));
                    }
                }
                s1
            };
            let s2 = pair_sums::<R>(p, b, &mp);
            let dx = ldf(p.dx.as_ptr().add(b * TILE));
            for r in 0..R {
                accf[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), _mm512_cvtepi32_ps(s1[r]), accf[r]);
                accf[r] =
                    _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dmin[r]), dx), _mm512_cvtepi32_ps(s2[r]), accf[r]);
            }
        }
    }
    store(&accf, P, out);
}

/// # Safety
///
/// The CPU supports the features named in `target_feature` (AVX-512; the dispatcher checks
/// `cpu::isa()` first), and the slices hold what the format implies: whole blocks per row
/// (`MatRef::new` checked the sizes), activations and outputs for every token in range.
#[inline(always)]
unsafe fn gemm_q6k<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let bb = DType::Q6_K.block_bytes();
    gemm_signed16::<R, P>(ps, out, false, |r, b| {
        let blk = std::slice::from_raw_parts(w.as_ptr().add(r * row_bytes + b * bb), bb);
        // `codes_q6k` gives q + 32, 32 values a vector.
        let u = codes_q6k(blk);
        let mut q = [_mm512_setzero_si512(); 4];
        for (c, v) in q.iter_mut().enumerate() {
            *v = _mm512_inserti64x4(_mm512_castsi256_si512(u[2 * c]), u[2 * c + 1], 1);
            *v = _mm512_sub_epi8(*v, _mm512_set1_epi8(32));
        }
        (q, _mm_loadu_si128(blk.as_ptr().add(192) as *const __m128i), f16_to_f32(f16_bits(blk, 208)))
    });
}

/// The frame of the formats whose 256-value blocks unpack to signed codes q (one byte each)
/// with a scale per 16 values and one float scale `d` (Q6_K, the IQ formats), against flipped
/// panels (`flips`): `unpack(r, b)` gives row r's block b as its codes in value order (64 a
/// vector), its sixteen scales as bytes (−128..=127) and its `d`. Per lane (token), with
/// x + 128 the flipped activations, the block's integer sum is
/// Σ_g scale_g · (q_g · (x_g + 128)) − 128 · W, W = Σ_g scale_g · Σ q_g the row's own
/// (`signed_offset`), then `acc = fma(d·dx, isum, acc)`, `accumulate`'s step. With `per32`
/// (the formats whose two 16-value halves share a scale) the products are scaled per 32
/// values (`groups` with N = 8): half the multiplies, the same integer.
///
/// Against the codes offset to unsigned (q + bias, the bias taken off per token as
/// bias · Σ_g scale_g · the activations' 16-value sums), kernel lab, Intel Xeon with AVX-512
/// VNNI, 1024×2048, one thread, GMAC per CPU second, medians of five interleaved rounds: 128
/// tokens IQ4_XS 100.1 → 109.8, Q6_K 97.2 → 105.2, IQ2_XS 93.5 → 101.9, IQ3_S 97.5 → 106.4,
/// IQ1_M 88.3 → 100.7, Q3_K (flipped panels only) 114.0 → 121.9; 16 tokens (one panel, where
/// W's cost is not shared) 0.99–1.07×.
///
/// # Safety
///
/// The CPU has AVX-512 VNNI (the caller, compiled for it, was dispatched after `cpu::isa()`
/// and `cpu::has_vnni()`); the panels hold flipped Q8_K activations; `unpack` reads only
/// whole blocks.
#[inline(always)]
unsafe fn gemm_signed16<const R: usize, const P: usize>(
    ps: &[Panel],
    out: &mut Out,
    per32: bool,
    mut unpack: impl FnMut(usize, usize) -> ([__m512i; 4], __m128i, f32),
) {
    let mut accf: Acc<R> = [[_mm512_setzero_ps(); R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut sc = [[0i32; 16]; R];
    let mut wv = [_mm512_setzero_si512(); ROWS];
    let mut d = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let (q, bytes, dr) = unpack(r, b);
            for (c, v) in q.iter().enumerate() {
                _mm512_storeu_si512(codes[r].as_mut_ptr().add(64 * c) as *mut _, *v);
            }
            let sv = _mm512_cvtepi8_epi32(bytes);
            _mm512_storeu_si512(sc[r].as_mut_ptr() as *mut _, sv);
            wv[r] = signed_offset(&q, bytes, sv);
            d[r] = dr;
        }
        let off = times128_spread(&wv);
        for (pi, p) in ps[..P].iter().enumerate() {
            let accf = &mut accf[pi];
            let xc = p.codes.as_ptr().add(b * 64 * TILE);
            let s1 = if per32 {
                groups::<R, 8, 16, true>(&codes, &sc, xc)
            } else {
                groups::<R, 16, 16, true>(&codes, &sc, xc)
            };
            let dx = ldf(p.dx.as_ptr().add(b * TILE));
            for r in 0..R {
                let isum = _mm512_sub_epi32(s1[r], off[r]);
                accf[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), _mm512_cvtepi32_ps(isum), accf[r]);
            }
        }
    }
    store(&accf, P, out);
}

/// W = Σ_g scale_g · Σ (signed codes `q` of 16-value group g) of one block, spread over the
/// i32 lanes (their sum is W), from its scale bytes (`bytes`, and `sv` the same as i32 lanes):
/// one `vpdpbusd` per 64 codes, the codes made unsigned (q + 128, their sign bit flipped)
/// against each value's scale byte, and 128 · 16 · Σ_g scale_g taken off.
///
/// # Safety
///
/// The CPU has AVX-512 VNNI (checked by `cpu::isa()` and `cpu::has_vnni()`); inlined only into
/// functions compiled for it.
#[inline(always)]
unsafe fn signed_offset(q: &[__m512i; 4], bytes: __m128i, sv: __m512i) -> __m512i {
    let bytes = _mm512_broadcast_i32x4(bytes);
    let flip = _mm512_set1_epi8(-128);
    let lane = 0x0101_0101_0101_0101i64;
    let lane_index = _mm512_setr_epi64(0, 0, lane, lane, 2 * lane, 2 * lane, 3 * lane, 3 * lane);
    let mut acc = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sv, 11));
    for (c, v) in q.iter().enumerate() {
        // 128-bit lane k of chunk c holds group 4c + k's values: its scale byte in all 16.
        let pick = _mm512_add_epi8(_mm512_set1_epi8(4 * c as i8), lane_index);
        acc = _mm512_dpbusd_epi32(acc, _mm512_xor_si512(*v, flip), _mm512_shuffle_epi8(bytes, pick));
    }
    acc
}

/// 128 · (the sum of `v[r]`'s lanes), in every lane of result r: four rows' sums found together
/// (pairs of rows interleaved, then the 128-bit lanes folded), cheaper than four reductions.
///
/// # Safety
///
/// The CPU has AVX-512 F (checked by `cpu::isa()`); inlined only into functions compiled for it.
#[inline(always)]
unsafe fn times128_spread(v: &[__m512i; ROWS]) -> [__m512i; ROWS] {
    // Per 128-bit lane: [v0 0+2, v1 0+2, v0 1+3, v1 1+3], the same for v2 and v3.
    let t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
    let t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
    // Per 128-bit lane: each row's sum of that lane, rows 0..4.
    let u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    // Every 128-bit lane: the rows' whole sums.
    let u = _mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, 0b01_00_11_10));
    let u = _mm512_slli_epi32(_mm512_add_epi32(u, _mm512_shuffle_i32x4(u, u, 0b10_11_00_01)), 7);
    [
        _mm512_shuffle_epi32(u, _MM_PERM_AAAA),
        _mm512_shuffle_epi32(u, _MM_PERM_BBBB),
        _mm512_shuffle_epi32(u, _MM_PERM_CCCC),
        _mm512_shuffle_epi32(u, _MM_PERM_DDDD),
    ]
}

/// Sixteen scale bytes, one per 16 values, from eight, one per 32 (bytes 0..8 of `b`).
///
/// # Safety
///
/// Needs only SSE2 (the callers' target features include it).
#[inline(always)]
unsafe fn per16(b: __m128i) -> __m128i {
    _mm_unpacklo_epi8(b, b)
}

/// `iq512_x86::aux_odd_scales` (IQ3_XXS's and IQ2_XXS's scales, one per 32 values) as
/// bytes 0..8.
///
/// # Safety
///
/// The CPU has AVX-512 F/VL (checked by `cpu::isa()`); inlined only into functions compiled for
/// them.
#[inline(always)]
unsafe fn aux_scale_bytes(aux: __m256i) -> __m128i {
    _mm256_cvtepi32_epi8(super::iq512_x86::aux_odd_scales(aux))
}

/// Q2_K with each code multiplied by its group's scale before the dot products: a 2-bit code
/// times a 4-bit scale is at most 45, still an unsigned byte, so one `vpdpbusd` chain per row
/// sums Σ scale · (codes · activations) over the whole block, with no per-group multiply and add
/// (`groups`'s `vpmulld`, two operations on the port the dot products use, and `vpaddd` for
/// every four `vpdpbusd`). The integer is the same, so are the float steps (`dot_ref`'s).
///
/// Unpacked with AVX-512 64 values at a time, one 16-value group per 128-bit lane (value
/// 128h + 32j + l's code is bits 2j..2j + 2 of `qs` byte 32h + l). A group's four multiples
/// [0, s, 2s, 3s] come from one `vpshufb` table per block, built by masked adds of s and 2s:
/// lane i holds groups i, 4 + i, 8 + i and 12 + i, so chunk c's codes pick theirs as
/// code + 4c.
///
/// # Safety
///
/// The CPU supports the features named in `gemm`'s `target_feature` (AVX-512 VNNI; the
/// dispatcher checks `cpu::isa()` and `cpu::has_vnni()` first); `w` holds R whole rows of
/// `row_bytes` of Q2_K; the panel holds Q8_K activations of the rows' width.
#[inline(always)]
unsafe fn gemm_q2k<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let bb = DType::Q2_K.block_bytes();
    let mut accf: Acc<R> = [[_mm512_setzero_ps(); R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut mins = [[0i32; 8]; R];
    let mut d = [0f32; R];
    let mut dmin = [0f32; R];
    // Byte 4m + k of lane i: group 4m + i's scale (then times k: s where k is odd, plus 2s
    // where k ≥ 2).
    let rep = {
        let e: [u8; 64] = std::array::from_fn(|e| (4 * (e % 16 / 4) + e / 16) as u8);
        ld_bytes(&e)
    };
    let (m1, m2) = (0xAAAA_AAAA_AAAA_AAAAu64, 0xCCCC_CCCC_CCCC_CCCCu64);
    // Chunk c's shift of `qs` (2j, j = 2(c % 2) in bytes 0..32, j + 1 in 32..64).
    let shift = [ld_bytes(&qs_shifts(0)), ld_bytes(&qs_shifts(1))];
    let nib = _mm_set1_epi8(0x0F);
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let sm = _mm_loadu_si128(blk as *const __m128i);
            let s1 = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_and_si128(sm, nib)), rep);
            let odd = _mm512_maskz_mov_epi8(m1, s1);
            let tab = _mm512_mask_add_epi8(odd, m2, odd, _mm512_add_epi8(s1, s1));
            for c in 0..4 {
                let low = low2(blk.add(16), c, &shift);
                let v = _mm512_shuffle_epi8(tab, _mm512_or_si512(low, _mm512_set1_epi8(4 * c as i8)));
                _mm512_storeu_si512(codes[r].as_mut_ptr().add(64 * c) as *mut _, v);
            }
            let wb = std::slice::from_raw_parts(blk, bb);
            for j in 0..8 {
                // The mins against the pair (Σ of values 32j..32j+16, Σ of 32j+16..32j+32).
                mins[r][j] = (wb[2 * j] >> 4) as i32 | ((wb[2 * j + 1] >> 4) as i32) << 16;
            }
            d[r] = f16_to_f32(f16_bits(wb, 80));
            dmin[r] = f16_to_f32(f16_bits(wb, 82));
        }
        for (pi, p) in ps[..P].iter().enumerate() {
            let accf = &mut accf[pi];
            let s1 = dot_block::<R, false>(&codes, p.codes.as_ptr().add(b * 64 * TILE));
            let s2 = pair_sums::<R>(p, b, &mins);
            let dx = ldf(p.dx.as_ptr().add(b * TILE));
            for r in 0..R {
                let isum = s1[r];
                accf[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), _mm512_cvtepi32_ps(isum), accf[r]);
                accf[r] =
                    _mm512_fnmadd_ps(_mm512_mul_ps(_mm512_set1_ps(dmin[r]), dx), _mm512_cvtepi32_ps(s2[r]), accf[r]);
            }
        }
    }
    store(&accf, P, out);
}

/// Q3_K with each code multiplied by its group's scale while unpacking, as Q2_K's kernel does,
/// but signed: a code c (−4..3) times a 6-bit scale s (−32..31) lies in −124..128, one value
/// past a signed byte, so the bytes are −c·s (−128..124, always a byte), and the activations,
/// `vpdpbusd`'s unsigned operand, go in as x + 128 (a flipped panel, `flips`; Q8_K's are
/// −128..127). The dot product of a row is then −Σ x·c·s − 128·Σ c·s, and the block's integer
/// Σ x·c·s is 128·W − dot, W = Σ −c·s over the block (the row's own, from `vpsadbw`). No
/// per-group multiply and add (those of `groups`), no activation sums; the same integer as
/// `dot_ref`'s and the same float step.
///
/// Unpacking with AVX-512: 64 values at a time, one 16-value group per 128-bit lane. Each
/// group's eight products −c·s for the eight codes (c + 4 = 0..7) are eight bytes of a `vpshufb`
/// table, built from the sixteen scales by masked adds of s, 2s and 4s and a masked negation;
/// lane i of table t holds group 8t + i in bytes 0..8 and group 8t + 4 + i in bytes 8..16, so
/// the four chunks of a block use two tables, the odd chunks with the index plus 8. Value
/// 128h + 32j + l's code is bits 2j..2j + 2 of `qs` byte 32h + l, plus 4 when bit 4h + j of
/// `hmask` byte l is set.
///
/// # Safety
///
/// The CPU supports the features named in `gemm`'s `target_feature` (AVX-512 VNNI; the
/// dispatcher checks `cpu::isa()` and `cpu::has_vnni()` first); `w` holds R whole rows of
/// `row_bytes` of Q3_K; the panel holds Q8_K activations of the rows' width.
#[inline(always)]
unsafe fn gemm_q3k<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let bb = DType::Q3_K.block_bytes();
    let mut accf: Acc<R> = [[_mm512_setzero_ps(); R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut wsum = [0i32; R];
    let mut d = [0f32; R];
    let flip = _mm512_set1_epi8(-128);
    let zero = _mm512_setzero_si512();
    // Byte e of lane i of table t belongs to group 8t + i (e < 8) or 8t + 4 + i and to code
    // index k = e % 8, whose multiple of s is 4 − k: s where 4 − k is odd, plus 2s where
    // |4 − k| is 2 or 3, plus 4s where it is 4, negated where k > 4.
    let rep_bytes = |t: usize| -> [u8; 64] { std::array::from_fn(|e| (8 * t + e / 16 + 4 * (e % 16 / 8)) as u8) };
    let rep = [ld_bytes(&rep_bytes(0)), ld_bytes(&rep_bytes(1))];
    let (m1, m2, m4, neg) =
        (0xAAAA_AAAA_AAAA_AAAAu64, 0xC6C6_C6C6_C6C6_C6C6u64, 0x0101_0101_0101_0101u64, 0xE0E0_E0E0_E0E0_E0E0u64);
    // Chunk c (values 64c..64c + 64, h = c / 2, j = 2(c % 2) and j + 1): the bit of `hmask` and
    // the shift of `qs` for each half.
    let hbit_bytes = |c: usize| -> [u8; 64] {
        let b0 = 1u8 << (4 * (c / 2) + 2 * (c % 2));
        std::array::from_fn(|i| if i < 32 { b0 } else { b0 << 1 })
    };
    let hbit = [ld_bytes(&hbit_bytes(0)), ld_bytes(&hbit_bytes(1)), ld_bytes(&hbit_bytes(2)), ld_bytes(&hbit_bytes(3))];
    let shift = [ld_bytes(&qs_shifts(0)), ld_bytes(&qs_shifts(1))];
    let base = [_mm512_setzero_si512(), _mm512_set1_epi8(8)];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let sz = _mm512_broadcast_i32x4(super::k23_x86::q3_scales(blk.add(96)));
            // Not `array::from_fn`: its closure would not inherit this function's target features.
            let mut tab = [zero; 2];
            for (t, rep) in tab.iter_mut().zip(rep) {
                let s1 = _mm512_shuffle_epi8(sz, rep);
                let s2 = _mm512_add_epi8(s1, s1);
                let s4 = _mm512_add_epi8(s2, s2);
                let v = _mm512_maskz_mov_epi8(m1, s1);
                let v = _mm512_mask_add_epi8(v, m2, v, s2);
                let v = _mm512_mask_add_epi8(v, m4, v, s4);
                *t = _mm512_mask_sub_epi8(v, neg, zero, v);
            }
            let hm = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk as *const __m256i));
            let mut sum = zero;
            for c in 0..4 {
                let idx = _mm512_or_si512(low2(blk.add(32), c, &shift), base[c % 2]);
                let idx = _mm512_mask_add_epi8(idx, _mm512_test_epi8_mask(hm, hbit[c]), idx, _mm512_set1_epi8(4));
                let v = _mm512_shuffle_epi8(tab[c / 2], idx);
                _mm512_storeu_si512(codes[r].as_mut_ptr().add(64 * c) as *mut _, v);
                sum = _mm512_add_epi64(sum, _mm512_sad_epu8(_mm512_xor_si512(v, flip), zero));
            }
            // Σ (−c·s + 128) over 256 values, less 128 · 256.
            wsum[r] = _mm512_reduce_add_epi64(sum) as i32 - 128 * 256;
            d[r] = f16_to_f32((blk.add(108) as *const u16).read_unaligned());
        }
        for (pi, p) in ps[..P].iter().enumerate() {
            let accf = &mut accf[pi];
            let dot = dot_block::<R, true>(&codes, p.codes.as_ptr().add(b * 64 * TILE));
            let dx = ldf(p.dx.as_ptr().add(b * TILE));
            for r in 0..R {
                let isum = _mm512_sub_epi32(_mm512_set1_epi32(wsum[r] << 7), dot[r]);
                accf[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[r]), dx), _mm512_cvtepi32_ps(isum), accf[r]);
            }
        }
    }
    store(&accf, P, out);
}

/// IQ4_XS, IQ1_S and IQ1_M, unpacked 64 values at a time as the decode kernels unpack them
/// (`iq512_x86`) and made one signed byte per value — IQ4_XS's levels by one shuffle of its
/// codes, IQ1's codes (which come offset by 9) less 9 — with one scale per 16 values, through
/// `gemm_signed16`. The integer sum is `iq::block_isum`'s, the float step `accumulate`'s (`D` = the
/// stored f16 times the format's power of two, exact). Kernel lab, Intel Xeon, one thread,
/// 1024×4096, GMAC per CPU second, against the AVX2 kernels' 32-value groups: 16 tokens IQ4_XS
/// 91.8 → 100.4, IQ1_M 66.7 → 83.6; 512 tokens IQ4_XS 89.5 → 90.0, IQ1_S 82.0 → 87.1, IQ1_M
/// 77.1 → 81.5.
///
/// # Safety
///
/// The CPU supports the features named in `gemm`'s `target_feature` (AVX-512 VNNI; the
/// dispatcher checks `cpu::isa()` and `cpu::has_vnni()` first); `w` holds R whole rows of
/// `row_bytes` of the format; the panel holds Q8_K activations of the rows' width.
#[inline(always)]
unsafe fn gemm_iq<const R: usize, const P: usize, const DT: u32>(
    w: &[u8],
    row_bytes: usize,
    ps: &[Panel],
    out: &mut Out,
) {
    use super::iq_tables::IQ4NL_VALUES;
    use super::iq_x86::{d_bits, dtype_const};
    let dt = const { dtype_const(DT) };
    let bb = dt.block_bytes();
    let factor = super::iq::scale_factor(dt);
    // IQ4_XS's levels, a `vpshufb` table in each 128-bit lane (formed once per call).
    let levels = _mm512_broadcast_i32x4(_mm_loadu_si128(IQ4NL_VALUES.as_ptr() as *const __m128i));
    // IQ1_M has a scale per 16 values, IQ4_XS and IQ1_S one per 32.
    gemm_signed16::<R, P>(ps, out, dt != DType::IQ1_M, |r, b| {
        let blk = w.as_ptr().add(r * row_bytes + b * bb);
        let d = f16_to_f32(d_bits::<DT>(blk)) * factor;
        let mut q = [_mm512_setzero_si512(); 4];
        if dt == DType::IQ4_XS {
            // The levels straight from the codes, one shuffle per 64 values.
            let (n, sc8) = super::iq512_x86::iq4xs_parts(blk);
            for c in 0..4 {
                q[c] = _mm512_shuffle_epi8(levels, n[c]);
            }
            return (q, per16(_mm_packs_epi16(sc8, sc8)), d);
        }
        // IQ1: codes offset by 9.
        let k = super::iq512_x86::unpack::<DT>(blk);
        for c in 0..4 {
            q[c] = _mm512_sub_epi8(k.u[c], _mm512_set1_epi8(9));
        }
        (q, _mm256_cvtepi16_epi8(k.s16), d)
    });
}

/// IQ2_XS unpacked with AVX-512 whole blocks at a time (see `gemm_iq3`): the 32 u16 of `qs`
/// hold a 9-bit codebook index (eight values, bytes 0..8 of the entry) and a 7-bit sign field
/// each; eight entries come by one 64-bit gather, the sign fields, narrowed to bytes and
/// completed with their parity bit (`iq_x86::with_parity`), are the block's 256 sign bits in
/// value order, four 64-bit byte masks of a masked negation (± magnitude, at most 43).
/// Two 4-bit scales per 32 values (values 0..16, 16..32), odd: 2·nibble + 1. Through
/// `gemm_signed16`: the same integers and float step as `gemm_iq`.
///
/// # Safety
///
/// As `gemm_iq3`, for IQ2_XS rows.
#[inline(always)]
unsafe fn gemm_iq2xs<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    use super::iq_tables::IQ2XS_GRID;
    let bb = DType::IQ2_XS.block_bytes();
    let factor = super::iq::scale_factor(DType::IQ2_XS);
    gemm_signed16::<R, P>(ps, out, false, |r, b| {
        let blk = w.as_ptr().add(r * row_bytes + b * bb);
        let v = _mm512_loadu_si512(blk.add(2) as *const _);
        let mut idx = [0u16; 32];
        _mm512_storeu_si512(idx.as_mut_ptr() as *mut _, _mm512_and_si512(v, _mm512_set1_epi16(511)));
        let fields = _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 9));
        let mut signs = [0u64; 4];
        _mm256_storeu_si256(signs.as_mut_ptr() as *mut __m256i, super::iq_x86::with_parity(fields));
        let mut q = [_mm512_setzero_si512(); 4];
        for c in 0..4 {
            let i = _mm256_cvtepu16_epi32(_mm_loadu_si128(idx.as_ptr().add(8 * c) as *const __m128i));
            // Nine-bit indices: inside the 512-entry codebook.
            q[c] = iq2_entries(&IQ2XS_GRID, i, signs[c]);
        }
        let sc = odd_scale_bytes((blk.add(66) as *const u64).read_unaligned());
        (q, sc, f16_to_f32((blk as *const u16).read_unaligned()) * factor)
    });
}

/// Eight codebook entries of eight values each (by one 64-bit gather, indices `i`), signed by
/// the byte mask `signs` (magnitudes at most 43).
///
/// # Safety
///
/// Every index is below N; the CPU has AVX-512 F/BW (checked by `cpu::isa()`); inlined only
/// into functions compiled for them.
#[inline(always)]
unsafe fn iq2_entries<const N: usize>(grid: &[u64; N], i: __m256i, signs: u64) -> __m512i {
    let mag = _mm512_i32gather_epi64::<8>(i, grid.as_ptr() as *const i64);
    _mm512_mask_sub_epi8(mag, signs, _mm512_setzero_si512(), mag)
}

/// IQ2_XXS unpacked with AVX-512 whole blocks at a time (see `gemm_iq2xs`): per 32 values a
/// u32 of four 8-bit codebook indices, then a u32 of four 7-bit sign fields (widened with their
/// parity by `iq_x86::sign_words`, as for IQ3_XXS) and a 4-bit scale (2·s + 1 for all 32).
///
/// # Safety
///
/// As `gemm_iq3`, for IQ2_XXS rows.
#[inline(always)]
unsafe fn gemm_iq2xxs<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    use super::iq_tables::IQ2XXS_GRID;
    let bb = DType::IQ2_XXS.block_bytes();
    let factor = super::iq::scale_factor(DType::IQ2_XXS);
    gemm_signed16::<R, P>(ps, out, true, |r, b| {
        let blk = w.as_ptr().add(r * row_bytes + b * bb);
        let v = _mm512_loadu_si512(blk.add(2) as *const _);
        let aux = _mm512_cvtepi64_epi32(_mm512_srli_epi64(v, 32));
        let mut idx = [0u8; 32];
        _mm256_storeu_si256(idx.as_mut_ptr() as *mut __m256i, _mm512_cvtepi64_epi32(v));
        let mut signs = [0u64; 4];
        _mm256_storeu_si256(signs.as_mut_ptr() as *mut __m256i, super::iq_x86::sign_words(aux));
        let mut q = [_mm512_setzero_si512(); 4];
        for c in 0..4 {
            let i = _mm256_cvtepu8_epi32(_mm_loadl_epi64(idx.as_ptr().add(8 * c) as *const __m128i));
            q[c] = iq2_entries(&IQ2XXS_GRID, i, signs[c]);
        }
        (q, per16(aux_scale_bytes(aux)), f16_to_f32((blk as *const u16).read_unaligned()) * factor)
    });
}

/// IQ2_S unpacked with AVX-512 whole blocks at a time (see `gemm_iq2xs`): ten-bit codebook
/// indices, the low eight bits in `qs` bytes 0..32, the top two of entry e in bits 2e..2e + 2 of
/// the `qh` bytes read as a little-endian u64; the 256 sign bits in value order as stored
/// (`qs` bytes 32..64); two 4-bit scales per 32 values, 2·s + 1.
///
/// # Safety
///
/// As `gemm_iq3`, for IQ2_S rows.
#[inline(always)]
unsafe fn gemm_iq2s<const R: usize, const P: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    use super::iq_tables::IQ2S_GRID;
    let bb = DType::IQ2_S.block_bytes();
    let factor = super::iq::scale_factor(DType::IQ2_S);
    gemm_signed16::<R, P>(ps, out, false, |r, b| {
        let blk = w.as_ptr().add(r * row_bytes + b * bb);
        let mut q = [_mm512_setzero_si512(); 4];
        for c in 0..4 {
            let signs = (blk.add(34 + 8 * c) as *const u64).read_unaligned();
            // Ten-bit indices: inside the 1024-entry codebook.
            let idx = super::iq512_x86::iq2s_indices(blk, c);
            q[c] = iq2_entries(&IQ2S_GRID, idx, signs);
        }
        let sc = odd_scale_bytes((blk.add(74) as *const u64).read_unaligned());
        (q, sc, f16_to_f32((blk as *const u16).read_unaligned()) * factor)
    });
}

/// IQ3_S and IQ3_XXS unpacked with AVX-512 whole blocks at a time, where `gemm_iq` goes
/// through the AVX2 kernels' 32-value groups (a scalar load and an insert per codebook entry,
/// two extracts per scale). Sixteen codebook entries (four values each, bytes 0..4) come at a
/// time by one gather: IQ3_XXS's 64 indices are its `qs` bytes; IQ3_S's have nine bits, the
/// `qs` bytes with bit i of the 8 `qh` bytes (read as one little-endian u64) as bit 8 of index
/// i, set by a masked OR. The block's 256 sign bits in value order (IQ3_S's as stored, IQ3_XXS's
/// widened from their 7-bit fields by `iq_x86::sign_words`) are four 64-bit byte masks for a
/// masked negation: m where the bit is clear, −m where set. Through `gemm_signed16`, scaled
/// per 32 values: the same integers (Σ over 32-value groups of the odd scale 1 + 2·nibble ·
/// codes · activations) and the same float step.
///
/// # Safety
///
/// The CPU supports the features named in `gemm`'s `target_feature` (AVX-512 VNNI; the
/// dispatcher checks `cpu::isa()` and `cpu::has_vnni()` first); `w` holds R whole rows of
/// `row_bytes` of the format (IQ3_XXS if `XXS`, else IQ3_S); the panel holds Q8_K activations
/// of the rows' width.
#[inline(always)]
unsafe fn gemm_iq3<const R: usize, const P: usize, const XXS: bool>(
    w: &[u8],
    row_bytes: usize,
    ps: &[Panel],
    out: &mut Out,
) {
    use super::iq_tables::{IQ3S_GRID, IQ3XXS_GRID};
    let dt = if XXS { DType::IQ3_XXS } else { DType::IQ3_S };
    let bb = dt.block_bytes();
    let factor = super::iq::scale_factor(dt);
    let grid = if XXS { IQ3XXS_GRID.as_ptr() } else { IQ3S_GRID.as_ptr() } as *const i32;
    let bit8 = _mm512_set1_epi32(256);
    gemm_signed16::<R, P>(ps, out, true, |r, b| {
        let blk = w.as_ptr().add(r * row_bytes + b * bb);
        // IQ3_XXS: after `qs`, eight u32 of four 7-bit sign fields and a 4-bit scale.
        let aux = _mm256_loadu_si256(blk.add(66) as *const __m256i);
        let mut xxs_signs = [0u64; 4];
        if XXS {
            _mm256_storeu_si256(xxs_signs.as_mut_ptr() as *mut __m256i, super::iq_x86::sign_words(aux));
        }
        let qh = (blk.add(66) as *const u64).read_unaligned();
        let mut q = [_mm512_setzero_si512(); 4];
        for c in 0..4 {
            let mut idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(blk.add(2 + 16 * c) as *const __m128i));
            if !XXS {
                idx = _mm512_mask_or_epi32(idx, (qh >> (16 * c)) as u16, idx, bit8);
            }
            // Every index has as many bits as the codebook has entries (8 or 9).
            let mag = _mm512_i32gather_epi32::<4>(idx, grid);
            // Magnitudes are at most 62.
            let signs = if XXS { xxs_signs[c] } else { (blk.add(74 + 8 * c) as *const u64).read_unaligned() };
            q[c] = _mm512_mask_sub_epi8(mag, signs, _mm512_setzero_si512(), mag);
        }
        // One scale per 32 values, given for both of its 16-value halves.
        let per32 = if XXS {
            aux_scale_bytes(aux)
        } else {
            odd_scale_bytes((blk.add(106) as *const u32).read_unaligned() as u64)
        };
        (q, per16(per32), f16_to_f32((blk as *const u16).read_unaligned()) * factor)
    });
}

/// Pairs of a K-quant block's unpacked 32-value code vectors and their scale vectors
/// (`x86::unpack_q4k` / `unpack_q6k`) joined into 512-bit vectors: pair c holds vectors 2c
/// and 2c+1, i.e. elements 64c..64c+64 in order.
///
/// # Safety
///
/// The CPU has AVX-512 F (checked by `cpu::isa()`); inlined only into functions compiled for it.
#[inline(always)]
pub(crate) unsafe fn widen_unpacked(u: &[__m256i; 8], sv: &[__m256i; 8]) -> ([__m512i; 4], [__m512i; 4]) {
    let join = |a: __m256i, b: __m256i| _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
    let mut wu = [_mm512_setzero_si512(); 4];
    let mut ws = [_mm512_setzero_si512(); 4];
    for c in 0..4 {
        wu[c] = join(u[2 * c], u[2 * c + 1]);
        ws[c] = join(sv[2 * c], sv[2 * c + 1]);
    }
    (wu, ws)
}

/// `x86::dot_unpacked` on 512-bit vectors: the same integer sums (in 8 lanes, each lane the
/// sum of the two lanes the 256-bit kernel would have had in two vectors — integers, so
/// exactly the same totals once eight blocks are reduced).
///
/// # Safety
///
/// `xq` points to the block's 256 activation codes; the CPU has AVX-512 F and BW (checked by
/// `cpu::isa()`); inlined only into functions compiled for them.
#[inline(always)]
pub(crate) unsafe fn dot_unpacked(
    offset_shift: Option<i32>,
    u: &[__m512i; 4],
    sv: &[__m512i; 4],
    sums16: __m256i,
    xq: *const i8,
    bs: __m256i,
) -> (__m256i, __m256i) {
    let mut v = _mm512_setzero_si512();
    for c in 0..4 {
        let x = _mm512_loadu_si512(xq.add(64 * c) as *const _);
        v = _mm512_add_epi32(v, _mm512_madd_epi16(_mm512_maddubs_epi16(u[c], x), sv[c]));
    }
    let v = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    super::x86::offset_or_mins(offset_shift, v, _mm256_madd_epi16(sums16, bs))
}

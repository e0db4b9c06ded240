//! The AVX2 prefill kernel: tokens in lanes, without VNNI.
//!
//! The layout is the AVX-512 VNNI kernel's (`x86_512`): a `Panel` holds up to 16 tokens'
//! activation codes, four values of each token side by side, and each 4-byte group of an
//! unpacked weight row is broadcast against it. Here a panel is two 256-bit halves of 8 tokens,
//! and the 4-value dot product of every token is `vpmaddubsw` (unsigned weight codes times
//! signed activation codes, two i16 sums per token) followed, every few groups, by `vpmaddwd`
//! with the scale of the values summed (their scale, or 1): the i32 lane of a token then holds
//! its scaled sum. No horizontal reduction: a block's integer sums come out one lane per token.
//!
//! `vpmaddubsw` saturates a pair's sum to i16, and the i16 sums added before `vpmaddwd` wrap,
//! so every format bounds how many groups are summed in i16. Activation codes are at most 127
//! in magnitude (Q8_0, Q8_1 and Q8_K all stay within ±127), so one pair is at most 2·127·c for
//! weight codes up to c, and `G` pairs are summed only where G·2·127·c ≤ 32767:
//!
//! | format | codes | pair at most | pairs summed in i16 |
//! |---|---|---|---|
//! | Q4_0, Q4_1, Q4_K | 0..15 | 3810 | 8 (30480) |
//! | Q5_0, Q5_1, Q5_K | 0..31 | 7874 | 4 (31496) |
//! | MXFP4 (+12) | 0..24 | 6096 | 4 (24384) |
//! | Q2_K | 0..3 | 762 | 4, a 16-value group (3048) |
//! | Q3_K (+4) | 0..7 | 1778 | 4, a 16-value group (7112) |
//! | Q6_K (+32) | 0..63 | 16002 | 2 (32004) |
//!
//! Offsets (Q4_0's 8, Q5_0's 16, MXFP4's 12, Q3_K's 4, Q6_K's 32) come off afterwards through
//! the activations' sums, as in `x86_512`. The integer sums are `dot_ref::block_ints`' exactly,
//! and each lane applies `dot_ref::accumulate`'s float operations for its (row, token) pair,
//! block after block, so results equal the scalar reference to the bit, whatever the panel.
//!
//! The IQ formats unpack as the AVX2 IQ kernels unpack them (`iq_x86::for_groups`): byte
//! magnitudes, whose signs go onto the activations with `vpsignb` (the broadcast sign bytes of
//! the same four values), and a scale per 16 values; IQ1's codes come offset by 9 instead, and
//! 9 · Σ scale · (16-value activation sum) comes off after. Their magnitudes bound the sums too
//! (`iq_pairs`): IQ4's levels reach 127 (one pair per `vpmaddwd`), IQ3_XXS's 62 and the IQ2
//! grids' 43 (two), IQ3_S's 15 and IQ1's offset codes 18 (four).
//!
//! Q8_0 pairs with 16-bit activations (`act`'s Q16): its panel holds two i16 values of each
//! token per dword, each block's codes are widened to i16 once, and `vpmaddwd` of a broadcast
//! pair of weights against the panel leaves exact i32 sums (a block's 16 pairs reach at most
//! 16 · 2 · 128 · 32767 < 2³¹, codes reaching −128). The VNNI kernel does not take Q8_0, so
//! this one serves it on AVX-512 machines too.
//!
//! Formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, the K-quants and the IQ formats.

// Index loops over lanes, rows and blocks read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use super::blocks::e8m0_half;
use super::iq_x86::{by_dtype, d_bits, dtype_const, for_groups, signed};
use super::panel::{Panel, ROWS, TILE};
use super::x86::{codes32, codes_q4k, codes_q6k, f16_bits, f16_to_f32};
use crate::DType;
use std::arch::x86_64::*;

/// Tokens per half panel (the i32 lanes of a 256-bit vector).
const HALF: usize = 8;

/// Whether this kernel takes `dtype`.
pub fn supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::MXFP4
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
    ) || super::iq::is_iq(dtype)
}

/// How many 4-value groups of an IQ format's products `vpmaddubsw` may leave to be summed in
/// i16 before `vpmaddwd` (a pair of products is at most 2 · 127 · the largest magnitude; the
/// test `iq_pair_bounds_hold` checks these against the grids).
const fn iq_pairs(dt: DType) -> usize {
    match dt {
        DType::IQ4_NL | DType::IQ4_XS => 1,
        DType::IQ3_XXS | DType::IQ2_XXS | DType::IQ2_XS | DType::IQ2_S => 2,
        _ => 4,
    }
}

/// # Safety
///
/// `p` is valid for reading 8 dwords; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn ld(p: *const u32) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// # Safety
///
/// `p` is valid for reading 8 floats; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn ldf(p: *const f32) -> __m256 {
    _mm256_loadu_ps(p)
}

/// # Safety
///
/// `p` is valid for reading 4 bytes; the CPU has AVX2 (checked by `cpu::isa()`).
#[inline(always)]
unsafe fn bcast(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// Per lane (token of each of the first H half panels): Σ over `N` consecutive 4-value groups
/// of weight codes (from `cp[r]`) times activation codes (panel dwords from `xc`, `TILE`
/// apart), as two i16 sums per token (the lanes `vpmaddubsw` leaves), for R rows; each
/// broadcast weight group meets both halves. The caller keeps `N` within the bound of the
/// module's table.
///
/// # Safety
///
/// `cp[r]` is valid for 4·N bytes, `xc` for N panel rows; the CPU has AVX2.
#[inline(always)]
unsafe fn pairs<const R: usize, const H: usize, const N: usize>(
    cp: &[*const u8; R],
    xc: *const u32,
) -> [[__m256i; H]; R] {
    let mut s = [[_mm256_setzero_si256(); H]; R];
    for g in 0..N {
        let xv: [__m256i; H] = std::array::from_fn(|h| ld(xc.add(g * TILE + HALF * h)));
        for r in 0..R {
            let wv = bcast(cp[r].add(4 * g));
            for h in 0..H {
                s[r][h] = _mm256_add_epi16(s[r][h], _mm256_maddubs_epi16(wv, xv[h]));
            }
        }
    }
    s
}

/// `acc[r][h] += scale[r] · (the two i16 sums of each token in part[r][h])`, in i32 lanes.
///
/// # Safety
///
/// Needs only AVX2, which the caller checked.
#[inline(always)]
unsafe fn add_scaled<const R: usize, const H: usize>(
    acc: &mut [[__m256i; H]; R],
    part: [[__m256i; H]; R],
    scale: [i32; R],
) {
    for r in 0..R {
        let sv = _mm256_set1_epi16(scale[r] as i16);
        for h in 0..H {
            acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(part[r][h], sv));
        }
    }
}

/// Per lane (token of half panels h0..h0 + H): Σ over block `b`'s eight pairs of 16-value
/// activation sums of each sum times its factor, the two factors of pair j packed as i16 in
/// `pair[r][j]` (a min or a scale).
///
/// # Safety
///
/// The panel holds Q8_K activations (its pairs of sums), `b < p.nb`, `h0 + H ≤ 2`; the CPU
/// has AVX2.
#[inline(always)]
unsafe fn pair_sums<const R: usize, const H: usize>(
    p: &Panel,
    b: usize,
    h0: usize,
    pair: &[[i32; 8]; R],
) -> [[__m256i; H]; R] {
    let mut s2 = [[_mm256_setzero_si256(); H]; R];
    for j in 0..8 {
        let pv: [__m256i; H] = std::array::from_fn(|h| ld(p.bpairs.as_ptr().add((b * 8 + j) * TILE + HALF * (h0 + h))));
        for r in 0..R {
            let f = _mm256_set1_epi32(pair[r][j]);
            for h in 0..H {
                s2[r][h] = _mm256_add_epi32(s2[r][h], _mm256_madd_epi16(pv[h], f));
            }
        }
    }
    s2
}

/// Most panels one call takes: each block of the R rows is unpacked once for all of them (the
/// IQ formats' codebook lookups cost as much as a panel's products).
pub const PANELS: usize = 4;

/// One call's results: `[panel][row][token]`.
pub type Out = [[[f32; TILE]; ROWS]; PANELS];

/// Rows `w` (R of them, `row_bytes` apart) against panels `ps` (1 to `PANELS`, of the same
/// width); `out[i][r][c]` receives the dot product of row r with token c of panel i (tokens past
/// a panel's `n` are left unspecified).
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (the dispatcher checks `cpu::isa()`); `supports(dtype)`;
/// `w` holds R whole rows of the format; the panels hold the activations the format pairs with,
/// of the rows' width.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn gemm<const R: usize>(dtype: DType, w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    debug_assert!((1..=PANELS).contains(&ps.len()));
    macro_rules! iq {
        ($id:literal) => {
            gemm_iq::<R, $id>(w, row_bytes, ps, out)
        };
    }
    match dtype {
        d if super::iq::is_iq(d) => by_dtype!(d, iq),
        DType::Q6_K => gemm_q6k::<R>(w, row_bytes, ps, out),
        DType::Q2_K => gemm_k23::<R, false>(w, row_bytes, ps, out),
        DType::Q3_K => gemm_k23::<R, true>(w, row_bytes, ps, out),
        DType::Q4_K => gemm_q4k::<R, false>(w, row_bytes, ps, out),
        DType::Q5_K => gemm_q4k::<R, true>(w, row_bytes, ps, out),
        DType::Q8_0 => gemm_q8::<R>(w, row_bytes, ps, out),
        DType::Q4_0 => gemm32::<R, { DType::Q4_0.ggml_id() }>(w, row_bytes, ps, out),
        DType::Q4_1 => gemm32::<R, { DType::Q4_1.ggml_id() }>(w, row_bytes, ps, out),
        DType::Q5_0 => gemm32::<R, { DType::Q5_0.ggml_id() }>(w, row_bytes, ps, out),
        DType::Q5_1 => gemm32::<R, { DType::Q5_1.ggml_id() }>(w, row_bytes, ps, out),
        _ => gemm32::<R, { DType::MXFP4.ggml_id() }>(w, row_bytes, ps, out),
    }
}

/// The half panels holding the panel's tokens, for the kernels that walk them one after the
/// other (the IQ formats, Q6_K, Q2_K, Q3_K): a bound the compiler cannot unroll, since two
/// copies of a long per-half body spill more (Q2_K's 128-token rate fell by a sixth with the
/// loop's bound known to be at most 2). The others take both halves at once when the panel has
/// tokens in the second (each broadcast weight group then serves 16 tokens).
#[inline(always)]
fn halves(p: &Panel) -> usize {
    p.n.div_ceil(HALF)
}

/// Runs `$step` for each panel `$p` with its accumulators `$acc` and `$h` the half panels it
/// takes at once: both (2) when the panel has tokens in the second half, else the first (1) —
/// for the kernels whose per-half body is short enough to run on both halves together.
macro_rules! by_halves {
    ($ps:expr, $accf:expr, |$p:ident, $acc:ident, $h:ident| $step:expr) => {
        for (pi, $p) in $ps.iter().enumerate() {
            let $acc = &mut $accf[pi];
            if $p.n > HALF {
                const $h: usize = 2;
                $step
            } else {
                const $h: usize = 1;
                $step
            }
        }
    };
}

/// Float accumulators of R rows × both halves of each panel.
type Acc<const R: usize> = [[[__m256; 2]; R]; PANELS];

/// Stores the accumulators of the `n` panels into `out`.
///
/// # Safety
///
/// Needs only AVX2, which the caller checked.
#[inline(always)]
unsafe fn store<const R: usize>(accf: &Acc<R>, n: usize, out: &mut Out) {
    for (pi, o) in out.iter_mut().enumerate().take(n) {
        for r in 0..R {
            for h in 0..2 {
                _mm256_storeu_ps(o[r].as_mut_ptr().add(HALF * h), accf[pi][r][h]);
            }
        }
    }
}

/// The 32-value block formats Q4_0, Q4_1, Q5_0, Q5_1 and MXFP4 (Q8_0 and Q8_1 activations).
///
/// # Safety
///
/// As `gemm`.
#[inline(always)]
unsafe fn gemm32<const R: usize, const DT: u32>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    // One copy per format: the format's branches fold away.
    let dtype = match DT {
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        _ => DType::MXFP4,
    };
    let bb = dtype.block_bytes();
    let mxfp4 = super::mxfp4_x86::table();
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut codes = [[0u8; 32]; R];
    let mut d = [0f32; R];
    let mut m = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let u = if dtype == DType::MXFP4 { super::mxfp4_x86::codes(mxfp4, blk) } else { codes32(dtype, blk) };
            _mm256_storeu_si256(codes[r].as_mut_ptr() as *mut __m256i, u);
            let wb = std::slice::from_raw_parts(blk, bb);
            d[r] = if dtype == DType::MXFP4 { e8m0_half(wb[0]) } else { f16_to_f32(f16_bits(wb, 0)) };
            if matches!(dtype, DType::Q4_1 | DType::Q5_1) {
                m[r] = f16_to_f32(f16_bits(wb, 2));
            }
        }
        by_halves!(ps, accf, |p, acc, H| step32::<R, H>(dtype, &codes, &d, &m, p, b, acc));
    }
    store(&accf, ps.len(), out);
}

/// Q8_0 against Q16 activations: each block's codes widened to i16 once for all the panels.
///
/// # Safety
///
/// As `gemm`, the panels built from Q16 activations.
#[inline(always)]
unsafe fn gemm_q8<const R: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let bb = DType::Q8_0.block_bytes();
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut wide = [[0i16; 32]; R];
    let mut d = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let q = _mm256_loadu_si256(blk.add(2) as *const __m256i);
            let at = wide[r].as_mut_ptr() as *mut __m256i;
            _mm256_storeu_si256(at, _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q)));
            _mm256_storeu_si256(at.add(1), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1)));
            d[r] = f16_to_f32(f16_bits(std::slice::from_raw_parts(blk, bb), 0));
        }
        by_halves!(ps, accf, |p, acc, H| step_q8::<R, H>(&wide, &d, p, b, acc));
    }
    store(&accf, ps.len(), out);
}

/// Block `b` of R widened Q8_0 rows (`wide`, scales `d`) against the first H halves of a Q16
/// panel, into the panel's accumulators: `dot_ref::accumulate`'s `fma(d·dx, isum, acc)`.
///
/// # Safety
///
/// As `gemm`, with `b < p.nb`.
#[inline(always)]
unsafe fn step_q8<const R: usize, const H: usize>(
    wide: &[[i16; 32]; R],
    d: &[f32; R],
    p: &Panel,
    b: usize,
    accf: &mut [[__m256; 2]; R],
) {
    let xc = p.codes.as_ptr().add(b * 16 * TILE);
    let mut isum = [[_mm256_setzero_si256(); H]; R];
    for g in 0..16 {
        let xv: [__m256i; H] = std::array::from_fn(|h| ld(xc.add(g * TILE + HALF * h)));
        for r in 0..R {
            let wv = bcast(wide[r].as_ptr().add(2 * g) as *const u8);
            for h in 0..H {
                isum[r][h] = _mm256_add_epi32(isum[r][h], _mm256_madd_epi16(wv, xv[h]));
            }
        }
    }
    for h in 0..H {
        let dx = ldf(p.dx.as_ptr().add(b * TILE + HALF * h));
        for r in 0..R {
            let ddx = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
            accf[r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(isum[r][h]), accf[r][h]);
        }
    }
}

/// Block `b` of R unpacked rows of a 32-value block format (`codes`, `d` and Q4_1's or Q5_1's
/// `m`) against the first H halves of a panel, into the panel's accumulators.
///
/// # Safety
///
/// As `gemm`, with `b < p.nb`.
#[inline(always)]
unsafe fn step32<const R: usize, const H: usize>(
    dtype: DType,
    codes: &[[u8; 32]; R],
    d: &[f32; R],
    m: &[f32; R],
    p: &Panel,
    b: usize,
    accf: &mut [[__m256; 2]; R],
) {
    let has_m = matches!(dtype, DType::Q4_1 | DType::Q5_1);
    // Q4's codes are four bits: eight groups summed in i16; five bits and MXFP4's: four.
    let four_bits = matches!(dtype, DType::Q4_0 | DType::Q4_1);
    let bias: i32 = match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::MXFP4 => super::mxfp4_x86::OFFSET,
        _ => 0,
    };
    let ones = [1i32; R];
    let cp: [*const u8; R] = std::array::from_fn(|r| codes[r].as_ptr());
    let cp16: [*const u8; R] = std::array::from_fn(|r| codes[r].as_ptr().add(16));
    let xc = p.codes.as_ptr().add(b * 8 * TILE);
    let mut isum = [[_mm256_setzero_si256(); H]; R];
    if four_bits {
        add_scaled(&mut isum, pairs::<R, H, 8>(&cp, xc), ones);
    } else {
        add_scaled(&mut isum, pairs::<R, H, 4>(&cp, xc), ones);
        add_scaled(&mut isum, pairs::<R, H, 4>(&cp16, xc.add(4 * TILE)), ones);
    }
    for h in 0..H {
        let at = b * TILE + HALF * h;
        let dx = ldf(p.dx.as_ptr().add(at));
        let xs = _mm256_mullo_epi32(ld(p.xsum.as_ptr().add(at) as *const u32), _mm256_set1_epi32(bias));
        for r in 0..R {
            let is = if bias != 0 { _mm256_sub_epi32(isum[r][h], xs) } else { isum[r][h] };
            let ddx = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
            accf[r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(is), accf[r][h]);
            if has_m {
                accf[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(m[r]), ldf(p.sx.as_ptr().add(at)), accf[r][h]);
            }
        }
    }
}

/// Q4_K and Q5_K (`Q5`): eight 32-value sub-blocks with a scale and a min each.
///
/// # Safety
///
/// As `gemm`.
#[inline(always)]
unsafe fn gemm_q4k<const R: usize, const Q5: bool>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let dtype = if Q5 { DType::Q5_K } else { DType::Q4_K };
    let bb = dtype.block_bytes();
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut u =
        K4Rows::<R> { codes: [[0u8; 256]; R], sc: [[0i32; 8]; R], mp: [[0i32; 8]; R], d: [0f32; R], dmin: [0f32; R] };
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = std::slice::from_raw_parts(w.as_ptr().add(r * row_bytes + b * bb), bb);
            for c in 0..4 {
                let (lo, hi) = codes_q4k(Q5, blk, c);
                _mm256_storeu_si256(u.codes[r].as_mut_ptr().add(64 * c) as *mut __m256i, lo);
                _mm256_storeu_si256(u.codes[r].as_mut_ptr().add(64 * c + 32) as *mut __m256i, hi);
            }
            // Scales s0..s7 then mins m0..m7, as bytes; each min against the pair (Σ of values
            // 32j..32j+16, Σ of 32j+16..32j+32), so twice in one i32.
            let sm = _mm256_castsi256_si128(super::x86::k4_scale_bytes(blk.as_ptr()));
            _mm256_storeu_si256(u.sc[r].as_mut_ptr() as *mut __m256i, _mm256_cvtepu8_epi32(sm));
            let mins = _mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8));
            _mm256_storeu_si256(
                u.mp[r].as_mut_ptr() as *mut __m256i,
                _mm256_or_si256(mins, _mm256_slli_epi32(mins, 16)),
            );
            u.d[r] = f16_to_f32(f16_bits(blk, 0));
            u.dmin[r] = f16_to_f32(f16_bits(blk, 2));
        }
        by_halves!(ps, accf, |p, acc, H| step_q4k::<R, H, Q5>(&u, p, b, acc));
    }
    store(&accf, ps.len(), out);
}

/// One block of R Q4_K/Q5_K rows, unpacked: codes (0..31), sub-block scales, each min as a
/// pair of i16, and the float scales.
struct K4Rows<const R: usize> {
    codes: [[u8; 256]; R],
    sc: [[i32; 8]; R],
    mp: [[i32; 8]; R],
    d: [f32; R],
    dmin: [f32; R],
}

/// Block `b` of R unpacked Q4_K/Q5_K rows against the first H halves of a panel, into the
/// panel's accumulators.
///
/// # Safety
///
/// As `gemm`, with `b < p.nb`.
#[inline(always)]
unsafe fn step_q4k<const R: usize, const H: usize, const Q5: bool>(
    u: &K4Rows<R>,
    p: &Panel,
    b: usize,
    accf: &mut [[__m256; 2]; R],
) {
    let xc = p.codes.as_ptr().add(b * 64 * TILE);
    let mut s1 = [[_mm256_setzero_si256(); H]; R];
    for j in 0..8 {
        let scale: [i32; R] = std::array::from_fn(|r| u.sc[r][j]);
        let cp: [*const u8; R] = std::array::from_fn(|r| u.codes[r].as_ptr().add(32 * j));
        let xj = xc.add(8 * j * TILE);
        if Q5 {
            let cp16: [*const u8; R] = std::array::from_fn(|r| cp[r].add(16));
            add_scaled(&mut s1, pairs::<R, H, 4>(&cp, xj), scale);
            add_scaled(&mut s1, pairs::<R, H, 4>(&cp16, xj.add(4 * TILE)), scale);
        } else {
            add_scaled(&mut s1, pairs::<R, H, 8>(&cp, xj), scale);
        }
    }
    let s2 = pair_sums::<R, H>(p, b, 0, &u.mp);
    for h in 0..H {
        let dx = ldf(p.dx.as_ptr().add(b * TILE + HALF * h));
        for r in 0..R {
            let ddx = _mm256_mul_ps(_mm256_set1_ps(u.d[r]), dx);
            accf[r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(s1[r][h]), accf[r][h]);
            let mdx = _mm256_mul_ps(_mm256_set1_ps(u.dmin[r]), dx);
            accf[r][h] = _mm256_fnmadd_ps(mdx, _mm256_cvtepi32_ps(s2[r][h]), accf[r][h]);
        }
    }
}

/// Q6_K: codes q + 32 (0..63) with a signed scale per 16 values; the 32 comes off as
/// 32 · Σ scale · (16-value activation sum).
///
/// # Safety
///
/// As `gemm`.
#[inline(always)]
unsafe fn gemm_q6k<const R: usize>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let bb = DType::Q6_K.block_bytes();
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut sc = [[0i32; 16]; R];
    let mut sp = [[0i32; 8]; R];
    let mut d = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = std::slice::from_raw_parts(w.as_ptr().add(r * row_bytes + b * bb), bb);
            for (j, v) in codes_q6k(blk).iter().enumerate() {
                _mm256_storeu_si256(codes[r].as_mut_ptr().add(32 * j) as *mut __m256i, *v);
            }
            // The sixteen signed scales, widened to i32 for the scaled steps and to i16 pairs
            // (two to an i32, scale 2j low) against the panel's sums.
            let s8 = _mm_loadu_si128(blk.as_ptr().add(192) as *const __m128i);
            _mm256_storeu_si256(sc[r].as_mut_ptr() as *mut __m256i, _mm256_cvtepi8_epi32(s8));
            _mm256_storeu_si256(sc[r].as_mut_ptr().add(8) as *mut __m256i, _mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)));
            _mm256_storeu_si256(sp[r].as_mut_ptr() as *mut __m256i, _mm256_cvtepi8_epi16(s8));
            d[r] = f16_to_f32(f16_bits(blk, 208));
        }
        // The halves one after the other: both at once (as the other formats) keep more i32
        // sums live than there are registers here (twice as many steps as Q4_K's), and
        // spilling them halved the rate.
        for (pi, p) in ps.iter().enumerate() {
            for h in 0..halves(p) {
                let xc = p.codes.as_ptr().add(b * 64 * TILE + HALF * h);
                let mut s1 = [[_mm256_setzero_si256(); 1]; R];
                // Two groups of four values at a time (the i16 bound for codes up to 63).
                for k in 0..32 {
                    let scale: [i32; R] = std::array::from_fn(|r| sc[r][k / 2]);
                    let cp: [*const u8; R] = std::array::from_fn(|r| codes[r].as_ptr().add(8 * k));
                    add_scaled(&mut s1, pairs::<R, 1, 2>(&cp, xc.add(2 * k * TILE)), scale);
                }
                let corr = pair_sums::<R, 1>(p, b, h, &sp);
                let dx = ldf(p.dx.as_ptr().add(b * TILE + HALF * h));
                for r in 0..R {
                    let isum = _mm256_sub_epi32(s1[r][0], _mm256_slli_epi32(corr[r][0], 5));
                    let ddx = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
                    accf[pi][r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(isum), accf[pi][r][h]);
                }
            }
        }
    }
    store(&accf, ps.len(), out);
}

/// Q2_K and Q3_K (`Q3`): sixteen 16-value groups with a scale each. Q2_K's codes are 0..3 with
/// a 4-bit scale and a 4-bit min per group (the min against the group's activation sum, as
/// Q4_K's); Q3_K's are −4..3 unpacked as 0..7, with a signed 6-bit scale per group and
/// 4 · Σ scale · (group sum) taken off after.
///
/// # Safety
///
/// As `gemm`.
#[inline(always)]
unsafe fn gemm_k23<const R: usize, const Q3: bool>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let dtype = if Q3 { DType::Q3_K } else { DType::Q2_K };
    let bb = dtype.block_bytes();
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut codes = [[0u8; 256]; R];
    let mut sc = [[0i32; 16]; R];
    // Pairs of i16 against the panel's pairs of 16-value sums: Q2_K's mins, Q3_K's scales.
    let mut pair = [[0i32; 8]; R];
    let mut d = [0f32; R];
    let mut dmin = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let up = super::k23_x86::unpack::<Q3>(blk);
            for (k, v) in up.u.iter().enumerate() {
                _mm256_storeu_si256(codes[r].as_mut_ptr().add(32 * k) as *mut __m256i, *v);
            }
            let wb = std::slice::from_raw_parts(blk, bb);
            // The sixteen scales (and Q2_K's mins) as bytes: widened to i32 for the scaled
            // steps and to i16 pairs (two to an i32, group 2j low) against the panel's sums.
            let (scales, second) = if Q3 {
                let s = super::k23_x86::q3_scales(blk.add(96));
                (_mm256_cvtepi8_epi32(s), _mm256_cvtepi8_epi16(s))
            } else {
                let raw = _mm_loadu_si128(blk as *const __m128i);
                let nib = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(raw, nib);
                let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), nib);
                (_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi16(hi))
            };
            let hi_scales = if Q3 {
                _mm256_cvtepi8_epi32(_mm_srli_si128(super::k23_x86::q3_scales(blk.add(96)), 8))
            } else {
                _mm256_cvtepu8_epi32(_mm_srli_si128(
                    _mm_and_si128(_mm_loadu_si128(blk as *const __m128i), _mm_set1_epi8(0x0F)),
                    8,
                ))
            };
            _mm256_storeu_si256(sc[r].as_mut_ptr() as *mut __m256i, scales);
            _mm256_storeu_si256(sc[r].as_mut_ptr().add(8) as *mut __m256i, hi_scales);
            _mm256_storeu_si256(pair[r].as_mut_ptr() as *mut __m256i, second);
            d[r] = f16_to_f32(f16_bits(wb, if Q3 { 108 } else { 80 }));
            if !Q3 {
                dmin[r] = f16_to_f32(f16_bits(wb, 82));
            }
        }
        // The halves one after the other, as Q6_K's (sixteen scaled steps a block).
        for (pi, p) in ps.iter().enumerate() {
            for h in 0..halves(p) {
                let xc = p.codes.as_ptr().add(b * 64 * TILE + HALF * h);
                let mut s1 = [[_mm256_setzero_si256(); 1]; R];
                for g in 0..16 {
                    let scale: [i32; R] = std::array::from_fn(|r| sc[r][g]);
                    let cp: [*const u8; R] = std::array::from_fn(|r| codes[r].as_ptr().add(16 * g));
                    add_scaled(&mut s1, pairs::<R, 1, 4>(&cp, xc.add(4 * g * TILE)), scale);
                }
                let s2 = pair_sums::<R, 1>(p, b, h, &pair);
                let dx = ldf(p.dx.as_ptr().add(b * TILE + HALF * h));
                for r in 0..R {
                    let ddx = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
                    if Q3 {
                        let isum = _mm256_sub_epi32(s1[r][0], _mm256_slli_epi32(s2[r][0], 2));
                        accf[pi][r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(isum), accf[pi][r][h]);
                    } else {
                        accf[pi][r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(s1[r][0]), accf[pi][r][h]);
                        let mdx = _mm256_mul_ps(_mm256_set1_ps(dmin[r]), dx);
                        accf[pi][r][h] = _mm256_fnmadd_ps(mdx, _mm256_cvtepi32_ps(s2[r][0]), accf[pi][r][h]);
                    }
                }
            }
        }
    }
    store(&accf, ps.len(), out);
}

/// The IQ formats (IQ4_NL's 32-value blocks against Q8_0 activations, the others' 256-value
/// blocks against Q8_K): per 16-value group, magnitudes times the activations with the group's
/// signs, summed as `iq_pairs` allows, times the group's scale; IQ1's offset of 9 taken off
/// with the activations' 16-value sums. The integer sum is `iq::block_isum`'s, the float step
/// `accumulate`'s (`D` = the stored f16 times the format's power of two, exact).
///
/// # Safety
///
/// As `gemm`.
#[inline(always)]
unsafe fn gemm_iq<const R: usize, const DT: u32>(w: &[u8], row_bytes: usize, ps: &[Panel], out: &mut Out) {
    let dt = const { dtype_const(DT) };
    let n_pairs = const { iq_pairs(dtype_const(DT)) };
    let sgnd = const { signed(dtype_const(DT)) };
    let bb = dt.block_bytes();
    // 16-value groups per block: 2 (IQ4_NL) or 16.
    let ng = dt.block_elems() / 16;
    let factor = super::iq::scale_factor(dt);
    let mut accf: Acc<R> = [[[_mm256_setzero_ps(); 2]; R]; PANELS];
    let mut mag = [[0u8; 256]; R];
    let mut sgn = [[0u8; 256]; R];
    let mut sc = [[0i32; 16]; R];
    let mut sp = [[0i32; 8]; R];
    let mut d = [0f32; R];
    for b in 0..ps[0].nb {
        for r in 0..R {
            let blk = w.as_ptr().add(r * row_bytes + b * bb);
            let (m, sg, c) = (&mut mag[r], &mut sgn[r], &mut sc[r]);
            for_groups::<DT>(blk, |k, g_mag, g_sgn, scl| {
                _mm256_storeu_si256(m.as_mut_ptr().add(32 * k) as *mut __m256i, g_mag);
                _mm256_storeu_si256(sg.as_mut_ptr().add(32 * k) as *mut __m256i, g_sgn);
                // Lanes 0..8 hold the scale of values 0..16, lanes 8..16 that of 16..32.
                c[2 * k] = _mm256_extract_epi16::<0>(scl) as i16 as i32;
                c[2 * k + 1] = _mm256_extract_epi16::<8>(scl) as i16 as i32;
            });
            if !sgnd {
                for j in 0..8 {
                    sp[r][j] = (sc[r][2 * j] & 0xFFFF) | (sc[r][2 * j + 1] << 16);
                }
            }
            d[r] = f16_to_f32(d_bits::<DT>(blk)) * factor;
        }
        for (pi, p) in ps.iter().enumerate() {
            for h in 0..halves(p) {
                let xc = p.codes.as_ptr().add(b * ng * 4 * TILE + HALF * h);
                let mut s1 = [_mm256_setzero_si256(); R];
                for gi in 0..ng {
                    let mut part = [_mm256_setzero_si256(); R];
                    for g in 0..4 {
                        let xv = ld(xc.add((4 * gi + g) * TILE));
                        let o = 16 * gi + 4 * g;
                        for r in 0..R {
                            let x = if sgnd { _mm256_sign_epi8(xv, bcast(sgn[r].as_ptr().add(o))) } else { xv };
                            part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(bcast(mag[r].as_ptr().add(o)), x));
                        }
                        if (g + 1) % n_pairs == 0 {
                            for r in 0..R {
                                let prod = _mm256_madd_epi16(part[r], _mm256_set1_epi16(sc[r][gi] as i16));
                                s1[r] = _mm256_add_epi32(s1[r], prod);
                                part[r] = _mm256_setzero_si256();
                            }
                        }
                    }
                }
                if !sgnd {
                    let corr = pair_sums::<R, 1>(p, b, h, &sp);
                    for r in 0..R {
                        s1[r] = _mm256_sub_epi32(s1[r], _mm256_mullo_epi32(corr[r][0], _mm256_set1_epi32(9)));
                    }
                }
                let dx = ldf(p.dx.as_ptr().add(b * TILE + HALF * h));
                for r in 0..R {
                    let ddx = _mm256_mul_ps(_mm256_set1_ps(d[r]), dx);
                    accf[pi][r][h] = _mm256_fmadd_ps(ddx, _mm256_cvtepi32_ps(s1[r]), accf[pi][r][h]);
                }
            }
        }
    }
    store(&accf, ps.len(), out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::iq_tables::*;

    /// `iq_pairs` keeps every i16 sum of products within range: `iq_pairs` pairs of products,
    /// each at most 2 · 127 · the largest magnitude the format's grid (or level table) holds.
    #[test]
    fn iq_pair_bounds_hold() {
        let bytes64 = |t: &[u64]| t.iter().flat_map(|v| v.to_le_bytes()).max().unwrap() as i32;
        let bytes32 = |t: &[u32]| t.iter().flat_map(|v| v.to_le_bytes()).max().unwrap() as i32;
        let largest = [
            (DType::IQ4_NL, IQ4NL_VALUES.iter().map(|v| (*v as i32).abs()).max().unwrap()),
            (DType::IQ4_XS, IQ4NL_VALUES.iter().map(|v| (*v as i32).abs()).max().unwrap()),
            (DType::IQ2_XXS, bytes64(&IQ2XXS_GRID)),
            (DType::IQ2_XS, bytes64(&IQ2XS_GRID)),
            (DType::IQ2_S, bytes64(&IQ2S_GRID)),
            (DType::IQ3_XXS, bytes32(&IQ3XXS_GRID)),
            (DType::IQ3_S, bytes32(&IQ3S_GRID)),
            // Offset codes: the grid plus 2 where the delta is +1.
            (DType::IQ1_S, bytes64(&IQ1S_GRID8) + 2),
            (DType::IQ1_M, bytes64(&IQ1S_GRID8) + 2),
        ];
        for (dt, m) in largest {
            let worst = iq_pairs(dt) as i32 * 2 * 127 * m;
            assert!(worst <= i16::MAX as i32, "{dt}: {} pairs of magnitudes up to {m} reach {worst}", iq_pairs(dt));
            assert!(4 % iq_pairs(dt) == 0, "{dt}: pairs must divide a 16-value group's four");
        }
    }
}

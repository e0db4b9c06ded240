//! Float prefill (F32, F16 and BF16 weights against `min_tokens` or more f32 tokens, at AVX2
//! and AVX-512), blocked over rows, tokens and k.
//!
//! The products follow `float`'s contract to the bit: per (row, token) 16 lane accumulators,
//! lane l taking elements 16c + l by fused multiply-add in order of c, a zero-padded final
//! chunk, then the (8, 4, 2, 1) tree. `float::tile` walks whole rows: with rows of 14336 a tile's
//! rows and tokens (some 200 KB) come from L2 at every step, and a prefill batch's activations
//! (29 MB for 512 tokens) from L3 or memory once per tile of rows — the product ran at a third
//! to a half of llama.cpp's. Here:
//!
//! - a block of `MB` rows is widened to f32 and packed once (each row read in one sequential
//!   pass), and so is each block of `NB` tokens; both stay in cache while the tiles walk them;
//! - the block's partial sums (`MB × NB` pairs of 16 lanes) wait in a buffer while k advances in
//!   chunks of `KC`, so a chunk of the rows and of the tokens is in L1/L2 for every tile that
//!   passes over it, and a tile keeps its accumulators in registers for the whole chunk;
//! - the low eight and the high eight lanes are independent chains, packed apart and walked one
//!   after the other: each output then needs one register, and a tile of 4 rows × 3 tokens
//!   loads 7 aligned vectors for 12 multiply-adds.
//!
//! Every lane sees the same additions in the same order as in `float::dot_ref`; only where the
//! partial sums wait between chunks differs.

// Index loops over rows and tokens of a tile read most plainly in kernel code.
#![allow(clippy::needless_range_loop)]

use crate::dtype::DType;
use crate::float::{load_elem, reduce16, LANES};
use crate::matmul::{MatRef, SendPtr};

/// Token counts from which `matmul` takes this path (below, the tiles of `float`, which read
/// the weights in place: packing a row block costs more than it saves for few tokens). At
/// AVX2 (AMD EPYC Zen 3, 4096×14336, one thread, blocked over tiles): 2 tokens 0.4–0.5×, 8
/// 0.9×, 16 1.0–1.1×, 512 1.9–2.1×; at AVX-512 (Intel Xeon with AVX-512, the same shape),
/// where the 4 × 4 tiles hold a pair in one register: 16 tokens 0.5–0.7×, 64 1.3–1.55×, 512
/// 1.0–1.5×.
pub(crate) const fn min_tokens(isa: crate::cpu::Isa) -> usize {
    match isa {
        crate::cpu::Isa::Avx512 => 64,
        _ => 16,
    }
}
/// Elements of k per chunk (a multiple of `LANES`).
const KC: usize = 256;
/// Rows of a tile; tokens of the AVX2 tile (4 × 3: 12 accumulators of 8 lanes) and of the
/// AVX-512 one (4 × 6: 24 of 16 lanes, with the 6 tokens' vectors and a row's, 31 registers).
const TR: usize = 4;
const TT: usize = 3;
const TT512: usize = 6;
/// Rows per block (a multiple of `TR`).
const MB: usize = 48;
/// Tokens per block (a multiple of `TT` and `TT512`).
const NB: usize = 36;

/// 16 floats on a 64-byte boundary: the unit of the packed buffers, so that every load of a
/// tile is an aligned 32-byte half of a cache line.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([f32; LANES]);

/// A zeroed buffer of `n` floats (a multiple of 16) on a 64-byte boundary.
fn lines(n: usize) -> Vec<Line> {
    vec![Line([0.0; LANES]); n / LANES]
}

/// Packs `kc` elements of a row (element `c0 + i` as f32 through `get8`/`get`) into `KC`
/// floats, zero past `kc`: for the AVX2 tiles as two halves, element 16s + l at
/// `(l / 8) · KC/2 + 8s + l % 8` — the low eight lanes of every step, then the high eight —
/// for the AVX-512 ones (`WIDE`: a step of 16 in one register) in order. `get8(i)` widens the eight
/// elements `c0 + i..c0 + i + 8` (called only where all eight are inside the chunk).
///
/// # Safety
///
/// The CPU has AVX2 (checked by `cpu::isa()`); `dst` holds `KC` floats.
#[inline(always)]
unsafe fn pack<const WIDE: bool>(
    kc: usize,
    dst: *mut f32,
    get8: impl Fn(usize) -> std::arch::x86_64::__m256,
    get: impl Fn(usize) -> f32,
) {
    use std::arch::x86_64::*;
    for s in 0..KC / LANES {
        for h in 0..2 {
            let i = s * LANES + h * 8;
            let d = if WIDE { dst.add(s * LANES + h * 8) } else { dst.add(h * KC / 2 + s * 8) };
            if i + 8 <= kc {
                _mm256_store_ps(d, get8(i));
            } else {
                for l in 0..8 {
                    *d.add(l) = if i + l < kc { get(i + l) } else { 0.0 };
                }
            }
        }
    }
}

/// `pack` for elements `c0..c0 + kc` of a stored float row.
///
/// # Safety
///
/// The CPU has AVX2 and F16C (checked by `cpu::isa()`); `c0 + kc` is within the row; `dst`
/// holds `KC` floats on a 32-byte boundary.
#[inline(always)]
unsafe fn pack_row<const WIDE: bool>(dtype: DType, row: &[u8], c0: usize, kc: usize, dst: *mut f32) {
    use std::arch::x86_64::*;
    let get = |i: usize| load_elem(dtype, row, c0 + i);
    let p16 = (row.as_ptr() as *const u16).add(c0);
    match dtype {
        DType::F32 => {
            let p = (row.as_ptr() as *const f32).add(c0);
            pack::<WIDE>(kc, dst, |i| _mm256_loadu_ps(p.add(i)), get)
        }
        DType::BF16 => pack::<WIDE>(
            kc,
            dst,
            |i| {
                let h = _mm_loadu_si128(p16.add(i) as *const __m128i);
                _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
            },
            get,
        ),
        DType::F16 => pack::<WIDE>(kc, dst, |i| _mm256_cvtph_ps(_mm_loadu_si128(p16.add(i) as *const __m128i)), get),
        _ => unreachable!("{dtype} is not a float format"),
    }
}

/// One tile of R rows × T tokens over `steps` steps, for lanes `h..h + 8` of each pair's 16 (h
/// is 0 or 8; the two halves are independent chains, so they are walked one after the other,
/// each output then needing one register instead of two): `wp[r]` and `xp[t]` point to the
/// half's packed floats (8 a step), the accumulators come from `acc` (row r, token t at
/// `(r · NB + t) · 16 + h`), stay in registers for the chunk, and go back. With R = 4 and T = 3
/// a step loads 7 vectors for 12 multiply-adds, all in 16 registers.
///
/// # Safety
///
/// The CPU has AVX2 and FMA; `wp[r]` and `xp[t]` are 32-byte aligned and valid for `8 · steps`
/// floats; `acc` holds the tile's R · T pairs of 16 lanes.
#[inline(always)]
unsafe fn tile<const R: usize, const T: usize>(
    acc: *mut f32,
    wp: [*const f32; R],
    xp: [*const f32; T],
    steps: usize,
    h: usize,
) {
    use std::arch::x86_64::*;
    let at = |r: usize, t: usize| acc.add((r * NB + t) * LANES + h);
    let mut a = [[_mm256_setzero_ps(); T]; R];
    for r in 0..R {
        for t in 0..T {
            a[r][t] = _mm256_loadu_ps(at(r, t));
        }
    }
    for s in 0..steps {
        let o = s * 8;
        let xv: [__m256; T] = std::array::from_fn(|t| _mm256_load_ps(xp[t].add(o)));
        for r in 0..R {
            let wv = _mm256_load_ps(wp[r].add(o));
            for t in 0..T {
                a[r][t] = _mm256_fmadd_ps(wv, xv[t], a[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            _mm256_storeu_ps(at(r, t), a[r][t]);
        }
    }
}

/// `tile` for `nr ≤ TR` rows of the packed panel from `w` and `nt ≤ TT` packed tokens from `x`
/// (both `KC` floats apart), both halves.
///
/// # Safety
///
/// As `tile`'s.
#[inline(always)]
unsafe fn tile_any(acc: *mut f32, w: *const f32, nr: usize, x: *const f32, nt: usize, steps: usize) {
    macro_rules! go {
        ($r:literal, $t:literal) => {
            for h in [0, 8] {
                let half = h / 8 * KC / 2;
                let wp = std::array::from_fn(|r| w.add(r * KC + half));
                let xp = std::array::from_fn(|t| x.add(t * KC + half));
                tile::<$r, $t>(acc, wp, xp, steps, h)
            }
        };
    }
    match (nr, nt) {
        (4, 3) => go!(4, 3),
        (4, 2) => go!(4, 2),
        (4, _) => go!(4, 1),
        (3, 3) => go!(3, 3),
        (3, 2) => go!(3, 2),
        (3, _) => go!(3, 1),
        (2, 3) => go!(2, 3),
        (2, 2) => go!(2, 2),
        (2, _) => go!(2, 1),
        (_, 3) => go!(1, 3),
        (_, 2) => go!(1, 2),
        _ => go!(1, 1),
    }
}

/// `tile` at AVX-512: a step of 16 lanes in one register, packed in order (no halves), the
/// accumulators of row r, token t at `(r · NB + t) · 16`.
///
/// # Safety
///
/// The CPU has AVX-512 F; `wp[r]` and `xp[t]` are 64-byte aligned and valid for `16 · steps`
/// floats; `acc` holds the tile's R · T vectors of 16 lanes.
#[inline(always)]
unsafe fn tile512<const R: usize, const T: usize>(
    acc: *mut f32,
    wp: [*const f32; R],
    xp: [*const f32; T],
    steps: usize,
) {
    use std::arch::x86_64::*;
    let at = |r: usize, t: usize| acc.add((r * NB + t) * LANES);
    let mut a = [[_mm512_setzero_ps(); T]; R];
    for r in 0..R {
        for t in 0..T {
            a[r][t] = _mm512_loadu_ps(at(r, t));
        }
    }
    for s in 0..steps {
        let o = s * LANES;
        let xv: [__m512; T] = std::array::from_fn(|t| _mm512_load_ps(xp[t].add(o)));
        for r in 0..R {
            let wv = _mm512_load_ps(wp[r].add(o));
            for t in 0..T {
                a[r][t] = _mm512_fmadd_ps(wv, xv[t], a[r][t]);
            }
        }
    }
    for r in 0..R {
        for t in 0..T {
            _mm512_storeu_ps(at(r, t), a[r][t]);
        }
    }
}

/// `tile512` for `nr ≤ TR` rows of the packed panel from `w` and `nt ≤ TT512` packed tokens from
/// `x` (both `KC` floats apart).
///
/// # Safety
///
/// As `tile512`'s.
#[inline(always)]
unsafe fn tile512_any(acc: *mut f32, w: *const f32, nr: usize, x: *const f32, nt: usize, steps: usize) {
    macro_rules! go {
        ($r:literal, $t:literal) => {
            tile512::<$r, $t>(
                acc,
                std::array::from_fn(|r| w.add(r * KC)),
                std::array::from_fn(|t| x.add(t * KC)),
                steps,
            )
        };
    }
    macro_rules! by_t {
        ($r:literal) => {
            match nt {
                6 => go!($r, 6),
                5 => go!($r, 5),
                4 => go!($r, 4),
                3 => go!($r, 3),
                2 => go!($r, 2),
                _ => go!($r, 1),
            }
        };
    }
    match nr {
        4 => by_t!(4),
        3 => by_t!(3),
        2 => by_t!(2),
        _ => by_t!(1),
    }
}

/// Rows `rows` of `out = x · Wᵀ` (out is n × w.rows) for float weights and n ≥ 2 tokens, with
/// AVX2 tiles of 4 rows × 3 tokens, half a pair's lanes at a time (12 accumulators of 8 lanes,
/// in registers).
///
/// # Safety
///
/// The CPU has AVX2, FMA and F16C (checked by `cpu::isa()`); `x` holds n rows of `w.cols`;
/// `out` points to an n × w.rows buffer whose columns `rows` no one else touches meanwhile.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn rows_avx2(w: MatRef<'_>, rows: std::ops::Range<usize>, x: &[f32], n: usize, out: SendPtr) {
    rows_blocked::<false>(w, rows, x, n, out)
}

/// `rows_avx2` with AVX-512 tiles of 4 rows × 6 tokens (`tile512`).
///
/// # Safety
///
/// As `rows_avx2`'s, the CPU having AVX-512 F and BW (checked by `cpu::isa()`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(crate) unsafe fn rows_avx512(w: MatRef<'_>, rows: std::ops::Range<usize>, x: &[f32], n: usize, out: SendPtr) {
    rows_blocked::<true>(w, rows, x, n, out)
}

/// The blocked product, with the AVX-512 tiles (`WIDE`) or the AVX2 ones.
///
/// # Safety
///
/// As `rows_avx2`'s; with `WIDE` the caller is compiled for AVX-512 (`rows_avx512`).
#[inline(always)]
unsafe fn rows_blocked<const WIDE: bool>(
    w: MatRef<'_>,
    rows: std::ops::Range<usize>,
    x: &[f32],
    n: usize,
    out: SendPtr,
) {
    let (k, m) = (w.cols, w.rows);
    debug_assert!(w.dtype.is_float() && x.len() >= n * k && rows.end <= m);
    let chunks = k.div_ceil(KC);
    let mut acc = vec![0f32; MB * NB * LANES];
    // A block's rows and a block's tokens, packed whole (chunk c of row r at (c · MB + r) · KC,
    // of token t at (c · NB + t) · KC): each row and each token is read from memory in one
    // sequential pass, not in runs of a chunk, and the packed blocks (a few MB) stay in cache
    // while the tiles walk them.
    let mut panel = lines(chunks * MB * KC);
    let mut xpack = lines(chunks * NB * KC);
    let (pp, xq) = (panel.as_mut_ptr() as *mut f32, xpack.as_mut_ptr() as *mut f32);
    let mut r0 = rows.start;
    while r0 < rows.end {
        let mr = MB.min(rows.end - r0);
        for r in 0..mr {
            let row = w.row(r0 + r);
            for c in 0..chunks {
                pack_row::<WIDE>(w.dtype, row, c * KC, KC.min(k - c * KC), pp.add((c * MB + r) * KC));
            }
        }
        let mut t0 = 0;
        while t0 < n {
            let nt = NB.min(n - t0);
            for t in 0..nt {
                let xr = x.as_ptr().add((t0 + t) * k);
                for c in 0..chunks {
                    let xc = xr.add(c * KC);
                    let get8 = |i| std::arch::x86_64::_mm256_loadu_ps(xc.add(i));
                    pack::<WIDE>(KC.min(k - c * KC), xq.add((c * NB + t) * KC), get8, |i| *xc.add(i));
                }
            }
            acc.fill(0.0);
            for c in 0..chunks {
                // Steps of 16, the last zero-padded (the contract's final chunk).
                let steps = KC.min(k - c * KC).div_ceil(LANES);
                let mut rt = 0;
                while rt < mr {
                    let nr = TR.min(mr - rt);
                    let mut tt = 0;
                    while tt < nt {
                        let ntt = (if WIDE { TT512 } else { TT }).min(nt - tt);
                        let a = acc.as_mut_ptr().add((rt * NB + tt) * LANES);
                        let (wt, xt) = (pp.add((c * MB + rt) * KC), xq.add((c * NB + tt) * KC));
                        if WIDE {
                            tile512_any(a, wt, nr, xt, ntt, steps);
                        } else {
                            tile_any(a, wt, nr, xt, ntt, steps);
                        }
                        tt += ntt;
                    }
                    rt += nr;
                }
            }
            for r in 0..mr {
                for t in 0..nt {
                    let mut lanes = [0f32; LANES];
                    lanes.copy_from_slice(&acc[(r * NB + t) * LANES..][..LANES]);
                    // SAFETY: row r0 + r of token t0 + t lies in this call's columns.
                    *out.get().add((t0 + t) * m + r0 + r) = reduce16(lanes);
                }
            }
            t0 += nt;
        }
        r0 += mr;
    }
}

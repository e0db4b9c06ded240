//! GGUF's IQ formats ("importance" quants): layouts, the integer form every kernel computes
//! with, reference dequantization, and a simple quantizer (for tests and the kernel lab).
//!
//! Layouts (byte offsets within one block; `d` is an f16; "group" = 32 elements, "sub" = 8):
//!
//! | type | elems | bytes | layout |
//! |---|---|---|---|
//! | IQ4_NL | 32 | 18 | d, qs[16]: element j = low nibble of qs[j], j+16 = high; w = d·K[q] |
//! | IQ4_XS | 256 | 136 | d, scales_h (u16: 2 high bits per group), scales_l[4] (4 low bits per group), qs[128] (16 per group, as IQ4_NL); w = d·(ls − 32)·K[q] |
//! | IQ2_XXS | 256 | 66 | d, per group 8 bytes: 4 grid indices (8 bits), then a u32 with four 7-bit sign fields and a 4-bit scale (bits 28..32); w = d·(½ + s)/4·grid·sign |
//! | IQ2_XS | 256 | 74 | d, qs[32] (u16 per sub: 9-bit grid index, 7-bit sign field), scales[8] (a nibble per 16 elements); w = d·(½ + s)/4·grid·sign |
//! | IQ2_S | 256 | 82 | d, qs[32] (grid index low 8 bits per sub), signs[32] (8 sign bits per sub), qh[8] (2 high index bits per sub), scales[8] (a nibble per 16); w = d·(½ + s)/4·grid·sign |
//! | IQ3_XXS | 256 | 98 | d, qs[64] (8-bit grid index per 4 elements), per group a u32 of four 7-bit sign fields and a 4-bit scale; w = d·(½ + s)/2·grid·sign |
//! | IQ3_S | 256 | 110 | d, qs[64] (index low 8 bits per 4 elements), qh[8] (the 9th bits, a byte per group), signs[32], scales[4] (a nibble per group); w = d·(1 + 2s)·grid·sign |
//! | IQ1_S | 256 | 50 | d, qs[32] (index low 8 bits per sub), qh[8] (u16 per group: 3 high index bits per sub, a 3-bit scale at bits 12..15, the delta's sign at bit 15); w = d·(2s + 1)·(grid ± ⅛) |
//! | IQ1_M | 256 | 56 | qs[32], qh[16] (a nibble per sub: 3 high index bits, the delta's sign), scales[8] (four u16: 3-bit scales per 16 elements in bits 0..12, and the f16 `d` in their top nibbles); w = d·(2s + 1)·(grid ± ⅛) |
//!
//! `K` is the 16-level non-linear table `IQ4NL_VALUES`; `grid` an entry of the format's
//! codebook (`iq_tables`), selected by the index; a 7-bit sign field carries the signs of
//! seven of eight values, the eighth being whatever makes the number of minus signs even.
//!
//! **Integer form.** Every format is `w_i = D · s_g · c_i`: a block scale `D` (the f16 times
//! a power of two: ⅛ for IQ2_* and IQ1_*, ¼ for IQ3_XXS, 1 otherwise — exact), an integer
//! scale `s_g` per 16 elements (`2s + 1`, `ls − 32`, or 1) and an integer code `c_i` (the grid
//! value with its sign; `8·grid ± 1` for IQ1_S/IQ1_M, the ±⅛ delta made integral). A block's
//! dot product is then `D · dx · Σ_g s_g · Σ_{i∈g} c_i·q_i` with one exact integer sum, which
//! is `dot_ref::accumulate`'s plain formula `fma(D·dx, isum, acc)`.
//!
//! **Grid indices are in range by construction.** Each index is assembled from exactly as
//! many bits as its codebook has entries: 8 bits into 256 entries (IQ2_XXS, IQ3_XXS), 9 into
//! 512 (IQ2_XS, IQ3_S), 10 into 1024 (IQ2_S), 11 into 2048 (IQ1_S, IQ1_M); sign fields are 7
//! bits into 128 patterns, IQ4 nibbles 4 bits into 16 levels. The decoders mask every field to
//! its width, so no byte pattern can select a missing entry (the tests decode blocks of all
//! ones, the largest index of every format). Nothing is left to report: a corrupt block
//! decodes to some in-range values (or to a non-finite scale, which propagates like any other
//! non-finite weight).

use super::iq_tables::*;
use crate::dtype::DType;
use half::f16;

/// Whether `dtype` is one of the IQ formats.
pub fn is_iq(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::IQ4_NL
            | DType::IQ4_XS
            | DType::IQ3_XXS
            | DType::IQ3_S
            | DType::IQ2_XXS
            | DType::IQ2_XS
            | DType::IQ2_S
            | DType::IQ1_S
            | DType::IQ1_M
    )
}

/// The byte of eight signs (bit j set: element j negative) a 7-bit sign field stands for:
/// the eighth sign makes the number of minus signs even.
pub const fn sign_byte(field: u8) -> u8 {
    let f = field & 0x7f;
    f | (((f.count_ones() & 1) as u8) << 7)
}

#[inline(always)]
fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

#[inline(always)]
fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// `v`'s `n` bytes (little-endian) as `n` codes, each negated where `signs` has its bit set.
#[inline(always)]
fn signed_bytes(out: &mut [i8], v: u64, signs: u8) {
    for (j, o) in out.iter_mut().enumerate() {
        let m = ((v >> (8 * j)) & 0xff) as i8;
        *o = if signs & (1 << j) != 0 { -m } else { m };
    }
}

/// The f16 bits of an IQ1_M block's scale, kept in the top nibbles of its four scale words.
#[inline(always)]
pub fn iq1m_d_bits(b: &[u8]) -> u16 {
    let sc = |i: usize| u16_at(b, 48 + 2 * i);
    (sc(0) >> 12) | ((sc(1) >> 8) & 0x00f0) | ((sc(2) >> 4) & 0x0f00) | (sc(3) & 0xf000)
}

/// The power of two the stored `d` is multiplied by to give the block scale `D`.
pub const fn scale_factor(dtype: DType) -> f32 {
    match dtype {
        DType::IQ2_XXS | DType::IQ2_XS | DType::IQ2_S | DType::IQ1_S | DType::IQ1_M => 0.125,
        DType::IQ3_XXS => 0.25,
        _ => 1.0,
    }
}

/// The block scale `D` (the stored f16 times `scale_factor`: exact).
pub fn block_scale(dtype: DType, b: &[u8]) -> f32 {
    let bits = if dtype == DType::IQ1_M { iq1m_d_bits(b) } else { u16_at(b, 0) };
    f16::from_bits(bits).to_f32() * scale_factor(dtype)
}

/// One block in integer form: `codes[i]` and a scale per 16 elements (`w_i = D·scales[i/16]·codes[i]`).
/// IQ4_NL fills the first 32 codes and two unit scales.
#[derive(Clone, Copy)]
pub struct IqBlock {
    pub codes: [i8; 256],
    pub scales: [i8; 16],
}

/// Decodes an IQ block into its integer form.
pub fn decode(dtype: DType, b: &[u8]) -> IqBlock {
    let mut k = IqBlock { codes: [0; 256], scales: [0; 16] };
    let (c, s) = (&mut k.codes, &mut k.scales);
    let odd = |n: u32| (2 * n + 1) as i8;
    match dtype {
        DType::IQ4_NL => {
            for j in 0..16 {
                c[j] = IQ4NL_VALUES[(b[2 + j] & 0xf) as usize];
                c[j + 16] = IQ4NL_VALUES[(b[2 + j] >> 4) as usize];
            }
            s[0] = 1;
            s[1] = 1;
        }
        DType::IQ4_XS => {
            let sh = u16_at(b, 2);
            for g in 0..8 {
                let lo = (b[4 + g / 2] >> (4 * (g % 2))) & 0xf;
                let hi = ((sh >> (2 * g)) & 3) as u8;
                let ls = (lo | (hi << 4)) as i8 - 32;
                s[2 * g] = ls;
                s[2 * g + 1] = ls;
                let qs = &b[8 + 16 * g..24 + 16 * g];
                for j in 0..16 {
                    c[32 * g + j] = IQ4NL_VALUES[(qs[j] & 0xf) as usize];
                    c[32 * g + 16 + j] = IQ4NL_VALUES[(qs[j] >> 4) as usize];
                }
            }
        }
        DType::IQ2_XXS => {
            for g in 0..8 {
                let aux = u32_at(b, 6 + 8 * g);
                let ls = odd(aux >> 28);
                s[2 * g] = ls;
                s[2 * g + 1] = ls;
                for l in 0..4 {
                    let grid = IQ2XXS_GRID[b[2 + 8 * g + l] as usize];
                    let signs = sign_byte(((aux >> (7 * l)) & 0x7f) as u8);
                    signed_bytes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], grid, signs);
                }
            }
        }
        DType::IQ2_XS => {
            for g in 0..8 {
                let sc = b[66 + g];
                s[2 * g] = odd((sc & 0xf) as u32);
                s[2 * g + 1] = odd((sc >> 4) as u32);
                for l in 0..4 {
                    let q = u16_at(b, 2 + 8 * g + 2 * l);
                    let grid = IQ2XS_GRID[(q & 511) as usize];
                    let signs = sign_byte((q >> 9) as u8);
                    signed_bytes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], grid, signs);
                }
            }
        }
        DType::IQ2_S => {
            for g in 0..8 {
                let sc = b[74 + g];
                s[2 * g] = odd((sc & 0xf) as u32);
                s[2 * g + 1] = odd((sc >> 4) as u32);
                let qh = b[66 + g] as usize;
                for l in 0..4 {
                    let idx = b[2 + 4 * g + l] as usize | (((qh >> (2 * l)) & 3) << 8);
                    let signs = b[34 + 4 * g + l];
                    signed_bytes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], IQ2S_GRID[idx], signs);
                }
            }
        }
        DType::IQ3_XXS => {
            for g in 0..8 {
                let aux = u32_at(b, 66 + 4 * g);
                let ls = odd(aux >> 28);
                s[2 * g] = ls;
                s[2 * g + 1] = ls;
                for l in 0..4 {
                    let signs = sign_byte(((aux >> (7 * l)) & 0x7f) as u8);
                    let g1 = IQ3XXS_GRID[b[2 + 8 * g + 2 * l] as usize] as u64;
                    let g2 = IQ3XXS_GRID[b[2 + 8 * g + 2 * l + 1] as usize] as u64;
                    signed_bytes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], g1 | (g2 << 32), signs);
                }
            }
        }
        DType::IQ3_S => {
            for g in 0..8 {
                let ls = odd(((b[106 + g / 2] >> (4 * (g % 2))) & 0xf) as u32);
                s[2 * g] = ls;
                s[2 * g + 1] = ls;
                let qh = b[66 + g] as usize;
                for l in 0..4 {
                    let i1 = b[2 + 8 * g + 2 * l] as usize | (((qh >> (2 * l)) & 1) << 8);
                    let i2 = b[2 + 8 * g + 2 * l + 1] as usize | (((qh >> (2 * l + 1)) & 1) << 8);
                    let v = IQ3S_GRID[i1] as u64 | ((IQ3S_GRID[i2] as u64) << 32);
                    signed_bytes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], v, b[74 + 4 * g + l]);
                }
            }
        }
        DType::IQ1_S => {
            for g in 0..8 {
                let qh = u16_at(b, 34 + 2 * g) as usize;
                let ls = odd(((qh >> 12) & 7) as u32);
                s[2 * g] = ls;
                s[2 * g + 1] = ls;
                let delta: i8 = if qh & 0x8000 != 0 { -1 } else { 1 };
                for l in 0..4 {
                    let idx = b[2 + 4 * g + l] as usize | (((qh >> (3 * l)) & 7) << 8);
                    iq1_codes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], idx, delta);
                }
            }
        }
        DType::IQ1_M => {
            for g in 0..8 {
                let sc = u16_at(b, 48 + 2 * (g / 2)) as u32;
                s[2 * g] = odd((sc >> (6 * (g % 2))) & 7);
                s[2 * g + 1] = odd((sc >> (6 * (g % 2) + 3)) & 7);
                for l in 0..4 {
                    let h = (b[32 + 2 * g + l / 2] >> (4 * (l % 2))) as usize;
                    let idx = b[4 * g + l] as usize | ((h & 7) << 8);
                    let delta: i8 = if h & 8 != 0 { -1 } else { 1 };
                    iq1_codes(&mut c[32 * g + 8 * l..32 * g + 8 * l + 8], idx, delta);
                }
            }
        }
        _ => unreachable!("{dtype} is not an IQ format"),
    }
    k
}

/// IQ1 codes of one 8-value sub-block: `8·grid + delta` (grid in {−1, 0, 1}, delta ±1).
#[inline(always)]
fn iq1_codes(out: &mut [i8], idx: usize, delta: i8) {
    let v = IQ1S_GRID[idx & 2047];
    for (j, o) in out.iter_mut().enumerate() {
        *o = 8 * ((v >> (8 * j)) as u8 as i8) + delta;
    }
}

/// Widens one block to f32: `(D·s)·c`, every product exact (see `dequantize_is_exact` in the
/// tests), so the values equal ggml's and gguf-py's, whose formulas group the same factors
/// differently.
pub fn dequantize(dtype: DType, b: &[u8], y: &mut [f32]) {
    let k = decode(dtype, b);
    let d = block_scale(dtype, b);
    for (i, v) in y.iter_mut().enumerate() {
        *v = (d * k.scales[i / 16] as f32) * k.codes[i] as f32;
    }
}

/// Σ_g s_g · Σ c_i·x_i over one block (the exact integer part of its dot product).
pub fn block_isum(dtype: DType, w: &[u8], x: &[i8]) -> i32 {
    let k = decode(dtype, w);
    let n = dtype.block_elems();
    let mut isum = 0i32;
    for g in 0..n / 16 {
        let s: i32 = (16 * g..16 * g + 16).map(|i| k.codes[i] as i32 * x[i] as i32).sum();
        isum += k.scales[g] as i32 * s;
    }
    isum
}

// ---------------------------------------------------------------------------------------
// A simple quantizer (deterministic, not llama.cpp's importance-weighted search): each group's
// scale maps its largest magnitude to the codebook's largest level, each value goes to its
// nearest level, and each sub-block to the codebook entry nearest those levels.

/// A codebook's levels (the values its entries' bytes take, as i8), and for every combination
/// of per-value level indices (base `levels.len()`, value j the j-th digit) the nearest entry.
struct Nearest {
    levels: &'static [i8],
    width: usize,
    map: Vec<u16>,
}

impl Nearest {
    fn build(levels: &'static [i8], width: usize, entries: &[u64]) -> Nearest {
        let nl = levels.len();
        let map = (0..nl.pow(width as u32))
            .map(|key| {
                let mut want = [0i32; 8];
                let mut k = key;
                for w in want.iter_mut().take(width) {
                    *w = levels[k % nl] as i32;
                    k /= nl;
                }
                let mut best = (i32::MAX, 0u16);
                for (e, v) in entries.iter().enumerate() {
                    let d: i32 = (0..width)
                        .map(|j| {
                            let t = ((v >> (8 * j)) as u8 as i8) as i32 - want[j];
                            t * t
                        })
                        .sum();
                    if d < best.0 {
                        best = (d, e as u16);
                    }
                }
                best.1
            })
            .collect();
        Nearest { levels, width, map }
    }

    /// The entry nearest values `m` (in codebook units).
    fn find(&self, m: &[f32]) -> usize {
        let nl = self.levels.len();
        let mut key = 0;
        for j in (0..self.width).rev() {
            let dist = |l: usize| (self.levels[l] as f32 - m[j]).abs();
            let l = (0..nl).min_by(|a, b| dist(*a).total_cmp(&dist(*b))).unwrap_or(0);
            key = key * nl + l;
        }
        self.map[key] as usize
    }
}

fn nearest_for(dtype: DType) -> &'static Nearest {
    use std::sync::OnceLock;
    static IQ2XXS: OnceLock<Nearest> = OnceLock::new();
    static IQ2XS: OnceLock<Nearest> = OnceLock::new();
    static IQ2S: OnceLock<Nearest> = OnceLock::new();
    static IQ3XXS: OnceLock<Nearest> = OnceLock::new();
    static IQ3S: OnceLock<Nearest> = OnceLock::new();
    static IQ1S: OnceLock<Nearest> = OnceLock::new();
    const L2: &[i8] = &[0x08, 0x19, 0x2b];
    const L3: &[i8] = &[0x04, 0x0c, 0x14, 0x1c, 0x24, 0x2c, 0x34, 0x3e];
    const L3S: &[i8] = &[1, 3, 5, 7, 9, 11, 13, 15];
    const L1: &[i8] = &[-1, 0, 1];
    let w32 = |g: &[u32]| g.iter().map(|v| *v as u64).collect::<Vec<u64>>();
    match dtype {
        DType::IQ2_XXS => IQ2XXS.get_or_init(|| Nearest::build(L2, 8, &IQ2XXS_GRID)),
        DType::IQ2_XS => IQ2XS.get_or_init(|| Nearest::build(L2, 8, &IQ2XS_GRID)),
        DType::IQ2_S => IQ2S.get_or_init(|| Nearest::build(L2, 8, &IQ2S_GRID)),
        DType::IQ3_XXS => IQ3XXS.get_or_init(|| Nearest::build(L3, 4, &w32(&IQ3XXS_GRID))),
        DType::IQ3_S => IQ3S.get_or_init(|| Nearest::build(L3S, 4, &w32(&IQ3S_GRID))),
        DType::IQ1_S | DType::IQ1_M => IQ1S.get_or_init(|| Nearest::build(L1, 8, &IQ1S_GRID)),
        _ => unreachable!("{dtype} has no codebook"),
    }
}

fn amax(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The value of largest magnitude, with its sign.
fn signed_max(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| if x.abs() > m.abs() { *x } else { m })
}

/// Nearest IQ4 level index of `v` (in level units).
fn nearest_k(v: f32) -> u8 {
    (0..16u8)
        .min_by(|a, b| {
            (IQ4NL_VALUES[*a as usize] as f32 - v).abs().total_cmp(&(IQ4NL_VALUES[*b as usize] as f32 - v).abs())
        })
        .unwrap_or(0)
}

/// Chooses a block's f16 `d` and per-group odd scales `2s + 1` (s in 0..16) so that each group's
/// largest magnitude maps near the codebook's largest level `top`; returns (d as stored, s).
fn odd_scales(group_max: &[f32], top: f32, factor: f32, smax: u32) -> (f32, Vec<u32>) {
    let gmax = group_max.iter().fold(0f32, |m, v| m.max(*v));
    // D·(2s+1)·top = group max; the largest group takes the largest odd scale.
    let d = f16::from_f32(gmax / (top * (2 * smax + 1) as f32) / factor).to_f32();
    let dd = d * factor;
    let s = group_max
        .iter()
        .map(|m| if dd > 0.0 { (((m / (dd * top)) - 1.0) / 2.0).round().clamp(0.0, smax as f32) as u32 } else { 0 })
        .collect();
    (d, s)
}

/// The sign bits of eight values of `x` (bit j: x_j < 0); with `even`, the smallest value's
/// sign flipped where needed so the count of minus signs is even (the 7-bit fields).
fn sign_bits(x: &[f32], even: bool) -> u8 {
    let mut s = 0u8;
    for (j, v) in x.iter().enumerate() {
        if *v < 0.0 {
            s |= 1 << j;
        }
    }
    if even && s.count_ones() % 2 == 1 {
        let j = (0..x.len()).min_by(|a, b| x[*a].abs().total_cmp(&x[*b].abs())).unwrap_or(0);
        s ^= 1 << j;
    }
    s
}

/// Quantizes one block (`dtype.block_elems()` values of `x`) into `b`.
pub fn quantize(dtype: DType, x: &[f32], b: &mut [u8]) {
    b.fill(0);
    let put_d = |b: &mut [u8], d: f32| b[0..2].copy_from_slice(&f16::from_f32(d).to_bits().to_le_bytes());
    match dtype {
        DType::IQ4_NL => {
            let d = f16::from_f32(signed_max(x) / -127.0).to_f32();
            put_d(b, d);
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            for j in 0..16 {
                b[2 + j] = nearest_k(x[j] * id) | (nearest_k(x[j + 16] * id) << 4);
            }
        }
        DType::IQ4_XS => {
            let sc: Vec<f32> = x.chunks_exact(32).map(|g| signed_max(g) / -127.0).collect();
            let ms = amax(&sc);
            let d = f16::from_f32(ms / 32.0).to_f32();
            put_d(b, d);
            let mut sh = 0u16;
            for g in 0..8 {
                let ls = if d > 0.0 { (sc[g] / d).round().clamp(-32.0, 31.0) as i32 } else { 0 };
                let l = (ls + 32) as u8;
                b[4 + g / 2] |= (l & 0xf) << (4 * (g % 2));
                sh |= ((l >> 4) as u16) << (2 * g);
                let dl = d * ls as f32;
                let id = if dl != 0.0 { 1.0 / dl } else { 0.0 };
                for j in 0..16 {
                    let lo = nearest_k(x[32 * g + j] * id);
                    let hi = nearest_k(x[32 * g + 16 + j] * id);
                    b[8 + 16 * g + j] = lo | (hi << 4);
                }
            }
            b[2..4].copy_from_slice(&sh.to_le_bytes());
        }
        DType::IQ2_XXS | DType::IQ3_XXS => {
            let (top, factor, width) = if dtype == DType::IQ2_XXS { (43.0, 0.125, 8) } else { (62.0, 0.25, 4) };
            let gm: Vec<f32> = x.chunks_exact(32).map(amax).collect();
            let (d, s) = odd_scales(&gm, top, factor, 15);
            put_d(b, d);
            let nr = nearest_for(dtype);
            for g in 0..8 {
                let dl = d * factor * (2 * s[g] + 1) as f32;
                let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
                let mut aux = s[g] << 28;
                for l in 0..4 {
                    let xs = &x[32 * g + 8 * l..32 * g + 8 * l + 8];
                    let m: Vec<f32> = xs.iter().map(|v| v.abs() * id).collect();
                    aux |= ((sign_bits(xs, true) & 0x7f) as u32) << (7 * l);
                    if width == 8 {
                        b[2 + 8 * g + l] = nr.find(&m) as u8;
                    } else {
                        b[2 + 8 * g + 2 * l] = nr.find(&m[..4]) as u8;
                        b[2 + 8 * g + 2 * l + 1] = nr.find(&m[4..]) as u8;
                    }
                }
                let o = if dtype == DType::IQ2_XXS { 6 + 8 * g } else { 66 + 4 * g };
                b[o..o + 4].copy_from_slice(&aux.to_le_bytes());
            }
        }
        DType::IQ2_XS | DType::IQ2_S => {
            let gm: Vec<f32> = x.chunks_exact(16).map(amax).collect();
            let (d, s) = odd_scales(&gm, 43.0, 0.125, 15);
            put_d(b, d);
            let nr = nearest_for(dtype);
            for g in 0..8 {
                let sc_at = if dtype == DType::IQ2_XS { 66 } else { 74 };
                b[sc_at + g] = (s[2 * g] | (s[2 * g + 1] << 4)) as u8;
                for l in 0..4 {
                    let dl = d * 0.125 * (2 * s[2 * g + l / 2] + 1) as f32;
                    let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
                    let xs = &x[32 * g + 8 * l..32 * g + 8 * l + 8];
                    let m: Vec<f32> = xs.iter().map(|v| v.abs() * id).collect();
                    let idx = nr.find(&m);
                    if dtype == DType::IQ2_XS {
                        let q = idx as u16 | (((sign_bits(xs, true) & 0x7f) as u16) << 9);
                        b[2 + 8 * g + 2 * l..4 + 8 * g + 2 * l].copy_from_slice(&q.to_le_bytes());
                    } else {
                        b[2 + 4 * g + l] = idx as u8;
                        b[66 + g] |= ((idx >> 8) as u8) << (2 * l);
                        b[34 + 4 * g + l] = sign_bits(xs, false);
                    }
                }
            }
        }
        DType::IQ3_S => {
            let gm: Vec<f32> = x.chunks_exact(32).map(amax).collect();
            let (d, s) = odd_scales(&gm, 15.0, 1.0, 15);
            put_d(b, d);
            let nr = nearest_for(dtype);
            for g in 0..8 {
                b[106 + g / 2] |= (s[g] as u8) << (4 * (g % 2));
                let dl = d * (2 * s[g] + 1) as f32;
                let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
                for l in 0..4 {
                    let xs = &x[32 * g + 8 * l..32 * g + 8 * l + 8];
                    let m: Vec<f32> = xs.iter().map(|v| v.abs() * id).collect();
                    for h in 0..2 {
                        let idx = nr.find(&m[4 * h..4 * h + 4]);
                        b[2 + 8 * g + 2 * l + h] = idx as u8;
                        b[66 + g] |= ((idx >> 8) as u8) << (2 * l + h);
                    }
                    b[74 + 4 * g + l] = sign_bits(xs, false);
                }
            }
        }
        DType::IQ1_S | DType::IQ1_M => {
            // A scale per 32 (IQ1_S) or 16 (IQ1_M) values; in units of D·(2s+1) a value is
            // 8·grid ± 1 with grid in {−1, 0, 1}: the largest magnitude maps to 9.
            let gl = if dtype == DType::IQ1_S { 32 } else { 16 };
            let gm: Vec<f32> = x.chunks_exact(gl).map(amax).collect();
            let (d, s) = odd_scales(&gm, 9.0, 0.125, 7);
            let nr = nearest_for(dtype);
            let mut idx = [0usize; 32];
            // Σ (value − 8·grid) per sub-block, in code units: its sign picks the delta.
            let mut rest = [0f32; 32];
            for sb in 0..32 {
                let dl = d * 0.125 * (2 * s[8 * sb / gl] + 1) as f32;
                let id = if dl > 0.0 { 1.0 / dl } else { 0.0 };
                let m: Vec<f32> = x[8 * sb..8 * sb + 8].iter().map(|v| v * id).collect();
                let g: Vec<f32> = m.iter().map(|v| v / 8.0).collect();
                idx[sb] = nr.find(&g);
                let grid = IQ1S_GRID[idx[sb]];
                rest[sb] = (0..8).map(|j| m[j] - 8.0 * ((grid >> (8 * j)) as u8 as i8) as f32).sum();
            }
            if dtype == DType::IQ1_S {
                put_d(b, d);
                for g in 0..8 {
                    let mut qh = (s[g] as u16) << 12;
                    if rest[4 * g..4 * g + 4].iter().sum::<f32>() < 0.0 {
                        qh |= 0x8000;
                    }
                    for l in 0..4 {
                        b[2 + 4 * g + l] = idx[4 * g + l] as u8;
                        qh |= ((idx[4 * g + l] >> 8) as u16) << (3 * l);
                    }
                    b[34 + 2 * g..36 + 2 * g].copy_from_slice(&qh.to_le_bytes());
                }
            } else {
                for sb in 0..32 {
                    b[sb] = idx[sb] as u8;
                    let h = (idx[sb] >> 8) as u8 | if rest[sb] < 0.0 { 8 } else { 0 };
                    b[32 + sb / 2] |= h << (4 * (sb % 2));
                }
                let db = f16::from_f32(d).to_bits();
                for w in 0..4 {
                    let mut v = 0u16;
                    for k in 0..4 {
                        v |= (s[4 * w + k] as u16) << (3 * k);
                    }
                    v |= ((db >> (4 * w)) & 0xf) << 12;
                    b[48 + 2 * w..50 + 2 * w].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        _ => unreachable!("{dtype} is not an IQ format"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) const IQ: [DType; 9] = [
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

    #[test]
    fn sign_bytes_are_ggmls() {
        // The first entries of ggml's ksigns_iq2xs, and the rule: an even number of minus signs.
        let want = [0u8, 129, 130, 3, 132, 5, 6, 135, 136, 9, 10, 139, 12, 141, 142, 15];
        for (i, w) in want.iter().enumerate() {
            assert_eq!(sign_byte(i as u8), *w);
        }
        for f in 0..128u8 {
            assert_eq!(sign_byte(f).count_ones() % 2, 0);
            assert_eq!(sign_byte(f) & 0x7f, f);
        }
    }

    #[test]
    fn codebooks_have_the_sizes_the_index_widths_need() {
        // Index widths: 8, 9, 10, 8, 9, 11 bits; every pattern of those bits is an entry.
        assert_eq!(IQ2XXS_GRID.len(), 1 << 8);
        assert_eq!(IQ2XS_GRID.len(), 1 << 9);
        assert_eq!(IQ2S_GRID.len(), 1 << 10);
        assert_eq!(IQ3XXS_GRID.len(), 1 << 8);
        assert_eq!(IQ3S_GRID.len(), 1 << 9);
        assert_eq!(IQ1S_GRID.len(), 1 << 11);
        // IQ1's bytes are −1, 0 or 1; the others' magnitudes are the levels the formats name.
        assert!(IQ1S_GRID.iter().all(|v| v.to_le_bytes().iter().all(|b| matches!(*b, 0xff | 0 | 1))));
        assert!(IQ2S_GRID.iter().all(|v| v.to_le_bytes().iter().all(|b| matches!(*b, 0x08 | 0x19 | 0x2b))));
        assert!(IQ3S_GRID.iter().all(|v| v.to_le_bytes().iter().all(|b| *b % 2 == 1 && *b <= 15)));
    }

    #[test]
    fn the_largest_indices_decode_to_the_last_entries() {
        // Every byte 0xFF: every index field at its maximum, every sign set. No panic, and
        // the codes are the last codebook entries (negated where the signs say so).
        for dtype in IQ {
            let mut b = vec![0xffu8; dtype.block_bytes()];
            // A finite scale, so the values are comparable.
            if dtype == DType::IQ1_M {
                for w in 0..4 {
                    b[49 + 2 * w] = 0x0f | (((0x3c00u16 >> (4 * w)) as u8 & 0xf) << 4);
                }
            } else {
                b[0..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
            }
            let k = decode(dtype, &b);
            let mut y = vec![0f32; dtype.block_elems()];
            dequantize(dtype, &b, &mut y);
            assert!(y.iter().all(|v| v.is_finite()), "{dtype}");
            assert_eq!(block_scale(dtype, &b), scale_factor(dtype), "{dtype}");
            let bytes = |v: u64, j: usize| (v >> (8 * j)) as u8 as i8;
            for i in 0..8 {
                let want = match dtype {
                    // Nibble 15 is level 113; IQ4_XS scale 63 − 32 = 31.
                    DType::IQ4_NL | DType::IQ4_XS => 113,
                    // 7-bit sign field 127 has seven minus signs, so the eighth is one too.
                    DType::IQ2_XXS => -bytes(IQ2XXS_GRID[255], i),
                    DType::IQ2_XS => -bytes(IQ2XS_GRID[511], i),
                    DType::IQ2_S => -bytes(IQ2S_GRID[1023], i),
                    DType::IQ3_XXS => -bytes(IQ3XXS_GRID[255] as u64, i % 4),
                    DType::IQ3_S => -bytes(IQ3S_GRID[511] as u64, i % 4),
                    // Delta sign set: 8·grid − 1.
                    _ => 8 * bytes(IQ1S_GRID[2047], i) - 1,
                };
                assert_eq!(k.codes[i], want, "{dtype} code {i}");
            }
            let top_scale = match dtype {
                DType::IQ4_NL => 1,
                DType::IQ4_XS => 31,
                DType::IQ1_S | DType::IQ1_M => 15,
                _ => 31,
            };
            assert_eq!(k.scales[0], top_scale, "{dtype}");
        }
    }

    fn wave(n: usize, seed: f32) -> Vec<f32> {
        (0..n).map(|i| (i as f32 * 0.731 + seed).sin() * 1.7 + (i as f32 * 0.05).cos() * 0.3).collect()
    }

    #[test]
    fn quantize_then_dequantize_is_close() {
        // Relative RMS error against the block's RMS: what a grid of that many bits allows a
        // simple quantizer (llama.cpp's, with importance search, does better).
        for (dtype, tol) in [
            (DType::IQ4_NL, 0.12),
            (DType::IQ4_XS, 0.12),
            (DType::IQ3_S, 0.3),
            (DType::IQ3_XXS, 0.3),
            (DType::IQ2_S, 0.5),
            (DType::IQ2_XS, 0.5),
            (DType::IQ2_XXS, 0.6),
            (DType::IQ1_M, 0.8),
            (DType::IQ1_S, 0.8),
        ] {
            let n = 1024;
            let x = wave(n, 0.3);
            let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
            let mut y = vec![0f32; n];
            for (xs, ys) in x.chunks_exact(be).zip(y.chunks_exact_mut(be)) {
                let mut b = vec![0u8; bb];
                quantize(dtype, xs, &mut b);
                dequantize(dtype, &b, ys);
            }
            let rms = |v: &mut dyn Iterator<Item = f32>| (v.map(|a| (a * a) as f64).sum::<f64>() / n as f64).sqrt();
            let err = rms(&mut x.iter().zip(&y).map(|(a, b)| a - b)) / rms(&mut x.iter().copied());
            assert!(err < tol, "{dtype}: relative RMS error {err:.3}");
        }
    }

    #[test]
    fn integer_sum_is_the_dequantized_dot() {
        // Σ dequant(w)·q = D · isum exactly (small integers, exact products).
        for dtype in IQ {
            let be = dtype.block_elems();
            let x = wave(be, 1.1);
            let mut b = vec![0u8; dtype.block_bytes()];
            quantize(dtype, &x, &mut b);
            let q: Vec<i8> = (0..be).map(|i| ((i * 37 + 11) % 255) as i32 as i8 ^ 0x55).map(|v| v.max(-127)).collect();
            let mut y = vec![0f32; be];
            dequantize(dtype, &b, &mut y);
            let want: f64 = y.iter().zip(&q).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = block_scale(dtype, &b) as f64 * block_isum(dtype, &b, &q) as f64;
            assert_eq!(got, want, "{dtype}");
        }
    }
}

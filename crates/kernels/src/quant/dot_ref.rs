//! Scalar reference of every quantized dot product, and the float accumulation that every
//! SIMD variant shares.
//!
//! A block's contribution splits into exact integer sums (`BlockInts`, computed here by plain
//! loops and by SIMD elsewhere; integer sums do not depend on order) and one float formula per
//! format (`accumulate`), applied block after block in order. SIMD variants call the same
//! `accumulate`, so they agree with this reference to the bit, and a row's result never
//! depends on the other rows or tokens of its tile.

use super::act::QuantAct;
use super::blocks::{e8m0_half, f16_at, q3k_scales, scale_min_k4, MXFP4_VALUES};
use crate::dtype::DType;

/// Exact integer parts of one block's dot product.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockInts {
    /// Σ (scale ·) weight code · activation code.
    pub isum: i32,
    /// K-quants with a block minimum: Σ min · (Σ activation codes of the sub-block).
    pub mins: i32,
}

/// Reference integer sums of weight block `w` against activation codes `x` (with `bsums`: the
/// Q8_K sums of each 16 codes, when the format needs them).
pub fn block_ints(dtype: DType, w: &[u8], x: &[i8], bsums: &[i16]) -> BlockInts {
    let bsums: Vec<i32> = bsums.iter().map(|v| *v as i32).collect();
    let dot =
        |codes: &mut dyn Iterator<Item = i32>, xs: &[i8]| -> i32 { codes.zip(xs).map(|(c, v)| c * *v as i32).sum() };
    match dtype {
        DType::Q4_0 | DType::Q4_1 => {
            let (qs, off) = if dtype == DType::Q4_0 { (&w[2..18], 8) } else { (&w[4..20], 0) };
            let lo = dot(&mut qs.iter().map(|q| (q & 0xF) as i32 - off), &x[..16]);
            let hi = dot(&mut qs.iter().map(|q| (q >> 4) as i32 - off), &x[16..]);
            BlockInts { isum: lo + hi, mins: 0 }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let (o, off) = if dtype == DType::Q5_0 { (2, 16) } else { (4, 0) };
            let qh = u32::from_le_bytes(w[o..o + 4].try_into().expect("4"));
            let qs = &w[o + 4..o + 20];
            let mut s = 0;
            for j in 0..16 {
                let lo = (qs[j] & 0xF) as i32 | ((((qh >> j) & 1) as i32) << 4);
                let hi = (qs[j] >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
                s += (lo - off) * x[j] as i32 + (hi - off) * x[j + 16] as i32;
            }
            BlockInts { isum: s, mins: 0 }
        }
        DType::Q8_0 => BlockInts { isum: dot(&mut w[2..34].iter().map(|q| *q as i8 as i32), x), mins: 0 },
        DType::MXFP4 => {
            let qs = &w[1..17];
            let lo = dot(&mut qs.iter().map(|q| MXFP4_VALUES[(q & 0xF) as usize] as i32), &x[..16]);
            let hi = dot(&mut qs.iter().map(|q| MXFP4_VALUES[(q >> 4) as usize] as i32), &x[16..]);
            BlockInts { isum: lo + hi, mins: 0 }
        }
        DType::Q4_K | DType::Q5_K => {
            let sc = &w[4..16];
            let (qh, qs) = if dtype == DType::Q5_K { (&w[16..48], &w[48..176]) } else { (&w[0..0], &w[16..144]) };
            let (mut isum, mut mins) = (0, 0);
            for c in 0..4 {
                let (s1, m1) = scale_min_k4(2 * c, sc);
                let (s2, m2) = scale_min_k4(2 * c + 1, sc);
                let (mut a, mut b) = (0, 0);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                    if dtype == DType::Q5_K {
                        lo += (((qh[l] >> (2 * c)) & 1) as i32) << 4;
                        hi += (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
                    }
                    a += lo * x[64 * c + l] as i32;
                    b += hi * x[64 * c + 32 + l] as i32;
                }
                isum += s1 as i32 * a + s2 as i32 * b;
                mins +=
                    m1 as i32 * (bsums[4 * c] + bsums[4 * c + 1]) + m2 as i32 * (bsums[4 * c + 2] + bsums[4 * c + 3]);
            }
            BlockInts { isum, mins }
        }
        DType::Q6_K => {
            let (ql, qh, sc) = (&w[0..128], &w[128..192], &w[192..208]);
            let mut g = [0i32; 16];
            for n in 0..2 {
                for l in 0..32 {
                    let (a, h) = (ql[64 * n + l], qh[32 * n + l]);
                    let b = ql[64 * n + l + 32];
                    let q1 = ((a & 0xF) | ((h & 3) << 4)) as i32 - 32;
                    let q2 = ((b & 0xF) | (((h >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((a >> 4) | (((h >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((b >> 4) | (((h >> 6) & 3) << 4)) as i32 - 32;
                    let base = 128 * n;
                    g[(base + l) / 16] += q1 * x[base + l] as i32;
                    g[(base + l + 32) / 16] += q2 * x[base + l + 32] as i32;
                    g[(base + l + 64) / 16] += q3 * x[base + l + 64] as i32;
                    g[(base + l + 96) / 16] += q4 * x[base + l + 96] as i32;
                }
            }
            let isum = (0..16).map(|i| (sc[i] as i8) as i32 * g[i]).sum();
            BlockInts { isum, mins: 0 }
        }
        DType::Q3_K => {
            let (hm, qs) = (&w[0..32], &w[32..96]);
            let scales = q3k_scales(&w[96..108]);
            let mut isum = 0;
            for n in 0..2 {
                for j in 0..4 {
                    let mbit = 1u8 << (n * 4 + j);
                    for half in 0..2 {
                        let mut s = 0;
                        for l in 0..16 {
                            let i = 16 * half + l;
                            let q2 = ((qs[32 * n + i] >> (2 * j)) & 3) as i32;
                            let v = q2 - if hm[i] & mbit != 0 { 0 } else { 4 };
                            s += v * x[128 * n + 32 * j + i] as i32;
                        }
                        isum += scales[n * 8 + j * 2 + half] as i32 * s;
                    }
                }
            }
            BlockInts { isum, mins: 0 }
        }
        DType::Q2_K => {
            let (sc, qs) = (&w[0..16], &w[16..80]);
            let (mut isum, mut mins) = (0, 0);
            for n in 0..2 {
                for j in 0..4 {
                    for half in 0..2 {
                        let g = n * 8 + j * 2 + half;
                        let mut s = 0;
                        for l in 0..16 {
                            let i = 16 * half + l;
                            s += ((qs[32 * n + i] >> (2 * j)) & 3) as i32 * x[128 * n + 32 * j + i] as i32;
                        }
                        isum += (sc[g] & 0xF) as i32 * s;
                        mins += (sc[g] >> 4) as i32 * bsums[g];
                    }
                }
            }
            BlockInts { isum, mins }
        }
        _ => unreachable!("{dtype} is not block-quantized"),
    }
}

/// Integer lanes of a Q4_K/Q5_K/Q6_K superblock, as the 512-bit kernels leave them.
///
/// Lane `L` of vector `k` (0..4) covers elements `64k + 32·(L/8) + 4·(L%8) + 0..4` (for
/// Q4_K/Q5_K: sub-block `2k + L/8`); `main[L]` sums over `k` of scale × Σ code·x of those four
/// elements. `side[L]` (8 lanes) is Q4_K/Q5_K's `min_L · Σx` of sub-block L, or Q6_K's
/// `32 · (scale_{2L}·Σx_{2L} + scale_{2L+1}·Σx_{2L+1})` over its 16-value groups.
pub fn kquant_lanes(dtype: DType, w: &[u8], x: &[i8], bsums: &[i16]) -> ([i32; 16], [i32; 8]) {
    let mut main = [0i32; 16];
    let mut side = [0i32; 8];
    let mut codes = [0i32; 256];
    let mut scale_of = [0i32; 256];
    match dtype {
        DType::Q4_K | DType::Q5_K => {
            let sc = &w[4..16];
            let (qh, qs) = if dtype == DType::Q5_K { (&w[16..48], &w[48..176]) } else { (&w[0..0], &w[16..144]) };
            for c in 0..4 {
                let (s1, _) = scale_min_k4(2 * c, sc);
                let (s2, _) = scale_min_k4(2 * c + 1, sc);
                for l in 0..32 {
                    let q = qs[32 * c + l];
                    let (mut lo, mut hi) = ((q & 0xF) as i32, (q >> 4) as i32);
                    if dtype == DType::Q5_K {
                        lo += (((qh[l] >> (2 * c)) & 1) as i32) << 4;
                        hi += (((qh[l] >> (2 * c + 1)) & 1) as i32) << 4;
                    }
                    codes[64 * c + l] = lo;
                    codes[64 * c + 32 + l] = hi;
                    scale_of[64 * c + l] = s1 as i32;
                    scale_of[64 * c + 32 + l] = s2 as i32;
                }
            }
            for (j, s) in side.iter_mut().enumerate() {
                let (_, m) = scale_min_k4(j, sc);
                *s = m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
            }
        }
        DType::Q6_K => {
            let (ql, qh, sc) = (&w[0..128], &w[128..192], &w[192..208]);
            for n in 0..2 {
                for l in 0..32 {
                    let (a, h) = (ql[64 * n + l], qh[32 * n + l]);
                    let b = ql[64 * n + l + 32];
                    let base = 128 * n;
                    codes[base + l] = ((a & 0xF) | ((h & 3) << 4)) as i32;
                    codes[base + l + 32] = ((b & 0xF) | (((h >> 2) & 3) << 4)) as i32;
                    codes[base + l + 64] = ((a >> 4) | (((h >> 4) & 3) << 4)) as i32;
                    codes[base + l + 96] = ((b >> 4) | (((h >> 6) & 3) << 4)) as i32;
                }
            }
            for (e, s) in scale_of.iter_mut().enumerate() {
                *s = (sc[e / 16] as i8) as i32;
            }
            for (j, s) in side.iter_mut().enumerate() {
                let g = (sc[2 * j] as i8) as i32 * bsums[2 * j] as i32 + (sc[2 * j + 1] as i8) as i32 * bsums[2 * j + 1] as i32;
                *s = 32 * g;
            }
        }
        _ => unreachable!("{dtype} has no lane layout"),
    }
    for k in 0..4 {
        for (lane, m) in main.iter_mut().enumerate() {
            let e0 = 64 * k + 32 * (lane / 8) + 4 * (lane % 8);
            let dot: i32 = (e0..e0 + 4).map(|e| codes[e] * x[e] as i32).sum();
            *m += scale_of[e0] * dot;
        }
    }
    (main, side)
}

/// Whether `dtype` accumulates in K-quant lanes (the formats with SIMD kernels).
pub fn has_kquant_lanes(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

/// Float lanes of the 32-element block formats: block `b` accumulates into lane `b % 8`, and
/// the lanes are tree-summed at the end, so eight blocks at a time can go through one vector.
pub const LANES32: usize = 8;

/// Tree-sums the eight lanes in the fixed order (4, 2, 1).
#[inline(always)]
pub fn reduce8(mut l: [f32; LANES32]) -> f32 {
    for w in [4, 2, 1] {
        for i in 0..w {
            l[i] += l[i + w];
        }
    }
    l[0]
}

/// The scales a block's float formula needs, widened from f16/E8M0 (exact).
#[derive(Clone, Copy, Debug, Default)]
pub struct BlockScales {
    pub d: f32,
    /// Q4_1/Q5_1: the block minimum `m`; Q2_K/Q4_K/Q5_K: `dmin`.
    pub m: f32,
}

pub fn block_scales(dtype: DType, w: &[u8]) -> BlockScales {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => BlockScales { d: f16_at(w, 0), m: 0.0 },
        DType::MXFP4 => BlockScales { d: e8m0_half(w[0]), m: 0.0 },
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => BlockScales { d: f16_at(w, 0), m: f16_at(w, 2) },
        DType::Q2_K => BlockScales { d: f16_at(w, 80), m: f16_at(w, 82) },
        DType::Q6_K => BlockScales { d: f16_at(w, 208), m: 0.0 },
        DType::Q3_K => BlockScales { d: f16_at(w, 108), m: 0.0 },
        _ => unreachable!("{dtype} is not block-quantized"),
    }
}

/// One block's contribution added to `acc` (a lane for 32-blocks, the row sum for K-quants):
/// the float formula of each format. `dx` is the activation block's scale, `sx` its `d·Σq`
/// (Q8_1 only). SIMD variants evaluate exactly these operations, in this order.
#[inline(always)]
pub fn accumulate(dtype: DType, acc: f32, w: BlockScales, ints: BlockInts, dx: f32, sx: f32) -> f32 {
    match dtype {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::MXFP4 | DType::Q6_K | DType::Q3_K => {
            acc + (w.d * dx) * ints.isum as f32
        }
        DType::Q4_1 | DType::Q5_1 => acc + (w.d * dx) * ints.isum as f32 + w.m * sx,
        DType::Q2_K | DType::Q4_K | DType::Q5_K => acc + (w.d * dx) * ints.isum as f32 - (w.m * dx) * ints.mins as f32,
        _ => unreachable!("{dtype} is not block-quantized"),
    }
}

/// Reference dot product of one weight row with activation row `t`.
///
/// Q4_K, Q5_K and Q6_K accumulate lane by lane: per superblock, `main[L] += (d·dx)·lane` and
/// `side[L] += (m·dx)·side_lane` (fused multiply-adds, `m` = dmin, or d for Q6_K), and the
/// result is `reduce16(main) − reduce8(side)`.
pub fn row_dot(dtype: DType, row: &[u8], act: &QuantAct, t: usize) -> f32 {
    let bb = dtype.block_bytes();
    if has_kquant_lanes(dtype) {
        let mut main = [0f32; 16];
        let mut side = [0f32; 8];
        for b in 0..act.blocks_per_row() {
            let i = act.idx(t, b);
            let w = &row[b * bb..(b + 1) * bb];
            let (li, si) = kquant_lanes(dtype, w, act.block_qs(t, b), &act.bsums[i * 16..i * 16 + 16]);
            let sc = block_scales(dtype, w);
            let (md, ms) = (sc.d * act.d[i], if dtype == DType::Q6_K { sc.d } else { sc.m } * act.d[i]);
            for l in 0..16 {
                main[l] = md.mul_add(li[l] as f32, main[l]);
            }
            for l in 0..8 {
                side[l] = ms.mul_add(si[l] as f32, side[l]);
            }
        }
        return crate::float::reduce16(main) - reduce8(side);
    }
    let lanes32 = dtype.block_elems() == 32;
    let mut lanes = [0f32; LANES32];
    let mut acc = 0f32;
    for b in 0..act.blocks_per_row() {
        let i = act.idx(t, b);
        let bs: &[i16] = if act.bsums.is_empty() { &[] } else { &act.bsums[i * 16..i * 16 + 16] };
        let w = &row[b * bb..(b + 1) * bb];
        let ints = block_ints(dtype, w, act.block_qs(t, b), bs);
        let sx = if act.s.is_empty() { 0.0 } else { act.s[i] };
        let sc = block_scales(dtype, w);
        if lanes32 {
            lanes[b % LANES32] = accumulate(dtype, lanes[b % LANES32], sc, ints, act.d[i], sx);
        } else {
            acc = accumulate(dtype, acc, sc, ints, act.d[i], sx);
        }
    }
    if lanes32 {
        reduce8(lanes)
    } else {
        acc
    }
}

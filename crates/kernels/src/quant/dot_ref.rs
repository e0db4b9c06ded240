//! Scalar reference of every quantized dot product, and the float accumulation every SIMD
//! variant reproduces.
//!
//! A block's contribution splits into exact integer sums (`BlockInts`: computed here by plain
//! loops, by SIMD elsewhere; integer sums do not depend on order) and one float formula per
//! format (`accumulate`), applied block after block, in order, with fused multiply-adds. A
//! SIMD kernel may put tokens or rows in its lanes, but each (row, token) pair goes through
//! exactly these operations, so every variant agrees with this reference to the bit and a
//! row's result never depends on the other rows or tokens it was computed with.

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
        d if super::iq::is_iq(d) => BlockInts { isum: super::iq::block_isum(d, w, x), mins: 0 },
        _ => unreachable!("{dtype} is not block-quantized"),
    }
}

/// Integer sum of a Q8_0 weight block against Q16 activations: Σ q·x, exact in i32
/// (|q| ≤ 127, |x| ≤ 32767, 32 terms).
pub fn block_ints_q16(dtype: DType, w: &[u8], x: &[i16]) -> BlockInts {
    assert_eq!(dtype, DType::Q8_0, "Q16 activations pair with Q8_0 weights");
    BlockInts { isum: w[2..34].iter().zip(x).map(|(q, v)| *q as i8 as i32 * *v as i32).sum(), mins: 0 }
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
        // IQ formats: `D`, the f16 times a power of two (see `iq`).
        d if super::iq::is_iq(d) => BlockScales { d: super::iq::block_scale(d, w), m: 0.0 },
        _ => unreachable!("{dtype} is not block-quantized"),
    }
}

/// Whether the format's float formula has a second term (a block minimum).
pub fn has_min(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q5_1 | DType::Q2_K | DType::Q4_K | DType::Q5_K)
}

/// One block's contribution added to `acc`:
///
/// * every format: `acc = fma(d·dx, isum, acc)` (IQ formats: `d` is the block scale `D`);
/// * Q4_1, Q5_1: then `acc = fma(m, sx, acc)` (`sx` = the activation block's `d·Σq`);
/// * Q2_K, Q4_K, Q5_K: then `acc = fma(−(dmin·dx), mins, acc)`.
///
/// Products of two scales are rounded to f32 before the fused step; integers convert to f32
/// with round-to-nearest. SIMD kernels evaluate exactly these operations.
#[inline(always)]
pub fn accumulate(dtype: DType, acc: f32, w: BlockScales, ints: BlockInts, dx: f32, sx: f32) -> f32 {
    let acc = (w.d * dx).mul_add(ints.isum as f32, acc);
    match dtype {
        DType::Q4_1 | DType::Q5_1 => w.m.mul_add(sx, acc),
        DType::Q2_K | DType::Q4_K | DType::Q5_K => (-(w.m * dx)).mul_add(ints.mins as f32, acc),
        _ => acc,
    }
}

/// Reference dot product of one weight row with activation row `t`.
pub fn row_dot(dtype: DType, row: &[u8], act: &QuantAct, t: usize) -> f32 {
    let bb = dtype.block_bytes();
    let mut acc = 0f32;
    for b in 0..act.blocks_per_row() {
        let i = act.idx(t, b);
        let bs: &[i16] = if act.bsums.is_empty() { &[] } else { &act.bsums[i * 16..i * 16 + 16] };
        let w = &row[b * bb..(b + 1) * bb];
        let ints = if act.kind == super::act::ActKind::Q16 {
            block_ints_q16(dtype, w, act.block_qs16(t, b))
        } else {
            block_ints(dtype, w, act.block_qs(t, b), bs)
        };
        let sx = if act.s.is_empty() { 0.0 } else { act.s[i] };
        acc = accumulate(dtype, acc, block_scales(dtype, w), ints, act.d[i], sx);
    }
    acc
}

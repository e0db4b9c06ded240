//! Activations quantized per block, the way GGML's dot products expect them: the weight type
//! decides the activation type (its "vec_dot type").
//!
//! * Q8_0: 32 values, `d = max|x| / 127` (stored rounded to f16, as GGML stores it), `q = round(x / d)`.
//! * Q8_1: as Q8_0, plus `s = d · Σq` (f16) for formats with a block minimum (Q4_1, Q5_1).
//! * Q8_K: 256 values, `d = −max / 127` with the signed max (so the extreme value maps to −127),
//!   `q = round_half_even(x / d)` clamped to 127, plus the sums of each 16 values.
//! * Q16 (for Q8_0 weights): 32 values as 16-bit integers, `d = max|x| / 32767` (f32),
//!   `q = round(x / d)`. Where the weights carry 8 bits, 8-bit activations double the error
//!   of the product (llama.cpp pairs Q8_0 weights with Q8_0 activations); 16 bits make the
//!   activations' share negligible, at about the same cost (sign-extend the weights, one
//!   `vpmaddwd` per 16 products).
//!
//! Quantization is per token row, so it never depends on the batch. The SIMD levels quantize
//! with `act_x86`, to the same bits.

use super::blocks::{nearest_int, round_away};
use crate::cpu::Isa;
use crate::dtype::DType;
use half::f16;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum ActKind {
    Q8_0,
    Q8_1,
    Q8_K,
    Q16,
}

impl ActKind {
    /// The activation type GGML pairs with weights of `dtype`.
    pub fn for_weights(dtype: DType) -> Option<ActKind> {
        Some(match dtype {
            DType::Q8_0 => ActKind::Q16,
            DType::Q4_0 | DType::Q5_0 | DType::MXFP4 | DType::IQ4_NL => ActKind::Q8_0,
            DType::Q4_1 | DType::Q5_1 => ActKind::Q8_1,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K => ActKind::Q8_K,
            DType::IQ4_XS
            | DType::IQ3_XXS
            | DType::IQ3_S
            | DType::IQ2_XXS
            | DType::IQ2_XS
            | DType::IQ2_S
            | DType::IQ1_S
            | DType::IQ1_M => ActKind::Q8_K,
            _ => return None,
        })
    }

    pub fn block(self) -> usize {
        match self {
            ActKind::Q8_0 | ActKind::Q8_1 | ActKind::Q16 => 32,
            ActKind::Q8_K => 256,
        }
    }
}

/// `rows` activation rows of `cols` values, quantized.
pub struct QuantAct {
    pub kind: ActKind,
    pub cols: usize,
    pub rows: usize,
    /// Per block.
    pub d: Vec<f32>,
    /// Q8_1: `d · Σq` per block (f16-rounded). Empty otherwise.
    pub s: Vec<f32>,
    /// Per block: Σq as an integer (all kinds).
    pub sum: Vec<i32>,
    /// Q8_K: Σq of every 16 values (at most 16·127 in magnitude). Empty otherwise.
    pub bsums: Vec<i16>,
    /// Quantized values, row after row; each row padded with zero blocks to `stride` blocks
    /// (a multiple of 8), so kernels can take eight blocks at a time. Empty for Q16.
    pub qs: Vec<i8>,
    /// Q16's values, laid out as `qs`. Empty otherwise.
    pub qs16: Vec<i16>,
    /// Blocks per row in the padded layout.
    pub stride: usize,
}

impl QuantAct {
    pub fn new(kind: ActKind, x: &[f32], rows: usize, cols: usize) -> QuantAct {
        QuantAct::new_isa(crate::cpu::isa(), kind, x, rows, cols)
    }

    /// As `new`, with the instruction set named (the values do not depend on it).
    pub fn new_isa(isa: Isa, kind: ActKind, x: &[f32], rows: usize, cols: usize) -> QuantAct {
        assert_eq!(x.len(), rows * cols);
        assert!(cols.is_multiple_of(kind.block()), "{cols} columns are not whole {kind:?} blocks");
        let bl = kind.block();
        let per_row = cols / bl;
        let stride = per_row.div_ceil(8) * 8;
        let nb = rows * stride;
        let mut a = QuantAct {
            kind,
            cols,
            rows,
            d: vec![0.0; nb],
            s: if kind == ActKind::Q8_1 { vec![0.0; nb] } else { Vec::new() },
            sum: vec![0; nb],
            bsums: if kind == ActKind::Q8_K { vec![0; nb * 16] } else { Vec::new() },
            qs: if kind == ActKind::Q16 { Vec::new() } else { vec![0; nb * bl] },
            qs16: if kind == ActKind::Q16 { vec![0; nb * bl] } else { Vec::new() },
            stride,
        };
        for (t, b) in (0..rows).flat_map(|t| (0..per_row).map(move |b| (t, b))) {
            let xs = &x[t * cols + b * bl..t * cols + (b + 1) * bl];
            let b = t * stride + b;
            // SAFETY: the level was detected (or forced lower) by `cpu::isa()`; `xs` is one block
            // and `b` indexes this row's block in arrays sized for every row's padded blocks.
            #[cfg(target_arch = "x86_64")]
            if isa >= Isa::Avx2 && unsafe { super::act_x86::quantize_block(&mut a, xs, b) } {
                continue;
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = isa;
            a.quantize_block(xs, b);
        }
        a
    }

    /// The scalar reference: block `b` from its values `xs`.
    fn quantize_block(&mut self, xs: &[f32], b: usize) {
        let bl = self.kind.block();
        if self.kind == ActKind::Q16 {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 32767.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let q = &mut self.qs16[b * bl..(b + 1) * bl];
            let mut sum = 0;
            for (qv, xv) in q.iter_mut().zip(xs) {
                *qv = round_away(xv * id).clamp(-32767, 32767) as i16;
                sum += *qv as i32;
            }
            self.d[b] = d;
            self.sum[b] = sum;
            return;
        }
        let q = &mut self.qs[b * bl..(b + 1) * bl];
        match self.kind {
            ActKind::Q8_0 | ActKind::Q8_1 => {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut sum = 0;
                for (qv, xv) in q.iter_mut().zip(xs) {
                    *qv = round_away(xv * id) as i8;
                    sum += *qv as i32;
                }
                self.d[b] = f16::from_f32(d).to_f32();
                self.sum[b] = sum;
                if self.kind == ActKind::Q8_1 {
                    self.s[b] = f16::from_f32(d * sum as f32).to_f32();
                }
            }
            ActKind::Q8_K => {
                let mut max = 0f32;
                let mut amax = 0f32;
                for v in xs {
                    if v.abs() > amax {
                        amax = v.abs();
                        max = *v;
                    }
                }
                if amax == 0.0 {
                    return;
                }
                let iscale = -127.0 / max;
                for (qv, xv) in q.iter_mut().zip(xs) {
                    *qv = nearest_int(iscale * xv).min(127) as i8;
                }
                for g in 0..16 {
                    self.bsums[b * 16 + g] = q[16 * g..16 * g + 16].iter().map(|v| *v as i16).sum();
                }
                self.sum[b] = self.bsums[b * 16..b * 16 + 16].iter().map(|v| *v as i32).sum();
                self.d[b] = 1.0 / iscale;
            }
            ActKind::Q16 => unreachable!("handled above"),
        }
    }

    pub fn blocks_per_row(&self) -> usize {
        self.cols / self.kind.block()
    }

    /// Q16 values of block `b` of row `t`.
    #[inline(always)]
    pub fn block_qs16(&self, t: usize, b: usize) -> &[i16] {
        let o = self.idx(t, b) * 32;
        &self.qs16[o..o + 32]
    }

    /// Quantized values of block `b` of row `t`.
    #[inline(always)]
    pub fn block_qs(&self, t: usize, b: usize) -> &[i8] {
        let bl = self.kind.block();
        let o = self.idx(t, b) * bl;
        &self.qs[o..o + bl]
    }

    /// Index of block `b` of row `t` in the per-block arrays.
    #[inline(always)]
    pub fn idx(&self, t: usize, b: usize) -> usize {
        t * self.stride + b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8k_maps_the_extreme_value_to_minus_127() {
        let mut x = vec![0.01f32; 256];
        x[5] = 2.0;
        x[9] = -1.0;
        let a = QuantAct::new(ActKind::Q8_K, &x, 1, 256);
        assert_eq!(a.qs[5], -127);
        assert_eq!(a.qs[9], 64); // −1 / (−2/127) = 63.5 → ties to even
        assert!((a.d[0] * a.qs[5] as f32 - 2.0).abs() < 1e-6);
        assert_eq!(a.bsums[0] as i32, a.qs[..16].iter().map(|v| *v as i32).sum::<i32>());
    }

    #[test]
    fn q8_1_carries_the_scaled_sum() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) / 10.0).collect();
        let a = QuantAct::new(ActKind::Q8_1, &x, 2, 32);
        for t in 0..2 {
            let b = a.idx(t, 0);
            let sum: i32 = a.block_qs(t, 0).iter().map(|v| *v as i32).sum();
            assert_eq!(a.sum[b], sum);
            assert!((a.s[b] - a.d[b] * sum as f32).abs() <= 0.01 * a.s[b].abs().max(1.0));
            // Padding blocks are all zero.
            assert!(a.block_qs(t, 1).iter().all(|q| *q == 0) && a.d[a.idx(t, 7)] == 0.0);
        }
    }

    /// Every field as integers (floats by their bits).
    fn fields(a: &QuantAct) -> Vec<Vec<i64>> {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits() as i64).collect();
        let ints = |v: &mut dyn Iterator<Item = i64>| v.collect();
        vec![
            bits(&a.d),
            bits(&a.s),
            ints(&mut a.sum.iter().map(|v| *v as i64)),
            ints(&mut a.bsums.iter().map(|v| *v as i64)),
            ints(&mut a.qs.iter().map(|v| *v as i64)),
            ints(&mut a.qs16.iter().map(|v| *v as i64)),
        ]
    }

    #[test]
    fn every_level_quantizes_to_the_scalar_bits() {
        // Rows of 512 values, one kind of trouble per 32-value stretch (so every Q8_K block and
        // several 32-value blocks meet several): ordinary values, exact halves after scaling (ties
        // for both roundings), the largest magnitude twice with both signs in either order, zeros
        // and negative zeros, an infinity, a NaN, subnormal values (their inverse scale
        // overflows), huge ones.
        let mut s = 0x9e37_79b9u32;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let rows = 6;
        let mut x = vec![0f32; rows * 512];
        for (r, row) in x.chunks_exact_mut(512).enumerate() {
            for (i, v) in row.iter_mut().enumerate() {
                *v = match (i / 32 + r) % 10 {
                    0 | 1 => rnd() * 8.0,
                    // With 127 the largest magnitude, Q8_0's scale is 1 and Q8_K's −1 (or 1).
                    2 => [127.0, 2.5, -3.5, 0.5, -0.5, 126.5, -126.5, 1.5][i % 8],
                    3 => [-127.0, 2.5, -2.5, 4.5, 0.5, 1.0, -6.5, 0.0][i % 8],
                    4 => match i % 32 {
                        3 => -2.0,
                        10 => 2.0,
                        _ => rnd(),
                    },
                    5 => [0.0, -0.0][i % 2],
                    6 if i % 32 == 7 => [f32::INFINITY, f32::NEG_INFINITY, f32::NAN][r % 3],
                    7 => rnd() * 1e-39,
                    8 => rnd() * 1e37,
                    _ => rnd(),
                };
            }
        }
        // A Q8_K block of ties only, where the largest magnitude comes second with the other sign.
        // A Q8_K block of subnormal values only.
        x[5 * 512 + 256..6 * 512].iter_mut().for_each(|v| *v = rnd() * 1e-39);
        x[512..768]
            .iter_mut()
            .enumerate()
            .for_each(|(i, v)| *v = if i == 1 { 127.0 } else { [-127.0, 63.5, -0.5][i % 3] });
        for kind in [ActKind::Q8_0, ActKind::Q8_1, ActKind::Q8_K, ActKind::Q16] {
            let scalar = QuantAct::new_isa(Isa::Scalar, kind, &x, rows, 512);
            for isa in Isa::supported().into_iter().filter(|i| *i != Isa::Scalar) {
                let simd = QuantAct::new_isa(isa, kind, &x, rows, 512);
                assert!(fields(&simd) == fields(&scalar), "{kind:?} at {isa:?} differs from the scalar reference");
            }
            // The data reaches the cases it is for.
            let nonzero = scalar.d.iter().filter(|d| **d != 0.0).count();
            assert!(nonzero > rows, "{kind:?}: {nonzero} blocks with a scale");
        }
    }
}

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
//! Quantization is per token row, so it never depends on the batch.

use super::blocks::{nearest_int, round_away};
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
            if kind == ActKind::Q16 {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 32767.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q = &mut a.qs16[b * bl..(b + 1) * bl];
                let mut sum = 0;
                for (qv, xv) in q.iter_mut().zip(xs) {
                    *qv = round_away(xv * id).clamp(-32767, 32767) as i16;
                    sum += *qv as i32;
                }
                a.d[b] = d;
                a.sum[b] = sum;
                continue;
            }
            let q = &mut a.qs[b * bl..(b + 1) * bl];
            match kind {
                ActKind::Q8_0 | ActKind::Q8_1 => {
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let mut sum = 0;
                    for (qv, xv) in q.iter_mut().zip(xs) {
                        *qv = round_away(xv * id) as i8;
                        sum += *qv as i32;
                    }
                    a.d[b] = f16::from_f32(d).to_f32();
                    a.sum[b] = sum;
                    if kind == ActKind::Q8_1 {
                        a.s[b] = f16::from_f32(d * sum as f32).to_f32();
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
                        continue;
                    }
                    let iscale = -127.0 / max;
                    for (qv, xv) in q.iter_mut().zip(xs) {
                        *qv = nearest_int(iscale * xv).min(127) as i8;
                    }
                    for g in 0..16 {
                        a.bsums[b * 16 + g] = q[16 * g..16 * g + 16].iter().map(|v| *v as i16).sum();
                    }
                    a.sum[b] = a.bsums[b * 16..b * 16 + 16].iter().map(|v| *v as i32).sum();
                    a.d[b] = 1.0 / iscale;
                }
                ActKind::Q16 => unreachable!("handled above"),
            }
        }
        a
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
}

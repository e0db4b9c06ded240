//! Activations of up to 16 tokens regrouped for the tiled prefill kernels (tokens in lanes):
//! for every 4 consecutive values of the reduction dimension, the 4 bytes of each token side by
//! side, so that one broadcast 4-byte group of a weight row meets all the panel's tokens in one
//! integer dot-product instruction (`x86_512`: one 512-bit vector of 16 tokens; `tiled_avx2`: two
//! 256-bit halves of 8). Per-block activation scales and sums are laid out the same way, one lane
//! per token. Lanes past the panel's tokens hold zeros.
//!
//! A flipped panel holds 8-bit activation codes plus 128 (their sign bits flipped: unsigned
//! bytes), for the kernels that multiply signed weight codes (`x86_512::flips`); it leaves out
//! the pairs of 16-value sums, which those kernels do not read.

use super::act::QuantAct;

/// Tokens per panel (the lanes of a 512-bit vector of i32; two 256-bit halves).
pub const TILE: usize = 16;
/// Weight rows per microkernel pass.
pub const ROWS: usize = 4;

/// Up to 16 tokens' quantized activations, regrouped for the microkernels.
pub struct Panel {
    /// Real tokens (the remaining lanes are zero).
    pub n: usize,
    pub nb: usize,
    /// `[K/4][16]`: dword g (values 4g..4g+4) of each token; for Q16 activations (16-bit)
    /// `[K/2][16]`, dword g holding values 2g and 2g + 1.
    pub(super) codes: Vec<u32>,
    /// `[block][16]` activation scales.
    pub(super) dx: Vec<f32>,
    /// `[block][16]` Q8_1's `d·Σq`.
    pub(super) sx: Vec<f32>,
    /// `[block][16]` Σq.
    pub(super) xsum: Vec<i32>,
    /// Q8_K: `[block][pair j][16]`, the 16-value sums 2j and 2j+1 as two i16.
    pub(super) bpairs: Vec<u32>,
}

impl Panel {
    /// Tokens `t0..t0 + n` (n ≤ 16) of `act`, flipped if `flip` (8-bit codes only).
    pub fn new(act: &QuantAct, t0: usize, n: usize, flip: bool) -> Panel {
        assert!((1..=TILE).contains(&n));
        let (k, nb, bl) = (act.cols, act.blocks_per_row(), act.kind.block());
        let wide = !act.qs16.is_empty();
        assert!(!(wide && flip), "only 8-bit activation codes are flipped");
        let sign = if flip { 0x8080_8080 } else { 0 };
        let mut codes = vec![0u32; if wide { k / 2 } else { k / 4 } * TILE];
        let mut dx = vec![0f32; nb * TILE];
        let mut sx = vec![0f32; if act.s.is_empty() { 0 } else { nb * TILE }];
        let mut xsum = vec![0i32; nb * TILE];
        let mut bpairs = vec![0u32; if act.bsums.is_empty() || flip { 0 } else { nb * 8 * TILE }];
        for c in 0..n {
            let t = t0 + c;
            let base = act.idx(t, 0) * bl;
            if wide {
                for (g, q) in act.qs16[base..base + k].chunks_exact(2).enumerate() {
                    codes[g * TILE + c] = q[0] as u16 as u32 | (q[1] as u16 as u32) << 16;
                }
            } else {
                for (g, q) in act.qs[base..base + k].chunks_exact(4).enumerate() {
                    codes[g * TILE + c] = u32::from_le_bytes([q[0] as u8, q[1] as u8, q[2] as u8, q[3] as u8]) ^ sign;
                }
            }
            for b in 0..nb {
                let i = act.idx(t, b);
                dx[b * TILE + c] = act.d[i];
                xsum[b * TILE + c] = act.sum[i];
                if !sx.is_empty() {
                    sx[b * TILE + c] = act.s[i];
                }
                if !bpairs.is_empty() {
                    for j in 0..8 {
                        let (lo, hi) = (act.bsums[i * 16 + 2 * j] as u16, act.bsums[i * 16 + 2 * j + 1] as u16);
                        bpairs[(b * 8 + j) * TILE + c] = lo as u32 | (hi as u32) << 16;
                    }
                }
            }
        }
        Panel { n, nb, codes, dx, sx, xsum, bpairs }
    }
}

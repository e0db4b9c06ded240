//! Deterministic pseudo-random inputs for the tests, the kernel labs and the benchmarks: the
//! same seed gives the same values on every machine.

use crate::DType;

/// Uniform values in [−1, 1) from a 64-bit linear congruential generator.
pub fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// `rows × cols` uniform values quantized into rows of `dtype`.
pub fn quantized(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut r = uniform(seed);
    let v: Vec<f32> = (0..rows * cols).map(|_| r()).collect();
    crate::quant::quantize_rows(dtype, &v, cols)
}

//! Runs a fixed amount of decode work (matrix-vector products of one format, one thread) so
//! that an instruction counter (`valgrind --tool=callgrind`) can compare kernel variants
//! repeatably on a machine whose timings are noisy:
//!
//! `valgrind --tool=callgrind target/release/examples/matvec_work Q4_K 200`
//! (instructions per weight byte = total / (200 × the printed bytes)).

use sluice_kernels::{DType, MatRef, ThreadPool};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dtype = args.get(1).and_then(|s| DType::from_name(s)).expect("usage: matvec_work DTYPE [ITERS] [TOKENS]");
    let iters: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(100);
    let n: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(1);
    let (rows, cols) = (512, 2048);
    let mut s = 12345u64;
    let mut r = || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    let v: Vec<f32> = (0..rows * cols).map(|_| r()).collect();
    let w = sluice_kernels::quant::quantize_rows(dtype, &v, cols);
    let x: Vec<f32> = (0..n * cols).map(|_| r()).collect();
    let mut out = vec![0f32; n * rows];
    let m = MatRef::new(dtype, rows, cols, &w).unwrap();
    let pool = ThreadPool::new(1);
    for _ in 0..iters {
        sluice_kernels::matmul(&pool, m, &x, n, &mut out);
    }
    println!(
        "{} bytes of {} weights x {n} tokens, {iters} times; checksum {}",
        w.len(),
        dtype.name(),
        out.iter().sum::<f32>()
    );
}

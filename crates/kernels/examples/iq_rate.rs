use sluice_kernels::{DType, MatRef, ThreadPool};
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1);
    let types: Vec<DType> = args[2..].iter().filter_map(|s| DType::from_name(s)).collect();
    for dtype in types {
        let cols = 2048;
        let rows = if n == 1 { (200 * 1024 / dtype.row_bytes(cols).unwrap()).max(8) } else { 256 };
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
        let mut best = f64::MAX;
        for _ in 0..300 {
            let t0 = Instant::now();
            sluice_kernels::matmul(&pool, m, &x, n, &mut out);
            best = best.min(t0.elapsed().as_secs_f64());
        }
        if n == 1 {
            println!(
                "{:8} decode  {:6.2} GB/s  {:6.1} ns/block",
                dtype.name(),
                w.len() as f64 / best / 1e9,
                best * 1e9 / (w.len() / dtype.block_bytes()) as f64
            );
        } else {
            println!("{:8} n={n} {:6.2} GMAC/s", dtype.name(), (rows * cols * n) as f64 / best / 1e9);
        }
    }
}

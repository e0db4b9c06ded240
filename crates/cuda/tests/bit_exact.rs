//! The CUDA matmul against the CPU, bit for bit. These need an NVIDIA GPU, so they are
//! ignored by default: on a CUDA machine run `cargo test -p sluice-cuda -- --ignored` (or the
//! built test binary with `--ignored`; `tools/cuda/stage.sh` builds one to carry there).

use sluice_cuda::Gpu;
use sluice_kernels::compare::first_difference;
use sluice_kernels::quant::act::{ActKind, QuantAct};
use sluice_kernels::testdata::{quantized as weights, uniform as rng};
use sluice_kernels::{matmul_ref, DType, MatRef};

const FORMATS: [DType; 6] = [DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q2_K, DType::Q3_K, DType::Q8_0];

/// Activations with the cases quantizers trip on: an all-zero block, a block whose largest
/// magnitude occurs with both signs, values on rounding ties, and widely varying scales.
fn activations(n: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    let mut x: Vec<f32> = (0..n * cols).map(|i| r() * (1.0 + (i % 97) as f32)).collect();
    x[..cols.min(256)].iter_mut().for_each(|v| *v = 0.0);
    if n > 1 {
        let row = &mut x[cols..2 * cols];
        row[3] = -5.0;
        row[10] = 5.0;
        for (i, v) in row.iter_mut().enumerate().skip(32).take(64) {
            *v = (i as f32 - 64.0) * 0.5 * 5.0 / 127.0;
        }
    }
    x
}

fn matmul_lanes(gpu: &Gpu, w: &sluice_cuda::GpuMatrix, x: &[f32], n: usize, lanes: usize) -> Vec<f32> {
    let xd = gpu.stream().clone_htod(x).unwrap();
    let act = gpu.quantize(w.dtype, &xd, n, w.cols).unwrap();
    let mut out = gpu.stream().alloc_zeros::<f32>(n * w.rows).unwrap();
    gpu.matmul_lanes(w, &act, &mut out, lanes).unwrap();
    gpu.stream().clone_dtoh(&out).unwrap()
}

fn open() -> Gpu {
    Gpu::open(0).unwrap_or_else(|e| panic!("these tests need a CUDA device: {e}"))
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn every_format_matches_the_cpu_reference_bit_for_bit() {
    let gpu = open();
    for dtype in FORMATS {
        for (rows, cols) in [(37, 256), (64, 2048), (19, 2816)] {
            let data = weights(dtype, rows, cols, rows as u64 * 31 + cols as u64);
            let w = MatRef::new(dtype, rows, cols, &data).unwrap();
            let gw = gpu.upload(w).unwrap();
            // Up to 17 tokens: one to three token blocks; 100: thirteen, the last one short.
            for n in [1, 2, 7, 8, 9, 17, 100] {
                let x = activations(n, cols, n as u64 + 7);
                let mut want = vec![0f32; n * rows];
                matmul_ref(w, &x, n, &mut want);
                for lanes in [8, 16] {
                    let got = matmul_lanes(&gpu, &gw, &x, n, lanes);
                    for (i, (a, b)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{dtype} {rows}x{cols} n={n} lanes={lanes}: token {} row {}: CPU {a} GPU {b}",
                            i / rows,
                            i % rows
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn activations_are_quantized_as_the_cpu_quantizes_them() {
    let gpu = open();
    for dtype in [DType::Q4_K, DType::Q8_0] {
        let (n, cols) = (5, 1024);
        let x = activations(n, cols, 3);
        let cpu = QuantAct::new(ActKind::for_weights(dtype).unwrap(), &x, n, cols);
        let xd = gpu.stream().clone_htod(&x).unwrap();
        let h = gpu.quantize(dtype, &xd, n, cols).unwrap().to_host(&gpu).unwrap();
        let (d, qs, bsums, qs16) = (h.d, h.qs, h.bsums, h.qs16);
        let bl = cpu.kind.block();
        let per_row = cols / bl;
        for t in 0..n {
            for b in 0..per_row {
                let (g, c) = (t * per_row + b, cpu.idx(t, b));
                assert_eq!(d[g].to_bits(), cpu.d[c].to_bits(), "{dtype} token {t} block {b}: d");
                if cpu.kind == ActKind::Q8_K {
                    assert_eq!(&qs[g * 256..(g + 1) * 256], cpu.block_qs(t, b), "token {t} block {b}: codes");
                    assert_eq!(&bsums[g * 16..(g + 1) * 16], &cpu.bsums[c * 16..(c + 1) * 16], "token {t} block {b}");
                } else {
                    assert_eq!(&qs16[g * 32..(g + 1) * 32], cpu.block_qs16(t, b), "token {t} block {b}: codes");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn a_row_does_not_depend_on_the_batch() {
    let gpu = open();
    let (rows, cols, n) = (96, 2048, 13);
    for dtype in [DType::Q4_K, DType::Q6_K] {
        let data = weights(dtype, rows, cols, 11);
        let gw = gpu.upload(MatRef::new(dtype, rows, cols, &data).unwrap()).unwrap();
        let x = activations(n, cols, 5);
        let batch = gpu.matmul_host(&gw, &x, n).unwrap();
        for t in 0..n {
            let alone = gpu.matmul_host(&gw, &x[t * cols..(t + 1) * cols], 1).unwrap();
            let d = first_difference(&alone, &batch[t * rows..(t + 1) * rows]);
            assert_eq!(d, None, "{dtype} token {t}: alone and in the batch differ at row {d:?}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn grouped_expert_matmul_equals_each_expert_alone() {
    let gpu = open();
    let (n_expert, rows, cols) = (6, 96, 512);
    for dtype in [DType::Q4_K, DType::Q6_K, DType::Q8_0] {
        let datas: Vec<Vec<u8>> = (0..n_expert).map(|e| weights(dtype, rows, cols, 100 + e as u64)).collect();
        let mats: Vec<MatRef> = datas.iter().map(|d| MatRef::new(dtype, rows, cols, d).unwrap()).collect();
        let gmats: Vec<_> = mats.iter().map(|m| gpu.upload(*m).unwrap()).collect();
        // 40 tokens: 20 entries an expert, shared between three token blocks.
        for n in [1, 5, 40] {
            let x = activations(n, cols, 40 + n as u64);
            // Token t routes to experts (t + 2k) % n_expert, k < 3; entries grouped by expert.
            let mut pairs: Vec<(usize, usize)> =
                (0..n).flat_map(|t| (0..3).map(move |k| ((t + 2 * k) % n_expert, t))).collect();
            pairs.sort();
            let act_rows: Vec<i32> = pairs.iter().map(|p| p.1 as i32).collect();
            let mut segments = Vec::new();
            let mut i = 0;
            while i < pairs.len() {
                let e = pairs[i].0;
                let end = i + pairs[i..].iter().take_while(|p| p.0 == e).count();
                segments.push((gmats[e].view(&gpu), i..end));
                i = end;
            }
            let xd = gpu.stream().clone_htod(&x).unwrap();
            let act = gpu.quantize(dtype, &xd, n, cols).unwrap();
            let mut out = gpu.stream().alloc_zeros::<f32>(pairs.len() * rows).unwrap();
            gpu.matmul_ids(&segments, &act, &act_rows, &mut out).unwrap();
            let got = gpu.stream().clone_dtoh(&out).unwrap();
            for (i, &(e, t)) in pairs.iter().enumerate() {
                let mut want = vec![0f32; rows];
                matmul_ref(mats[e], &x[t * cols..(t + 1) * cols], 1, &mut want);
                let d = first_difference(&want, &got[i * rows..(i + 1) * rows]);
                assert_eq!(d, None, "{dtype} n={n} expert {e} token {t}: differs from the CPU at row {d:?}");
            }
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on a CUDA machine"]
fn grouped_matmul_refuses_mismatched_input() {
    let gpu = open();
    let a = weights(DType::Q4_K, 8, 256, 1);
    let b = weights(DType::Q4_K, 8, 512, 2);
    let ga = gpu.upload(MatRef::new(DType::Q4_K, 8, 256, &a).unwrap()).unwrap();
    let gb = gpu.upload(MatRef::new(DType::Q4_K, 8, 512, &b).unwrap()).unwrap();
    let xd = gpu.stream().clone_htod(&activations(2, 256, 1)).unwrap();
    let act = gpu.quantize(DType::Q4_K, &xd, 2, 256).unwrap();
    let mut out = gpu.stream().alloc_zeros::<f32>(64).unwrap();
    let shapes = gpu.matmul_ids(&[(ga.view(&gpu), 0..1), (gb.view(&gpu), 1..2)], &act, &[0, 1], &mut out);
    assert!(shapes.unwrap_err().to_string().contains("grouped matmul of Q4_K 8x256 and Q4_K 8x512"));
    let row = gpu.matmul_ids(&[(ga.view(&gpu), 0..2)], &act, &[0, 2], &mut out);
    assert!(row.unwrap_err().to_string().contains("each below 2"));
    let gap = gpu.matmul_ids(&[(ga.view(&gpu), 1..2)], &act, &[0, 1], &mut out);
    assert!(gap.unwrap_err().to_string().contains("does not follow entry 0"));
}

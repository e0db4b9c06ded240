//! CUDA kernel lab: checks every quantized matmul kernel against the CPU scalar reference,
//! bit for bit, then times it on the device: decode (one token) as achieved bandwidth next
//! to the device's own copy rate measured in the same run, and batches of 8 to 512 tokens
//! as GMAC/s, with the activation quantization timed on its own.
//!
//! `cuda-lab [--quick] [--json] [--dtype NAME]`

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaSlice;
use sluice_cuda::{Gpu, GpuMatrix};
use sluice_kernels::{matmul_ref, DType, MatRef};
use std::process::ExitCode;

const FORMATS: [DType; 6] = [DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q8_0, DType::Q2_K, DType::Q3_K];

fn rng(seed: u64) -> impl FnMut() -> f32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = rng(seed);
    (0..n).map(|_| r()).collect()
}

struct Args {
    quick: bool,
    json: bool,
    dtype: Option<DType>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args { quick: false, json: false, dtype: None };
    let mut it = std::env::args().skip(1);
    while let Some(s) = it.next() {
        match s.as_str() {
            "--quick" => a.quick = true,
            "--json" => a.json = true,
            "--dtype" => {
                let v = it.next().ok_or("--dtype needs a format name")?;
                let d = DType::from_name(&v).ok_or_else(|| format!("unknown format {v}"))?;
                if !sluice_cuda::supports(d) {
                    return Err(format!("no CUDA kernel for {d}"));
                }
                a.dtype = Some(d);
            }
            "-h" | "--help" => return Err("cuda-lab [--quick] [--json] [--dtype NAME]".into()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(a)
}

/// Milliseconds `f` takes on the device's stream, timed with events.
fn time_ms(gpu: &Gpu, mut f: impl FnMut() -> Result<(), sluice_cuda::GpuError>) -> Result<f64, sluice_cuda::GpuError> {
    let s = gpu.stream();
    let start = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    f()?;
    let end = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
    Ok(start.elapsed_ms(&end)? as f64)
}

/// Compares the device's matmul with the CPU reference on small shapes; returns the number
/// of outputs compared, or the first difference.
fn check(gpu: &Gpu, dtype: DType) -> Result<usize, String> {
    let mut compared = 0;
    for (rows, cols) in [(37, 256), (64, 2048), (19, 2816)] {
        let data = sluice_kernels::quant::quantize_rows(dtype, &random(rows * cols, cols as u64), cols);
        let w = MatRef::new(dtype, rows, cols, &data).map_err(|e| e.to_string())?;
        let gw = gpu.upload(w).map_err(|e| e.to_string())?;
        for n in [1, 3, 8, 11] {
            let x: Vec<f32> =
                random(n * cols, n as u64).iter().enumerate().map(|(i, v)| v * (1 + i % 13) as f32).collect();
            let mut want = vec![0f32; n * rows];
            matmul_ref(w, &x, n, &mut want);
            let got = gpu.matmul_host(&gw, &x, n).map_err(|e| e.to_string())?;
            if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                return Err(format!(
                    "{rows}x{cols} n={n}: token {} row {}: CPU {} GPU {}",
                    i / rows,
                    i % rows,
                    want[i],
                    got[i]
                ));
            }
            compared += want.len();
        }
    }
    Ok(compared)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("cuda-lab: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let gpu = Gpu::open(0)?;
    println!(
        "device: {} (compute {}.{}), {:.1} GiB",
        gpu.name,
        gpu.capability.0,
        gpu.capability.1,
        gpu.total_mem as f64 / (1u64 << 30) as f64
    );
    let formats: Vec<DType> = args.dtype.map(|d| vec![d]).unwrap_or(FORMATS.to_vec());
    let mut ok = true;
    for &d in &formats {
        match check(&gpu, d) {
            Ok(n) => println!("check {d}: bit-identical to the CPU reference ({n} outputs)"),
            Err(e) => {
                println!("check {d}: MISMATCH {e}");
                ok = false;
            }
        }
    }

    // The device's copy rate (bytes read plus bytes written, per second): the ceiling a
    // matvec that reads its weights once can approach.
    let s = gpu.stream();
    let copy_bytes = 1usize << 30;
    let src = s.alloc_zeros::<u8>(copy_bytes)?;
    let mut dst = s.alloc_zeros::<u8>(copy_bytes)?;
    s.memcpy_dtod(&src, &mut dst)?;
    let reps = 10;
    let ms = time_ms(&gpu, || {
        for _ in 0..reps {
            s.memcpy_dtod(&src, &mut dst)?;
        }
        Ok(())
    })?;
    drop((src, dst));
    let copy_gbs = 2.0 * (copy_bytes * reps) as f64 / (ms * 1e-3) / 1e9;
    println!("copy: {copy_gbs:.0} GB/s (read + write, device to device)");

    let mut results = Vec::new();
    let (rows, cols) = (8192usize, 4096usize);
    for &d in &formats {
        let data = sluice_kernels::quant::quantize_rows(d, &random(rows * cols, 99), cols);
        let w = MatRef::new(d, rows, cols, &data)?;
        // Copies at distinct addresses spanning ≥ 1 GiB, far past the 50–60 MB of L2, so
        // that decode reads memory.
        let copies = (1usize << 30).div_ceil(data.len()).max(2);
        let mats: Vec<GpuMatrix> = (0..copies).map(|_| gpu.upload(w)).collect::<Result<_, _>>()?;
        let mut line =
            serde_json::json!({"dtype": d.to_string(), "rows": rows, "cols": cols, "weight_bytes": data.len()});
        let token_counts: &[usize] = if args.quick { &[1, 64] } else { &[1, 8, 64, 512] };
        for &n in token_counts {
            let x = s.clone_htod(&random(n * cols, n as u64))?;
            let act = gpu.quantize(d, &x, n, cols)?;
            let mut out: CudaSlice<f32> = s.alloc_zeros(n * rows)?;
            let passes = if n == 1 { 4 } else { 1 };
            let per = if n == 1 { copies } else { 8 };
            for m in mats.iter().take(per.min(2)) {
                gpu.matmul(m, &act, &mut out)?;
            }
            let ms = time_ms(&gpu, || {
                for _ in 0..passes {
                    for i in 0..per {
                        gpu.matmul(&mats[i % copies], &act, &mut out)?;
                    }
                }
                Ok(())
            })? / (passes * per) as f64;
            let qms = time_ms(&gpu, || gpu.quantize(d, &x, n, cols).map(|_| ()))?;
            let gbs = data.len() as f64 / (ms * 1e-3) / 1e9;
            let gmacs = (rows * cols * n) as f64 / (ms * 1e-3) / 1e9;
            if n == 1 {
                println!(
                    "{d} {rows}x{cols} n=1: {:.1} µs, {gbs:.0} GB/s of weights ({:.0}% of the copy rate), quantize {:.1} µs",
                    ms * 1e3,
                    100.0 * gbs / copy_gbs,
                    qms * 1e3
                );
            } else {
                println!(
                    "{d} {rows}x{cols} n={n}: {:.1} µs, {gmacs:.0} GMAC/s, quantize {:.1} µs",
                    ms * 1e3,
                    qms * 1e3
                );
            }
            line[format!("n{n}_us")] = serde_json::json!(ms * 1e3);
            line[format!("n{n}_quantize_us")] = serde_json::json!(qms * 1e3);
            line[format!("n{n}_gmacs")] = serde_json::json!(gmacs);
            if n == 1 {
                line["n1_weight_gbs"] = serde_json::json!(gbs);
            }
        }
        results.push(line);
    }
    if args.json {
        let doc = serde_json::json!({
            "device": gpu.name,
            "capability": format!("{}.{}", gpu.capability.0, gpu.capability.1),
            "copy_gbs": copy_gbs,
            "checks_passed": ok,
            "kernels": results,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(ok)
}

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

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut r = sluice_kernels::testdata::uniform(seed);
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

fn matmul_host(gpu: &Gpu, w: &GpuMatrix, x: &[f32], n: usize, lanes: usize) -> Result<Vec<f32>, sluice_cuda::GpuError> {
    let xd = gpu.stream().clone_htod(x)?;
    let act = gpu.quantize(w.dtype, &xd, n, w.cols)?;
    let mut out = gpu.stream().alloc_zeros::<f32>(n * w.rows)?;
    gpu.matmul_lanes(w, &act, &mut out, lanes)?;
    Ok(gpu.stream().clone_dtoh(&out)?)
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
            for lanes in [8, 16] {
                let got = matmul_host(gpu, &gw, &x, n, lanes).map_err(|e| e.to_string())?;
                if let Some(i) = (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits()) {
                    return Err(format!(
                        "{rows}x{cols} n={n} lanes={lanes}: token {} row {}: CPU {} GPU {}",
                        i / rows,
                        i % rows,
                        want[i],
                        got[i]
                    ));
                }
                compared += want.len();
            }
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
            let mut act = gpu.act_buffer(d, n, cols)?;
            gpu.quantize_into(&x, n, &mut act)?;
            let mut out: CudaSlice<f32> = s.alloc_zeros(n * rows)?;
            let passes = if n == 1 { 4 } else { 1 };
            let per = if n == 1 { copies } else { 8 };
            let qms = time_ms(&gpu, || gpu.quantize_into(&x, n, &mut act))?;
            for lanes in [8, 16] {
                for m in mats.iter().take(2) {
                    gpu.matmul_lanes(m, &act, &mut out, lanes)?;
                }
                let ms = time_ms(&gpu, || {
                    for _ in 0..passes {
                        for i in 0..per {
                            gpu.matmul_lanes(&mats[i % copies], &act, &mut out, lanes)?;
                        }
                    }
                    Ok(())
                })? / (passes * per) as f64;
                let gbs = data.len() as f64 / (ms * 1e-3) / 1e9;
                let gmacs = (rows * cols * n) as f64 / (ms * 1e-3) / 1e9;
                if n == 1 {
                    println!(
                        "{d} {rows}x{cols} n=1 lanes={lanes}: {:.1} µs, {gbs:.0} GB/s of weights ({:.0}% of the copy rate), quantize {:.1} µs",
                        ms * 1e3,
                        100.0 * gbs / copy_gbs,
                        qms * 1e3
                    );
                } else {
                    println!(
                        "{d} {rows}x{cols} n={n} lanes={lanes}: {:.1} µs, {gmacs:.0} GMAC/s, quantize {:.1} µs",
                        ms * 1e3,
                        qms * 1e3
                    );
                }
                line[format!("n{n}_g{lanes}_us")] = serde_json::json!(ms * 1e3);
                line[format!("n{n}_g{lanes}_gmacs")] = serde_json::json!(gmacs);
                if n == 1 {
                    line[format!("n1_g{lanes}_weight_gbs")] = serde_json::json!(gbs);
                }
            }
            line[format!("n{n}_quantize_us")] = serde_json::json!(qms * 1e3);
        }
        // Decode of a matrix eight times taller (the same rows repeated): launch costs fade,
        // the kernel's own rate shows.
        let tall = data.repeat(8);
        let wt = MatRef::new(d, 8 * rows, cols, &tall)?;
        let copies = (1usize << 30).div_ceil(tall.len()).max(2);
        drop(mats);
        let mats: Vec<GpuMatrix> = (0..copies).map(|_| gpu.upload(wt)).collect::<Result<_, _>>()?;
        let x = s.clone_htod(&random(cols, 1))?;
        let act = gpu.quantize(d, &x, 1, cols)?;
        let mut out: CudaSlice<f32> = s.alloc_zeros(8 * rows)?;
        for lanes in [8, 16] {
            gpu.matmul_lanes(&mats[0], &act, &mut out, lanes)?;
            let ms = time_ms(&gpu, || {
                for _ in 0..4 {
                    for m in &mats {
                        gpu.matmul_lanes(m, &act, &mut out, lanes)?;
                    }
                }
                Ok(())
            })? / (4 * copies) as f64;
            let gbs = tall.len() as f64 / (ms * 1e-3) / 1e9;
            println!(
                "{d} {}x{cols} n=1 lanes={lanes}: {:.1} µs, {gbs:.0} GB/s of weights ({:.0}% of the copy rate)",
                8 * rows,
                ms * 1e3,
                100.0 * gbs / copy_gbs
            );
            line[format!("tall_n1_g{lanes}_weight_gbs")] = serde_json::json!(gbs);
        }
        results.push(line);
    }
    // A MoE layer's experts at Qwen3-30B-A3B's shape (128 experts, gate 768 × 2048, Q4_K):
    // the 8 a token routes to, and 512 tokens' 8 each, in one grouped launch.
    let mut moe = moe_lab(&gpu, copy_gbs)?;
    moe["vram_tier_pageable"] = vram_lab(&gpu, false)?;
    moe["vram_tier_registered"] = vram_lab(&gpu, true)?;
    if args.json {
        let doc = serde_json::json!({
            "device": gpu.name,
            "capability": format!("{}.{}", gpu.capability.0, gpu.capability.1),
            "copy_gbs": copy_gbs,
            "checks_passed": ok,
            "kernels": results,
            "moe": moe,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(ok)
}

fn moe_lab(gpu: &Gpu, copy_gbs: f64) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let (n_expert, rows, cols, k) = (128usize, 768usize, 2048usize, 8usize);
    let d = DType::Q4_K;
    let distinct: Vec<Vec<u8>> =
        (0..8).map(|e| sluice_kernels::quant::quantize_rows(d, &random(rows * cols, 500 + e), cols)).collect();
    let experts: Vec<GpuMatrix> = (0..n_expert)
        .map(|e| gpu.upload(MatRef::new(d, rows, cols, &distinct[e % 8]).expect("shape")))
        .collect::<Result<_, _>>()?;
    let s = gpu.stream();
    let mut doc = serde_json::json!({"dtype": d.to_string(), "n_expert": n_expert, "rows": rows, "cols": cols, "k": k});
    for n in [1usize, 512] {
        // Token t routes to k distinct pseudo-random experts; entries grouped by expert.
        let mut pairs: Vec<(usize, usize)> = Vec::new();
        for t in 0..n {
            pairs.extend(route(t as u64, n_expert, k).into_iter().map(|e| (e, t)));
        }
        pairs.sort();
        let act_rows: Vec<i32> = pairs.iter().map(|p| p.1 as i32).collect();
        let mut segments = Vec::new();
        let mut touched = Vec::new();
        let mut i = 0;
        while i < pairs.len() {
            let e = pairs[i].0;
            let end = i + pairs[i..].iter().take_while(|p| p.0 == e).count();
            segments.push((experts[e].view(gpu), i..end));
            touched.push(e);
            i = end;
        }
        let x = s.clone_htod(&random(n * cols, 7))?;
        let act = gpu.quantize(d, &x, n, cols)?;
        let mut out: CudaSlice<f32> = s.alloc_zeros(pairs.len() * rows)?;
        gpu.matmul_ids(&segments, &act, &act_rows, &mut out)?;
        let reps = if n == 1 { 50 } else { 5 };
        let grouped = time_ms(gpu, || {
            for _ in 0..reps {
                gpu.matmul_ids(&segments, &act, &act_rows, &mut out)?;
            }
            Ok(())
        })? / reps as f64;
        let bytes = segments.len() * experts[0].bytes();
        let gmacs = (pairs.len() * rows * cols) as f64 / (grouped * 1e-3) / 1e9;
        println!(
            "moe {d} {n_expert}x{rows}x{cols} top-{k}, {n} token(s), {} experts touched: grouped {:.1} µs, {:.0} GB/s of expert weights ({:.0}% of the copy rate), {gmacs:.0} GMAC/s",
            segments.len(),
            grouped * 1e3,
            bytes as f64 / (grouped * 1e-3) / 1e9,
            100.0 * bytes as f64 / (grouped * 1e-3) / 1e9 / copy_gbs
        );
        doc[format!("n{n}_grouped_us")] = serde_json::json!(grouped * 1e3);
        doc[format!("n{n}_gmacs")] = serde_json::json!(gmacs);
        if n == 1 {
            // The same work as one launch per expert.
            let single = time_ms(gpu, || {
                for _ in 0..reps {
                    for &e in &touched {
                        gpu.matmul(&experts[e], &act, &mut out)?;
                    }
                }
                Ok(())
            })? / reps as f64;
            println!("moe n=1: {k} launches, one per expert: {:.1} µs", single * 1e3);
            doc["n1_per_expert_launches_us"] = serde_json::json!(single * 1e3);
        }
    }
    Ok(doc)
}

/// The VRAM tier at Qwen3-30B-A3B's expert shape (gate, up 768 × 2048 Q4_K; down 2048 × 768
/// Q6_K) with 16 of a layer's 128 experts in VRAM: tokens routed to 8 random experts each,
/// misses copied from (pageable) host memory, then gate, up and down as grouped launches.
fn vram_lab(gpu: &Gpu, registered: bool) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    use sluice_cuda::vram_cache::{slot_bytes_for, ExpertKey, HostPart, VramExperts};
    let (n_expert, ff, hidden, k, slots) = (128usize, 768usize, 2048usize, 8usize, 16usize);
    let gate = sluice_kernels::quant::quantize_rows(DType::Q4_K, &random(ff * hidden, 1), hidden);
    let down = sluice_kernels::quant::quantize_rows(DType::Q6_K, &random(hidden * ff, 2), ff);
    let shapes = [(DType::Q4_K, ff, hidden), (DType::Q4_K, ff, hidden), (DType::Q6_K, hidden, ff)];
    let slot = slot_bytes_for(&shapes).ok_or("shape")?;
    let mut cache = VramExperts::new(gpu, slot, slots * slot)?;
    // Every expert's bytes live apart in host memory (as in a host cache), so that a copy
    // really reads its own bytes.
    let host_experts: Vec<Vec<u8>> =
        (0..n_expert).map(|_| [gate.clone(), gate.clone(), down.clone()].concat()).collect();
    let _pinned: Vec<_> = if registered {
        host_experts.iter().map(|e| gpu.register_host(e)).collect::<Result<_, _>>()?
    } else {
        Vec::new()
    };
    let (gb, db) = (gate.len(), down.len());
    let host = |key: ExpertKey| -> Result<Vec<HostPart<'_>>, sluice_cuda::GpuError> {
        let e = &host_experts[key.expert as usize];
        Ok(vec![
            HostPart { dtype: DType::Q4_K, rows: ff, cols: hidden, data: &e[..gb] },
            HostPart { dtype: DType::Q4_K, rows: ff, cols: hidden, data: &e[gb..2 * gb] },
            HostPart { dtype: DType::Q6_K, rows: hidden, cols: ff, data: &e[2 * gb..2 * gb + db] },
        ])
    };
    let s = gpu.stream();
    let x = s.clone_htod(&random(hidden, 3))?;
    let ax = gpu.quantize(DType::Q4_K, &x, 1, hidden)?;
    let hvec = s.clone_htod(&random(ff, 4))?;
    let ah = gpu.quantize(DType::Q6_K, &hvec, 1, ff)?;
    let mut g: CudaSlice<f32> = s.alloc_zeros(k * ff)?;
    let mut u: CudaSlice<f32> = s.alloc_zeros(k * ff)?;
    let mut d: CudaSlice<f32> = s.alloc_zeros(k * hidden)?;
    let tokens = 64;
    let mut step = 1u64 << 32;
    gpu.synchronize()?;
    let t0 = std::time::Instant::now();
    for _ in 0..tokens {
        step += 1;
        let chosen: Vec<u32> = route(step, n_expert, k).into_iter().map(|e| e as u32).collect();
        let keys: Vec<ExpertKey> = chosen.iter().map(|&e| ExpertKey { layer: 0, expert: e }).collect();
        let res = cache.acquire(gpu, &keys, &host)?;
        let part = |p: usize| (0..k).map(|i| (res.expert(i)[p], i..i + 1)).collect::<Vec<_>>();
        let rows = vec![0i32; k];
        gpu.matmul_ids(&part(0), &ax, &rows, &mut g)?;
        gpu.matmul_ids(&part(1), &ax, &rows, &mut u)?;
        gpu.matmul_ids(&part(2), &ah, &rows, &mut d)?;
        drop(res);
    }
    gpu.synchronize()?;
    let per_token_us = t0.elapsed().as_secs_f64() * 1e6 / tokens as f64;
    let st = cache.stats();
    let copy_gbs = st.bytes_copied as f64 / (st.copy_ns as f64 * 1e-9) / 1e9;
    println!(
        "vram tier: {slots} of {n_expert} experts in VRAM ({:.1} MB a slot), top-{k}: {:.2} misses a token, {per_token_us:.0} µs a token for one layer, copies at {copy_gbs:.1} GB/s ({} host memory)",
        slot as f64 / 1e6,
        st.misses as f64 / tokens as f64,
        if registered { "page-locked" } else { "pageable" }
    );
    Ok(serde_json::json!({
        "slots": slots, "n_expert": n_expert, "slot_bytes": slot, "k": k, "tokens": tokens,
        "misses_per_token": st.misses as f64 / tokens as f64, "layer_us_per_token": per_token_us,
        "copy_gbs": copy_gbs, "host_memory_page_locked": registered,
    }))
}

/// `k` distinct pseudo-random experts of `n_expert` for token `t` (xorshift).
fn route(t: u64, n_expert: usize, k: usize) -> Vec<usize> {
    let mut h = t.wrapping_mul(0x9E3779B97F4A7C15) | 1;
    let mut chosen = Vec::with_capacity(k);
    while chosen.len() < k {
        h ^= h << 13;
        h ^= h >> 7;
        h ^= h << 17;
        let e = (h % n_expert as u64) as usize;
        if !chosen.contains(&e) {
            chosen.push(e);
        }
    }
    chosen
}

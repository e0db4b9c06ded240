//! Kernel lab: checks every SIMD variant of every matmul kernel and of the Gated DeltaNet
//! ops against its scalar reference, then times decode-time matrix-vector products (achieved
//! bandwidth next to the best read rate this machine reaches, measured in the same run at the
//! same thread count: the larger of a plain read probe and an F32 matvec, both at the CPU's
//! best SIMD level, over four times the last-level cache), prefill matmuls (GMAC/s), the
//! DeltaNet recurrence at Qwen3-Next's dimensions, and the f32 activation ops (rmsnorm, the
//! FFN combines, softmax, axpy, argmax) at decode widths.
//!
//! `kernel-lab [--quick] [--json] [--dtype NAME] [--shape ROWSxCOLS]`
//!
//! `kernel-lab matmul --dtype NAME --shape ROWSxCOLS --tokens N --threads T` times one product
//! and nothing else (no checks), as llama.cpp's `test-backend-ops perf -o MUL_MAT` times one
//! case: the same matrix over and over for at least a second, f32 activations quantized inside
//! the timed call, the mean time per product. It prints one JSON line; bench/matmul.py runs it
//! beside llama.cpp's figures.

use sluice_kernels::cpu::Isa;
use sluice_kernels::testdata::{quantized as weights, uniform as rng};
use sluice_kernels::{matmul_ref, DType, MatRef, ThreadPool};
use std::time::Instant;

/// Bytes a timed matvec or read sweeps: four times the last-level cache and at least 1 GiB,
/// so that rates are the memory's and not the cache's (machines of this kind have shown a
/// 480 MiB L3, which holds a whole small model).
fn working_set() -> usize {
    let llc = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index3/size")
        .ok()
        .and_then(|s| cache_size(&s))
        .unwrap_or(0);
    (4 * llc).max(1 << 30)
}

/// A cache size as sysfs writes it ("491520K", "32M"), in bytes.
fn cache_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'K' => (&s[..s.len() - 1], 1usize << 10),
        'M' => (&s[..s.len() - 1], 1 << 20),
        'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>().ok()?.checked_mul(mul)
}

/// Copies of `m` at distinct addresses until they span `working_set()` bytes: a matvec that
/// cycles through them reads memory, whatever the cache holds.
fn spread(m: Vec<u8>) -> Vec<Vec<u8>> {
    let copies = working_set().div_ceil(m.len()).max(2);
    let mut v = Vec::with_capacity(copies);
    for _ in 1..copies {
        v.push(m.clone());
    }
    v.push(m);
    v
}

/// The read rates behind a matvec's bound at one thread count (GB/s).
struct ReadBound {
    /// `read_probe`: plain wide loads summed over `working_set()` bytes.
    probe: f64,
    /// An F32 matrix-vector product cycling through copies of an 8192 × 4096 matrix that
    /// span `working_set()` bytes.
    f32_matvec: f64,
}

impl ReadBound {
    /// The best read rate the machine was seen to reach: a kernel that streams faster than
    /// the probe shows the probe is not the machine's limit, so the bound is the larger.
    fn best(&self) -> f64 {
        self.probe.max(self.f32_matvec)
    }
}

/// Measures both read rates with `pool`'s threads at the best SIMD level the CPU has (the
/// machine's rate, whatever level `SLUICE_ISA` forces on the kernels under test), whatever
/// `--quick` says: the bound has to come from a working set far past the caches.
fn read_bound(pool: &ThreadPool) -> ReadBound {
    let (rows, cols) = (8192, 4096);
    let mats = spread(weights(DType::F32, rows, cols, 40));
    let mut r = rng(3);
    let x: Vec<f32> = (0..cols).map(|_| r()).collect();
    let (best_isa, one) = (Isa::detect(), ThreadPool::new(1));
    let n = pool.n_threads();
    let f32_matvec = sweep_rate(&mats, |mat| {
        let m = MatRef::new(DType::F32, rows, cols, mat).expect("lab matrix");
        // Each thread its share of rows, as `matmul` splits them.
        pool.run(&|t| {
            let part = m.slice_rows(t * rows / n, (t + 1) * rows / n);
            std::hint::black_box(sluice_kernels::matmul::matmul_with_isa(best_isa, &one, part, &x, 1));
        });
    });
    ReadBound { probe: read_probe(pool), f32_matvec }
}

/// GB/s of `mats` that `f`, called once per matrix, gets through: the best of three sweeps.
fn sweep_rate(mats: &[Vec<u8>], mut f: impl FnMut(&[u8])) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        for mat in mats {
            f(mat);
        }
        best = best.min(t0.elapsed().as_secs_f64() / mats.len() as f64);
    }
    mats[0].len() as f64 / best / 1e9
}

/// Decode-time rate (GB/s of weights) of one matvec through each of `mats`.
fn matvec_rate(pool: &ThreadPool, d: DType, rows: usize, cols: usize, mats: &[Vec<u8>]) -> f64 {
    let mut r = rng(3);
    let x: Vec<f32> = (0..cols).map(|_| r()).collect();
    let mut out = vec![0f32; rows];
    sweep_rate(mats, |mat| {
        let m = MatRef::new(d, rows, cols, mat).expect("lab matrix");
        sluice_kernels::matmul(pool, m, &x, 1, &mut out);
    })
}

/// Read probe: bandwidth of this machine with all of `pool`'s threads reading at once (GB/s), over
/// `working_set()` bytes in all.
fn read_probe(pool: &ThreadPool) -> f64 {
    let per_thread = (working_set() / pool.n_threads()).next_multiple_of(512);
    let bufs: Vec<Vec<u8>> = (0..pool.n_threads()).map(|_| vec![1u8; per_thread]).collect();
    let mut best = 0f64;
    for _ in 0..4 {
        let t0 = Instant::now();
        pool.run(&|i| {
            std::hint::black_box(read_all(&bufs[i]));
        });
        let dt = t0.elapsed().as_secs_f64();
        best = best.max((per_thread * pool.n_threads()) as f64 / dt / 1e9);
    }
    best
}

/// Sums a buffer with the widest loads available, eight independent accumulators.
fn read_all(b: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if Isa::detect() == Isa::Avx512 {
        // SAFETY: AVX-512F is present (checked above); every load stays inside `b`.
        return unsafe { read_avx512(b) };
    }
    let mut acc = [0u64; 8];
    for c in b.chunks_exact(64) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = a.wrapping_add(u64::from_le_bytes(c[l * 8..l * 8 + 8].try_into().expect("8 bytes")));
        }
    }
    acc.iter().fold(0, |a, b| a.wrapping_add(*b))
}

/// # Safety
///
/// The CPU has AVX-512F (the caller checked), and `b.len()` is a multiple of 64.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn read_avx512(b: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_si512(); 8];
    let p = b.as_ptr();
    let mut i = 0;
    while i + 512 <= b.len() {
        for (k, acc) in a.iter_mut().enumerate() {
            *acc = _mm512_add_epi64(*acc, _mm512_loadu_si512(p.add(i + 64 * k) as *const _));
        }
        i += 512;
    }
    let mut s = a[0];
    for acc in &a[1..] {
        s = _mm512_add_epi64(s, *acc);
    }
    _mm512_reduce_add_epi64(s) as u64
}

/// Every variant against the reference, at small batches (3 tokens: the small-batch kernels
/// at every level; 5: the one-row K-quant kernels on 256-bit vectors) and a batch past the
/// tiled kernels' threshold whose last panel is partial.
fn check(dtype: DType, isa: Isa) -> Result<f32, String> {
    let mut worst = 0f32;
    for n in [3, 5, 13] {
        let (rows, cols) = (37, 256 + 32 * dtype.block_elems().min(8));
        let cols = cols / dtype.block_elems() * dtype.block_elems();
        let w = weights(dtype, rows, cols, 1);
        let mut r = rng(2);
        let x: Vec<f32> = (0..n * cols).map(|_| r()).collect();
        let m = MatRef::new(dtype, rows, cols, &w).map_err(|e| e.to_string())?;
        let mut want = vec![0f32; n * rows];
        matmul_ref(m, &x, n, &mut want);
        let got = sluice_kernels::matmul::matmul_with_isa(isa, &ThreadPool::new(1), m, &x, n);
        worst = worst.max(relative_error(&got, &want)?);
    }
    Ok(worst)
}

/// The largest |got − want| / max(|want|, 1); a length mismatch or a NaN on either side is an
/// error, not a small number (`f32::max` would skip a NaN and `zip` a missing tail).
fn relative_error(got: &[f32], want: &[f32]) -> Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{} outputs, the reference has {}", got.len(), want.len()));
    }
    let mut max = 0f32;
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        if a.is_nan() || b.is_nan() {
            return Err(format!("NaN at output {i} ({a} vs reference {b})"));
        }
        let e = if a == b { 0.0 } else { (a - b).abs() / b.abs().max(1.0) };
        if e.is_nan() || e > max {
            max = if e.is_nan() { f32::INFINITY } else { e };
        }
    }
    Ok(max)
}

/// The value after `flag`, parsed; exits with a message naming the flag when it is missing or
/// does not parse.
fn flag_value<T: std::str::FromStr>(args: &[String], flag: &str, what: &str) -> T {
    let given = args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    match given.map(|s| s.parse::<T>()) {
        Some(Ok(v)) => v,
        Some(Err(_)) => {
            eprintln!("{flag} wants {what}, not '{}'", given.map(String::as_str).unwrap_or(""));
            std::process::exit(2);
        }
        None => {
            eprintln!("kernel-lab matmul needs {flag} ({what})");
            std::process::exit(2);
        }
    }
}

/// `ROWSxCOLS` with both above zero.
fn parse_shape(given: &str) -> Option<(usize, usize)> {
    let (r, c) = given.split_once('x')?;
    let (r, c) = (r.parse::<usize>().ok()?, c.parse::<usize>().ok()?);
    (r > 0 && c > 0).then_some((r, c))
}

/// `kernel-lab matmul …`: the mean time of one `tokens`-token product with a `rows × cols`
/// matrix of `dtype` on `threads` threads, as one JSON line.
/// CPU time (user and system, every thread) this process has used, in seconds: on a shared
/// host whose other tenants take cycles, work per CPU second compares two kernels more steadily
/// than work per wall second.
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage fills the zeroed struct it is given and reads nothing else.
    let u = unsafe {
        let mut u: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut u);
        u
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    secs(u.ru_utime) + secs(u.ru_stime)
}

fn time_one_matmul(args: &[String]) {
    let name: String = flag_value(args, "--dtype", "a format name such as Q4_K");
    let Some(d) = DType::from_name(&name).filter(|d| sluice_kernels::supports_matmul(*d)) else {
        eprintln!("--dtype: '{name}' is not a format the kernels multiply");
        std::process::exit(2);
    };
    let shape: String = flag_value(args, "--shape", "ROWSxCOLS, e.g. 4096x14336");
    let Some((rows, cols)) = parse_shape(&shape) else {
        eprintln!("--shape wants ROWSxCOLS with both above zero (e.g. 4096x14336), not '{shape}'");
        std::process::exit(2);
    };
    if !cols.is_multiple_of(d.block_elems()) {
        eprintln!("--shape: {cols} columns are not whole blocks of {} ({} values each)", d.name(), d.block_elems());
        std::process::exit(2);
    }
    let tokens: usize = flag_value(args, "--tokens", "a token count above zero");
    let threads: usize = flag_value(args, "--threads", "a thread count above zero");
    if tokens == 0 || threads == 0 {
        eprintln!("--tokens and --threads want counts above zero");
        std::process::exit(2);
    }
    // Values do not change the time: quantize a band of rows once and repeat it (the IQ
    // quantizers search their grids, slow for a whole large matrix).
    let band = rows.min(64);
    let one = weights(d, band, cols, 12);
    let mut w = Vec::with_capacity(one.len() * rows.div_ceil(band));
    while w.len() < d.row_bytes(cols).unwrap_or(0) * rows {
        w.extend_from_slice(&one);
    }
    w.truncate(d.row_bytes(cols).unwrap_or(0) * rows);
    let m = MatRef::new(d, rows, cols, &w).expect("lab matrix");
    let mut r = rng(8);
    let x: Vec<f32> = (0..tokens * cols).map(|_| r()).collect();
    let mut out = vec![0f32; tokens * rows];
    let pool = ThreadPool::new(threads);
    sluice_kernels::matmul(&pool, m, &x, tokens, &mut out); // warm-up
    let (mut runs, t0, c0) = (0u64, Instant::now(), cpu_seconds());
    while runs == 0 || t0.elapsed().as_secs_f64() < 1.0 {
        sluice_kernels::matmul(&pool, m, &x, tokens, &mut out);
        runs += 1;
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / runs as f64;
    let cpu_us = (cpu_seconds() - c0) * 1e6 / runs as f64;
    let macs = (rows * cols * tokens) as f64;
    let (gmacs, gmac_cpu) = (macs / us / 1e3, macs / cpu_us / 1e3);
    println!(
        "{{\"kernel\":\"matmul_one\",\"dtype\":\"{}\",\"isa\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"tokens\":{tokens},\"threads\":{threads},\"runs\":{runs},\"us_per_run\":{us:.2},\"gmac_s\":{gmacs:.3},\"cpu_us_per_run\":{cpu_us:.2},\"gmac_per_cpu_s\":{gmac_cpu:.3},\"weight_bytes\":{}}}",
        d.name(),
        sluice_kernels::cpu::isa().name(),
        w.len()
    );
}

fn main() {
    // Output piped into `head` and the like: end quietly when the reader goes away, as
    // command-line tools do, rather than panic on the failed write (the lab opens no sockets).
    // SAFETY: restores the default disposition of SIGPIPE before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("matmul") {
        time_one_matmul(&args);
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let json = args.iter().any(|a| a == "--json");
    let isas = Isa::supported();
    // `--dtype Q4_K` limits the run to one format.
    let only = args.iter().position(|a| a == "--dtype").and_then(|i| args.get(i + 1)).and_then(|s| DType::from_name(s));
    // `--shape 1024x2048` times a model's own matrix size (an OLMoE expert's gate, say).
    let shape = args.iter().position(|a| a == "--shape").map(|i| {
        let given = args.get(i + 1).map(String::as_str).unwrap_or("");
        match parse_shape(given) {
            Some(rc) => rc,
            None => {
                eprintln!("--shape wants ROWSxCOLS with both above zero (e.g. 1024x2048), not '{given}'");
                std::process::exit(2);
            }
        }
    });
    let dtypes: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|d| sluice_kernels::supports_matmul(*d) && only.is_none_or(|o| o == *d))
        .collect();

    // 1. Every variant against the reference.
    let mut ok = true;
    for &d in &dtypes {
        for &isa in &isas {
            match check(d, isa) {
                Ok(err) => {
                    let pass = err <= 1e-5;
                    ok &= pass;
                    if !json {
                        println!(
                            "check {:6} {:7} max rel err {:.2e} {}",
                            d.name(),
                            isa.name(),
                            err,
                            if pass { "ok" } else { "FAIL" }
                        );
                    }
                }
                Err(e) => {
                    ok = false;
                    println!("check {:6} {:7} error: {e}", d.name(), isa.name());
                }
            }
        }
    }

    // 1b. The Gated DeltaNet ops: every ISA level to the bit.
    for &isa in &isas {
        let (pass, what) = check_recurrent(isa);
        ok &= pass;
        if !json {
            println!("check recurrent {:7} {what} {}", isa.name(), if pass { "ok" } else { "FAIL" });
        }
    }
    time_recurrent(json, quick);
    time_ops(json);

    // 1c. Decode compute rate: a matrix that stays in L2, one thread, many passes. Where it
    //     is not far above the memory bandwidth, decode is compute-bound. Its rows are as long
    //     as the timed matvec's below, so that it runs the same kernel (the K-quant decode
    //     takes rows of up to eight blocks four at a time, longer ones one by one).
    {
        let pool = ThreadPool::new(1);
        let matvec_cols = shape.unwrap_or(if quick { (2048, 2048) } else { (8192, 4096) }).1;
        for &d in &dtypes {
            let cols = (matvec_cols / d.block_elems()).max(1) * d.block_elems();
            let rows = (256 * 1024 / d.row_bytes(cols).unwrap_or(1)).clamp(8, 512);
            let w = weights(d, rows, cols, 21);
            let mut r = rng(5);
            let x: Vec<f32> = (0..cols).map(|_| r()).collect();
            let mut out = vec![0f32; rows];
            let m = MatRef::new(d, rows, cols, &w).unwrap();
            let iters = if quick { 100 } else { 400 };
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t0 = Instant::now();
                for _ in 0..iters {
                    sluice_kernels::matmul(&pool, m, &x, 1, &mut out);
                }
                best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
            }
            let gbs = w.len() as f64 / best / 1e9;
            if json {
                println!(
                    "{{\"kernel\":\"matvec_l2\",\"dtype\":\"{}\",\"isa\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"threads\":1,\"gb_s\":{gbs:.2}}}",
                    d.name(),
                    sluice_kernels::cpu::isa().name()
                );
            } else {
                println!("compute {:6} {rows}x{cols} in L2, 1 thread: {gbs:6.1} GB/s of weights", d.name());
            }
        }
    }

    // 2. Decode matvec bandwidth, 1 and 2 threads, against the best read rate the machine
    //    reaches at the same thread count (see `read_bound`).
    let (rows, cols) = shape.unwrap_or(if quick { (2048, 2048) } else { (8192, 4096) });
    let mut results = Vec::new();
    for threads in [1usize, 2] {
        let pool = ThreadPool::new(threads);
        let bound = read_bound(&pool);
        if !json {
            println!(
                "read bound, threads {threads}: {:.1} GB/s (read probe {:.1}, F32 matvec {:.1}; {:.2} GiB swept)",
                bound.best(),
                bound.probe,
                bound.f32_matvec,
                working_set() as f64 / (1u64 << 30) as f64
            );
        }
        for &d in &dtypes {
            if !cols.is_multiple_of(d.block_elems()) {
                continue; // a `--shape` whose width is not whole blocks of this format
            }
            // Copies of one matrix, so the working set is well past the caches.
            let mats = spread(weights(d, rows, cols, 10));
            let gbs = matvec_rate(&pool, d, rows, cols, &mats);
            let bw = bound.best();
            let line = serde_like(d, threads, rows, cols, gbs, &bound);
            if json {
                println!("{line}");
            } else {
                println!(
                    "matvec {:6} {rows}x{cols} threads {threads}: {:6.1} GB/s = {:5.1}% of the read bound {:.1} GB/s",
                    d.name(),
                    gbs,
                    100.0 * gbs / bw,
                    bw
                );
            }
            results.push(gbs);
        }
    }
    // 2b. Small batches (a speculative verify pass, a few requests decoding together): the
    //     time of n tokens against a matrix from memory, over the time of one. Weights read
    //     once serve every token, so where decode is bound by reading them this stays near 1;
    //     near n, each token pays its own arithmetic.
    {
        let (rows, cols) = shape.unwrap_or(if quick { (2048, 2048) } else { (8192, 4096) });
        let pool = ThreadPool::new(2);
        for &d in &dtypes {
            if !cols.is_multiple_of(d.block_elems()) {
                continue;
            }
            let mats = spread(weights(d, rows, cols, 10));
            let mut r = rng(6);
            let x: Vec<f32> = (0..16 * cols).map(|_| r()).collect();
            let mut out = vec![0f32; 16 * rows];
            let time = |n: usize, out: &mut Vec<f32>| {
                1.0 / sweep_rate(&mats, |mat| {
                    let m = MatRef::new(d, rows, cols, mat).expect("lab matrix");
                    sluice_kernels::matmul(&pool, m, &x[..n * cols], n, &mut out[..n * rows]);
                })
            };
            let one = time(1, &mut out);
            let ratios: Vec<(usize, f64)> =
                [2usize, 3, 4, 5, 8, 12, 16].iter().map(|&n| (n, time(n, &mut out) / one)).collect();
            if json {
                let r: Vec<String> = ratios.iter().map(|(n, x)| format!("\"{n}\":{x:.2}")).collect();
                println!(
                    "{{\"kernel\":\"small_batch\",\"dtype\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"threads\":2,\"time_over_one_token\":{{{}}}}}",
                    d.name(),
                    r.join(",")
                );
            } else {
                let r: Vec<String> = ratios.iter().map(|(n, x)| format!("n={n} {x:.2}×")).collect();
                println!("small batch {:6} {rows}x{cols} threads 2, time over one token: {}", d.name(), r.join("  "));
            }
        }
    }
    // 3. Prefill: many tokens against one matrix, as GMAC/s (arithmetic, not bandwidth, bound).
    let n_tok = 64;
    let (rows, cols) = if quick { (1024, 1024) } else { (2048, 2048) };
    for threads in [1usize, 2] {
        let pool = ThreadPool::new(threads);
        for &d in &dtypes {
            let w = weights(d, rows, cols, 5);
            let mut r = rng(4);
            let x: Vec<f32> = (0..n_tok * cols).map(|_| r()).collect();
            let mut out = vec![0f32; n_tok * rows];
            let m = MatRef::new(d, rows, cols, &w).unwrap();
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t0 = Instant::now();
                sluice_kernels::matmul(&pool, m, &x, n_tok, &mut out);
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let gmacs = (rows * cols * n_tok) as f64 / best / 1e9;
            if json {
                println!(
                    "{{\"kernel\":\"matmul\",\"dtype\":\"{}\",\"tokens\":{n_tok},\"rows\":{rows},\"cols\":{cols},\"threads\":{threads},\"gmac_s\":{gmacs:.2}}}",
                    d.name()
                );
            } else {
                println!("matmul {:6} {rows}x{cols} x {n_tok} tokens, threads {threads}: {gmacs:7.2} GMAC/s", d.name());
            }
        }
    }
    if !ok {
        eprintln!("some kernel variants disagree with the reference");
        std::process::exit(1);
    }
}

/// The conv, the delta rule and the gated norm at `isa` against their scalar references.
fn check_recurrent(isa: Isa) -> (bool, String) {
    use sluice_kernels::recurrent as rec;
    let mut r = rng(7);
    let (c, kernel, n) = (200, 4, 9);
    let x: Vec<f32> = (0..(kernel - 1 + n) * c).map(|_| r()).collect();
    let w: Vec<f32> = (0..c * kernel).map(|_| r()).collect();
    let (mut a, mut b) = (vec![0f32; n * c], vec![0f32; n * c]);
    rec::conv1d_silu_ref(&x, &w, kernel, n, &mut a);
    rec::conv1d_silu_isa(isa, &x, &w, kernel, n, &mut b);
    let conv = sluice_kernels::compare::same_bits(&a, &b);
    let (dk, dv) = (128, 96);
    let s0: Vec<f32> = (0..dk * dv).map(|_| 0.1 * r()).collect();
    let mut unit = |len: usize| -> Vec<f32> {
        let mut v: Vec<f32> = (0..len).map(|_| r()).collect();
        for row in v.chunks_mut(dk) {
            rec::l2_normalize(row, 1e-6);
        }
        v
    };
    let (q, k) = (unit(n * dk), unit(n * dk));
    let v: Vec<f32> = (0..n * dv).map(|_| r()).collect();
    let beta: Vec<f32> = (0..n).map(|_| 0.5 + 0.4 * r()).collect();
    let decay: Vec<f32> = (0..n).map(|_| 0.9 + 0.09 * r()).collect();
    let (mut s1, mut s2) = (vec![0f32; dk * dv], vec![0f32; dk * dv]);
    let (mut o1, mut o2) = (vec![0f32; n * dv], vec![0f32; n * dv]);
    rec::delta_rule_ref(&s0, &mut s1, dk, &q, &k, &v, &beta, &decay, &mut o1);
    rec::delta_rule_isa(isa, &s0, &mut s2, dk, &q, &k, &v, &beta, &decay, &mut o2);
    let delta = sluice_kernels::compare::same_bits(&s1, &s2) && sluice_kernels::compare::same_bits(&o1, &o2);
    (
        conv && delta,
        format!(
            "conv {} delta rule {}",
            if conv { "same bits" } else { "DIFFER" },
            if delta { "same bits" } else { "DIFFER" }
        ),
    )
}

/// One decode step of the delta rule over 32 value heads of 128 × 128 (Qwen3-Next's), one
/// thread: time per layer and the state traffic it achieves (the state is read and written).
fn time_recurrent(json: bool, quick: bool) {
    use sluice_kernels::recurrent as rec;
    let (heads, dk, dv) = (32, 128, 128);
    let mut r = rng(9);
    let s0: Vec<f32> = (0..heads * dk * dv).map(|_| 0.01 * r()).collect();
    let mut s1 = vec![0f32; heads * dk * dv];
    let q: Vec<f32> = (0..dk).map(|_| 0.05 * r()).collect();
    let k = q.clone();
    let v: Vec<f32> = (0..dv).map(|_| r()).collect();
    let mut o = vec![0f32; dv];
    let iters = if quick { 20 } else { 100 };
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t0 = Instant::now();
        for _ in 0..iters {
            for h in 0..heads {
                let (a, b) = (&s0[h * dk * dv..(h + 1) * dk * dv], &mut s1[h * dk * dv..(h + 1) * dk * dv]);
                rec::delta_rule(a, b, dk, &q, &k, &v, &[0.5], &[0.95], &mut o);
            }
        }
        best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
    }
    let bytes = 2.0 * (heads * dk * dv * 4) as f64;
    if json {
        println!(
            "{{\"kernel\":\"delta_rule\",\"isa\":\"{}\",\"heads\":{heads},\"d_k\":{dk},\"d_v\":{dv},\"us_per_token_layer\":{:.1},\"state_gb_s\":{:.2}}}",
            sluice_kernels::cpu::isa().name(),
            best * 1e6,
            bytes / best / 1e9
        );
    } else {
        println!(
            "delta rule {heads} heads x {dk}x{dv}, 1 token, 1 thread: {:7.1} us per layer ({:.1} GB/s of state read and written)",
            best * 1e6,
            bytes / best / 1e9
        );
    }
}

/// The f32 activation ops (`ops`), one thread, at the widths a decode step gives them: time
/// per call and the bytes of activations they read and write per second. They run once per
/// row per layer (rmsnorm, the FFN's combine), per head (softmax over the keys) or per token
/// (softmax or argmax over the vocabulary); set them beside the matvecs' microseconds to see
/// whether one is worth vectorizing.
fn time_ops(json: bool) {
    use sluice_kernels::{float, ops};
    let mut r = rng(11);
    let row = |n: usize, r: &mut dyn FnMut() -> f32| -> Vec<f32> { (0..n).map(|_| r()).collect() };
    let (x2k, w2k, x8k, u8k, xv) =
        (row(2048, &mut r), row(2048, &mut r), row(8192, &mut r), row(8192, &mut r), row(151_936, &mut r));
    let mut out = vec![0f32; 151_936];
    // Attention over 1024 cached positions of a KV group: keys and values 64 wide, rows 128
    // apart (two KV heads), four query heads of the group.
    let (keys, vals) = (row(1024 * 128, &mut r), row(1024 * 128, &mut r));
    let q4: Vec<Vec<f32>> = (0..4).map(|_| row(64, &mut r)).collect();
    let w1k: Vec<f32> = row(1024, &mut r).iter().map(|v| v.abs() / 1024.0).collect();
    // (name, elements, bytes moved per call, the op)
    type Case<'a> = (&'static str, usize, usize, Box<dyn FnMut(&mut [f32]) + 'a>);
    let cases: Vec<Case> = vec![
        (
            "rms_norm 2048",
            2048,
            3 * 2048 * 4,
            Box::new(|o: &mut [f32]| ops::rms_norm(&x2k, &w2k, 1e-6, &mut o[..2048])),
        ),
        (
            "glu silu 8192",
            8192,
            3 * 8192 * 4,
            Box::new(|o: &mut [f32]| {
                o[..8192].copy_from_slice(&x8k);
                ops::glu(&mut o[..8192], &u8k, ops::GluAct::Silu)
            }),
        ),
        (
            "glu gelu_tanh 8192",
            8192,
            3 * 8192 * 4,
            Box::new(|o: &mut [f32]| {
                o[..8192].copy_from_slice(&x8k);
                ops::glu(&mut o[..8192], &u8k, ops::GluAct::GeluTanh)
            }),
        ),
        (
            "softmax 4096",
            4096,
            2 * 4096 * 4,
            Box::new(|o: &mut [f32]| {
                o[..4096].copy_from_slice(&x8k[..4096]);
                ops::softmax(&mut o[..4096])
            }),
        ),
        (
            "softmax 151936",
            151_936,
            2 * 151_936 * 4,
            Box::new(|o: &mut [f32]| {
                o.copy_from_slice(&xv);
                ops::softmax(o)
            }),
        ),
        (
            "attention softmax 1024 (float::softmax)",
            1024,
            2 * 1024 * 4,
            Box::new(|o: &mut [f32]| {
                o[..1024].copy_from_slice(&x8k[..1024]);
                float::softmax(&mut o[..1024], None)
            }),
        ),
        (
            "softmax 1024 (ops::softmax)",
            1024,
            2 * 1024 * 4,
            Box::new(|o: &mut [f32]| {
                o[..1024].copy_from_slice(&x8k[..1024]);
                ops::softmax(&mut o[..1024])
            }),
        ),
        ("axpy 2048", 2048, 3 * 2048 * 4, Box::new(|o: &mut [f32]| ops::axpy(&mut o[..2048], 0.5, &x2k))),
        (
            "scores 4 heads x 1024, one by one",
            4096,
            4 * 1024 * 64 * 4,
            Box::new(|o: &mut [f32]| {
                for (h, q) in q4.iter().enumerate() {
                    float::dots_f32(q, &keys, 128, 1024, 0.125, &mut o[h * 1024..(h + 1) * 1024]);
                }
            }),
        ),
        (
            "scores 4 heads x 1024, together",
            4096,
            1024 * 64 * 4,
            Box::new(|o: &mut [f32]| {
                let qs: Vec<&[f32]> = q4.iter().map(|q| q.as_slice()).collect();
                let mut outs: Vec<&mut [f32]> = o[..4096].chunks_exact_mut(1024).collect();
                float::dots_f32_multi(&qs, &keys, 128, 1024, 0.125, &mut outs);
            }),
        ),
        (
            "values 1024 x 64, axpy per row",
            64,
            1024 * 64 * 4,
            Box::new(|o: &mut [f32]| {
                o[..64].fill(0.0);
                for (j, s) in w1k.iter().enumerate() {
                    ops::axpy(&mut o[..64], *s, &vals[j * 128..j * 128 + 64]);
                }
            }),
        ),
        (
            "values 1024 x 64, weighted_rows",
            64,
            1024 * 64 * 4,
            Box::new(|o: &mut [f32]| float::weighted_rows(&mut o[..64], &w1k, &vals, 128)),
        ),
        (
            "argmax 151936",
            151_936,
            151_936 * 4,
            Box::new(|_: &mut [f32]| {
                std::hint::black_box(ops::argmax(&xv));
            }),
        ),
    ];
    for (name, elems, bytes, mut f) in cases {
        let iters = (50_000_000 / elems).clamp(20, 20_000);
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            for _ in 0..iters {
                f(&mut out);
            }
            best = best.min(t0.elapsed().as_secs_f64() / iters as f64);
        }
        std::hint::black_box(&out);
        if json {
            println!(
                "{{\"kernel\":\"op\",\"op\":\"{name}\",\"elements\":{elems},\"us\":{:.3},\"gb_s\":{:.2}}}",
                best * 1e6,
                bytes as f64 / best / 1e9
            );
        } else {
            println!(
                "op {name:20} 1 thread: {:9.2} us per call ({:6.1} GB/s of activations)",
                best * 1e6,
                bytes as f64 / best / 1e9
            );
        }
    }
}

fn serde_like(d: DType, threads: usize, rows: usize, cols: usize, gbs: f64, bound: &ReadBound) -> String {
    let bw = bound.best();
    format!(
        "{{\"kernel\":\"matvec\",\"dtype\":\"{}\",\"isa\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"threads\":{threads},\"gb_s\":{gbs:.2},\"memory_gb_s\":{bw:.2},\"probe_gb_s\":{:.2},\"f32_matvec_gb_s\":{:.2},\"fraction\":{:.3}}}",
        d.name(),
        sluice_kernels::cpu::isa().name(),
        bound.probe,
        bound.f32_matvec,
        gbs / bw
    )
}

#[cfg(test)]
mod tests {
    use super::{cache_size, parse_shape, relative_error};

    #[test]
    fn shapes_parse_only_with_both_sides_above_zero() {
        assert_eq!(parse_shape("4096x14336"), Some((4096, 14336)));
        assert_eq!(parse_shape("0x256"), None);
        assert_eq!(parse_shape("256x0"), None);
        assert_eq!(parse_shape("256"), None);
        assert_eq!(parse_shape("ax256"), None);
        assert_eq!(parse_shape("256x-1"), None);
    }

    #[test]
    fn sysfs_cache_sizes_parse() {
        assert_eq!(cache_size("491520K\n"), Some(491520 << 10));
        assert_eq!(cache_size("32M"), Some(32 << 20));
        assert_eq!(cache_size("1G"), Some(1 << 30));
        assert_eq!(cache_size("4096"), Some(4096));
        assert_eq!(cache_size("lots"), None);
        assert_eq!(cache_size(""), None);
    }

    #[test]
    fn a_nan_or_a_missing_output_fails_the_check() {
        assert_eq!(relative_error(&[1.0, 2.0], &[1.0, 2.0]), Ok(0.0));
        assert!(relative_error(&[1.0, f32::NAN], &[1.0, 2.0]).is_err());
        assert!(relative_error(&[1.0, 2.0], &[1.0, f32::NAN]).is_err());
        assert!(relative_error(&[1.0], &[1.0, 2.0]).is_err());
        assert_eq!(relative_error(&[f32::INFINITY], &[1.0]), Ok(f32::INFINITY));
        assert!(relative_error(&[3.0], &[2.0]).unwrap() > 0.4);
    }
}

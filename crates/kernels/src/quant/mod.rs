//! Block-quantized formats (GGUF's): layouts, reference dequantization, activation
//! quantization, and dot-product kernels (scalar reference, AVX2, AVX-512 VNNI).
//!
//! `matmul_quant` quantizes each activation row once into the weight format's activation
//! type, then gives each thread a contiguous range of weight rows; every (row, token) dot
//! product runs block by block through `dot_ref::accumulate`, whatever the ISA or tile.

pub mod act;
#[cfg(target_arch = "x86_64")]
mod act_x86;
#[cfg(target_arch = "x86_64")]
mod block32_x86;
pub mod blocks;
pub mod dot_ref;
pub mod iq;
#[cfg(target_arch = "x86_64")]
mod iq512_x86;
mod iq_tables;
#[cfg(target_arch = "x86_64")]
mod iq_x86;
#[cfg(target_arch = "x86_64")]
mod k23_x86;
#[cfg(target_arch = "x86_64")]
mod k512_x86;
#[cfg(target_arch = "x86_64")]
mod mxfp4_x86;
#[cfg(target_arch = "x86_64")]
mod panel;
#[cfg(target_arch = "x86_64")]
mod tiled_avx2;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_512;

use crate::cpu::Isa;
use crate::dtype::DType;
use crate::matmul::{MatRef, SendPtr};
use crate::pool::ThreadPool;
use act::{ActKind, QuantAct};

/// Whether a quantized matmul kernel exists for `dtype`.
pub fn supports(dtype: DType) -> bool {
    ActKind::for_weights(dtype).is_some()
}

/// Widens one stored row to f32 (`out.len()` elements).
pub fn dequantize_row(dtype: DType, row: &[u8], out: &mut [f32]) -> Result<(), crate::KernelError> {
    let need = dtype.row_bytes(out.len()).ok_or(crate::KernelError::PartialBlock { dtype, cols: out.len() })?;
    if row.len() != need {
        return Err(crate::KernelError::Size { dtype, rows: 1, cols: out.len(), expected: need, got: row.len() });
    }
    if dtype.is_float() {
        for (i, o) in out.iter_mut().enumerate() {
            *o = crate::float::load_elem(dtype, row, i);
        }
        return Ok(());
    }
    let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
    for (b, y) in out.chunks_exact_mut(be).enumerate() {
        blocks::dequantize_block(dtype, &row[b * bb..(b + 1) * bb], y);
    }
    Ok(())
}

/// Quantizes `rows × cols` f32 values (row-major) into rows of `dtype`.
pub fn quantize_rows(dtype: DType, v: &[f32], cols: usize) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        _ => {
            let (be, bb) = (dtype.block_elems(), dtype.block_bytes());
            assert!(cols.is_multiple_of(be), "{cols} columns are not whole {dtype} blocks");
            let mut out = vec![0u8; v.len() / be * bb];
            for (x, b) in v.chunks_exact(be).zip(out.chunks_exact_mut(bb)) {
                blocks::quantize_block(dtype, x, b);
            }
            out
        }
    }
}

/// Scalar reference: one stored row against f32 activations (quantized as the kernels do).
pub(crate) fn dot_ref(dtype: DType, row: &[u8], x: &[f32]) -> f32 {
    let kind = ActKind::for_weights(dtype).expect("quantized type");
    let act = QuantAct::new(kind, x, 1, x.len());
    dot_ref::row_dot(dtype, row, &act, 0)
}

pub(crate) fn matmul_quant(pool: &ThreadPool, w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    matmul_quant_isa(crate::cpu::isa(), pool, w, x, n, out)
}

pub(crate) fn matmul_quant_isa(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let kind = ActKind::for_weights(w.dtype).expect("MatRef::new checks support");
    let act = QuantAct::new(kind, x, n, w.cols);
    let o = SendPtr(out.as_mut_ptr());
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = Tiled::choose(isa, w.dtype, n) {
        return gemm_tiled(kernel, pool, w, &act, n, o);
    }
    // IQ formats: their own AVX2 kernels (decode and small batches at the AVX-512 level too,
    // and prefill where the tiled kernel above does not run).
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && iq::is_iq(w.dtype) {
        return iq_x86::matmul(isa, pool, w, &act, n, o);
    }
    // MXFP4: its own AVX2 kernels (which serve the AVX-512 level too, where the tiled kernel
    // above does not apply).
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && w.dtype == DType::MXFP4 {
        return mxfp4_x86::matmul(isa, pool, w, &act, n, o);
    }
    // K-quants: decode and small batches on the kernels of `x86` (every format; Q2_K and Q3_K
    // unpacked by `k23_x86`).
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && is_k(w.dtype) {
        if n == 1 {
            return decode_k(isa, pool, w, &act, o);
        }
        if n > 1 && n < ROW_KERNEL_MIN_TOKENS {
            return batch_k(isa, pool, w, &act, n, o);
        }
    }
    // The 32-element block formats: their own AVX2 kernels (which serve the AVX-512 level too,
    // where the tiled kernel above does not apply).
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && is_block32(w.dtype) {
        return block32_x86::matmul(pool, w, &act, n, o);
    }
    // Rows in blocks of ROWS, tokens in chunks of TOKENS: a block's weights and a chunk's
    // activations stay in L1 while every pair is computed.
    const ROWS: usize = 16;
    const TOKENS: usize = 32;
    pool.for_ranges(w.rows, 4, &|rows| {
        let mut vals = vec![0f32; TOKENS.min(n)];
        let mut r0 = rows.start;
        while r0 < rows.end {
            let r1 = (r0 + ROWS).min(rows.end);
            let mut t0 = 0;
            while t0 < n {
                let t1 = (t0 + TOKENS).min(n);
                for r in r0..r1 {
                    row_tokens(w.dtype, w.row(r), &act, t0..t1, &mut vals);
                    for (i, v) in vals[..t1 - t0].iter().enumerate() {
                        // SAFETY: this thread owns row r's column of the n × rows output.
                        unsafe { *o.get().add((t0 + i) * w.rows + r) = *v };
                    }
                }
                t0 = t1;
            }
            r0 = r1;
        }
    });
}

#[cfg(target_arch = "x86_64")]
fn is_k(dtype: DType) -> bool {
    matches!(dtype, DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K)
}

fn is_block32(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0)
}

/// Walks `w`'s rows in groups of `per_call` (1 to 4; fewer at a range's end) across the pool;
/// `f(rows, k, vals)` computes the k rows whose bytes are `rows` into `vals[..k]`, which land in
/// output row 0 of `o`.
#[cfg(target_arch = "x86_64")]
fn rows_by(
    pool: &ThreadPool,
    w: MatRef<'_>,
    per_call: usize,
    o: SendPtr,
    f: impl Fn(&[u8], usize, &mut [f32; 4]) + Sync,
) {
    debug_assert!((1..=4).contains(&per_call));
    let rb = w.row_bytes();
    pool.for_ranges(w.rows, 4, &|rows| {
        let mut vals = [0f32; 4];
        let mut r = rows.start;
        while r < rows.end {
            let k = (rows.end - r).min(per_call);
            f(&w.data[r * rb..(r + k) * rb], k, &mut vals);
            for (i, v) in vals.iter().enumerate().take(k) {
                // SAFETY: this thread owns these rows of the single output row.
                unsafe { *o.get().add(r + i) = *v };
            }
            r += k;
        }
    });
}

/// One token against a K-quant matrix, four rows a call (`x86::rowsk_decode`). Rows of more
/// than eight blocks are walked whole, one after another, so a thread's reads stay one
/// sequential stream: walking four long rows together, group by group, interleaved four
/// streams of 1–2 KiB pieces, which the hardware prefetcher of an AVX-512 AMD EPYC followed
/// poorly (kernel lab, decode GB/s with 1 | 2 threads, four interleaved rows → one row a call:
/// Q4_K 2048×4096 7.5 → 14.0 | 14.7 → 29.4, 4096×14336 9.9 → 11.5 | 10.5 → 19.2, Q6_K
/// 4096×14336 6.8 → 9.8 | 14.2 → 18.5). One row a call, though, left each call's float chain
/// (eight blocks' dependent FMAs) alone in its vector; four rows a call run the four chains in
/// one vector's lanes, in the order of one row's. Kernel lab, Intel Xeon, one row a call →
/// four walked whole, GMAC per CPU second at 113×4096 on one thread: Q4_K 21.6 → 25.1, Q3_K
/// 18.3 → 20.1 (AVX2 kernel); Q6_K matvec 8192×4096 with 2 threads (its 512-bit kernel, two
/// alternated runs each), % of the read bound: 62, 67 → 69, 69. Each row is its own float
/// chain, so the bits do not depend on how many rows a call takes.
///
/// At the AVX-512 level Q2_K, Q3_K and Q6_K take `x86::rowsk_decode_zmm` (products 64 values
/// per instruction; Q3_K and Q6_K unpacked natively, `k512_x86`): 113×4096, one thread,
/// against the AVX2 kernel: Q6_K 25.9 against 19.9 GMAC per CPU second, Q3_K 23.2 against
/// 20.1 (17.7 with its AVX2 unpacking widened), Q2_K 27.7 against 26.0. Q4_K and Q5_K decode
/// faster on the AVX2 kernel there (Q4_K 25.1 against 23.9; `k512_x86` says why).
///
/// Where the CPU has AVX-512 VNNI, every K-quant takes `x86::rowsk_decode_vnni`: products
/// unscaled by `vpdpbusd`, scales applied to sums narrowed to i16 (`k512_x86` has the numbers,
/// 9–19% less time per product). The integers are the same, so are the bits.
#[cfg(target_arch = "x86_64")]
fn decode_k(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, o: SendPtr) {
    let vnni = isa.uses_vnni();
    let zmm = isa == Isa::Avx512 && matches!(w.dtype, DType::Q2_K | DType::Q3_K | DType::Q6_K);
    let rb = w.row_bytes();
    let per_call = 4;
    rows_by(pool, w, per_call, o, |wr, k, vals| {
        macro_rules! go {
            ($dt:expr) => {
                match (vnni, zmm, k) {
                    (true, _, 4) => x86::rowsk_decode_vnni::<4, { $dt }>(wr, rb, act, vals),
                    (true, _, 3) => x86::rowsk_decode_vnni::<3, { $dt }>(wr, rb, act, vals),
                    (true, _, 2) => x86::rowsk_decode_vnni::<2, { $dt }>(wr, rb, act, vals),
                    (true, _, _) => x86::rowsk_decode_vnni::<1, { $dt }>(wr, rb, act, vals),
                    (false, true, 4) => x86::rowsk_decode_zmm::<4, { $dt }>(wr, rb, act, vals),
                    (false, true, 3) => x86::rowsk_decode_zmm::<3, { $dt }>(wr, rb, act, vals),
                    (false, true, 2) => x86::rowsk_decode_zmm::<2, { $dt }>(wr, rb, act, vals),
                    (false, true, _) => x86::rowsk_decode_zmm::<1, { $dt }>(wr, rb, act, vals),
                    (false, false, 4) => x86::rowsk_decode::<4, { $dt }>(wr, rb, act, vals),
                    (false, false, 3) => x86::rowsk_decode::<3, { $dt }>(wr, rb, act, vals),
                    (false, false, 2) => x86::rowsk_decode::<2, { $dt }>(wr, rb, act, vals),
                    (false, false, _) => x86::rowsk_decode::<1, { $dt }>(wr, rb, act, vals),
                }
            };
        }
        // SAFETY: AVX2/FMA/F16C (and AVX-512 F/BW where `zmm`) were detected; `wr` holds k
        // whole rows; activation rows are padded to whole groups of eight blocks.
        unsafe {
            match w.dtype {
                DType::Q2_K => go!(10),
                DType::Q3_K => go!(11),
                DType::Q4_K => go!(12),
                DType::Q5_K => go!(13),
                _ => go!(14),
            }
        }
    });
}

/// Most tokens the small-batch kernels take at once (`x86::rowsk_batch`,
/// `block32_x86::rows_batch`, `mxfp4_x86::rows_batch`). Measured (kernel lab, AVX2 K-quant
/// kernel, 2 threads): 16 made every batch size slower than 8 (Q4_K at 64 tokens 68 against
/// 86 GMAC/s) — the scratch no longer sits in L1 beside the weights and activations.
pub(crate) const SMALL_BATCH: usize = 8;

/// Tokens from which the one-row kernels of the 32-value block formats and the IQ formats
/// (`row_tokens`: eight blocks unpacked once for up to 32 tokens), or the AVX2 tiled kernel
/// where it takes the format, take over from their small-batch kernels (four rows against up
/// to `SMALL_BATCH`, `rows_batch`).
/// Measured with the kernel lab's small-batch timings (2 threads, AVX2 kernels), time over one
/// token before → after: Q5_0 n=2 2.48× → 1.26×, n=5 3.01× → 2.23×; Q8_0 n=2 2.11× → 1.34×,
/// n=8 3.09× → 3.05×, n=16 5.20× → 6.03× (so the rows-batch kernel stops below 8). Decode
/// (one token) keeps `rows_decode`: run through `rows_batch`, Q5_0 decoded at 14.9 GB/s
/// against 17.0. Eight tokens (a server batch of eight streams) went to `row_tokens` until
/// measured on an AVX-512 EPYC (kernel lab, 2 threads, interleaved runs of both binaries, time
/// of 8 tokens over one token's): on `rows_batch` Q5_0 4.3–5.7× → 3.9× (4864×896, at AVX2 too:
/// 4.3× → 3.9×), Q8_0 4.4× → 3.6×, Q4_0 5.4× → 5.0×, IQ4_XS 5.0× → 4.3×, IQ2_XXS 3.5× → 3.1×
/// (2048×2048), MXFP4 unchanged (5.5×); so the small-batch kernels take every size they can.
/// Past `SMALL_BATCH` they run in even chunks (9 tokens: 5 + 4), up to where the tiled kernels
/// take the 32-value block formats (`avx2_tiled_min_tokens`, `gemm_min_tokens`: 12).
pub(crate) const ROW_KERNEL_MIN_TOKENS: usize = 12;

/// One small-batch kernel call's results: `[token][row]`.
pub(crate) type BatchOut = [[f32; 4]; SMALL_BATCH];

/// The small-batch kernels' working arrays, set up once per thread and dispatch by
/// `small_batches` and handed to every call. Set up in each call instead, they cost a 4–8 KiB
/// `memset` per four rows — 5.8% of a speculative verify pass's time (perf, Qwen2.5-Coder-0.5B,
/// AVX2). Each kernel writes every element it later reads in the same call (lanes of rows
/// past a call's R, and blocks past a row's end, hold whatever they held; they only reach
/// lanes whose results are dropped), so what an earlier call left here never reaches an output.
#[cfg(target_arch = "x86_64")]
pub(crate) struct BatchScratch {
    /// Per token: the float terms of four rows (the 32-value block and MXFP4 kernels).
    pub(crate) terms: [x86::Terms; SMALL_BATCH],
    /// Per token: eight blocks' integer sums, and their minimum sums (K-quant and IQ kernels).
    pub(crate) a: [[std::arch::x86_64::__m256i; 8]; SMALL_BATCH],
    pub(crate) mn: [[std::arch::x86_64::__m256i; 8]; SMALL_BATCH],
    /// `[row][token][block]` scale products and integer sums as floats, and the minimum terms
    /// (K-quant and IQ kernels).
    pub(crate) ddx: [[[f32; 8]; SMALL_BATCH]; 4],
    pub(crate) isf: [[[f32; 8]; SMALL_BATCH]; 4],
    pub(crate) mdx: [[[f32; 8]; SMALL_BATCH]; 4],
    pub(crate) minf: [[[f32; 8]; SMALL_BATCH]; 4],
}

#[cfg(target_arch = "x86_64")]
impl BatchScratch {
    /// A scratch of all-ones bytes (NaN floats): an element a kernel read before writing it
    /// would poison an output, which the bit-exactness tests would see.
    fn new() -> Box<BatchScratch> {
        let mut b = Box::<BatchScratch>::new_uninit();
        // SAFETY: the fields are arrays of floats and integer vectors, for which every byte
        // pattern is a valid value, so the filled box is initialized.
        unsafe {
            std::ptr::write_bytes(b.as_mut_ptr() as *mut u8, 0xff, std::mem::size_of::<BatchScratch>());
            b.assume_init()
        }
    }
}

/// Several tokens against a matrix on a small-batch kernel: rows in blocks of 16 (whose
/// weights stay in L1/L2 while every token passes), tokens in chunks of at most `SMALL_BATCH`
/// (as even as they can be), four rows at a time. `f(rows, k, t0, nt, vals, scratch)` computes the k rows whose bytes are `rows`
/// against tokens `t0..t0 + nt` into `vals[t][r]`, with the thread's `BatchScratch`.
#[cfg(target_arch = "x86_64")]
pub(crate) fn small_batches(
    pool: &ThreadPool,
    w: MatRef<'_>,
    n: usize,
    o: SendPtr,
    f: impl Fn(&[u8], usize, usize, usize, &mut BatchOut, &mut BatchScratch) + Sync,
) {
    const BLOCK_ROWS: usize = 16;
    let rb = w.row_bytes();
    // Chunks as even as they can be (9 tokens: 5 + 4, not 8 + 1).
    let per_call = n.div_ceil(n.div_ceil(SMALL_BATCH));
    pool.for_ranges(w.rows, 4, &|rows| {
        let mut vals = [[0f32; 4]; SMALL_BATCH];
        let mut scratch = BatchScratch::new();
        let mut b0 = rows.start;
        while b0 < rows.end {
            let b1 = (b0 + BLOCK_ROWS).min(rows.end);
            for t0 in (0..n).step_by(per_call) {
                let nt = (n - t0).min(per_call);
                let mut r = b0;
                while r < b1 {
                    let k = (b1 - r).min(4);
                    f(&w.data[r * rb..(r + k) * rb], k, t0, nt, &mut vals, &mut scratch);
                    for (t, row_vals) in vals.iter().enumerate().take(nt) {
                        for (i, v) in row_vals.iter().enumerate().take(k) {
                            // SAFETY: this thread owns rows b0..b1 of every token's output.
                            unsafe { *o.get().add((t0 + t) * w.rows + r + i) = *v };
                        }
                    }
                    r += k;
                }
            }
            b0 = b1;
        }
    });
}

/// Several tokens against a K-quant matrix (`small_batches` on `x86::rowsk_batch`, or
/// `rowsk_batch_zmm` at the AVX-512 level).
#[cfg(target_arch = "x86_64")]
fn batch_k(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    let zmm = isa == Isa::Avx512;
    let vnni = isa.uses_vnni();
    let rb = w.row_bytes();
    small_batches(pool, w, n, o, |wr, k, t0, nt, vals, s| {
        macro_rules! go {
            ($dt:expr) => {
                match (zmm, k) {
                    (true, 4) if vnni => x86::rowsk_batch_vnni::<4, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, 3) if vnni => x86::rowsk_batch_vnni::<3, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, 2) if vnni => x86::rowsk_batch_vnni::<2, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, _) if vnni => x86::rowsk_batch_vnni::<1, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, 4) => x86::rowsk_batch_zmm::<4, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, 3) => x86::rowsk_batch_zmm::<3, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, 2) => x86::rowsk_batch_zmm::<2, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (true, _) => x86::rowsk_batch_zmm::<1, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (false, 4) => x86::rowsk_batch::<4, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (false, 3) => x86::rowsk_batch::<3, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (false, 2) => x86::rowsk_batch::<2, { $dt }>(wr, rb, act, t0, nt, vals, s),
                    (false, _) => x86::rowsk_batch::<1, { $dt }>(wr, rb, act, t0, nt, vals, s),
                }
            };
        }
        // SAFETY: AVX2/FMA/F16C (and AVX-512 F/BW where `zmm`) were detected; `wr` holds k
        // whole rows; tokens t0..t0 + nt exist; activation rows are padded to whole groups of
        // eight blocks.
        unsafe {
            match w.dtype {
                DType::Q2_K => go!(10),
                DType::Q3_K => go!(11),
                DType::Q4_K => go!(12),
                DType::Q5_K => go!(13),
                _ => go!(14),
            }
        }
    });
}

/// Fewest tokens for which the tiled kernel beats the row kernels. Its panels are 16 tokens
/// wide, so a short batch pays for idle lanes: measured with the kernel lab's small-batch
/// timings (2 threads, Xeon with VNNI), Q4_K at 4–5 tokens took 2.5× one token's time tiled
/// and 2.0× on the row kernels, 8 tokens about the same either way (2.7× / 2.9×); Q6_K and
/// Q2_K cross near 7, Q5_K and Q3_K near 10, the 32-value block formats (Q4_0 at 8 tokens:
/// 4.2× tiled, 3.5× on the row kernels) past 10. The IQ formats (AMD EPYC with VNNI, 2
/// threads): IQ4_NL crosses near 4 (5 tokens: 2.6× tiled, 3.1× on the row kernels), IQ1_S
/// near 6, IQ2_XXS, IQ3_XXS and IQ4_XS near 8 (IQ2_XXS at 8: 3.2× tiled, 3.4× on the row
/// kernels; at 5: 3.0× against 2.4×). MXFP4 (same machine) takes the tiled kernel past the
/// small-batch kernels' largest batch: at 8 tokens both take about 4× one token's time, at 12
/// tiled 3.4–3.7× against 4.4–7.8× on its one-row prefill kernel. Verify passes of speculative
/// decoding and small decode batches are these sizes.
fn gemm_min_tokens(dtype: DType) -> usize {
    if is_block32(dtype) {
        12
    } else if dtype == DType::IQ4_NL {
        5
    } else if dtype == DType::MXFP4 {
        SMALL_BATCH + 1
    } else {
        8
    }
}

/// Formats the VNNI tiled kernel takes (Q8_0, paired with 16-bit activations, goes to the
/// AVX2 tiled kernel).
fn gemm_supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::MXFP4
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
    ) || iq::is_iq(dtype)
}

/// The tiled prefill kernels (tokens in lanes, panels of 16 tokens; see `panel`).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tiled {
    /// `x86_512`: one `vpdpbusd` per 4 values × 16 tokens.
    Vnni,
    /// `tiled_avx2`: `vpmaddubsw` + `vpmaddwd` per 4 values × 8 tokens.
    Avx2,
}

#[cfg(target_arch = "x86_64")]
impl Tiled {
    /// The tiled kernel for `n` tokens of `dtype` at `isa`, where one beats the row kernels.
    /// Q8_0, which the VNNI kernel does not take, runs on the AVX2 one at every level (Intel
    /// Xeon with VNNI, 4096×14336, one thread: 16–512 tokens 23–25 GMAC/s on the AVX-512 row
    /// kernels, 47–51 on the AVX2 tiled kernel; 9 tokens 20 against 29).
    fn choose(isa: Isa, dtype: DType, n: usize) -> Option<Tiled> {
        if isa.uses_vnni() && gemm_supports(dtype) {
            (n >= gemm_min_tokens(dtype)).then_some(Tiled::Vnni)
        } else if isa >= Isa::Avx2 {
            (n >= avx2_tiled_min_tokens(dtype) && tiled_avx2::supports(dtype)).then_some(Tiled::Avx2)
        } else {
            None
        }
    }
}

/// Fewest tokens for which the AVX2 tiled kernel takes over from the AVX2 small-batch kernels:
/// past their largest batch. Its cost is nearly flat up to 8 tokens (one half panel: 3–4.5×
/// one token's time for every format) and 16 (5–6.5×), so it loses to the small-batch kernels
/// below about 8 and wins above. Measured with the kernel lab's small-batch timings (2048×2048,
/// 2 threads, AMD EPYC Zen 3 with AVX2 only, tiled forced from 2 tokens against the previous
/// kernels), time over one token at 8 | 12 | 16 tokens, tiled against before: Q4_0 3.6 | 5.2 |
/// 5.4 against 5.2 | 7.2 | 8.6; Q5_0 4.0 | 5.6 | 5.6 against 3.7 | 6.4 | 8.5; MXFP4 4.6 | 6.3 | 6.4
/// against 4.3 | 7.6 | 11.5; Q3_K 3.9 | 6.3 | 6.1 against 3.4 | 5.7 | 9.4; Q6_K 2.9 | 4.5 | 5.1
/// against 3.7 | 5.3 | 6.6 (that machine's runs scatter by a fifth). At 128 tokens (2048×4096,
/// one thread) it is 1.3–2.5× the row kernels: Q4_K 33 → 82 GMAC/s, Q6_K 32 → 58, Q4_0 27 → 57,
/// Q5_0 26 → 51, MXFP4 26 → 55, Q3_K 35 → 62.
/// The 4- and 5-bit 32-value formats wait until 12 tokens: at 9 (a verify pass of eight drafted
/// tokens) the tiled kernel costs what it costs at 16 (a second half panel of one token), and
/// the small-batch kernels in two even chunks beat it (kernel lab, 4864×896, 2 threads, AVX2
/// EPYC, best of five interleaved runs, GMAC/s tiled → chunks at 9 | 12 tokens: Q5_0 30.7 →
/// 37.0 | 46.3 → 53.8, Q4_0 38.3 → 50.6 | 53.4 → 50.1, Q5_1 38.9 → 48.0 | 52.8 → 48.0), while
/// Q8_0 and the K-quants stay ahead tiled from 9 (Q8_0 52.4 against 44.7, Q4_K 896×4864 80.4
/// against 58.6, Q6_K about even). A whole Qwen2.5-Coder-0.5B pass of 9 tokens had cost 104 ms
/// against 65 for 8. An Intel Xeon forced to AVX2 disagrees (best of three, 2 threads, time
/// chunks / tiled at 9 | 11 tokens: Q4_0 0.97 | 1.11, Q5_0 1.07 | 1.08, Q5_1 1.16 | 1.29, Q4_1
/// 1.07 | 0.88), but such a machine runs the VNNI level, where 9–11 tokens of these formats
/// also moved, from the one-row kernels to the small-batch ones, at about the same time (0.89–
/// 1.12); the AVX2-only machines users have are AMD's, which the threshold follows.
#[cfg(target_arch = "x86_64")]
fn avx2_tiled_min_tokens(dtype: DType) -> usize {
    if is_block32(dtype) && dtype != DType::Q8_0 {
        ROW_KERNEL_MIN_TOKENS
    } else {
        SMALL_BATCH + 1
    }
}

// Both tiled kernels return their panels' results in one array type.
#[cfg(target_arch = "x86_64")]
const _: () = assert!(x86_512::PANELS == tiled_avx2::PANELS);

/// A tiled prefill: panels of 16 tokens, rows in blocks that stay in L2. Each kernel takes up
/// to `PANELS` panels a call (each block of weights unpacked once for them all).
#[cfg(target_arch = "x86_64")]
fn gemm_tiled(kernel: Tiled, pool: &ThreadPool, w: MatRef<'_>, act: &QuantAct, n: usize, o: SendPtr) {
    use panel::{Panel, ROWS, TILE};
    let flip = kernel == Tiled::Vnni && x86_512::flips(w.dtype);
    let panels: Vec<Panel> = (0..n).step_by(TILE).map(|t0| Panel::new(act, t0, (n - t0).min(TILE), flip)).collect();
    let per_call = match kernel {
        Tiled::Vnni => x86_512::PANELS,
        Tiled::Avx2 => tiled_avx2::PANELS,
    };
    let rb = w.row_bytes();
    const BLOCK_ROWS: usize = 64;
    pool.for_ranges(w.rows, ROWS, &|rows| {
        let mut vals = [[[0f32; TILE]; ROWS]; tiled_avx2::PANELS];
        let mut b0 = rows.start;
        while b0 < rows.end {
            let b1 = (b0 + BLOCK_ROWS).min(rows.end);
            for (ci, ps) in panels.chunks(per_call).enumerate() {
                let mut r = b0;
                while r < b1 {
                    let k = (b1 - r).min(ROWS);
                    let wr = &w.data[r * rb..(r + k) * rb];
                    macro_rules! go {
                        ($call:ident) => {
                            match k {
                                4 => $call!(4),
                                3 => $call!(3),
                                2 => $call!(2),
                                _ => $call!(1),
                            }
                        };
                    }
                    macro_rules! vnni {
                        ($r:literal) => {
                            x86_512::gemm::<$r>(w.dtype, wr, rb, ps, &mut vals)
                        };
                    }
                    macro_rules! avx2 {
                        ($r:literal) => {
                            tiled_avx2::gemm::<$r>(w.dtype, wr, rb, ps, &mut vals)
                        };
                    }
                    // SAFETY: `Tiled::choose` picked a kernel whose instruction set was detected
                    // and which takes this format; `wr` holds k whole rows; the panels cover this
                    // matrix's reduction dimension with the activations the format pairs with.
                    unsafe {
                        match kernel {
                            Tiled::Vnni => go!(vnni),
                            Tiled::Avx2 => go!(avx2),
                        }
                    }
                    for (pj, p) in ps.iter().enumerate() {
                        let t0 = (ci * per_call + pj) * TILE;
                        for (i, row_vals) in vals[pj].iter().enumerate().take(k) {
                            for (c, v) in row_vals.iter().enumerate().take(p.n) {
                                // SAFETY: this thread owns rows b0..b1 of every token's output.
                                unsafe { *o.get().add((t0 + c) * w.rows + r + i) = *v };
                            }
                        }
                    }
                    r += k;
                }
            }
            b0 = b1;
        }
    });
}

/// One weight row against tokens `toks` of `act`, into `out` (one value per token): the scalar
/// reference (the SIMD levels send every format to their own kernels before this).
fn row_tokens(dtype: DType, row: &[u8], act: &QuantAct, toks: std::ops::Range<usize>, out: &mut [f32]) {
    for (o, t) in out.iter_mut().zip(toks) {
        *o = dot_ref::row_dot(dtype, row, act, t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::matmul_with_isa;

    /// Random but valid blocks: random bytes with sane f16 scales.
    fn random_row(dtype: DType, cols: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        };
        let mut v: Vec<u8> = (0..dtype.row_bytes(cols).unwrap()).map(|_| next() as u8).collect();
        let bb = dtype.block_bytes();
        let scale_at: &[usize] = match dtype {
            DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => &[0],
            DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
            DType::Q2_K => &[80, 82],
            DType::Q3_K => &[108],
            DType::Q6_K => &[208],
            _ => &[],
        };
        for b in v.chunks_exact_mut(bb) {
            for &o in scale_at {
                blocks::put_f16(b, o, ((next() % 1000) as f32 + 1.0) * 1e-5);
            }
            if dtype == DType::MXFP4 {
                b[0] = 118 + (next() % 8) as u8;
            }
        }
        v
    }

    fn xs(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    const TYPES: [DType; 11] = [
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::MXFP4,
    ];

    #[test]
    fn integer_dot_equals_dequantized_dot() {
        // The integer path must equal Σ dequant(w)·dequant(x) up to float rounding.
        for dtype in TYPES {
            let cols = 512;
            let row = random_row(dtype, cols, 3);
            let x = xs(cols, 5);
            let kind = ActKind::for_weights(dtype).unwrap();
            let act = QuantAct::new(kind, &x, 1, cols);
            let mut wf = vec![0f32; cols];
            dequantize_row(dtype, &row, &mut wf).unwrap();
            let xq: Vec<f32> = (0..cols)
                .map(|i| {
                    let b = i / kind.block();
                    let q = if kind == ActKind::Q16 { act.qs16[i] as f32 } else { act.qs[i] as f32 };
                    q * act.d[b]
                })
                .collect();
            let want: f64 = wf.iter().zip(&xq).map(|(a, b)| *a as f64 * *b as f64).sum();
            let got = dot_ref::row_dot(dtype, &row, &act, 0) as f64;
            let scale: f64 = wf.iter().zip(&xq).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
            assert!((got - want).abs() <= 1e-4 * scale.max(1e-6), "{dtype}: {got} vs {want}");
        }
    }

    #[test]
    fn every_isa_matches_the_reference_bit_for_bit() {
        let pool = ThreadPool::new(2);
        // Single tokens (the decode kernels), small batches (3 and 6 tokens) and the tiled
        // kernels (from 9 tokens at AVX2, from 8 or 12 with VNNI): one half panel of 256-bit
        // lanes (9), both halves (13, 16), a second, partial panel (17), three panels (33) and
        // five (70: two calls of the AVX2 kernel, which takes four); rows left over after groups
        // of four (four, three, two or one at a time) and blocks left over after groups of eight;
        // decode of rows short enough to pair up (four, three and two K-quant blocks), and of
        // rows too long for the K-quant decode's kept terms (130 blocks: 128, then 2).
        for (dtype, (rows, cols, n)) in TYPES.iter().flat_map(|d| {
            [
                (9, 512, 3),
                (9, 512, 6),
                (9, 512, 13),
                (9, 512, 17),
                (9, 512, 1),
                (7, 1024, 1),
                (6, 768, 1),
                (7, 2560, 1),
                (5, 130 * 256, 1),
                (6, 2560, 3),
                (7, 512, 9),
                (6, 256, 16),
                (5, 768, 33),
                (5, 512, 70),
            ]
            .map(|s| (*d, s))
        }) {
            let w: Vec<u8> = (0..rows).flat_map(|r| random_row(dtype, cols, 100 + r as u64)).collect();
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            let x = xs(n * cols, 9);
            let mut want = vec![0f32; n * rows];
            crate::matmul_ref(m, &x, n, &mut want);
            for isa in Isa::supported() {
                let got = matmul_with_isa(isa, &pool, m, &x, n);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "{dtype} {isa:?} element {i}: {a} vs {b}");
                }
            }
        }
    }

    /// The integer kernels sum products in 16-bit lanes as far as the largest codes allow (see
    /// `tiled_avx2`): rows whose every code is the format's largest (bytes 0xFF; MXFP4's 0x77,
    /// its largest value; Q8_0's 0x80, −128) against activations that quantize to their
    /// largest magnitude everywhere are the worst case for those bounds, and must still give
    /// the reference's bits.
    #[test]
    fn largest_codes_against_largest_activations_match_the_reference() {
        let pool = ThreadPool::new(2);
        for dtype in TYPES {
            let cols = 512;
            let fill = match dtype {
                DType::MXFP4 => 0x77,
                DType::Q8_0 => 0x80,
                _ => 0xFF,
            };
            let mut w = Vec::new();
            for r in 0..6 {
                let mut row = random_row(dtype, cols, 7 + r);
                let bb = dtype.block_bytes();
                // Every byte at `fill` except the float scales random_row made sane.
                let keep: std::ops::Range<usize> = match dtype {
                    DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => 0..2,
                    DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => 0..4,
                    DType::Q2_K => 80..84,
                    DType::Q3_K => 108..110,
                    DType::Q6_K => 208..210,
                    _ => 0..1,
                };
                for b in row.chunks_exact_mut(bb) {
                    for (i, v) in b.iter_mut().enumerate() {
                        if !keep.contains(&i) {
                            *v = fill;
                        }
                    }
                }
                w.extend(row);
            }
            let m = MatRef::new(dtype, 6, cols, &w).unwrap();
            for sign in [1.0f32, -1.0] {
                for n in [1, 5, 9, 16, 20] {
                    let x = vec![sign; n * cols];
                    let mut want = vec![0f32; n * 6];
                    crate::matmul_ref(m, &x, n, &mut want);
                    for isa in Isa::supported() {
                        let got = matmul_with_isa(isa, &pool, m, &x, n);
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                a.to_bits(),
                                b.to_bits(),
                                "{dtype} {isa:?} n={n} x={sign} element {i}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn small_batch_scratch_left_by_earlier_calls_never_reaches_an_output() {
        // One thread: every call of a dispatch shares one `BatchScratch`, four rows, four, then
        // three (lanes the earlier calls filled), over rows whose last group of eight blocks is
        // partial (K formats: 9 blocks; 32-value formats: 41) and a row of zeros (a call whose
        // terms are all zero after calls whose were not).
        let pool = ThreadPool::new(1);
        for dtype in TYPES {
            let cols = if dtype.block_elems() == 256 { 9 * 256 } else { 41 * 32 };
            let rows = 11;
            let mut w: Vec<u8> = (0..rows).flat_map(|r| random_row(dtype, cols, 300 + r as u64)).collect();
            let rb = dtype.row_bytes(cols).unwrap();
            w[9 * rb..10 * rb].fill(0);
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            for n in [2, 5, SMALL_BATCH] {
                let x = xs(n * cols, 40 + n as u64);
                let mut want = vec![0f32; n * rows];
                crate::matmul_ref(m, &x, n, &mut want);
                for isa in Isa::supported() {
                    let got = matmul_with_isa(isa, &pool, m, &x, n);
                    assert!(crate::compare::same_bits(&got, &want), "{dtype} {isa:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn batch_and_threads_do_not_change_a_row() {
        // 3 and 7 tokens run on the small-batch kernels, 13 on the tiled ones where the CPU has
        // them (else on the small-batch kernels for K-quants, the row kernels for the others).
        for (dtype, n) in
            [DType::Q4_K, DType::Q6_K, DType::Q8_0, DType::Q5_0].into_iter().flat_map(|d| [(d, 3), (d, 7), (d, 13)])
        {
            let (rows, cols) = (33, 256);
            let w: Vec<u8> = (0..rows).flat_map(|r| random_row(dtype, cols, r as u64)).collect();
            let m = MatRef::new(dtype, rows, cols, &w).unwrap();
            let x = xs(n * cols, 1);
            let mut all = vec![0f32; n * rows];
            crate::matmul(&ThreadPool::new(2), m, &x, n, &mut all);
            for t in 0..n {
                let mut one = vec![0f32; rows];
                crate::matmul(&ThreadPool::new(1), m, &x[t * cols..(t + 1) * cols], 1, &mut one);
                assert!(crate::compare::same_bits(&one, &all[t * rows..(t + 1) * rows]));
            }
        }
    }
}

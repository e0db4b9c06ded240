//! `out = x · Wᵀ` for a stored weight matrix `W` (rows × cols, rows contiguous) and f32
//! activations `x` (n × cols): the one op that touches weights.
//!
//! Work is split across threads by output rows only, and each (row, token) pair is reduced by
//! the same code path whatever the tile it falls in, so results are independent of the thread
//! count and of the batch (see `float` for the order).

use crate::cpu::{isa, Isa};
use crate::dtype::DType;
use crate::pool::ThreadPool;

/// A borrowed weight matrix in its stored format.
#[derive(Clone, Copy, Debug)]
pub struct MatRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    /// Checks that `data` holds exactly `rows` rows of `cols` elements.
    pub fn new(dtype: DType, rows: usize, cols: usize, data: &'a [u8]) -> Result<MatRef<'a>, crate::KernelError> {
        let rb = dtype.row_bytes(cols).ok_or(crate::KernelError::PartialBlock { dtype, cols })?;
        if data.len() != rb * rows {
            return Err(crate::KernelError::Size { dtype, rows, cols, expected: rb * rows, got: data.len() });
        }
        if !crate::supports_matmul(dtype) {
            return Err(crate::KernelError::Unsupported { dtype });
        }
        Ok(MatRef { dtype, rows, cols, data })
    }

    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.cols).expect("validated in MatRef::new")
    }

    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }

    /// Rows `start..end` as a matrix of their own.
    pub fn slice_rows(&self, start: usize, end: usize) -> MatRef<'a> {
        let rb = self.row_bytes();
        MatRef { dtype: self.dtype, rows: end - start, cols: self.cols, data: &self.data[start * rb..end * rb] }
    }
}

/// A raw pointer that may cross to pool threads; each thread writes a disjoint set of elements.
#[derive(Clone, Copy)]
pub struct SendPtr(pub *mut f32);
// SAFETY: used only to write disjoint output elements from pool threads while the owner waits.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    #[inline]
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[t][r] = Σ_c W[r][c] · x[t][c]`, `x` is `n × cols`, `out` is `n × rows`.
pub fn matmul(pool: &ThreadPool, w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    assert_eq!(x.len(), n * w.cols, "matmul: x is not n × cols");
    assert_eq!(out.len(), n * w.rows, "matmul: out is not n × rows");
    if w.dtype.is_float() {
        let o = SendPtr(out.as_mut_ptr());
        pool.for_ranges(w.rows, 16, &|rows| {
            // SAFETY: this thread writes only columns `rows` of the n × rows output.
            unsafe { float_rows(isa(), w, rows, x, n, o) };
        });
    } else {
        crate::quant::matmul_quant(pool, w, x, n, out);
    }
}

/// One token (`x`, one row) through matrices that share it, in one dispatch of the pool: each
/// thread takes the same share of every matrix's rows (about 1/threads of each, in whole groups
/// of four rows), computes its pieces one after another with the one-thread kernels, and then
/// runs `then` on its pieces of the outputs (in the order of `ws`) while they are in its cache
/// (a gated FFN combines its gate and up rows there). Every row comes from the kernel `matmul`
/// runs for it, over the same weights and activations, so `outs` get `matmul`'s bits; a decode
/// step of a dense model saves a dispatch per extra matrix (q/k/v, gate/up), and the combine
/// runs on every thread instead of on one while the others wait.
pub fn matvecs(
    pool: &ThreadPool,
    ws: &[MatRef<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
    then: &(dyn Fn(&mut [&mut [f32]]) + Sync),
) {
    assert_eq!(ws.len(), outs.len(), "matvecs: one output per matrix");
    for (w, o) in ws.iter().zip(outs.iter()) {
        assert_eq!(x.len(), w.cols, "matvecs: x is not one row of cols");
        assert_eq!(o.len(), w.rows, "matvecs: an output is not rows long");
    }
    let ptrs: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
    let threads = pool.n_threads();
    let one = ThreadPool::serial();
    pool.run(&|t| {
        let mut mine: Vec<&mut [f32]> = Vec::with_capacity(ws.len());
        for (w, p) in ws.iter().zip(&ptrs) {
            let per = w.rows.div_ceil(threads).next_multiple_of(4);
            let (a, b) = ((t * per).min(w.rows), ((t + 1) * per).min(w.rows));
            // SAFETY: thread t alone writes rows a..b of this output (the shares are disjoint),
            // and `outs` outlives the dispatch.
            let out = unsafe { std::slice::from_raw_parts_mut(p.get().add(a), b - a) };
            if b > a {
                matmul(one, w.slice_rows(a, b), x, 1, out);
            }
            mine.push(out);
        }
        then(&mut mine);
    });
}

/// Float weights: rows `rows` of the output for all `n` tokens.
///
/// # Safety
/// `out` points to an `n × w.rows` buffer whose columns `rows` no one else touches meanwhile.
pub(crate) unsafe fn float_rows(
    isa: Isa,
    w: MatRef<'_>,
    rows: std::ops::Range<usize>,
    x: &[f32],
    n: usize,
    out: SendPtr,
) {
    // Prefill: blocked over rows, tokens and k, from packed panels (`float_gemm`), from the
    // token count where that pays (`float_gemm::min_tokens`).
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 && n >= crate::float_gemm::min_tokens(isa) {
        // SAFETY: `isa` was detected (or lowered) from this CPU's features; the caller's contract.
        return unsafe {
            match isa {
                Isa::Avx512 => crate::float_gemm::rows_avx512(w, rows, x, n, out),
                _ => crate::float_gemm::rows_avx2(w, rows, x, n, out),
            }
        };
    }
    let k = w.cols;
    let m = w.rows;
    let xs: Vec<&[f32]> = (0..n).map(|t| &x[t * k..(t + 1) * k]).collect();
    let mut buf = [0f32; 8 * 4];
    // Decode (one token): 8 rows a tile for memory-level parallelism. Small batches: 4 rows × 4
    // tokens with AVX-512 (16 accumulators of 16 lanes); at AVX2 a pair's 16 lanes take two
    // registers, and 3 rows × 2 tokens (12) keep them in the register file where 4 × 4 (32)
    // spill (AMD EPYC Zen 3, 4096×14336, one thread, 16 tokens, GMAC/s: F32 13.4 → 17.0, BF16
    // 14.5 → 20.1, F16 14.4 → 19.4).
    let (rt, tt) = match (n, isa) {
        (1, _) => (8, 1),
        (_, Isa::Avx512) => (4, 4),
        _ => (3, 2),
    };
    let mut r = rows.start;
    while r < rows.end {
        let re = (r + rt).min(rows.end);
        let mut wr: [&[u8]; 8] = [&[]; 8];
        for i in r..re {
            wr[i - r] = w.row(i);
        }
        let wr = &wr[..re - r];
        let mut t = 0;
        while t < n {
            let te = (t + tt).min(n);
            crate::float::tile(isa, w.dtype, wr, &xs[t..te], &mut buf, 8);
            for tk in t..te {
                // SAFETY: row range r..re of token tk lies in this thread's columns (caller's contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(buf.as_ptr().add((tk - t) * 8), out.get().add(tk * m + r), re - r)
                };
            }
            t = te;
        }
        r = re;
    }
}

/// `matmul` forced onto one ISA level (the kernel lab and tests compare levels with it).
pub fn matmul_with_isa(isa: Isa, pool: &ThreadPool, w: MatRef<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n * w.rows];
    if w.dtype.is_float() {
        let o = SendPtr(out.as_mut_ptr());
        // SAFETY: a single call covers every row; `out` is n × rows.
        unsafe { float_rows(isa, w, 0..w.rows, x, n, o) };
    } else {
        crate::quant::matmul_quant_isa(isa, pool, w, x, n, &mut out);
    }
    out
}

/// Reference matmul: every (row, token) through the scalar dot of the weight's format.
pub fn matmul_ref(w: MatRef<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    for t in 0..n {
        let xt = &x[t * w.cols..(t + 1) * w.cols];
        for r in 0..w.rows {
            out[t * w.rows + r] = if w.dtype.is_float() {
                crate::float::dot_ref(w.dtype, w.row(r), xt)
            } else {
                crate::quant::dot_ref(w.dtype, w.row(r), xt)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testdata::{quantized, uniform};

    /// `matvecs` gives each matrix `matmul`'s bits at any thread count, row counts that do not
    /// split evenly included, and `then` sees exactly the thread's pieces: here it doubles them,
    /// so a row it missed or saw twice shows.
    #[test]
    fn matvecs_equal_matmul_and_then_sees_each_row_once() {
        let cols = 256;
        let shapes = [(DType::Q4_K, 70), (DType::Q8_0, 9), (DType::F32, 33), (DType::Q5_0, 1)];
        let data: Vec<Vec<u8>> = shapes.iter().map(|&(d, r)| quantized(d, r, cols, r as u64)).collect();
        let ws: Vec<MatRef> =
            shapes.iter().zip(&data).map(|(&(d, r), b)| MatRef::new(d, r, cols, b).unwrap()).collect();
        let mut next = uniform(5);
        let x: Vec<f32> = (0..cols).map(|_| next()).collect();
        for threads in 1..=3 {
            let pool = ThreadPool::new(threads);
            let want: Vec<Vec<f32>> = ws
                .iter()
                .map(|w| {
                    let mut o = vec![0f32; w.rows];
                    matmul(&pool, *w, &x, 1, &mut o);
                    o
                })
                .collect();
            let mut got: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; w.rows]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|g| g.as_mut_slice()).collect();
            matvecs(&pool, &ws, &x, &mut outs, &|pieces| {
                for p in pieces.iter_mut() {
                    p.iter_mut().for_each(|v| *v *= 2.0);
                }
            });
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let doubled: Vec<u32> = w.iter().map(|v| (v * 2.0).to_bits()).collect();
                assert_eq!(g.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), doubled, "matrix {i}, {threads} threads");
            }
        }
    }
}

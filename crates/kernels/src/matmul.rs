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

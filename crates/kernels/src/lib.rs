//! sluice's compute kernels: stored weight formats, a scalar reference for every op,
//! runtime-dispatched SIMD variants that agree with the reference, and the decode thread pool.

pub mod compare;
pub mod cpu;
pub mod dtype;
pub mod float;
#[cfg(target_arch = "x86_64")]
mod float_gemm;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod recurrent;
pub mod testdata;

pub use dtype::DType;
pub use matmul::{matmul, matmul_ref, matvecs, MatRef, SendPtr};
pub use pool::ThreadPool;

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{dtype} rows of {cols} elements are not a whole number of blocks")]
    PartialBlock { dtype: DType, cols: usize },
    #[error("{dtype} matrix {rows}x{cols} needs {expected} bytes, got {got}")]
    Size { dtype: DType, rows: usize, cols: usize, expected: usize, got: usize },
    #[error("no matmul kernel for {dtype} weights")]
    Unsupported { dtype: DType },
}

/// Whether `matmul` can consume weights stored as `dtype`.
pub fn supports_matmul(dtype: DType) -> bool {
    dtype.is_float() || quant::supports(dtype)
}

//! Block-quantized formats (GGUF's): dequantization references and dot kernels.

use crate::dtype::DType;
use crate::matmul::MatRef;
use crate::pool::ThreadPool;

/// Whether a quantized matmul kernel exists for `dtype`.
pub fn supports(_dtype: DType) -> bool {
    false
}

pub(crate) fn matmul_quant(_pool: &ThreadPool, w: MatRef<'_>, _x: &[f32], _n: usize, _out: &mut [f32]) {
    unreachable!("MatRef::new rejects {}", w.dtype)
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
    Err(crate::KernelError::Unsupported { dtype })
}

pub(crate) fn matmul_quant_isa(
    _isa: crate::cpu::Isa,
    pool: &ThreadPool,
    w: MatRef<'_>,
    x: &[f32],
    n: usize,
    out: &mut [f32],
) {
    matmul_quant(pool, w, x, n, out)
}

/// Quantizes `rows × cols` f32 values (row-major) into rows of `dtype`.
pub fn quantize_rows(dtype: DType, v: &[f32], cols: usize) -> Vec<u8> {
    match dtype {
        DType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        DType::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes()).collect(),
        _ => {
            let _ = cols;
            unimplemented!("quantize {dtype}")
        }
    }
}

pub(crate) fn dot_ref(dtype: DType, _row: &[u8], _x: &[f32]) -> f32 {
    unreachable!("MatRef::new rejects {dtype}")
}

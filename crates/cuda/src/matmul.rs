//! `out = x · Wᵀ` on the device for weights in their stored block format: the activations
//! are quantized on the device as the CPU quantizes them (`GpuAct`), then each (row, token)
//! goes through the reference's integer sums and float formula (`kernels/quant.cu`).

use crate::device::{Gpu, GpuError};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sluice_kernels::quant::act::ActKind;
use sluice_kernels::{DType, MatRef};

/// Rows (one warp each) per thread block of the matmul kernels.
const ROWS_PER_BLOCK: u32 = 4;

/// The matmul kernel's base name for weights of `dtype`.
pub(crate) fn kernel_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Q4_K => "matmul_q4_k",
        DType::Q5_K => "matmul_q5_k",
        DType::Q6_K => "matmul_q6_k",
        DType::Q2_K => "matmul_q2_k",
        DType::Q3_K => "matmul_q3_k",
        DType::Q8_0 => "matmul_q8_0",
        _ => return None,
    })
}

/// A weight matrix on the device, in its stored format (rows × cols, rows contiguous).
pub struct GpuMatrix {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    data: CudaSlice<u8>,
}

impl GpuMatrix {
    pub fn bytes(&self) -> usize {
        self.data.len()
    }
}

/// `n` activation rows of `cols` values, quantized on the device for one weight format.
pub struct GpuAct {
    kind: ActKind,
    cols: usize,
    n: usize,
    d: CudaSlice<f32>,
    /// Q8_K codes and their sums of 16 (empty for Q16).
    qs: CudaSlice<i8>,
    bsums: CudaSlice<i16>,
    /// Q16 codes (empty otherwise).
    qs16: CudaSlice<i16>,
}

/// A `GpuAct` copied back, block after block, token-major (no padding blocks).
pub struct HostAct {
    pub d: Vec<f32>,
    /// Q8_K codes (empty for Q16).
    pub qs: Vec<i8>,
    /// Q8_K sums of every 16 codes (empty for Q16).
    pub bsums: Vec<i16>,
    /// Q16 codes (empty otherwise).
    pub qs16: Vec<i16>,
}

impl GpuAct {
    pub fn tokens(&self) -> usize {
        self.n
    }

    /// Copies the quantized blocks back to the host.
    pub fn to_host(&self, gpu: &Gpu) -> Result<HostAct, GpuError> {
        let s = &gpu.stream;
        let (qs, bsums, qs16) = match self.kind {
            ActKind::Q8_K => (s.clone_dtoh(&self.qs)?, s.clone_dtoh(&self.bsums)?, Vec::new()),
            _ => (Vec::new(), Vec::new(), s.clone_dtoh(&self.qs16)?),
        };
        Ok(HostAct { d: s.clone_dtoh(&self.d)?, qs, bsums, qs16 })
    }
}

impl Gpu {
    /// Copies a weight matrix to the device.
    pub fn upload(&self, w: MatRef<'_>) -> Result<GpuMatrix, GpuError> {
        if kernel_name(w.dtype).is_none() {
            return Err(GpuError::Unsupported(w.dtype));
        }
        let data = self.stream.clone_htod(w.data)?;
        Ok(GpuMatrix { dtype: w.dtype, rows: w.rows, cols: w.cols, data })
    }

    /// Quantizes `n × cols` f32 activations on the device as the CPU does for `dtype` weights.
    pub fn quantize(&self, dtype: DType, x: &CudaSlice<f32>, n: usize, cols: usize) -> Result<GpuAct, GpuError> {
        let kind = ActKind::for_weights(dtype).filter(|_| kernel_name(dtype).is_some());
        let kind = kind.ok_or(GpuError::Unsupported(dtype))?;
        if x.len() != n * cols || !cols.is_multiple_of(kind.block()) {
            return Err(GpuError::Shape(format!(
                "activations of {} values are not {n} rows of {cols} whole {}-value blocks",
                x.len(),
                kind.block()
            )));
        }
        let blocks = n * cols / kind.block();
        let s = &self.stream;
        let (name, qs, bsums, qs16) = match kind {
            ActKind::Q8_K => {
                ("quantize_q8k", s.alloc_zeros::<i8>(blocks * 256)?, s.alloc_zeros(blocks * 16)?, s.alloc_zeros(1)?)
            }
            ActKind::Q16 => ("quantize_q16", s.alloc_zeros::<i8>(1)?, s.alloc_zeros(1)?, s.alloc_zeros(blocks * 32)?),
            _ => return Err(GpuError::Unsupported(dtype)),
        };
        let mut act = GpuAct { kind, cols, n, d: s.alloc_zeros(blocks)?, qs, bsums, qs16 };
        let f = self.function(name)?;
        let (cols_i, n_i) = (cols as i32, n as i32);
        let cfg =
            LaunchConfig { grid_dim: ((blocks as u32).div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = s.launch_builder(&f);
        b.arg(x).arg(&cols_i).arg(&n_i).arg(&mut act.d);
        if kind == ActKind::Q8_K {
            b.arg(&mut act.qs).arg(&mut act.bsums);
        } else {
            b.arg(&mut act.qs16);
        }
        // SAFETY: the kernel reads n × cols floats of `x` and writes `blocks` entries of `d`
        // and of the code and sum arrays, each allocated to that size above.
        unsafe { b.launch(cfg) }?;
        Ok(act)
    }

    /// `out = x · Wᵀ` for quantized activations `x` (n × cols): `out` is n × rows.
    pub fn matmul(&self, w: &GpuMatrix, x: &GpuAct, out: &mut CudaSlice<f32>) -> Result<(), GpuError> {
        let base = kernel_name(w.dtype).ok_or(GpuError::Unsupported(w.dtype))?;
        if ActKind::for_weights(w.dtype) != Some(x.kind) || x.cols != w.cols {
            return Err(GpuError::Shape(format!(
                "{:?} activations of {} columns do not fit {} weights of {} columns",
                x.kind, x.cols, w.dtype, w.cols
            )));
        }
        if out.len() != x.n * w.rows {
            return Err(GpuError::Shape(format!("output of {} values is not {} × {}", out.len(), x.n, w.rows)));
        }
        if x.n == 0 || w.rows == 0 {
            return Ok(());
        }
        // One token: the decode kernel; more: eight tokens a pass (each token's result is
        // the same either way).
        let f = self.function(&format!("{base}_{}", if x.n == 1 { 1 } else { 8 }))?;
        let nb = (w.cols / w.dtype.block_elems()) as i32;
        let (rows, n) = (w.rows as i32, x.n as i32);
        let cfg = LaunchConfig {
            grid_dim: ((w.rows as u32).div_ceil(ROWS_PER_BLOCK), 1, 1),
            block_dim: (32 * ROWS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = self.stream.launch_builder(&f);
        b.arg(&w.data).arg(&rows).arg(&nb).arg(&x.d).arg(&x.qs).arg(&x.bsums).arg(&x.qs16).arg(&n).arg(out);
        // SAFETY: `w.data` holds rows × nb blocks (checked at upload), the activation arrays
        // hold n × nb blocks of the kind these weights pair with (checked above), and `out`
        // holds n × rows floats.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Host-to-host convenience: uploads `x` (n × cols), quantizes, multiplies, copies back.
    pub fn matmul_host(&self, w: &GpuMatrix, x: &[f32], n: usize) -> Result<Vec<f32>, GpuError> {
        let xd = self.stream.clone_htod(x)?;
        let act = self.quantize(w.dtype, &xd, n, w.cols)?;
        let mut out = self.stream.alloc_zeros::<f32>(n * w.rows)?;
        self.matmul(w, &act, &mut out)?;
        Ok(self.stream.clone_dtoh(&out)?)
    }
}

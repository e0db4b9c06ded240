//! `out = x · Wᵀ` on the device for weights in their stored block format: the activations
//! are quantized on the device as the CPU quantizes them (`GpuAct`), then each (row, token)
//! goes through the reference's integer sums and float formula (`kernels/quant.cu`).

use crate::device::{Gpu, GpuError};
use cudarc::driver::{CudaSlice, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};
use sluice_kernels::quant::act::ActKind;
use sluice_kernels::{DType, MatRef};

/// Threads a block of the matmul kernels.
const BLOCK_THREADS: u32 = 128;
/// Lanes that share one row in `matmul`.
const LANES_PER_ROW: usize = 8;

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

    /// The matrix as a borrowed device matrix (what the grouped matmul takes).
    pub fn view(&self, gpu: &Gpu) -> DeviceMat<'_> {
        let (ptr, _sync) = self.data.device_ptr(&gpu.stream);
        DeviceMat { dtype: self.dtype, rows: self.rows, cols: self.cols, ptr, _owner: std::marker::PhantomData }
    }
}

/// A matrix in device memory, borrowed from whatever owns it (a `GpuMatrix`, a slot of the
/// VRAM expert cache) for as long as `'a`.
#[derive(Clone, Copy, Debug)]
pub struct DeviceMat<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub(crate) ptr: u64,
    pub(crate) _owner: std::marker::PhantomData<&'a ()>,
}

/// `n` activation rows of `cols` values, quantized on the device for one weight format.
pub struct GpuAct {
    kind: ActKind,
    cols: usize,
    /// Rows quantized now, and rows there is room for.
    n: usize,
    capacity: usize,
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

/// Checks that activations `x` pair with `dtype` weights of `cols` columns.
fn check_fits(dtype: DType, cols: usize, x: &GpuAct) -> Result<(), GpuError> {
    if ActKind::for_weights(dtype) != Some(x.kind) || x.cols != cols {
        return Err(GpuError::Shape(format!(
            "{:?} activations of {} columns do not fit {dtype} weights of {cols} columns",
            x.kind, x.cols
        )));
    }
    Ok(())
}

/// Blocks a launch aims for at least, so that many tokens fill the device (a few per SM).
const TARGET_BLOCKS: usize = 1024;

/// A launch of `lanes` lanes for each of `rows` rows, `grid_y` times over, with up to
/// `tokens` tokens shared out along z: returns the launch and the tokens each z block takes
/// (a multiple of the kernels' eight-token pass; all of them when one z block suffices).
fn rows_launch(rows: usize, lanes: usize, grid_y: usize, tokens: usize) -> (LaunchConfig, i32) {
    let x = (rows * lanes).div_ceil(BLOCK_THREADS as usize);
    let passes = tokens.div_ceil(8).max(1);
    let z = TARGET_BLOCKS.div_ceil((x * grid_y).max(1)).clamp(1, passes.min(65535));
    let chunk = 8 * passes.div_ceil(z);
    let z = tokens.div_ceil(chunk).max(1);
    let cfg = LaunchConfig {
        grid_dim: (x as u32, grid_y as u32, z as u32),
        block_dim: (BLOCK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, chunk as i32)
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

    /// Room on the device for `n` activation rows of `cols` values quantized for `dtype`
    /// weights (`quantize_into` fills it; allocate once, reuse every step).
    pub fn act_buffer(&self, dtype: DType, n: usize, cols: usize) -> Result<GpuAct, GpuError> {
        let kind = ActKind::for_weights(dtype).filter(|_| kernel_name(dtype).is_some());
        let kind = kind.ok_or(GpuError::Unsupported(dtype))?;
        if !cols.is_multiple_of(kind.block()) {
            return Err(GpuError::Shape(format!("{cols} columns are not whole {}-value blocks", kind.block())));
        }
        let blocks = (n * cols / kind.block()).max(1);
        let s = &self.stream;
        let (qs, bsums, qs16) = match kind {
            ActKind::Q8_K => (s.alloc_zeros::<i8>(blocks * 256)?, s.alloc_zeros(blocks * 16)?, s.alloc_zeros(1)?),
            ActKind::Q16 => (s.alloc_zeros::<i8>(1)?, s.alloc_zeros(1)?, s.alloc_zeros(blocks * 32)?),
            _ => return Err(GpuError::Unsupported(dtype)),
        };
        Ok(GpuAct { kind, cols, n, capacity: n, d: s.alloc_zeros(blocks)?, qs, bsums, qs16 })
    }

    /// Quantizes `n × cols` f32 activations on the device as the CPU does for `dtype` weights.
    pub fn quantize(&self, dtype: DType, x: &CudaSlice<f32>, n: usize, cols: usize) -> Result<GpuAct, GpuError> {
        let mut act = self.act_buffer(dtype, n, cols)?;
        self.quantize_into(x, n, &mut act)?;
        Ok(act)
    }

    /// Quantizes `n × cols` activations for `dtype` weights into `buf`, which is (re)made
    /// when it is missing, of another kind or width, or too small (grown to twice the need).
    pub fn quantize_reusing(
        &self,
        dtype: DType,
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
        buf: &mut Option<GpuAct>,
    ) -> Result<(), GpuError> {
        let kind = ActKind::for_weights(dtype);
        if !buf.as_ref().is_some_and(|a| Some(a.kind) == kind && a.cols == cols && a.capacity >= n) {
            *buf = Some(self.act_buffer(dtype, 2 * n, cols)?);
        }
        self.quantize_into(x, n, buf.as_mut().expect("made above"))
    }

    /// Quantizes `n` rows of `x` into `act` (which must have room for them).
    pub fn quantize_into(&self, x: &CudaSlice<f32>, n: usize, act: &mut GpuAct) -> Result<(), GpuError> {
        let cols = act.cols;
        if n > act.capacity || x.len() < n * cols {
            return Err(GpuError::Shape(format!(
                "{n} activation rows of {cols} values: the buffer holds {} rows, the input {} values",
                act.capacity,
                x.len()
            )));
        }
        act.n = n;
        if n == 0 {
            return Ok(());
        }
        let blocks = n * cols / act.kind.block();
        let name = if act.kind == ActKind::Q8_K { "quantize_q8k" } else { "quantize_q16" };
        let f = self.function(name);
        let (cols_i, n_i) = (cols as i32, n as i32);
        let cfg =
            LaunchConfig { grid_dim: ((blocks as u32).div_ceil(8), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&cols_i).arg(&n_i).arg(&mut act.d);
        if act.kind == ActKind::Q8_K {
            b.arg(&mut act.qs).arg(&mut act.bsums);
        } else {
            b.arg(&mut act.qs16);
        }
        // SAFETY: the kernel reads n × cols floats of `x` and writes `blocks` entries of `d`
        // and of the code and sum arrays, which hold `capacity` ≥ n rows.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `out = x · Wᵀ` for quantized activations `x` (n × cols): `out` holds n × rows.
    pub fn matmul(&self, w: &GpuMatrix, x: &GpuAct, out: &mut CudaSlice<f32>) -> Result<(), GpuError> {
        self.matmul_lanes(w, x, out, LANES_PER_ROW)
    }

    /// `matmul` with `lanes` (8 or 16) lanes a row: the same bits either way (the kernel lab
    /// and the tests compare them).
    pub fn matmul_lanes(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        out: &mut CudaSlice<f32>,
        lanes: usize,
    ) -> Result<(), GpuError> {
        let len = out.len();
        self.launch_rows(w.view(self), x, &mut out.slice_mut(0..len), lanes)
    }

    /// `matmul` of a borrowed device matrix into part of a larger buffer (`out` holds
    /// n × rows from its start): several products of one input land in one buffer, to come
    /// back in one copy.
    pub fn matmul_into(&self, w: DeviceMat<'_>, x: &GpuAct, out: &mut CudaViewMut<'_, f32>) -> Result<(), GpuError> {
        self.launch_rows(w, x, out, LANES_PER_ROW)
    }

    fn launch_rows(
        &self,
        w: DeviceMat<'_>,
        x: &GpuAct,
        out: &mut CudaViewMut<'_, f32>,
        lanes: usize,
    ) -> Result<(), GpuError> {
        if lanes != 8 && lanes != 16 {
            return Err(GpuError::Shape(format!("{lanes} lanes a row: the kernels take 8 or 16")));
        }
        let base = kernel_name(w.dtype).ok_or(GpuError::Unsupported(w.dtype))?;
        check_fits(w.dtype, w.cols, x)?;
        if out.len() < x.n * w.rows {
            return Err(GpuError::Shape(format!("output of {} values is not {} × {}", out.len(), x.n, w.rows)));
        }
        if x.n == 0 || w.rows == 0 {
            return Ok(());
        }
        // One token: the decode kernel; more: eight tokens a pass, the tokens shared out
        // between blocks (each token's result is the same either way).
        let f = self.function(&format!("{base}_g{lanes}_{}", if x.n == 1 { 1 } else { 8 }));
        let nb = (w.cols / w.dtype.block_elems()) as i32;
        let (rows, n) = (w.rows as i32, x.n as i32);
        let (cfg, chunk) = rows_launch(w.rows, lanes, 1, x.n);
        let mut b = self.stream.launch_builder(f);
        b.arg(&w.ptr).arg(&rows).arg(&nb).arg(&x.d).arg(&x.qs).arg(&x.bsums).arg(&x.qs16).arg(&n).arg(&chunk).arg(out);
        // SAFETY: `w.ptr` is a live matrix of rows × nb blocks of its format, borrowed for
        // the call (its owner frees device memory in stream order, after this launch); the
        // activation arrays hold n × nb blocks of the kind these weights pair with (checked
        // above), and `out` holds n × rows floats.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Several matrices of one shape and format in one launch, as a MoE layer multiplies
    /// each selected expert with the tokens routed to it. `segments[s] = (W_s, range)`:
    /// entries `range` of the list multiply `W_s`; entry `i` reads activation row
    /// `act_rows[i]` of `x` and writes row `i` of `out` (entries × rows). Each entry's result
    /// is bit-identical to `matmul` of its matrix and its activation row alone.
    pub fn matmul_ids(
        &self,
        segments: &[(DeviceMat<'_>, std::ops::Range<usize>)],
        x: &GpuAct,
        act_rows: &[i32],
        out: &mut CudaSlice<f32>,
    ) -> Result<(), GpuError> {
        let len = out.len();
        self.matmul_ids_into(segments, x, act_rows, &mut out.slice_mut(0..len))
    }

    /// `matmul_ids` into part of a larger buffer.
    pub fn matmul_ids_into(
        &self,
        segments: &[(DeviceMat<'_>, std::ops::Range<usize>)],
        x: &GpuAct,
        act_rows: &[i32],
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), GpuError> {
        let Some((first, _)) = segments.first() else { return Ok(()) };
        let (dtype, rows, cols) = (first.dtype, first.rows, first.cols);
        let base = kernel_name(dtype).ok_or(GpuError::Unsupported(dtype))?;
        check_fits(dtype, cols, x)?;
        // The launch's table, in one upload: matrix pointers (u64), then segment starts,
        // lengths and the entries' activation rows (i32).
        let nseg = segments.len();
        let mut table: Vec<u8> = Vec::with_capacity(16 * nseg + 4 * act_rows.len());
        let mut expect = 0;
        let mut max_len = 0;
        for (w, _) in segments {
            if (w.dtype, w.rows, w.cols) != (dtype, rows, cols) {
                return Err(GpuError::Shape(format!(
                    "grouped matmul of {dtype} {rows}x{cols} and {} {}x{} matrices",
                    w.dtype, w.rows, w.cols
                )));
            }
            table.extend_from_slice(&w.ptr.to_le_bytes());
        }
        for (_, r) in segments {
            if r.start != expect || r.end < r.start {
                return Err(GpuError::Shape(format!("segment {r:?} does not follow entry {expect}")));
            }
            expect = r.end;
            max_len = max_len.max(r.len());
            table.extend_from_slice(&(r.start as i32).to_le_bytes());
        }
        for (_, r) in segments {
            table.extend_from_slice(&(r.len() as i32).to_le_bytes());
        }
        if act_rows.len() != expect || act_rows.iter().any(|&a| a < 0 || a as usize >= x.n) {
            return Err(GpuError::Shape(format!(
                "{} activation rows for {expect} entries, each below {}",
                act_rows.len(),
                x.n
            )));
        }
        table.extend(act_rows.iter().flat_map(|a| a.to_le_bytes()));
        if out.len() < expect * rows {
            return Err(GpuError::Shape(format!("output of {} values is not {expect} × {rows}", out.len())));
        }
        if expect == 0 || rows == 0 {
            return Ok(());
        }
        let s = &self.stream;
        let mut meta = self.meta.lock().unwrap_or_else(|p| p.into_inner());
        if meta.as_ref().is_none_or(|m| m.len() < table.len()) {
            *meta = Some(s.alloc_zeros::<u8>(table.len().next_power_of_two().max(4096))?);
        }
        let dev = meta.as_mut().expect("allocated above");
        s.memcpy_htod(&table, &mut dev.slice_mut(0..table.len()))?;
        let (tp, _sync) = dev.device_ptr(s);
        // SAFETY: every pointer is a live matrix of rows × nb blocks of this format, borrowed
        // for the call (its owner frees device memory in stream order, after this launch);
        // the table was copied in stream order before the launch and is rewritten only by a
        // later call on the same stream; segments are consecutive ranges of the entry list;
        // each activation row index is below x.n; `out` holds entries × rows floats.
        unsafe { self.launch_ids(base, (dtype, rows, cols), nseg, max_len, tp, x, out) }
    }

    /// The grouped kernel of `base`'s format over the table at `table` (`nseg` matrix
    /// pointers, then segment starts, lengths and activation rows), `max_len` the longest
    /// segment.
    ///
    /// # Safety
    ///
    /// The table is in device memory, written in stream order before this launch, and names
    /// `nseg` live matrices of `shape`, consecutive segments and activation rows below `x.n`;
    /// `out` holds (entries) × rows floats.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch_ids(
        &self,
        base: &str,
        (dtype, rows, cols): (DType, usize, usize),
        nseg: usize,
        max_len: usize,
        table: u64,
        x: &GpuAct,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), GpuError> {
        let (p_ptrs, p_starts, p_lens, p_rows) =
            (table, table + 8 * nseg as u64, table + 12 * nseg as u64, table + 16 * nseg as u64);
        let f = self.function(&format!("{base}_g{LANES_PER_ROW}_{}_ids", if max_len == 1 { 1 } else { 8 }));
        let nb = (cols / dtype.block_elems()) as i32;
        let rows_i = rows as i32;
        let (cfg, chunk) = rows_launch(rows, LANES_PER_ROW, nseg, max_len);
        let mut b = self.stream.launch_builder(f);
        b.arg(&p_ptrs).arg(&p_starts).arg(&p_lens).arg(&rows_i).arg(&nb);
        b.arg(&x.d).arg(&x.qs).arg(&x.bsums).arg(&x.qs16).arg(&p_rows).arg(&chunk).arg(out);
        b.launch(cfg)?;
        Ok(())
    }

    /// The grouped matmul of `nseg` matrices of one shape, one activation row each, from a
    /// table already in device memory at `table` (laid out as `matmul_ids_into` uploads it:
    /// `nseg` matrix pointers, then starts, lengths and activation rows): for a caller that
    /// builds the table on the device. Entry `i` writes row `i` of `out`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul_ids_table(
        &self,
        dtype: DType,
        rows: usize,
        cols: usize,
        nseg: usize,
        table: u64,
        x: &GpuAct,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), GpuError> {
        let base = kernel_name(dtype).ok_or(GpuError::Unsupported(dtype))?;
        check_fits(dtype, cols, x)?;
        if out.len() < nseg * rows {
            return Err(GpuError::Shape(format!("output of {} values is not {nseg} × {rows}", out.len())));
        }
        if nseg == 0 || rows == 0 {
            return Ok(());
        }
        // SAFETY: the caller's table (written in stream order before this launch) names `nseg`
        // live matrices of rows × nb blocks of this format, segments of one entry each and
        // activation rows below x.n; `out` holds nseg × rows floats (checked above).
        unsafe { self.launch_ids(base, (dtype, rows, cols), nseg, 1, table, x, out) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_blocks_cover_every_token_once_in_whole_passes() {
        for rows in [1, 37, 768, 2048, 151_936] {
            for grid_y in [1, 8, 128] {
                for tokens in [0, 1, 2, 8, 9, 100, 512, 4096] {
                    let (cfg, chunk) = rows_launch(rows, 8, grid_y, tokens);
                    let (x, y, z) = cfg.grid_dim;
                    let chunk = chunk as usize;
                    assert_eq!(x as usize, (rows * 8).div_ceil(128));
                    assert_eq!(y as usize, grid_y);
                    assert!(chunk > 0 && chunk.is_multiple_of(8), "{rows} {grid_y} {tokens}: chunk {chunk}");
                    // The z blocks take tokens [z·chunk, (z+1)·chunk): all of them, none empty.
                    assert!(z as usize * chunk >= tokens, "{rows} {grid_y} {tokens}: {z} × {chunk}");
                    assert!(
                        tokens == 0 || (z as usize - 1) * chunk < tokens,
                        "{rows} {grid_y} {tokens}: an empty block"
                    );
                    assert!(z <= 65535);
                }
            }
        }
        // A decode step is one block along z; a long prefill of a small matrix is many.
        assert_eq!(rows_launch(2048, 8, 1, 1).0.grid_dim.2, 1);
        assert!(rows_launch(2048, 8, 1, 512).0.grid_dim.2 >= 8);
    }
}

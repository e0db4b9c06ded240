//! The model's dense matrices in VRAM (`DenseCompute`): the token mixers' projections
//! (attention, latent attention, Gated DeltaNet), dense and shared-expert FFNs, the output
//! head and a multi-token-prediction head's, uploaded once in their stored format and
//! multiplied there with the bit-exact kernels, so the model's output stays the CPU run's
//! bit for bit. Products that share an input (q, k and v; gate and up) go down as one upload
//! and come back as one copy. Attention, norms and the KV cache stay on the host.

use crate::device::{Gpu, GpuError, Staging};
use crate::matmul::{kernel_name, GpuAct, GpuMatrix};
use cudarc::driver::CudaSlice;
use sluice_kernels::quant::act::ActKind;
use sluice_kernels::MatRef;
use sluice_model::dense::DenseCompute;
use sluice_model::weights::Weight;
use sluice_model::Model;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct CudaDense {
    gpu: Arc<Gpu>,
    /// Device copies, by the address of the host weight's data (resident for the model's life).
    mats: HashMap<usize, GpuMatrix>,
    held_bytes: usize,
    /// Dense matrices left on the CPU: no kernel for their format, or over the budget.
    left_bytes: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    x: Option<CudaSlice<f32>>,
    /// The input quantized for Q8_K-paired and for Q16-paired weights.
    act_k: Option<GpuAct>,
    act_16: Option<GpuAct>,
    out: Option<CudaSlice<f32>>,
    /// Page-locked host sides of the input and the outputs.
    up: Staging,
    back: Staging,
    /// Calls of one token (decode), and of more (prefill, verify passes): count and time.
    one: Tally,
    many: Tally,
    declined: u64,
    errors: u64,
    last_error: Option<String>,
}

#[derive(Default, Clone, Copy)]
struct Tally {
    calls: u64,
    ns: u64,
}

impl Tally {
    fn us_each(&self) -> f64 {
        self.ns as f64 / 1e3 / self.calls.max(1) as f64
    }
}

fn key(w: &Weight) -> usize {
    w.data.as_ptr() as usize
}

/// Whether `w` pairs with Q16 activations (Q8_0 weights) rather than Q8_K ones (K-quants).
fn pairs_q16(w: &GpuMatrix) -> bool {
    ActKind::for_weights(w.dtype) == Some(ActKind::Q16)
}

impl CudaDense {
    /// Uploads the dense matrices of `m` that have a kernel, in forward order, while they fit
    /// in `budget` bytes.
    pub fn upload(gpu: Arc<Gpu>, m: &Model, budget: usize) -> Result<CudaDense, GpuError> {
        let mut mats = HashMap::new();
        let (mut held, mut left) = (0, 0);
        for w in m.projected_weights() {
            if mats.contains_key(&key(w)) {
                continue;
            }
            if kernel_name(w.dtype).is_none() || held + w.bytes() > budget {
                left += w.bytes();
                continue;
            }
            let mat = MatRef::new(w.dtype, w.rows, w.cols, &w.data).map_err(|e| GpuError::Shape(e.to_string()))?;
            let g = gpu.upload(mat)?;
            held += g.bytes();
            mats.insert(key(w), g);
        }
        Ok(CudaDense { gpu, mats, held_bytes: held, left_bytes: left, state: Mutex::new(State::default()) })
    }

    /// Calls computed here, calls declined (a weight it does not hold), and calls that
    /// failed on the device (computed by the CPU instead).
    pub fn counts(&self) -> (u64, u64, u64) {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        (st.one.calls + st.many.calls, st.declined, st.errors)
    }

    /// The device copy of `w`, if this holds one.
    pub fn matrix(&self, w: &Weight) -> Option<&GpuMatrix> {
        self.mats.get(&key(w))
    }

    /// The device the matrices live on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Bytes of dense weights in VRAM.
    pub fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    fn run(
        &self,
        st: &mut State,
        mats: &[&GpuMatrix],
        x: &[f32],
        n: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), GpuError> {
        let gpu = &*self.gpu;
        let s = &gpu.stream;
        let cols = mats[0].cols;
        if x.len() != n * cols || outs.iter().zip(mats).any(|(o, w)| o.len() != n * w.rows) {
            return Err(GpuError::Shape(format!("{n} rows of {} values for {cols}-column weights", x.len())));
        }
        if st.x.as_ref().is_none_or(|b| b.len() < x.len()) {
            st.x = Some(s.alloc_zeros::<f32>(2 * x.len())?);
        }
        let up = st.up.room(gpu, x.len())?;
        up.copy_from_slice(x);
        let xd = st.x.as_mut().expect("made above");
        s.memcpy_htod(&*up, &mut xd.slice_mut(0..x.len()))?;
        // The input quantized once for each kind of activation the weights pair with.
        let mut done = [false; 2];
        for w in mats {
            let k = pairs_q16(w);
            if !done[k as usize] {
                let slot = if k { &mut st.act_16 } else { &mut st.act_k };
                gpu.quantize_reusing(w.dtype, xd, n, cols, slot)?;
                done[k as usize] = true;
            }
        }
        let total: usize = mats.iter().map(|w| n * w.rows).sum();
        if st.out.as_ref().is_none_or(|b| b.len() < total) {
            st.out = Some(s.alloc_zeros::<f32>(2 * total)?);
        }
        let out = st.out.as_mut().expect("made above");
        let mut at = 0;
        for w in mats {
            let act = if pairs_q16(w) { st.act_16.as_ref() } else { st.act_k.as_ref() };
            let len = n * w.rows;
            gpu.matmul_into(w.view(gpu), act.expect("quantized above"), &mut out.slice_mut(at..at + len))?;
            at += len;
        }
        let back = st.back.room(gpu, total)?;
        s.memcpy_dtoh(&out.slice(0..total), &mut *back)?;
        // The one wait of the call: the input's buffer is free again and the results are in.
        s.synchronize()?;
        let mut at = 0;
        for o in outs.iter_mut() {
            o.copy_from_slice(&back[at..at + o.len()]);
            at += o.len();
        }
        Ok(())
    }
}

impl DenseCompute for CudaDense {
    fn matmul(&self, ws: &[&Weight], x: &[f32], n: usize, outs: &mut [&mut [f32]]) -> bool {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(mats) = ws.iter().map(|w| self.mats.get(&key(w))).collect::<Option<Vec<_>>>() else {
            st.declined += 1;
            return false;
        };
        if mats.is_empty() || n == 0 {
            return false;
        }
        let t0 = Instant::now();
        match self.run(&mut st, &mats, x, n, outs) {
            Ok(()) => {
                let t = if n == 1 { &mut st.one } else { &mut st.many };
                t.calls += 1;
                t.ns += t0.elapsed().as_nanos() as u64;
                true
            }
            Err(e) => {
                st.errors += 1;
                st.last_error = Some(e.to_string());
                false
            }
        }
    }

    fn describe(&self) -> String {
        let mut s = format!("dense weights on {}: {:.2} GB in VRAM", self.gpu.name, self.held_bytes as f64 / 1e9);
        if self.left_bytes > 0 {
            s.push_str(&format!(
                ", {:.2} GB on the CPU (formats without a CUDA kernel, or over the budget)",
                self.left_bytes as f64 / 1e9
            ));
        }
        s
    }

    fn stats_line(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = format!(
            "GPU dense: {} calls of one token ({:.1} µs each, transfers included) and {} of more ({:.1} µs each), {} declined to the CPU",
            st.one.calls,
            st.one.us_each(),
            st.many.calls,
            st.many.us_each(),
            st.declined
        );
        if st.errors > 0 {
            s.push_str(&format!(
                "; {} failed and ran on the CPU (last: {})",
                st.errors,
                st.last_error.as_deref().unwrap_or("")
            ));
        }
        s
    }
}

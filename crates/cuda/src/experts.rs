//! Routed experts computed on the GPU for the CPU's forward pass (`ExpertCompute`): the
//! layer's chosen experts go through the VRAM tier, their gate and up products run as one
//! grouped launch each, the activation combine runs on the host with the CPU's own function,
//! and the down products run as one grouped launch. Every product is the CPU reference's to
//! the bit and the combine is the CPU's code, so the model's output is the CPU run's, bit for
//! bit, whatever the VRAM quota.
//!
//! Per layer and step this moves the tokens' hidden states down, the gate and up outputs up,
//! their combine down and the expert outputs up: four small copies, the price of that
//! exactness while the combine has no bit-identical device version.

use crate::device::{Gpu, GpuError};
use crate::matmul::{kernel_name, DeviceMat, GpuAct};
use crate::vram_cache::{ExpertKey, HostPart, VramExperts};
use cudarc::driver::CudaSlice;
use sluice_model::error::{ModelError, Result};
use sluice_model::ffn::offload::{ExpertBatch, ExpertCompute};
use std::sync::Mutex;

pub struct CudaExperts {
    gpu: Gpu,
    state: Mutex<VramExperts>,
    quota: usize,
}

fn gpu_err(e: GpuError) -> ModelError {
    ModelError::Invalid(format!("CUDA: {e}"))
}

impl CudaExperts {
    /// Opens device `ordinal` with a VRAM tier of `quota` bytes for experts of at most
    /// `expert_bytes` (the model's largest expert's three matrices).
    pub fn open(ordinal: usize, quota: usize, expert_bytes: usize) -> std::result::Result<CudaExperts, GpuError> {
        let gpu = Gpu::open(ordinal)?;
        // Each of the three parts may start up to one alignment step later.
        let slot = expert_bytes + 3 * 256;
        let state = Mutex::new(VramExperts::new(&gpu, slot, quota)?);
        Ok(CudaExperts { gpu, state, quota })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The VRAM tier's counters.
    pub fn tier_stats(&self) -> crate::vram_cache::VramStats {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stats()
    }

    fn run(&self, b: &ExpertBatch<'_>, y: &mut [f32]) -> std::result::Result<bool, GpuError> {
        let Some(first) = b.weights.first() else { return Ok(true) };
        let (gd, ud, dd) = (first.gate.dtype, first.up.dtype, first.down.dtype);
        let same = b.weights.iter().all(|w| {
            (w.gate.dtype, w.up.dtype, w.down.dtype, w.gate.rows, w.gate.cols, w.down.rows, w.down.cols)
                == (gd, ud, dd, first.gate.rows, first.gate.cols, first.down.rows, first.down.cols)
        });
        if !same || gd != ud || kernel_name(gd).is_none() || kernel_name(dd).is_none() {
            return Ok(false);
        }
        let (hidden, ff) = (first.gate.cols, first.gate.rows);
        let n = b.x.len() / hidden;
        let s = &self.gpu.stream;
        let mut vram = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let xd = s.clone_htod(b.x)?;
        let ax = self.gpu.quantize(gd, &xd, n, hidden)?;
        let chunk = vram.slots();
        for start in (0..b.ids.len()).step_by(chunk) {
            let end = (start + chunk).min(b.ids.len());
            let keys: Vec<ExpertKey> =
                b.ids[start..end].iter().map(|&e| ExpertKey { layer: b.layer as u32, expert: e }).collect();
            let host = |k: ExpertKey| -> std::result::Result<Vec<HostPart<'_>>, GpuError> {
                let i = start + keys.iter().position(|q| *q == k).expect("a key of this chunk");
                let w = &b.weights[i];
                Ok([w.gate, w.up, w.down]
                    .iter()
                    .map(|m| HostPart { dtype: m.dtype, rows: m.rows, cols: m.cols, data: m.data })
                    .collect())
            };
            let res = vram.acquire(&self.gpu, &keys, &host)?;
            // Entries: every (token, rank) slot each expert of the chunk serves, expert by
            // expert.
            let mut act_rows = Vec::new();
            let mut ranges = Vec::with_capacity(keys.len());
            for slots in &b.slots[start..end] {
                let r0 = act_rows.len();
                act_rows.extend(slots.iter().map(|&sl| (sl / b.k) as i32));
                ranges.push(r0..act_rows.len());
            }
            let entries = act_rows.len();
            let part = |p: usize| -> Vec<(DeviceMat<'_>, std::ops::Range<usize>)> {
                ranges.iter().enumerate().map(|(i, r)| (res.expert(i)[p], r.clone())).collect()
            };
            let mut g: CudaSlice<f32> = s.alloc_zeros(entries * ff)?;
            let mut u: CudaSlice<f32> = s.alloc_zeros(entries * ff)?;
            self.gpu.matmul_ids(&part(0), &ax, &act_rows, &mut g)?;
            self.gpu.matmul_ids(&part(1), &ax, &act_rows, &mut u)?;
            let mut gh = s.clone_dtoh(&g)?;
            let uh = s.clone_dtoh(&u)?;
            // The combine, per expert over its tokens, exactly as the CPU's gated FFN runs it.
            for r in &ranges {
                sluice_model::ffn::combine(
                    b.activation,
                    &mut gh[r.start * ff..r.end * ff],
                    &uh[r.start * ff..r.end * ff],
                );
            }
            let hd = s.clone_htod(&gh)?;
            let ah: GpuAct = self.gpu.quantize(dd, &hd, entries, ff)?;
            let own: Vec<i32> = (0..entries as i32).collect();
            let mut out: CudaSlice<f32> = s.alloc_zeros(entries * hidden)?;
            self.gpu.matmul_ids(&part(2), &ah, &own, &mut out)?;
            drop(res);
            let oh = s.clone_dtoh(&out)?;
            for (i, slots) in b.slots[start..end].iter().enumerate() {
                for (j, &sl) in slots.iter().enumerate() {
                    let e = ranges[i].start + j;
                    y[sl * hidden..(sl + 1) * hidden].copy_from_slice(&oh[e * hidden..(e + 1) * hidden]);
                }
            }
        }
        Ok(true)
    }
}

impl ExpertCompute for CudaExperts {
    fn compute(&self, batch: &ExpertBatch<'_>, y: &mut [f32]) -> Result<bool> {
        self.run(batch, y).map_err(gpu_err)
    }

    fn describe(&self) -> String {
        let v = self.state.lock().unwrap_or_else(|p| p.into_inner());
        format!(
            "routed experts computed on {} (compute {}.{}); VRAM tier {:.2} GB: {} experts of {:.1} MB",
            self.gpu.name,
            self.gpu.capability.0,
            self.gpu.capability.1,
            self.quota as f64 / 1e9,
            v.slots(),
            v.stats().slot_bytes as f64 / 1e6
        )
    }

    fn stats_line(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner()).stats();
        let total = (st.hits + st.misses).max(1);
        format!(
            "VRAM tier: {} hits, {} misses ({:.1}% hit rate), {} evictions, {:.1} MB copied from host memory in {:.3} s",
            st.hits,
            st.misses,
            100.0 * st.hits as f64 / total as f64,
            st.evictions,
            st.bytes_copied as f64 / 1e6,
            st.copy_ns as f64 * 1e-9
        )
    }
}

//! Routed experts computed on the GPU for the CPU's forward pass (`ExpertCompute`): each
//! layer's chosen experts are split between the GPU and the CPU's threads (`split`: held ones
//! on the GPU, each miss where the layer finishes sooner, from measured rates), and the GPU's
//! share goes through the VRAM tier, their gate and up products run as one
//! grouped launch each, the activation combine runs on the host with the CPU's own function,
//! and the down products run as one grouped launch. Every product is the CPU reference's to
//! the bit and the combine is the CPU's code, so the model's output is the CPU run's, bit for
//! bit, whatever the VRAM quota.
//!
//! Per layer and step this moves the tokens' hidden states down, the gate and up outputs up,
//! their combine down and the expert outputs up: four small copies (through page-locked
//! buffers, waited for twice), the price of that exactness while the combine has no
//! bit-identical device version.

use crate::device::HostRegistration;
use crate::device::{Gpu, GpuError, Staging};
use crate::matmul::{kernel_name, DeviceMat, GpuAct};
use crate::split::{Chosen, Explorer, Rates};
use crate::vram_cache::{slot_bytes_bound, ExpertKey, HostPart, VramExperts};
use cudarc::driver::CudaSlice;
use sluice_model::error::{ModelError, Result};
use sluice_model::expert::ExpertSource;
use sluice_model::ffn::offload::{CpuWork, ExpertBatch, ExpertCompute};
use sluice_model::ModelConfig;
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub struct CudaExperts {
    gpu: Arc<Gpu>,
    state: Mutex<State>,
    quota: usize,
    /// The host memory of the experts, page-locked by `warm` (kept for as long as this lives).
    pinned: Mutex<Vec<HostRegistration<'static>>>,
}

/// What `warm` did.
#[derive(Clone, Debug, Default)]
pub struct Warmed {
    /// Host bytes page-locked, and the time it took; or why none could be.
    pub locked_bytes: usize,
    pub lock_s: f64,
    pub lock_error: Option<String>,
    /// Experts copied into the VRAM tier, their bytes and the time it took.
    pub placed: usize,
    pub placed_bytes: usize,
    pub place_s: f64,
}

impl std::fmt::Display for Warmed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.lock_error {
            Some(e) => write!(f, "host experts not page-locked ({e}); ")?,
            None if self.locked_bytes > 0 => write!(
                f,
                "{:.2} GB of host experts page-locked in {:.2} s; ",
                self.locked_bytes as f64 / 1e9,
                self.lock_s
            )?,
            None => {}
        }
        write!(
            f,
            "VRAM tier warmed with {} experts ({:.2} GB) in {:.2} s ({:.1} GB/s)",
            self.placed,
            self.placed_bytes as f64 / 1e9,
            self.place_s,
            self.placed_bytes as f64 / 1e9 / self.place_s.max(1e-9)
        )
    }
}

/// The tier and the buffers every call reuses (grown when a call needs more).
struct State {
    vram: VramExperts,
    rates: Rates,
    /// Chosen experts the GPU computed, and those left to the CPU.
    on_gpu: u64,
    on_cpu: u64,
    /// When the CPU is next given a miss to measure its rate again.
    explorer: Explorer,
    x: Option<CudaSlice<f32>>,
    ax: Option<GpuAct>,
    /// Gate outputs, then up outputs (entries × ff each).
    gu: Option<CudaSlice<f32>>,
    h: Option<CudaSlice<f32>>,
    ah: Option<GpuAct>,
    out: Option<CudaSlice<f32>>,
    /// Page-locked host sides: the input, the gate and up outputs (the combine is written
    /// over the gate's and goes down from there), and the expert outputs.
    host_x: Staging,
    host_gu: Staging,
    host_out: Staging,
    /// Calls of one token (decode) and of more (prefill, verify passes).
    one: Phases,
    many: Phases,
}

/// Where calls' time goes (ns): input up and quantized, the tier's acquire (copies of misses
/// included), gate and up products and their copy back, the combine on the host, the down
/// product with its input up and its output back.
#[derive(Default, Clone, Copy)]
struct Phases {
    calls: u64,
    t_in: u64,
    t_acquire: u64,
    t_gate_up: u64,
    t_combine: u64,
    t_down: u64,
}

impl Phases {
    fn line(&self) -> String {
        let per = |ns: u64| ns as f64 / 1e3 / self.calls.max(1) as f64;
        format!(
            "{} calls: in {:.0} µs, acquire {:.0} µs, gate+up {:.0} µs, combine {:.0} µs, down {:.0} µs",
            self.calls,
            per(self.t_in),
            per(self.t_acquire),
            per(self.t_gate_up),
            per(self.t_combine),
            per(self.t_down)
        )
    }
}

fn gpu_err(e: GpuError) -> ModelError {
    ModelError::Invalid(format!("CUDA: {e}"))
}

/// `buf`, made (twice as large as asked, to grow rarely) when it holds fewer than `len`.
fn room<'b>(gpu: &Gpu, buf: &'b mut Option<CudaSlice<f32>>, len: usize) -> Result<&'b mut CudaSlice<f32>, GpuError> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = Some(gpu.stream.alloc_zeros::<f32>((2 * len).max(1))?);
    }
    Ok(buf.as_mut().expect("made above"))
}

impl CudaExperts {
    /// Opens device `ordinal` with a VRAM tier of `quota` bytes for experts of at most
    /// `expert_bytes` (the model's largest expert's three matrices).
    pub fn open(ordinal: usize, quota: usize, expert_bytes: usize) -> std::result::Result<CudaExperts, GpuError> {
        CudaExperts::with_gpu(Arc::new(Gpu::open(ordinal)?), quota, expert_bytes)
    }

    /// `open` on a device already open (shared with the dense weights).
    pub fn with_gpu(gpu: Arc<Gpu>, quota: usize, expert_bytes: usize) -> std::result::Result<CudaExperts, GpuError> {
        let vram = VramExperts::new(&gpu, slot_bytes_bound(expert_bytes, 3), quota)?;
        let state = State {
            vram,
            rates: Rates::default(),
            on_gpu: 0,
            on_cpu: 0,
            explorer: Explorer::default(),
            x: None,
            ax: None,
            gu: None,
            h: None,
            ah: None,
            out: None,
            host_x: Staging::default(),
            host_gu: Staging::default(),
            host_out: Staging::default(),
            one: Phases::default(),
            many: Phases::default(),
        };
        Ok(CudaExperts { gpu, state: Mutex::new(state), quota, pinned: Mutex::new(Vec::new()) })
    }

    /// Readies the tier before the first token: page-locks the host memory `src` holds its
    /// experts in for good (a resident copy; copies from it then run at the bus's rate), and
    /// fills the tier's slots with experts of `cfg`'s sparse layers that are in host memory now (reading nothing from a store), as many of each layer as the slots
    /// allow, lowest index first. Changes no result: where an
    /// expert is computed never changes its bits. A failure to page-lock is reported, not
    /// fatal (copies are staged instead).
    pub fn warm(&self, src: &dyn ExpertSource, cfg: &ModelConfig) -> std::result::Result<Warmed, GpuError> {
        let layers = cfg.sparse_layers();
        let n_expert = cfg.moe.as_ref().map_or(0, |m| m.n_expert);
        let mut w = Warmed::default();
        let t = Instant::now();
        {
            let mut pinned = self.pinned.lock().unwrap_or_else(|p| p.into_inner());
            for blob in src.host_memory() {
                if blob.is_empty() {
                    continue;
                }
                match self.gpu.register_blob(blob) {
                    Ok(r) => {
                        w.locked_bytes += r.bytes();
                        pinned.push(r);
                    }
                    Err(e) => {
                        w.lock_error = Some(e.to_string());
                        pinned.clear();
                        w.locked_bytes = 0;
                        break;
                    }
                }
            }
        }
        w.lock_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let slots = st.vram.slots();
        for (i, &l) in layers.iter().enumerate() {
            // Slots shared out evenly, the first layers taking the remainder.
            let take = (slots / layers.len().max(1) + usize::from(i < slots % layers.len().max(1))).min(n_expert);
            if take == 0 || st.vram.is_full() {
                break;
            }
            let ids: Vec<u32> = (0..take as u32).collect();
            let err = |e: ModelError| GpuError::Shape(format!("warming layer {l}: {e}"));
            // What is in host memory already: warming reads nothing from a store.
            let mut fetch = src.fetch_resident(l, &ids).map_err(err)?;
            let mut views = Vec::with_capacity(take);
            while let Some(next) = fetch.next() {
                views.push(next.map_err(err)?);
            }
            for (i, view) in &views {
                let ew = view.weights();
                let parts: Vec<HostPart<'_>> = [ew.gate, ew.up, ew.down]
                    .iter()
                    .map(|m| HostPart { dtype: m.dtype, rows: m.rows, cols: m.cols, data: m.data })
                    .collect();
                let key = ExpertKey { layer: l as u32, expert: ids[*i] };
                let bytes = parts.iter().map(|p| p.data.len()).sum::<usize>();
                if st.vram.place(&self.gpu, key, &parts)? {
                    w.placed += 1;
                    w.placed_bytes += bytes;
                }
            }
            // The copies read the views' bytes: done before they go.
            st.vram.settle()?;
        }
        w.place_s = t.elapsed().as_secs_f64();
        // The split starts from the copy rate just measured rather than a guess.
        st.rates.observe_copy(w.placed_bytes as u64, (w.place_s * 1e9) as u64);
        Ok(w)
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Runs `f` on the VRAM tier (locked meanwhile): the whole-step path takes its experts
    /// from the same tier.
    pub fn with_tier<R>(&self, f: impl FnOnce(&mut VramExperts) -> R) -> R {
        f(&mut self.state.lock().unwrap_or_else(|p| p.into_inner()).vram)
    }

    /// The VRAM tier's counters.
    pub fn tier_stats(&self) -> crate::vram_cache::VramStats {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).vram.stats()
    }

    fn run(&self, b: &ExpertBatch<'_>, y: &mut [f32]) -> std::result::Result<bool, GpuError> {
        let Some(first) = b.weights.first() else { return Ok(true) };
        if !computable(b) {
            return Ok(false);
        }
        let (gd, dd) = (first.gate.dtype, first.down.dtype);
        let (hidden, ff) = (first.gate.cols, first.gate.rows);
        let n = b.x.len() / hidden;
        let (gpu, s) = (&self.gpu, &self.gpu.stream);
        let mut guard = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = &mut *guard;
        st.on_gpu += b.ids.len() as u64;
        let mut ph = Phases { calls: 1, ..Phases::default() };
        let mut t = Instant::now();
        let mut lap = |acc: &mut u64| {
            let now = Instant::now();
            *acc += (now - t).as_nanos() as u64;
            t = now;
        };
        let before = st.vram.stats();
        let xd = room(gpu, &mut st.x, b.x.len())?;
        let hx = st.host_x.room(gpu, b.x.len())?;
        hx.copy_from_slice(b.x);
        s.memcpy_htod(&*hx, &mut xd.slice_mut(0..b.x.len()))?;
        gpu.quantize_reusing(gd, xd, n, hidden, &mut st.ax)?;
        lap(&mut ph.t_in);
        let ax = st.ax.as_ref().expect("quantized above");
        let chunk = st.vram.slots();
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
            let res = st.vram.acquire(gpu, &keys, &host)?;
            lap(&mut ph.t_acquire);
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
            let ef = entries * ff;
            let gu = room(gpu, &mut st.gu, 2 * ef)?;
            gpu.matmul_ids_into(&part(0), ax, &act_rows, &mut gu.slice_mut(0..ef))?;
            gpu.matmul_ids_into(&part(1), ax, &act_rows, &mut gu.slice_mut(ef..2 * ef))?;
            let hgu = st.host_gu.room(gpu, 2 * ef)?;
            s.memcpy_dtoh(&gu.slice(0..2 * ef), &mut *hgu)?;
            // Also frees the input's host buffer, and the combine's of the last chunk.
            s.synchronize()?;
            lap(&mut ph.t_gate_up);
            let (gh, uh) = hgu.split_at_mut(ef);
            // The combine, per expert over its tokens, exactly as the CPU's gated FFN runs it.
            for r in &ranges {
                sluice_model::ffn::combine(
                    b.activation,
                    &mut gh[r.start * ff..r.end * ff],
                    &uh[r.start * ff..r.end * ff],
                );
            }
            lap(&mut ph.t_combine);
            let hd = room(gpu, &mut st.h, ef)?;
            s.memcpy_htod(&*gh, &mut hd.slice_mut(0..ef))?;
            gpu.quantize_reusing(dd, hd, entries, ff, &mut st.ah)?;
            let own: Vec<i32> = (0..entries as i32).collect();
            let eh = entries * hidden;
            let out = room(gpu, &mut st.out, eh)?;
            gpu.matmul_ids_into(&part(2), st.ah.as_ref().expect("quantized above"), &own, &mut out.slice_mut(0..eh))?;
            drop(res);
            let ho = st.host_out.room(gpu, eh)?;
            s.memcpy_dtoh(&out.slice(0..eh), &mut *ho)?;
            s.synchronize()?;
            for (i, slots) in b.slots[start..end].iter().enumerate() {
                for (j, &sl) in slots.iter().enumerate() {
                    let e = ranges[i].start + j;
                    y[sl * hidden..(sl + 1) * hidden].copy_from_slice(&ho[e * hidden..(e + 1) * hidden]);
                }
            }
            lap(&mut ph.t_down);
        }
        let tally = if n == 1 { &mut st.one } else { &mut st.many };
        for (a, b) in [
            (&mut tally.calls, ph.calls),
            (&mut tally.t_in, ph.t_in),
            (&mut tally.t_acquire, ph.t_acquire),
            (&mut tally.t_gate_up, ph.t_gate_up),
            (&mut tally.t_combine, ph.t_combine),
            (&mut tally.t_down, ph.t_down),
        ] {
            *a += b;
        }
        let after = st.vram.stats();
        st.rates.observe_copy(after.bytes_copied - before.bytes_copied, after.copy_ns - before.copy_ns);
        Ok(true)
    }
}

/// Whether the GPU has kernels for these experts (one shape and format for all of them,
/// gate and up in the same format).
fn computable(b: &ExpertBatch<'_>) -> bool {
    let Some(first) = b.weights.first() else { return true };
    let (gd, ud, dd) = (first.gate.dtype, first.up.dtype, first.down.dtype);
    let same = b.weights.iter().all(|w| {
        (w.gate.dtype, w.up.dtype, w.down.dtype, w.gate.rows, w.gate.cols, w.down.rows, w.down.cols)
            == (gd, ud, dd, first.gate.rows, first.gate.cols, first.down.rows, first.down.cols)
    });
    same && gd == ud && kernel_name(gd).is_some() && kernel_name(dd).is_some()
}

impl ExpertCompute for CudaExperts {
    fn assign(&self, b: &ExpertBatch<'_>) -> Vec<bool> {
        if !computable(b) {
            return vec![true; b.ids.len()];
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let chosen: Vec<Chosen> = b
            .weights
            .iter()
            .zip(b.ids)
            .zip(b.slots)
            .map(|((w, &e), slots)| Chosen {
                bytes: w.bytes(),
                macs: w.elements() * slots.len(),
                held: st.vram.holds(ExpertKey { layer: b.layer as u32, expert: e }),
            })
            .collect();
        let rates = st.rates;
        let a = st.explorer.assign(&rates, &chosen);
        st.on_cpu += a.iter().filter(|g| !**g).count() as u64;
        a
    }

    fn observe_cpu(&self, w: CpuWork) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.rates.observe_cpu(w.bytes, w.macs, w.max_tokens, w.ns);
    }

    fn compute(&self, batch: &ExpertBatch<'_>, y: &mut [f32]) -> Result<bool> {
        self.run(batch, y).map_err(gpu_err)
    }

    fn describe(&self) -> String {
        let v = &self.state.lock().unwrap_or_else(|p| p.into_inner()).vram;
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
        let g = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let st = g.vram.stats();
        let total = (st.hits + st.misses).max(1);
        format!(
            "GPU experts: {} computed on the GPU, {} left to the CPU; VRAM tier: {} placed at load, {} hits, {} misses ({:.1}% hit rate), {} evictions, {:.1} MB copied from host memory in {:.3} s; rates: copy {:.1} GB/s, CPU {:.1} GB/s and {:.1} GMAC/s",
            g.on_gpu,
            g.on_cpu,
            st.placed,
            st.hits,
            st.misses,
            100.0 * st.hits as f64 / total as f64,
            st.evictions,
            st.bytes_copied as f64 / 1e6,
            st.copy_ns as f64 * 1e-9,
            g.rates.copy_bytes_per_s / 1e9,
            g.rates.cpu_bytes_per_s / 1e9,
            g.rates.cpu_macs_per_s / 1e9
        ) + &format!("; per call, of one token ({}), of more ({})", g.one.line(), g.many.line())
    }
}

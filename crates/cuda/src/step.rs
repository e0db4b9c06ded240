//! A whole decode step on the GPU (`StepCompute`): the hidden state stays in VRAM from the
//! embedding to the logits. Softmax gates are computed on the device; where the VRAM tier
//! holds every expert of the model, the step reads them through tables the gate writes and
//! the host waits only once, at the end, for the logits. Otherwise the host takes part once
//! per MoE layer: it reads the chosen ids back (or, for gates the device does not compute,
//! the router's logits, and routes with the model's own code) and has the tier make those
//! experts resident. Where the device's copy of the KV cache cannot grow, the step is left
//! to the host.
//!
//! Per attention layer: RMSNorm, the q/k/v products (the dense weights `CudaDense` holds),
//! biases, per-head QK-norm, rotary embedding (the host's cosines and sines for the step's
//! position), the keys and values written straight into the device's copy of the sequence's
//! KV cache, attention over it, the output product and the residual. Per FFN: RMSNorm, then
//! a dense gated FFN, or the router's product, the routed experts' gate and up products as
//! one grouped launch each, the activation, the down products as one grouped launch and
//! their weighted sum into the residual.
//!
//! The quantized products are the bit-exact kernels; the norms, attention and activation are
//! the device's own float arithmetic (`kernels/step.cu`), so a step's logits are close to the
//! CPU's, not equal. They are its own bits every time: every reduction has a fixed order and
//! every expert is computed by the same kernels whichever tier it came from, so the VRAM
//! quota never changes them.
//!
//! The host's `SeqState` stays the sequence's record: the step appends its keys and values
//! there too, and the device's copy of the cache is brought up to date from it whenever the
//! sequence changed behind the step's back (a prefill run on the CPU, a truncation, another
//! sequence).

use crate::dense::CudaDense;
use crate::device::{Gpu, GpuError, Staging};
use crate::experts::CudaExperts;
use crate::matmul::{kernel_name, DeviceMat, GpuAct, GpuMatrix};
use crate::vram_cache::{ExpertKey, HostPart};
use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use sluice_kernels::quant::act::ActKind;
use sluice_kernels::DType;
use sluice_model::config::{Activation, Gating, MixerKind, QkNorm};
use sluice_model::error::{ModelError, Result};
use sluice_model::ffn::router::route;
use sluice_model::ffn::FfnWeights;
use sluice_model::mixer::Mixer;
use sluice_model::rope::RopeStyle;
use sluice_model::step::StepCompute;
use sluice_model::weights::{embedding_row, Weight};
use sluice_model::{Logits, Model, SeqState};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The kernels of `kernels/step.cu`.
pub const KERNELS: &[&str] = &[
    "step_rms_norm",
    "step_attention",
    "step_add",
    "step_matvec_f32",
    "step_silu_mul",
    "step_weighted_add",
    "step_route",
    "step_qk_norm_rope",
    "step_add_rms_norm",
];

const THREADS: u32 = 256;

/// A layer's vectors in VRAM (its matrices are `CudaDense`'s).
struct StepLayer {
    attn_norm: CudaSlice<f32>,
    ffn_norm: CudaSlice<f32>,
    bias: Option<[CudaSlice<f32>; 3]>,
    o_bias: Option<CudaSlice<f32>>,
    qk_norm: Option<[CudaSlice<f32>; 2]>,
    /// The router widened to f32 (MoE layers).
    router: Option<CudaSlice<f32>>,
    /// The layer's softmax gate, computed on the device whatever the tier holds (so that the
    /// weights have the same bits either way); `None`: the host's routing code runs it.
    gate: Option<DeviceGate>,
    /// Where every expert of this layer sits in the VRAM tier, when the tier holds them all:
    /// the step then chooses and reads them with no host in between.
    held: Option<HeldExperts>,
}

#[derive(Clone, Copy)]
struct DeviceGate {
    norm: bool,
    topk_first: bool,
}

/// A layer's experts as the tier holds them: matrix pointers (gate, up, down; `ne` each)
/// and their shapes, (dtype, rows, cols) of the gate (and up) and of the down matrices.
struct HeldExperts {
    ptrs: CudaSlice<u64>,
    gate: Shape,
    down: Shape,
}

/// A matrix's (dtype, rows, cols).
type Shape = (DType, usize, usize);

pub struct CudaStep {
    gpu: Arc<Gpu>,
    dense: Arc<CudaDense>,
    experts: Option<Arc<CudaExperts>>,
    layers: Vec<StepLayer>,
    output_norm: CudaSlice<f32>,
    state: Mutex<State>,
    vram_bytes: usize,
    /// The tier's eviction count when the held tables were made: they are read only while it
    /// stays so (an eviction would have moved an expert out from under a table).
    held_evictions: u64,
}

/// The device's copy of one sequence's keys and values.
struct Mirror {
    /// Per layer (keys, values), `cap` positions each.
    kv: Vec<(CudaSlice<f32>, CudaSlice<f32>)>,
    cap: usize,
    /// The sequence it copies (`SeqState::lineage`) and how many of its positions it holds.
    lineage: (u64, u64),
    len: usize,
}

#[derive(Default)]
struct State {
    mirror: Option<Mirror>,
    bufs: Option<Bufs>,
    acts: Acts,
    up: Staging,
    router_back: Staging,
    kv_back: Staging,
    out_back: Staging,
    steps: u64,
    step_ns: u64,
    /// Time the host waited for the router's logits, and for the experts' residency.
    route_ns: u64,
    acquire_ns: u64,
    /// MoE layers routed on the device (no wait), and on the host.
    device_routed: u64,
    host_routed: u64,
    /// Positions copied up from the host's cache.
    synced: u64,
    /// Steps handed back to the host (the device's copy of the cache could not grow, or an
    /// expert came in a format the device has no kernel for), and why the last one was.
    declined: u64,
    declined_why: Option<String>,
    /// Set when a step met a format with no kernel: every later step is the host's.
    off: bool,
}

/// Inputs quantized for the kinds of weights they meet (K-quants: Q8_K; Q8_0: Q16), one
/// buffer per (kind, width): a step quantizes inputs of a few widths (hidden, q, expert FFN)
/// and a buffer made for one width is not reused for another.
#[derive(Default)]
struct Acts {
    bufs: Vec<(bool, usize, Option<GpuAct>)>,
}

fn is_q16(d: DType) -> bool {
    ActKind::for_weights(d) == Some(ActKind::Q16)
}

impl Acts {
    /// Quantizes `x` (`n` rows of `cols`) once for each kind `dtypes` pair with.
    fn quantize(
        &mut self,
        gpu: &Gpu,
        dtypes: &[DType],
        x: &CudaSlice<f32>,
        n: usize,
        cols: usize,
    ) -> std::result::Result<(), GpuError> {
        let mut done = [false; 2];
        for &d in dtypes {
            let q16 = is_q16(d);
            if done[q16 as usize] {
                continue;
            }
            let i = match self.bufs.iter().position(|b| b.0 == q16 && b.1 == cols) {
                Some(i) => i,
                None => {
                    self.bufs.push((q16, cols, None));
                    self.bufs.len() - 1
                }
            };
            gpu.quantize_reusing(d, x, n, cols, &mut self.bufs[i].2)?;
            done[q16 as usize] = true;
        }
        Ok(())
    }

    /// The last input of `cols` values quantized for `d` weights.
    fn get(&self, d: DType, cols: usize) -> &GpuAct {
        let q16 = is_q16(d);
        self.bufs
            .iter()
            .find(|b| b.0 == q16 && b.1 == cols)
            .and_then(|b| b.2.as_ref())
            .expect("quantized before the product")
    }
}

/// Device buffers of one step.
struct Bufs {
    /// The step's input: embedding row, then cosines and sines.
    input: CudaSlice<f32>,
    x: CudaSlice<f32>,
    h: CudaSlice<f32>,
    q: CudaSlice<f32>,
    att: CudaSlice<f32>,
    o: CudaSlice<f32>,
    router: CudaSlice<f32>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    y: CudaSlice<f32>,
    weights: CudaSlice<f32>,
    /// The device's routing: the chosen ids and the grouped products' three tables.
    ids: CudaSlice<i32>,
    tables: CudaSlice<u8>,
    logits: CudaSlice<f32>,
    scores: CudaSlice<f32>,
    scores_stride: usize,
}

fn gpu_err(e: GpuError) -> ModelError {
    ModelError::Invalid(format!("CUDA step: {e}"))
}

fn ptr<T>(s: &CudaSlice<T>, gpu: &Gpu) -> u64 {
    s.device_ptr(&gpu.stream).0
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// Why the step cannot run `m` whole on the device, if it cannot.
pub fn unsupported(m: &Model, dense: &CudaDense) -> Option<String> {
    let cfg = &m.cfg;
    let held = |w: &Weight| dense.matrix(w).is_some();
    if cfg.gemma || cfg.final_logit_softcap.is_some() || cfg.attn_output_gate || cfg.clip_qkv.is_some() {
        return Some("the family's extra attention or output operations".into());
    }
    if cfg.attn_sinks || m.rope_local.is_some() {
        return Some("attention sinks or a second rotary base".into());
    }
    if cfg.activation != Activation::Silu {
        return Some(format!("the {:?} activation", cfg.activation));
    }
    if cfg.qk_norm == QkNorm::Full {
        return Some("QK-norm over the whole projection".into());
    }
    if cfg.head_dim > 256 {
        return Some(format!("heads of {} values (the attention kernel takes up to 256)", cfg.head_dim));
    }
    if m.rope.cfg.dim > cfg.head_dim || !m.rope.cfg.dim.is_multiple_of(2) {
        return Some("a rotary width wider than a head".into());
    }
    if !held(&m.output) {
        return Some(format!("the output matrix ({}) is not in VRAM", m.output.dtype));
    }
    for (l, layer) in m.layers.iter().enumerate() {
        if !matches!(cfg.layers[l].mixer, MixerKind::Attention { window: None }) {
            return Some(format!("layer {l}'s token mixer (only full attention runs whole on the GPU)"));
        }
        if layer.attn_post_norm.is_some() || layer.ffn_post_norm.is_some() {
            return Some(format!("layer {l}'s post-norms"));
        }
        let Mixer::Attention(a) = &layer.mixer else { return Some(format!("layer {l}'s token mixer")) };
        if ![&a.q.w, &a.k.w, &a.v.w, &a.o.w].iter().all(|w| held(w)) {
            return Some(format!("layer {l}'s attention matrices are not all in VRAM"));
        }
        match &layer.ffn {
            FfnWeights::Dense(f) => {
                if ![&f.gate, &f.up, &f.down].iter().all(|w| held(w)) {
                    return Some(format!("layer {l}'s FFN matrices are not all in VRAM"));
                }
            }
            FfnWeights::Moe(w) => {
                if w.shared.is_some() || w.biases.is_some() || w.router_bias.is_some() {
                    return Some(format!("layer {l}'s shared expert or expert biases"));
                }
            }
        }
    }
    None
}

/// The gate the device computes for `m`'s sparse layers: a softmax over every expert, the
/// chosen weights renormalized or not (Qwen3-MoE, OLMoE, Mixtral), or a softmax over the
/// chosen logits; at most 1024 experts and 64 chosen. Others are routed by the host.
fn device_gate(m: &Model) -> Option<DeviceGate> {
    let moe = m.cfg.moe.as_ref()?;
    let g = match moe.gating {
        Gating::SoftmaxTopK { norm_topk } => DeviceGate { norm: norm_topk, topk_first: false },
        Gating::TopKSoftmax => DeviceGate { norm: false, topk_first: true },
        _ => return None,
    };
    (moe.n_expert <= 1024 && (1..=64).contains(&moe.n_expert_used) && moe.n_expert >= moe.n_expert_used).then_some(g)
}

/// Sparse layer `l`'s experts where the tier holds every one of them, in one shape and format.
fn held_experts(m: &Model, l: usize, c: &CudaExperts, gpu: &Gpu) -> std::result::Result<Option<HeldExperts>, String> {
    let ne = m.cfg.moe.as_ref().expect("a sparse layer of an MoE model").n_expert;
    let found = c.with_tier(|v| -> Option<(Vec<u64>, [Shape; 3])> {
        let mut ptrs = vec![0u64; 3 * ne];
        let mut shape = None;
        for e in 0..ne {
            let parts = v.parts_of_held(gpu, ExpertKey { layer: l as u32, expert: e as u32 })?;
            let sh: [Shape; 3] = [0, 1, 2].map(|p| (parts[p].dtype, parts[p].rows, parts[p].cols));
            if *shape.get_or_insert(sh) != sh || sh[0] != sh[1] {
                return None; // one grouped launch needs one shape and format
            }
            for p in 0..3 {
                ptrs[p * ne + e] = parts[p].ptr;
            }
        }
        Some((ptrs, shape?))
    });
    let Some((ptrs, [gate, _, down])) = found else { return Ok(None) };
    if kernel_name(gate.0).is_none() || kernel_name(down.0).is_none() {
        return Ok(None);
    }
    let ptrs = gpu.stream.clone_htod(&ptrs).map_err(|e| e.to_string())?;
    Ok(Some(HeldExperts { ptrs, gate, down }))
}

impl CudaStep {
    /// Uploads the vectors the step needs (norms, biases, routers) beside the matrices
    /// `dense` holds; routed experts come from `experts`' VRAM tier. Fails with the reason when
    /// the model has a part the step does not run (`unsupported`), or its tier cannot hold
    /// one token's experts at once.
    pub fn new(
        m: &Model,
        dense: Arc<CudaDense>,
        experts: Option<Arc<CudaExperts>>,
    ) -> std::result::Result<CudaStep, String> {
        if let Some(why) = unsupported(m, &dense) {
            return Err(why);
        }
        let cfg = &m.cfg;
        if let Some(moe) = &cfg.moe {
            let Some(c) = &experts else { return Err("no VRAM tier for the routed experts".into()) };
            let slots = c.with_tier(|v| v.slots());
            if slots < moe.n_expert_used {
                return Err(format!("the VRAM tier holds {slots} experts, fewer than a token's {}", moe.n_expert_used));
            }
            for &l in &cfg.sparse_layers() {
                // One format for a layer's gates and ups (they share their quantized input).
                if let Ok(mut f) = m.experts.fetch_resident(l, &[0]) {
                    if let Some(Ok((_, v))) = f.next() {
                        let w = v.weights();
                        if w.gate.dtype != w.up.dtype
                            || kernel_name(w.gate.dtype).is_none()
                            || kernel_name(w.down.dtype).is_none()
                        {
                            return Err(format!(
                                "layer {l}'s experts ({}, {}, {})",
                                w.gate.dtype, w.up.dtype, w.down.dtype
                            ));
                        }
                    }
                }
            }
        }
        let gpu = dense.gpu().clone();
        let up = |v: &[f32]| gpu.stream.clone_htod(v).map_err(|e| e.to_string());
        let mut vram_bytes = 0;
        let mut layers = Vec::with_capacity(m.layers.len());
        for (l, layer) in m.layers.iter().enumerate() {
            let Mixer::Attention(a) = &layer.mixer else { unreachable!("checked by `unsupported`") };
            let bias = match (&a.q.b, &a.k.b, &a.v.b) {
                (Some(q), Some(k), Some(v)) => Some([up(q)?, up(k)?, up(v)?]),
                _ => None,
            };
            let qk_norm = match (&a.q_norm, &a.k_norm) {
                (Some(q), Some(k)) => Some([up(q)?, up(k)?]),
                _ => None,
            };
            let router = match &layer.ffn {
                FfnWeights::Moe(w) => {
                    let r = &w.router;
                    let mut f = vec![0f32; r.rows * r.cols];
                    for (i, row) in f.chunks_exact_mut(r.cols).enumerate() {
                        embedding_row(r, i, row);
                    }
                    vram_bytes += 4 * f.len();
                    Some(up(&f)?)
                }
                FfnWeights::Dense(_) => None,
            };
            vram_bytes += 4 * (layer.attn_norm.len() + layer.ffn_norm.len());
            let (gate, held) = match (&layer.ffn, &experts) {
                (FfnWeights::Moe(_), Some(c)) => {
                    let gate = device_gate(m);
                    (gate, if gate.is_some() { held_experts(m, l, c, &gpu)? } else { None })
                }
                _ => (None, None),
            };
            layers.push(StepLayer {
                gate,
                held,
                attn_norm: up(&layer.attn_norm)?,
                ffn_norm: up(&layer.ffn_norm)?,
                bias,
                o_bias: a.o.b.as_deref().map(up).transpose()?,
                qk_norm,
                router,
            });
        }
        // Tables only where the tier holds every expert of every sparse layer: then no pass of
        // this model can miss, so none evicts (a miss in a layer the tier holds in part
        // could evict an expert of a layer whose table points at it).
        if layers.iter().any(|sl| sl.gate.is_some() && sl.held.is_none()) {
            for sl in &mut layers {
                sl.held = None;
            }
        }
        let held_evictions = experts.as_ref().map_or(0, |c| c.with_tier(|v| v.stats().evictions));
        let output_norm = up(&m.output_norm)?;
        Ok(CudaStep {
            gpu,
            dense,
            experts,
            layers,
            output_norm,
            state: Mutex::new(State::default()),
            vram_bytes,
            held_evictions,
        })
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> std::result::Result<(), GpuError> {
        let mut b = self.gpu.stream.launch_builder(self.gpu.function(name));
        for a in args {
            match a {
                Arg::P(p) => b.arg(p),
                Arg::I(i) => b.arg(i),
                Arg::F(f) => b.arg(f),
            };
        }
        // SAFETY: every kernel of step.cu is launched through the wrappers below, which pass
        // pointers to live device buffers of the lengths the kernel reads and writes.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    fn rms_norm(
        &self,
        x: u64,
        w: &CudaSlice<f32>,
        out: u64,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) -> std::result::Result<(), GpuError> {
        self.launch(
            "step_rms_norm",
            rows(n_rows),
            &[Arg::P(x), Arg::P(ptr(w, &self.gpu)), Arg::F(eps), Arg::P(out), Arg::I(dim as i32)],
        )
    }

    fn add(&self, a: u64, b: u64, n: usize) -> std::result::Result<(), GpuError> {
        self.launch("step_add", grid(n), &[Arg::P(a), Arg::P(b), Arg::I(n as i32)])
    }

    /// Device buffers for a step of `m` with up to `positions` positions of attention.
    fn bufs(&self, m: &Model, positions: usize) -> std::result::Result<Bufs, GpuError> {
        let cfg = &m.cfg;
        let s = &self.gpu.stream;
        let (k, ff) = cfg.moe.as_ref().map_or((1, cfg.ff), |moe| (moe.n_expert_used, moe.expert_ff.max(cfg.ff)));
        let ne = cfg.moe.as_ref().map_or(1, |moe| moe.n_expert);
        Ok(Bufs {
            input: s.alloc_zeros(cfg.hidden + cfg.head_dim)?,
            x: s.alloc_zeros(cfg.hidden)?,
            h: s.alloc_zeros(cfg.hidden)?,
            q: s.alloc_zeros(cfg.q_dim())?,
            att: s.alloc_zeros(cfg.q_dim())?,
            o: s.alloc_zeros(cfg.hidden)?,
            router: s.alloc_zeros(ne)?,
            g: s.alloc_zeros(k * ff)?,
            u: s.alloc_zeros(k * ff)?,
            y: s.alloc_zeros(k * cfg.hidden)?,
            weights: s.alloc_zeros(k)?,
            ids: s.alloc_zeros(k)?,
            tables: s.alloc_zeros(3 * 24 * k)?,
            logits: s.alloc_zeros(cfg.vocab_size)?,
            scores: s.alloc_zeros(cfg.n_head * positions)?,
            scores_stride: positions,
        })
    }

    /// Brings the device's copy of `state`'s cache up to date (room for one more position).
    fn sync_mirror(&self, m: &Model, st: &mut State, state: &SeqState) -> std::result::Result<(), GpuError> {
        let cfg = &m.cfg;
        let (kvd, need) = (cfg.kv_dim(), state.len() + 1);
        let s = &self.gpu.stream;
        // What the device's copy still holds: positions the sequence took back since (a
        // rejected draft, a restored snapshot) are copied again from the shortest cut, not
        // from the start.
        let held = st.mirror.as_ref().map_or(0, |o| o.len.min(state.unchanged_below(o.lineage)));
        let grow = st.mirror.as_ref().is_none_or(|mi| mi.cap < need)
            || st.bufs.as_ref().is_none_or(|b| b.scores_stride < need);
        if grow {
            let cap = need.next_power_of_two().max(256).min(state.max_len().max(need));
            // Both made before either replaces the old: a failed allocation leaves the two
            // as they were, in step with each other.
            let bufs = self.bufs(m, cap)?;
            let mut kv = Vec::with_capacity(cfg.n_layer);
            let keep = held * kvd;
            for l in 0..cfg.n_layer {
                let (mut kk, mut vv) = (s.alloc_zeros::<f32>(cap * kvd)?, s.alloc_zeros::<f32>(cap * kvd)?);
                if let Some(old) = st.mirror.as_ref().filter(|_| keep > 0) {
                    s.memcpy_dtod(&old.kv[l].0.slice(0..keep), &mut kk.slice_mut(0..keep))?;
                    s.memcpy_dtod(&old.kv[l].1.slice(0..keep), &mut vv.slice_mut(0..keep))?;
                }
                kv.push((kk, vv));
            }
            st.mirror = Some(Mirror { kv, cap, lineage: state.lineage(), len: held });
            st.bufs = Some(bufs);
        }
        let mi = st.mirror.as_mut().expect("made above");
        mi.len = held;
        mi.lineage = state.lineage();
        if mi.len < state.len() {
            let (from, to) = (mi.len * kvd, state.len() * kvd);
            for l in 0..cfg.n_layer {
                let (k, v) = state.kv(l);
                s.memcpy_htod(&k[from..to], &mut mi.kv[l].0.slice_mut(from..to))?;
                s.memcpy_htod(&v[from..to], &mut mi.kv[l].1.slice_mut(from..to))?;
            }
            st.synced += (state.len() - mi.len) as u64;
            mi.len = state.len();
        }
        Ok(())
    }

    fn mat(&self, w: &Weight) -> &GpuMatrix {
        self.dense.matrix(w).expect("checked by `unsupported`")
    }

    fn run(
        &self,
        m: &Model,
        st: &mut State,
        state: &mut SeqState,
        token: u32,
        want: Logits,
    ) -> std::result::Result<(Vec<f32>, Vec<f32>), StepError> {
        let cfg = &m.cfg;
        let gpu = &*self.gpu;
        let s = &gpu.stream;
        let (hd, qd, kvd, dh) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let pos = state.len();
        let State {
            mirror,
            bufs,
            acts,
            up,
            router_back,
            kv_back,
            out_back,
            route_ns,
            acquire_ns,
            device_routed,
            host_routed,
            ..
        } = st;
        let (Some(mirror), Some(b)) = (mirror.as_mut(), bufs.as_mut()) else {
            return Err(StepError::Gpu(GpuError::Shape("the step ran before its buffers were made".into())));
        };
        if b.scores_stride <= pos || mirror.cap <= pos {
            return Err(StepError::Gpu(GpuError::Shape(format!(
                "position {pos} past the device cache's {} positions",
                mirror.cap.min(b.scores_stride)
            ))));
        }
        // The tables stand while the tier has evicted nothing since they were made.
        let held_valid = self.layers.iter().any(|sl| sl.held.is_some())
            && self.experts.as_ref().is_some_and(|c| c.with_tier(|v| v.stats().evictions) == self.held_evictions);
        // The input: the token's embedding, then the position's cosines and sines.
        let rot = m.rope.cfg.dim;
        let up = up.room(gpu, hd + rot)?;
        embedding_row(&m.tok_embd, token as usize, &mut up[..hd]);
        {
            let (c, sn) = up[hd..].split_at_mut(rot / 2);
            m.rope.cos_sin(pos, c, sn);
        }
        s.memcpy_htod(&*up, &mut b.input.slice_mut(0..hd + rot))?;
        s.memcpy_dtod(&b.input.slice(0..hd), &mut b.x.slice_mut(0..hd))?;
        let kv_back = kv_back.room(gpu, 2 * cfg.n_layer * kvd)?;
        let (x, h, q, att, o) = (ptr(&b.x, gpu), ptr(&b.h, gpu), ptr(&b.q, gpu), ptr(&b.att, gpu), ptr(&b.o, gpu));
        let cs = ptr(&b.input, gpu) + 4 * hd as u64;
        let neox = i32::from(m.rope.cfg.style == RopeStyle::Neox);
        for ((l, layer), sl) in m.layers.iter().enumerate().zip(&self.layers) {
            let Mixer::Attention(a) = &layer.mixer else { unreachable!("checked by `unsupported`") };
            self.rms_norm(x, &sl.attn_norm, h, 1, hd, cfg.rms_eps)?;
            let (wq, wk, wv, wo) = (self.mat(&a.q.w), self.mat(&a.k.w), self.mat(&a.v.w), self.mat(&a.o.w));
            acts.quantize(gpu, &[wq.dtype, wk.dtype, wv.dtype], &b.h, 1, hd)?;
            let (kc, vc) = &mut mirror.kv[l];
            let at = pos * kvd..(pos + 1) * kvd;
            // Keys and values go straight into the device's cache, at this position.
            gpu.matmul_into(wq.view(gpu), acts.get(wq.dtype, wq.cols), &mut b.q.slice_mut(0..qd))?;
            gpu.matmul_into(wk.view(gpu), acts.get(wk.dtype, wk.cols), &mut kc.slice_mut(at.clone()))?;
            gpu.matmul_into(wv.view(gpu), acts.get(wv.dtype, wv.cols), &mut vc.slice_mut(at.clone()))?;
            let (kp, vp) = (ptr(kc, gpu) + 4 * at.start as u64, ptr(vc, gpu) + 4 * at.start as u64);
            if let Some([bq, bk, bv]) = &sl.bias {
                self.add(q, ptr(bq, gpu), qd)?;
                self.add(kp, ptr(bk, gpu), kvd)?;
                self.add(vp, ptr(bv, gpu), kvd)?;
            }
            // QK-norm (where the model has it) and rotary embedding, every head in one launch.
            if sl.qk_norm.is_some() || rot > 0 {
                let (wq, wk, norm) = match &sl.qk_norm {
                    Some([nq, nk]) => (ptr(nq, gpu), ptr(nk, gpu), 1),
                    None => (0, 0, 0),
                };
                let c = rows(cfg.n_head + cfg.n_head_kv);
                self.launch(
                    "step_qk_norm_rope",
                    c,
                    &[
                        Arg::P(q),
                        Arg::P(kp),
                        Arg::P(wq),
                        Arg::P(wk),
                        Arg::I(norm),
                        Arg::F(cfg.rms_eps),
                        Arg::I(cfg.n_head as i32),
                        Arg::I(dh as i32),
                        Arg::P(cs),
                        Arg::I(rot as i32),
                        Arg::I(neox),
                    ],
                )?;
            }
            // The position's keys and values go back to the host's cache as well (read after
            // the step's one final wait).
            let (bk, bv) = kv_back[2 * l * kvd..2 * (l + 1) * kvd].split_at_mut(kvd);
            s.memcpy_dtoh(&kc.slice(at.clone()), bk)?;
            s.memcpy_dtoh(&vc.slice(at.clone()), bv)?;
            self.launch(
                "step_attention",
                rows(cfg.n_head),
                &[
                    Arg::P(q),
                    Arg::P(ptr(kc, gpu)),
                    Arg::P(ptr(vc, gpu)),
                    Arg::P(att),
                    Arg::P(ptr(&b.scores, gpu)),
                    Arg::I(cfg.n_head as i32),
                    Arg::I(cfg.n_head_kv as i32),
                    Arg::I(dh as i32),
                    Arg::I(kvd as i32),
                    Arg::I(pos as i32 + 1),
                    Arg::I(b.scores_stride as i32),
                    Arg::F(cfg.attn_scale),
                ],
            )?;
            acts.quantize(gpu, &[wo.dtype], &b.att, 1, qd)?;
            gpu.matmul_into(wo.view(gpu), acts.get(wo.dtype, wo.cols), &mut b.o.slice_mut(0..hd))?;
            if let Some(ob) = &sl.o_bias {
                self.add(o, ptr(ob, gpu), hd)?;
            }
            self.launch(
                "step_add_rms_norm",
                rows(1),
                &[
                    Arg::P(x),
                    Arg::P(o),
                    Arg::P(ptr(&sl.ffn_norm, gpu)),
                    Arg::F(cfg.rms_eps),
                    Arg::P(h),
                    Arg::I(hd as i32),
                ],
            )?;
            match &layer.ffn {
                FfnWeights::Dense(f) => {
                    let (wg, wu, wd) = (self.mat(&f.gate), self.mat(&f.up), self.mat(&f.down));
                    let ff = wg.rows;
                    acts.quantize(gpu, &[wg.dtype, wu.dtype], &b.h, 1, hd)?;
                    gpu.matmul_into(wg.view(gpu), acts.get(wg.dtype, wg.cols), &mut b.g.slice_mut(0..ff))?;
                    gpu.matmul_into(wu.view(gpu), acts.get(wu.dtype, wu.cols), &mut b.u.slice_mut(0..ff))?;
                    self.silu_mul(b, ff)?;
                    acts.quantize(gpu, &[wd.dtype], &b.g, 1, ff)?;
                    gpu.matmul_into(wd.view(gpu), acts.get(wd.dtype, wd.cols), &mut b.o.slice_mut(0..hd))?;
                    self.add(x, o, hd)?;
                }
                FfnWeights::Moe(w) => {
                    let router = sl.router.as_ref().expect("a sparse layer has a router");
                    let ne = router.len() / hd;
                    self.launch(
                        "step_matvec_f32",
                        LaunchConfig {
                            grid_dim: ((ne as u32).div_ceil(THREADS / 32), 1, 1),
                            block_dim: (THREADS, 1, 1),
                            shared_mem_bytes: 0,
                        },
                        &[
                            Arg::P(ptr(router, gpu)),
                            Arg::P(h),
                            Arg::P(ptr(&b.router, gpu)),
                            Arg::I(ne as i32),
                            Arg::I(hd as i32),
                        ],
                    )?;
                    if let (Some(g), None) = (sl.gate, m.experts.route_mask(l)) {
                        // The gate on the device, whatever the tier holds (the same weights).
                        let held = sl.held.as_ref().filter(|_| held_valid);
                        self.route_on_device(m, g, held, b)?;
                        if let Some(held) = held {
                            self.held_experts_into(m, held, acts, b)?;
                            *device_routed += 1;
                            continue;
                        }
                        // The chosen ids go to the host, which makes those experts resident.
                        let t0 = Instant::now();
                        let k = cfg.moe.as_ref().expect("a sparse layer of an MoE model").n_expert_used;
                        let mut ids = vec![0i32; k];
                        s.memcpy_dtoh(&b.ids.slice(0..k), &mut ids)?;
                        s.synchronize()?;
                        *route_ns += t0.elapsed().as_nanos() as u64;
                        *host_routed += 1;
                        if let Some(bad) = ids.iter().find(|&&e| e < 0 || e as usize >= ne) {
                            return Err(StepError::Gpu(GpuError::Shape(format!(
                                "layer {l}'s router chose expert {bad} of {ne}"
                            ))));
                        }
                        let ids: Vec<u32> = ids.iter().map(|&e| e as u32).collect();
                        self.experts_into(m, l, &ids, None, acts, b, acquire_ns, Instant::now())?;
                        continue;
                    }
                    let t0 = Instant::now();
                    let logits = router_back.room(gpu, ne)?;
                    s.memcpy_dtoh(&b.router.slice(0..ne), &mut *logits)?;
                    s.synchronize()?;
                    let moe = cfg.moe.as_ref().expect("a sparse layer of an MoE model");
                    let (mut ids, mut wts) = (Vec::new(), Vec::new());
                    route(
                        moe.gating,
                        logits,
                        w.correction.as_deref(),
                        moe.n_expert_used,
                        m.experts.route_mask(l),
                        &mut ids,
                        &mut wts,
                    );
                    *route_ns += t0.elapsed().as_nanos() as u64;
                    *host_routed += 1;
                    let t0 = Instant::now();
                    self.experts_into(m, l, &ids, Some(&wts), acts, b, acquire_ns, t0)?;
                }
            }
        }
        self.rms_norm(x, &self.output_norm, h, 1, hd, cfg.rms_eps)?;
        let row = match want {
            Logits::None => false,
            Logits::All | Logits::Last | Logits::HiddenOnly => true,
            Logits::From(f) => f == 0,
        };
        let vocab = cfg.vocab_size;
        let want_logits = row && want != Logits::HiddenOnly;
        let back = out_back.room(gpu, vocab + hd)?;
        let (lb, hb) = back.split_at_mut(vocab);
        if want_logits {
            let wout = self.mat(&m.output);
            acts.quantize(gpu, &[wout.dtype], &b.h, 1, hd)?;
            gpu.matmul_into(wout.view(gpu), acts.get(wout.dtype, wout.cols), &mut b.logits.slice_mut(0..vocab))?;
            s.memcpy_dtoh(&b.logits.slice(0..vocab), &mut *lb)?;
        }
        s.memcpy_dtoh(&b.h.slice(0..hd), &mut hb[..hd])?;
        // The step's one wait for its results (the MoE layers waited for their routing).
        s.synchronize()?;
        for l in 0..cfg.n_layer {
            let at = 2 * l * kvd;
            state.append_kv(l, &kv_back[at..at + kvd], &kv_back[at + kvd..at + 2 * kvd]);
        }
        mirror.len = pos + 1;
        let logits = if want_logits { lb.to_vec() } else { Vec::new() };
        let hidden = if row { hb[..hd].to_vec() } else { Vec::new() };
        Ok((logits, hidden))
    }

    fn silu_mul(&self, b: &Bufs, n: usize) -> std::result::Result<(), GpuError> {
        let gpu = &*self.gpu;
        self.launch("step_silu_mul", grid(n), &[Arg::P(ptr(&b.g, gpu)), Arg::P(ptr(&b.u, gpu)), Arg::I(n as i32)])
    }

    /// The device's gate on the router's logits in `b.router`: the chosen ids and weights
    /// in `b.ids` and `b.weights`, and, for experts the tier holds (`held`), the grouped
    /// products' tables in `b.tables`.
    fn route_on_device(
        &self,
        m: &Model,
        g: DeviceGate,
        held: Option<&HeldExperts>,
        b: &Bufs,
    ) -> std::result::Result<(), GpuError> {
        let gpu = &*self.gpu;
        let moe = m.cfg.moe.as_ref().expect("a sparse layer of an MoE model");
        let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        self.launch(
            "step_route",
            one,
            &[
                Arg::P(ptr(&b.router, gpu)),
                Arg::I(moe.n_expert as i32),
                Arg::I(moe.n_expert_used as i32),
                Arg::I(i32::from(g.norm)),
                Arg::I(i32::from(g.topk_first)),
                Arg::P(held.map_or(0, |h| ptr(&h.ptrs, gpu))),
                Arg::P(ptr(&b.weights, gpu)),
                Arg::P(ptr(&b.tables, gpu)),
                Arg::P(ptr(&b.ids, gpu)),
            ],
        )
    }

    /// The experts `route_on_device` chose, all held by the tier: their gate, up and down
    /// products read their matrices through its tables, and their weighted sum joins the
    /// residual.
    fn held_experts_into(
        &self,
        m: &Model,
        held: &HeldExperts,
        acts: &mut Acts,
        b: &mut Bufs,
    ) -> std::result::Result<(), GpuError> {
        let gpu = &*self.gpu;
        let (hd, k) = (m.cfg.hidden, m.cfg.moe.as_ref().expect("a sparse layer of an MoE model").n_expert_used);
        let tables = ptr(&b.tables, gpu);
        let table = |t: u64| tables + t * 24 * k as u64;
        let ((gd, ff, _), (dd, _, _)) = (held.gate, held.down);
        acts.quantize(gpu, &[gd], &b.h, 1, hd)?;
        gpu.matmul_ids_table(gd, ff, hd, k, table(0), acts.get(gd, hd), &mut b.g.slice_mut(0..k * ff))?;
        gpu.matmul_ids_table(gd, ff, hd, k, table(1), acts.get(gd, hd), &mut b.u.slice_mut(0..k * ff))?;
        self.silu_mul(b, k * ff)?;
        acts.quantize(gpu, &[dd], &b.g, k, ff)?;
        gpu.matmul_ids_table(dd, hd, ff, k, table(2), acts.get(dd, ff), &mut b.y.slice_mut(0..k * hd))?;
        self.weighted_add(b, k, hd)
    }

    fn weighted_add(&self, b: &Bufs, k: usize, hd: usize) -> std::result::Result<(), GpuError> {
        let gpu = &*self.gpu;
        self.launch(
            "step_weighted_add",
            grid(hd),
            &[
                Arg::P(ptr(&b.x, gpu)),
                Arg::P(ptr(&b.y, gpu)),
                Arg::P(ptr(&b.weights, gpu)),
                Arg::I(k as i32),
                Arg::I(hd as i32),
            ],
        )
    }

    /// Experts `ids` of sparse layer `l` (weights `wts`, rank order, or already in
    /// `b.weights`) on the normed input `b.h`, their weighted sum added to the residual `b.x`.
    #[allow(clippy::too_many_arguments)]
    fn experts_into(
        &self,
        m: &Model,
        l: usize,
        ids: &[u32],
        wts: Option<&[f32]>,
        acts: &mut Acts,
        b: &mut Bufs,
        acquire_ns: &mut u64,
        t0: Instant,
    ) -> std::result::Result<(), StepError> {
        let gpu = &*self.gpu;
        let hd = m.cfg.hidden;
        let k = ids.len();
        let tier = self.experts.as_ref().expect("checked at construction");
        let keys: Vec<ExpertKey> = ids.iter().map(|&e| ExpertKey { layer: l as u32, expert: e }).collect();
        tier.with_tier(|vram| -> std::result::Result<(), StepError> {
            // Host copies of the experts the tier lacks, to copy them from (fetched with the
            // tier locked, so that no other pass evicts one of the others meanwhile).
            let missing: Vec<u32> = keys.iter().filter(|key| !vram.holds(**key)).map(|key| key.expert).collect();
            let mut views = Vec::with_capacity(missing.len());
            if !missing.is_empty() {
                let mut fetch = m.experts.fetch(l, &missing).map_err(StepError::Model)?;
                while let Some(v) = fetch.next() {
                    let (i, view) = v.map_err(StepError::Model)?;
                    views.push((missing[i], view));
                }
            }
            let host = |key: ExpertKey| -> std::result::Result<Vec<HostPart<'_>>, GpuError> {
                let (_, v) = views
                    .iter()
                    .find(|(e, _)| *e == key.expert)
                    .ok_or_else(|| GpuError::Shape(format!("expert {key:?} was not fetched")))?;
                let ew = v.weights();
                Ok([ew.gate, ew.up, ew.down]
                    .iter()
                    .map(|m| HostPart { dtype: m.dtype, rows: m.rows, cols: m.cols, data: m.data })
                    .collect())
            };
            let res = vram.acquire(gpu, &keys, &host)?;
            *acquire_ns += t0.elapsed().as_nanos() as u64;
            let part = |p: usize| -> Vec<(DeviceMat<'_>, std::ops::Range<usize>)> {
                (0..k).map(|i| (res.expert(i)[p], i..i + 1)).collect()
            };
            let (gate, down) = (res.expert(0)[0], res.expert(0)[2]);
            let ff = gate.rows;
            acts.quantize(gpu, &[gate.dtype], &b.h, 1, hd)?;
            let zeros = vec![0i32; k];
            gpu.matmul_ids_into(&part(0), acts.get(gate.dtype, gate.cols), &zeros, &mut b.g.slice_mut(0..k * ff))?;
            gpu.matmul_ids_into(&part(1), acts.get(gate.dtype, gate.cols), &zeros, &mut b.u.slice_mut(0..k * ff))?;
            self.silu_mul(b, k * ff)?;
            acts.quantize(gpu, &[down.dtype], &b.g, k, ff)?;
            let own: Vec<i32> = (0..k as i32).collect();
            gpu.matmul_ids_into(&part(2), acts.get(down.dtype, down.cols), &own, &mut b.y.slice_mut(0..k * hd))?;
            drop(res);
            if let Some(w) = wts {
                gpu.stream.memcpy_htod(w, &mut b.weights.slice_mut(0..k))?;
            }
            self.weighted_add(b, k, hd)?;
            Ok(())
        })
    }
}

enum Arg {
    P(u64),
    I(i32),
    F(f32),
}

enum StepError {
    Gpu(GpuError),
    Model(ModelError),
}

impl From<GpuError> for StepError {
    fn from(e: GpuError) -> Self {
        StepError::Gpu(e)
    }
}

impl From<cudarc::driver::DriverError> for StepError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        StepError::Gpu(GpuError::Driver(e))
    }
}

impl StepCompute for CudaStep {
    fn step(&self, m: &Model, state: &mut SeqState, token: u32, want: Logits) -> Option<Result<(Vec<f32>, Vec<f32>)>> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.off {
            st.declined += 1;
            return None;
        }
        let t0 = Instant::now();
        if let Err(e) = self.sync_mirror(m, &mut st, state) {
            // No room for the sequence's cache on the device (or its copy failed): the host
            // computes this step, with the state untouched.
            let _ = self.gpu.stream.synchronize();
            st.declined += 1;
            st.declined_why = Some(e.to_string());
            return None;
        }
        let r = self.run(m, &mut st, state, token, want);
        st.steps += 1;
        st.step_ns += t0.elapsed().as_nanos() as u64;
        Some(match r {
            Ok(out) => Ok(out),
            Err(StepError::Gpu(GpuError::Unsupported(d))) => {
                // Experts of a streamed source are seen only when a step first needs them;
                // the host's state is untouched until the step's end, so the host can take
                // this step and the rest.
                let _ = self.gpu.stream.synchronize();
                st.off = true;
                st.declined += 1;
                st.declined_why = Some(format!("no CUDA kernel for {d} experts"));
                return None;
            }
            Err(e) => {
                // Copies in flight read and write the staging buffers the next step reuses.
                let _ = self.gpu.stream.synchronize();
                // The device's copy may hold part of this position: it is rewritten next time.
                if let Some(mi) = st.mirror.as_mut() {
                    mi.len = mi.len.min(state.len());
                }
                Err(match e {
                    StepError::Gpu(e) => gpu_err(e),
                    StepError::Model(e) => e,
                })
            }
        })
    }

    fn describe(&self) -> String {
        format!(
            "decode steps run whole on {}: attention, norms and the KV cache in VRAM beside the dense weights ({:.2} MB of vectors), routed experts from the VRAM tier",
            self.gpu.name,
            self.vram_bytes as f64 / 1e6
        )
    }

    fn stats_line(&self) -> String {
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let per = |ns: u64| ns as f64 / 1e3 / st.steps.max(1) as f64;
        format!(
            "GPU steps: {} ({:.0} µs each: waiting for routing {:.0} µs, for experts {:.0} µs); MoE layers routed on the GPU {}, on the host {}; {} positions of KV copied up from the host{}",
            st.steps,
            per(st.step_ns),
            per(st.route_ns),
            per(st.acquire_ns),
            st.device_routed,
            st.host_routed,
            st.synced,
            match &st.declined_why {
                Some(why) => format!("; {} steps left to the host ({why})", st.declined),
                None => String::new(),
            }
        )
    }
}

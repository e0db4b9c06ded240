//! Where a model's routed experts live: all in memory (resident), in the page cache (mmap),
//! or streamed through sluice's expert cache. Without an explicit choice, sluice keeps the
//! model resident when it fits in available memory with headroom, and streams otherwise with
//! a cache sized from what is left; it says what it chose and why.

use crate::error::{Result, RuntimeError};
use sluice_experts::pressure::{PressureConfig, PressureMonitor};
use sluice_experts::{IoKind, Policy, StreamOptions, StreamingExperts};
use sluice_formats::safetensors::TensorData;
use sluice_model::weights::{ExpertPart, Key};
use sluice_model::{ExpertSource, ModelConfig, ModelError, ResidentExperts, TensorSource};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertMode {
    /// Decide from the model size and available memory.
    Auto,
    /// Every expert read into memory up front.
    Resident,
    /// Experts read through a memory map; the page cache decides what stays (the baseline).
    Mmap,
    /// Experts streamed through the bounded expert cache.
    Stream,
}

impl ExpertMode {
    pub fn parse(s: &str) -> Option<ExpertMode> {
        Some(match s {
            "auto" => ExpertMode::Auto,
            "resident" => ExpertMode::Resident,
            "mmap" => ExpertMode::Mmap,
            "stream" => ExpertMode::Stream,
            _ => return None,
        })
    }
}

#[derive(Clone)]
pub struct ExpertOptions {
    pub mode: ExpertMode,
    /// Cache size in bytes for streaming (None: sized from available memory).
    pub cache_bytes: Option<u64>,
    pub policy: Policy,
    pub prefetch: bool,
    pub depth: usize,
    pub io: IoKind,
    pub register_buffers: bool,
    /// A pack made by `sluice pack` for this model.
    pub pack: Option<PathBuf>,
    /// Shrink the cache under memory pressure (Linux PSI).
    pub pressure: bool,
    pub faults: Option<Arc<std::sync::Mutex<sluice_experts::io::FaultPlan>>>,
}

impl Default for ExpertOptions {
    fn default() -> Self {
        ExpertOptions {
            mode: ExpertMode::Auto,
            cache_bytes: None,
            policy: Policy::Lru,
            prefetch: true,
            depth: 32,
            io: IoKind::Auto,
            register_buffers: true,
            pack: None,
            pressure: true,
            faults: None,
        }
    }
}

/// What `place` decided.
pub struct Placement {
    pub experts: Arc<dyn ExpertSource>,
    /// Copy dense weights into memory of their own (so the page cache cannot take them).
    pub copy_dense: bool,
    pub reason: String,
    pub streaming: Option<Arc<StreamingExperts>>,
    pub monitor: Option<PressureMonitor>,
}

/// Available memory (bytes) from /proc/meminfo, if known.
pub fn mem_available() -> Option<u64> {
    let t = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = t.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Bytes of the routed experts (summed over every expert of every sparse layer).
pub fn expert_bytes(src: &dyn TensorSource, cfg: &ModelConfig) -> Result<u64> {
    let Some(moe) = &cfg.moe else { return Ok(0) };
    let mut total = 0u64;
    for l in (0..cfg.n_layer).filter(|l| cfg.is_sparse(*l)) {
        let per: u64 = ExpertPart::ALL.iter().map(|p| src.expert_bytes(*p, l, 0)).sum::<Result<u64, _>>()?;
        total += per * moe.n_expert as u64;
    }
    Ok(total)
}

/// A byte count for people: GiB, or MiB below 1 GiB, or KiB below 1 MiB (so that a small
/// quota never reads as "0.00 GiB").
pub fn gib(b: u64) -> String {
    if b < 1 << 20 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else if b < 1 << 30 {
        format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
    }
}

/// A tensor source whose tensors live in memory of their own rather than in a file mapping.
pub struct OwnedSource<'a>(pub &'a dyn TensorSource);

fn own(t: TensorData) -> TensorData {
    TensorData { data: t.data.to_owned_releasing(), ..t }
}

impl TensorSource for OwnedSource<'_> {
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn get(&self, key: Key, layer: Option<usize>) -> sluice_model::Result<Option<TensorData>> {
        Ok(self.0.get(key, layer)?.map(own))
    }
    fn require(&self, key: Key, layer: Option<usize>) -> sluice_model::Result<TensorData> {
        Ok(own(self.0.require(key, layer)?))
    }
    fn expert(&self, part: ExpertPart, layer: usize, expert: usize) -> sluice_model::Result<TensorData> {
        Ok(own(self.0.expert(part, layer, expert)?))
    }
    fn expert_bytes(&self, part: ExpertPart, layer: usize, expert: usize) -> sluice_model::Result<u64> {
        self.0.expert_bytes(part, layer, expert)
    }
}

/// Where the experts go, decided from sizes alone: what `place` does, and what `sluice fit`
/// predicts for a memory size.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Every expert in memory: copied (`copy`), or left in the file mapping.
    Resident { copy: bool, reason: String },
    /// Streamed through a cache of `quota` bytes (before the cap at every expert's slot).
    Stream { quota: u64 },
}

/// Memory left free beside a model: 1 GiB and a twentieth of what is available.
pub fn headroom(avail: u64) -> u64 {
    (1u64 << 30) + avail / 20
}

/// The placement rule: `dense`, `experts` and `kv` bytes against `avail` bytes of available
/// memory, under the asked mode and cache size.
pub fn decide(
    mode: ExpertMode,
    cache_bytes: Option<u64>,
    avail: Option<u64>,
    dense: u64,
    experts: u64,
    kv: u64,
) -> Result<Decision> {
    let mode = match (mode, cache_bytes) {
        (ExpertMode::Auto, Some(_)) => ExpertMode::Stream,
        (m, _) => m,
    };
    match mode {
        ExpertMode::Resident => {
            return Ok(Decision::Resident {
                copy: true,
                reason: format!("experts resident ({} in memory)", gib(experts)),
            })
        }
        ExpertMode::Mmap => {
            return Ok(Decision::Resident {
                copy: false,
                reason: format!("experts memory-mapped ({}; the page cache decides)", gib(experts)),
            })
        }
        _ => {}
    }
    let quota = match (mode, cache_bytes, avail) {
        (ExpertMode::Auto, None, Some(a)) if dense + experts + kv + headroom(a) <= a => {
            return Ok(Decision::Resident {
                copy: true,
                reason: format!(
                    "experts resident: the model ({}) fits in available memory ({}) with headroom",
                    gib(dense + experts),
                    gib(a)
                ),
            });
        }
        (ExpertMode::Auto, None, None) => {
            return Ok(Decision::Resident {
                copy: false,
                reason: "experts memory-mapped: available memory unknown".into(),
            })
        }
        (_, Some(q), _) => q,
        (_, None, Some(a)) => a.saturating_sub(dense + kv + headroom(a)),
        (_, None, None) => {
            return Err(RuntimeError::Input("available memory is unknown: give --expert-cache SIZE to stream".into()))
        }
    };
    Ok(Decision::Stream { quota })
}

/// Decides where the experts live and builds their source. `layout` builds the streaming
/// layout (from the model file or a pack) when streaming is chosen.
pub fn place(
    src: &dyn TensorSource,
    cfg: &ModelConfig,
    o: &ExpertOptions,
    file_bytes: u64,
    kv_bytes: u64,
    layout: &dyn Fn() -> Result<sluice_experts::layout::Layout>,
) -> Result<Placement> {
    let resident = |copy: bool, reason: String| -> Result<Placement> {
        Ok(Placement {
            experts: Arc::new(ResidentExperts::load(src, cfg, copy)?),
            copy_dense: copy,
            reason,
            streaming: None,
            monitor: None,
        })
    };
    if cfg.moe.is_none() {
        return resident(false, "dense model: weights memory-mapped".into());
    }
    let experts = expert_bytes(src, cfg)?;
    let dense = file_bytes.saturating_sub(experts);
    let avail = mem_available();
    let (mode, cache_bytes) = match (&o.io, o.mode) {
        // A remote model's expert bytes are not in the local file: they can only stream.
        (IoKind::Ranges(_), ExpertMode::Mmap) => {
            return Err(RuntimeError::Input(
                "--expert-mode mmap needs a local file; a remote model's experts stream (`sluice fetch URL --all` makes a local copy)".into(),
            ))
        }
        (IoKind::Ranges(_), ExpertMode::Resident) => (ExpertMode::Stream, Some(u64::MAX)),
        (IoKind::Ranges(_), _) => (ExpertMode::Stream, o.cache_bytes),
        (_, m) => (m, o.cache_bytes),
    };
    let quota = match decide(mode, cache_bytes, avail, dense, experts, kv_bytes)? {
        Decision::Resident { copy, reason } => return resident(copy, reason),
        Decision::Stream { quota } => quota,
    };
    let layout = layout()?;
    let slot = layout.slot_bytes() as u64;
    if quota < slot {
        let why = if o.cache_bytes.is_some() {
            format!(
                "--expert-cache {} is smaller than one expert; the minimum is {} ({slot} bytes)",
                gib(quota),
                gib(slot)
            )
        } else {
            format!(
                "not enough memory to stream: {} available, {} needed for dense weights, KV cache and one expert",
                gib(avail.unwrap_or(0)),
                gib(dense + kv_bytes + slot)
            )
        };
        return Err(RuntimeError::Input(why));
    }
    let quota = quota.min(layout.slot_bytes() as u64 * layout.experts.iter().map(|l| l.len() as u64).sum::<u64>());
    let so = StreamOptions {
        quota: quota as usize,
        policy: o.policy,
        prefetch: o.prefetch,
        prefetch_budget: 0,
        depth: o.depth,
        io: o.io.clone(),
        register_buffers: o.register_buffers,
        faults: o.faults.clone(),
    };
    let s = Arc::new(
        StreamingExperts::new(layout, so).map_err(|e| RuntimeError::Model(ModelError::Expert(e.to_string())))?,
    );
    let why = match (cache_bytes, avail) {
        (Some(_), _) => "as asked".to_string(),
        (None, Some(a)) => {
            format!("the model ({}) does not fit in available memory ({})", gib(dense + experts), gib(a))
        }
        _ => String::new(),
    };
    let monitor = if o.pressure {
        let floor = s.slot_bytes() * cfg.moe.as_ref().map_or(1, |m| m.n_expert_used);
        PressureMonitor::spawn(Arc::downgrade(&s), PressureConfig { floor, ..Default::default() })
    } else {
        None
    };
    Ok(Placement {
        reason: format!("{} ({why})", s.describe()),
        experts: s.clone(),
        copy_dense: true,
        streaming: Some(s),
        monitor,
    })
}

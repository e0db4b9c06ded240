//! The seam between the MoE block and wherever expert weights live.
//!
//! The block asks an `ExpertSource` for the experts its router chose and receives each one as
//! soon as its weights are resident, in whatever order they arrive; it combines outputs in the
//! canonical (rank) order itself, so arrival order never changes a bit. A view pins the
//! expert's memory until it is dropped. This file also holds the resident source (every expert
//! in memory or mapped), the reference every streaming source must match.

use crate::error::{ModelError, Result};
use crate::weights::{ExpertPart, TensorSource, Weight};
use sluice_kernels::MatRef;

/// One expert's three matrices: gate and up are ff × hidden, down is hidden × ff.
#[derive(Clone, Copy, Debug)]
pub struct ExpertWeights<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
}

impl ExpertWeights<'_> {
    /// Bytes of the three matrices as stored.
    pub fn bytes(&self) -> usize {
        self.gate.data.len() + self.up.data.len() + self.down.data.len()
    }

    /// Weights of the three matrices: the multiply-adds for one token.
    pub fn elements(&self) -> usize {
        [self.gate, self.up, self.down].iter().map(|m| m.rows * m.cols).sum()
    }
}

/// A resident expert, pinned while the view lives.
pub trait ExpertView: Send {
    fn weights(&self) -> ExpertWeights<'_>;
}

/// The experts of one request, delivered as they become resident.
pub trait ExpertFetch<'s> {
    /// The next resident expert with its index in the request; `None` when all were delivered.
    #[allow(clippy::type_complexity)]
    fn next(&mut self) -> Option<Result<(usize, Box<dyn ExpertView + 's>)>>;

    /// Whether every requested expert is resident already, so that `next` never waits: the
    /// MoE block may then take them all at once and schedule their matrices together.
    fn all_resident(&self) -> bool {
        false
    }

    /// Indices of requested experts this fetch will never hand out (only `fetch_resident`
    /// leaves any out: those that were not resident).
    fn missing(&self) -> &[usize] {
        &[]
    }
}

/// Counters an expert source keeps (zero for a resident source).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ExpertStats {
    /// Demand accesses found resident or already being read (by a prefetch or another
    /// request); `prefetch_hits` of them were brought in by a prefetch.
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    pub bytes_read: u64,
    /// Payload bytes of the experts made resident by reads (misses and prefetches); `bytes_read`
    /// over this is the read amplification (alignment, bounce ranges).
    pub loaded_bytes: u64,
    /// Time the forward pass waited for expert reads.
    pub stall_ns: u64,
    pub prefetch_issued: u64,
    /// Demands served by a prefetched expert.
    pub prefetch_hits: u64,
    /// Prefetched experts evicted unused.
    pub prefetch_wasted: u64,
    pub quota_bytes: u64,
    pub resident_bytes: u64,
    /// (seconds since start, old quota, new quota, reason)
    pub quota_changes: Vec<(f64, u64, u64, String)>,
    /// Reads go through the page cache (the file system refused O_DIRECT): the page cache
    /// holds a copy of what was read, beside the expert cache.
    pub buffered_io: bool,
    /// The tiers below the expert cache that served its reads, when they are not one local
    /// disk (a remote model: its disk tier, then the remote).
    pub tiers: Vec<TierStat>,
}

/// Reads one tier below the expert cache served.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct TierStat {
    pub tier: String,
    pub reads: u64,
    pub bytes: u64,
    /// Summed wall time of those reads.
    pub read_ns: u64,
    /// Reads that failed (after retries), and ranges the tier refused as damaged.
    pub errors: u64,
    /// Reads served by the same request as the read before them (back-to-back ranges
    /// coalesced): requests saved.
    pub merged: u64,
}

impl TierStat {
    fn since(&self, earlier: Option<&TierStat>) -> TierStat {
        let e = earlier.cloned().unwrap_or_default();
        TierStat {
            tier: self.tier.clone(),
            reads: self.reads - e.reads.min(self.reads),
            bytes: self.bytes - e.bytes.min(self.bytes),
            read_ns: self.read_ns - e.read_ns.min(self.read_ns),
            errors: self.errors - e.errors.min(self.errors),
            merged: self.merged - e.merged.min(self.merged),
        }
    }
}

impl ExpertStats {
    /// What happened after `earlier` (a snapshot of the same source): counters as differences;
    /// quota and resident bytes as they are now; the quota changes made since.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits - earlier.hits,
            misses: self.misses - earlier.misses,
            evictions: self.evictions - earlier.evictions,
            bytes_read: self.bytes_read - earlier.bytes_read,
            loaded_bytes: self.loaded_bytes - earlier.loaded_bytes,
            stall_ns: self.stall_ns - earlier.stall_ns,
            prefetch_issued: self.prefetch_issued - earlier.prefetch_issued,
            prefetch_hits: self.prefetch_hits - earlier.prefetch_hits,
            prefetch_wasted: self.prefetch_wasted - earlier.prefetch_wasted,
            quota_bytes: self.quota_bytes,
            resident_bytes: self.resident_bytes,
            quota_changes: self.quota_changes[earlier.quota_changes.len().min(self.quota_changes.len())..].to_vec(),
            buffered_io: self.buffered_io,
            tiers: self.tiers.iter().map(|t| t.since(earlier.tiers.iter().find(|e| e.tier == t.tier))).collect(),
        }
    }

    /// Demand accesses: every expert the MoE blocks asked for (prefetch hints not counted).
    pub fn accesses(&self) -> u64 {
        self.hits + self.misses
    }

    /// Share of demand accesses found in the cache without a prefetch's help (an expert kept
    /// from an earlier demand); `None` before any access.
    pub fn hit_rate(&self) -> Option<f64> {
        let a = self.accesses();
        (a > 0).then(|| (self.hits - self.prefetch_hits.min(self.hits)) as f64 / a as f64)
    }

    /// Share of demand accesses served by a prefetched expert (resident or still in flight).
    pub fn prefetch_hit_rate(&self) -> Option<f64> {
        let a = self.accesses();
        (a > 0).then(|| self.prefetch_hits.min(self.hits) as f64 / a as f64)
    }

    /// Share of demand accesses that had to be read.
    pub fn miss_rate(&self) -> Option<f64> {
        let a = self.accesses();
        (a > 0).then(|| self.misses as f64 / a as f64)
    }

    /// Share of prefetched experts that were used, among those whose fate is known (used, or
    /// evicted unused); `None` before any. Well defined over any interval, unlike hits over
    /// issued (a prefetch issued in one interval may be used in the next).
    pub fn prefetch_precision(&self) -> Option<f64> {
        let done = self.prefetch_hits + self.prefetch_wasted;
        (done > 0).then(|| self.prefetch_hits as f64 / done as f64)
    }

    /// Adds the counters of `other` (a later interval) to these.
    pub fn add(&mut self, other: &ExpertStats) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.evictions += other.evictions;
        self.bytes_read += other.bytes_read;
        self.loaded_bytes += other.loaded_bytes;
        self.stall_ns += other.stall_ns;
        self.prefetch_issued += other.prefetch_issued;
        self.prefetch_hits += other.prefetch_hits;
        self.prefetch_wasted += other.prefetch_wasted;
        self.quota_bytes = other.quota_bytes;
        self.resident_bytes = other.resident_bytes;
        self.quota_changes.extend(other.quota_changes.iter().cloned());
        self.buffered_io |= other.buffered_io;
    }
}

pub trait ExpertSource: Send + Sync {
    /// Starts making `experts` of `layer` resident.
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>>;

    /// Those of `experts` that are resident now, pinned and handed out as `fetch` would,
    /// reading nothing and leaving the counters and the eviction order as they were; the
    /// others are named by the fetch's `missing`. For a pass that must cost no IO and leave
    /// the cache as it found it (drafting from the resident experts). The default is `fetch`:
    /// right for a source that holds every expert.
    fn fetch_resident<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        self.fetch(layer, experts)
    }

    /// The experts `layer`'s router may choose, where this source restricts routing (pinned
    /// routing, lossy); `None`: any, as the model says.
    fn route_mask(&self, _layer: usize) -> Option<&[bool]> {
        None
    }

    /// Whether a `prefetch` hint for `layer` could do anything (the model skips predicting
    /// otherwise): false when prefetch is off, or when every expert of `layer` is already
    /// resident or on its way.
    fn wants_prefetch(&self, _layer: usize) -> bool {
        false
    }

    /// A hint: `experts` of `layer` are likely needed next.
    fn prefetch(&self, _layer: usize, _experts: &[u32]) {}

    /// Bytes of expert weights held in memory now.
    fn resident_bytes(&self) -> usize;

    /// Bytes of one expert's three matrices (the largest, if they differ by layer).
    fn expert_bytes(&self) -> usize;

    /// The blocks of memory that hold this source's experts for as long as it lives, where it
    /// owns them outright (a resident copy): a GPU backend may page-lock them, so that copies
    /// from them run at the bus's rate. Empty where experts come and go (a cache reuses and
    /// releases its slots) or stay in a mapped file.
    fn host_memory(&self) -> Vec<sluice_formats::Blob> {
        Vec::new()
    }

    /// A line about what this source is (for `--stats` and logs).
    fn describe(&self) -> String;

    /// Counters so far.
    fn stats(&self) -> ExpertStats {
        ExpertStats { resident_bytes: self.resident_bytes() as u64, ..Default::default() }
    }
}

/// Every expert resident (in memory or in a mapped file).
pub struct ResidentExperts {
    /// `[layer][expert]`; empty for dense layers.
    experts: Vec<Vec<[Weight; 3]>>,
    bytes: usize,
    /// With a copy: one allocation per layer holding its experts' bytes.
    memory: Vec<sluice_formats::Blob>,
}

impl ResidentExperts {
    fn largest_expert(&self) -> usize {
        self.experts.iter().flatten().map(|w| w.iter().map(|m| m.bytes()).sum::<usize>()).max().unwrap_or(0)
    }
}

impl ResidentExperts {
    /// Loads all experts of the sparse layers from `src`, checking shapes. With `copy`, their
    /// bytes are read into memory of their own (one allocation per layer); otherwise they stay
    /// where the source keeps them (a memory-mapped file, paged in by the system).
    pub fn load(src: &dyn TensorSource, cfg: &crate::config::ModelConfig, copy: bool) -> Result<ResidentExperts> {
        ResidentExperts::load_layers(src, cfg, &cfg.sparse_layers(), copy)
    }
}

impl ResidentExperts {
    /// No experts (for a head whose FFN is dense).
    pub fn empty() -> ResidentExperts {
        ResidentExperts { experts: Vec::new(), bytes: 0, memory: Vec::new() }
    }

    /// The experts of `layers` only (indexing by layer as the model does; other layers empty).
    pub fn load_layers(
        src: &dyn TensorSource,
        cfg: &crate::config::ModelConfig,
        layers: &[usize],
        copy: bool,
    ) -> Result<ResidentExperts> {
        // A dense model has no sparse layers: nothing to hold.
        let n_expert = match (&cfg.moe, layers.is_empty()) {
            (Some(m), _) => m.n_expert,
            (None, true) => 0,
            (None, false) => return Err(ModelError::Invalid("not an MoE model".into())),
        };
        let mut bytes = 0;
        let mut memory = Vec::new();
        let mut experts: Vec<Vec<[Weight; 3]>> = vec![Vec::new(); cfg.n_layer];
        for &l in layers {
            let mut ws = (0..n_expert).map(|e| load_expert(src, cfg, l, e)).collect::<Result<Vec<_>>>()?;
            if copy {
                let (whole, copies) = {
                    let parts: Vec<&sluice_formats::Blob> = ws.iter().flatten().map(|w| &w.data).collect();
                    sluice_formats::Blob::pack_releasing(&parts, PACK_ALIGN)
                };
                for (w, c) in ws.iter_mut().flatten().zip(copies) {
                    w.data = c;
                }
                memory.push(whole);
            }
            bytes += ws.iter().flatten().map(|w| w.bytes()).sum::<usize>();
            experts[l] = ws;
        }
        Ok(ResidentExperts { experts, bytes, memory })
    }
}

/// Where each matrix of a resident copy starts, in bytes from its layer's allocation (the
/// kernels' widest load, and a cache line).
const PACK_ALIGN: usize = 64;

/// One expert's three matrices from a tensor source, shape-checked.
pub fn load_expert(
    src: &dyn TensorSource,
    cfg: &crate::config::ModelConfig,
    l: usize,
    e: usize,
) -> Result<[Weight; 3]> {
    let moe = cfg.moe.as_ref().ok_or_else(|| ModelError::Invalid("not an MoE model".into()))?;
    let part = |p: ExpertPart, rows, cols| Weight::from_tensor(src.expert(p, l, e)?, rows, cols);
    Ok([
        part(ExpertPart::Gate, moe.expert_ff, cfg.hidden)?,
        part(ExpertPart::Up, moe.expert_ff, cfg.hidden)?,
        part(ExpertPart::Down, cfg.hidden, moe.expert_ff)?,
    ])
}

struct ResidentView<'s>(&'s [Weight; 3]);

impl ExpertView for ResidentView<'_> {
    fn weights(&self) -> ExpertWeights<'_> {
        ExpertWeights { gate: self.0[0].mat(), up: self.0[1].mat(), down: self.0[2].mat() }
    }
}

struct ResidentFetch<'s> {
    layer: &'s [[Weight; 3]],
    experts: Vec<u32>,
    next: usize,
}

impl<'s> ExpertFetch<'s> for ResidentFetch<'s> {
    fn next(&mut self) -> Option<Result<(usize, Box<dyn ExpertView + 's>)>> {
        let i = self.next;
        let e = *self.experts.get(i)? as usize;
        self.next += 1;
        Some(match self.layer.get(e) {
            Some(w) => Ok((i, Box::new(ResidentView(w)) as Box<dyn ExpertView + 's>)),
            None => Err(ModelError::Expert(format!("expert {e} out of range"))),
        })
    }

    fn all_resident(&self) -> bool {
        true
    }
}

impl ExpertSource for ResidentExperts {
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        let l = self.experts.get(layer).ok_or_else(|| ModelError::Expert(format!("layer {layer} out of range")))?;
        Ok(Box::new(ResidentFetch { layer: l, experts: experts.to_vec(), next: 0 }))
    }

    fn resident_bytes(&self) -> usize {
        self.bytes
    }

    fn expert_bytes(&self) -> usize {
        self.largest_expert()
    }

    fn host_memory(&self) -> Vec<sluice_formats::Blob> {
        self.memory.clone()
    }

    fn describe(&self) -> String {
        format!("resident experts ({:.1} MiB)", self.bytes as f64 / (1 << 20) as f64)
    }
}

/// What a source holds now, and nothing more: the view a draft pass runs through, so that
/// drafting from the target model itself reads nothing and leaves the cache as it was. The
/// router still scores every expert; the MoE block runs the chosen experts that are resident,
/// their weights scaled to keep each token's sum (see `ffn::moe`), and hands the ones left
/// out to `prefetch`, which, when `guide` is on, asks the real source to read them: the pass
/// that verifies the draft is likely to want them.
pub struct CachedOnly<'a> {
    inner: &'a dyn ExpertSource,
    guide: bool,
    counts: std::sync::Mutex<CachedOnlyCounts>,
}

/// What passes through a `CachedOnly` did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CachedOnlyCounts {
    /// Chosen experts run (resident).
    pub used: u64,
    /// Chosen experts left out (not resident).
    pub left_out: u64,
    /// (layer, expert) hinted to the real source's prefetch, in order (`guide` on).
    pub hinted: Vec<(u32, u32)>,
}

impl<'a> CachedOnly<'a> {
    pub fn new(inner: &'a dyn ExpertSource, guide: bool) -> CachedOnly<'a> {
        CachedOnly { inner, guide, counts: Default::default() }
    }

    /// The counts so far, and starts over.
    pub fn take_counts(&self) -> CachedOnlyCounts {
        std::mem::take(&mut *self.counts.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl ExpertSource for CachedOnly<'_> {
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        let f = self.inner.fetch_resident(layer, experts)?;
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        c.left_out += f.missing().len() as u64;
        c.used += (experts.len() - f.missing().len()) as u64;
        Ok(f)
    }

    fn fetch_resident<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        self.fetch(layer, experts)
    }

    fn route_mask(&self, layer: usize) -> Option<&[bool]> {
        self.inner.route_mask(layer)
    }

    /// Never: a draft's hidden states are not the verify pass's, so the layer-ahead
    /// prediction from them is left to the verify pass itself.
    fn wants_prefetch(&self, _layer: usize) -> bool {
        false
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        if self.guide && !experts.is_empty() {
            self.inner.prefetch(layer, experts);
            let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
            c.hinted.extend(experts.iter().map(|e| (layer as u32, *e)));
        }
    }

    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.inner.expert_bytes()
    }

    fn describe(&self) -> String {
        format!("the resident experts of {}", self.inner.describe())
    }

    fn stats(&self) -> ExpertStats {
        self.inner.stats()
    }
}

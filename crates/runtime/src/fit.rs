//! "Will it fit, how fast": from a model's sizes, the memory there is and the measured memory
//! and disk bandwidths, predict where the experts go (the rule `place` applies), the expert
//! cache's hit rate (replaying a routing trace through the cache at the predicted quota, when
//! one is given), and upper bounds on decode speed for resident, streamed and memory-mapped
//! experts. The bounds count bytes moved only: a model whose decode is compute-bound runs below
//! them.

use crate::engine::ModelSizes;
use crate::error::{Result, RuntimeError};
use crate::placement::{decide, Decision, ExpertMode};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Read rates of this machine (GB/s), measured or taken from the cache file.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Rates {
    /// Streaming read of memory by `threads` threads.
    pub memory_gb_s: f64,
    /// Random O_DIRECT reads of one expert slot, 32 in flight (how sluice streams).
    pub disk_gb_s: f64,
    /// Random 128 KiB reads, 2 in flight (page faults with readahead, as mmap reads).
    pub disk_small_gb_s: f64,
    pub threads: usize,
    pub disk_file: String,
    /// Whether these came from the cache file rather than a measurement just now.
    #[serde(default)]
    pub cached: bool,
}

/// Bytes per second of reading `bytes` of memory with `threads` threads (best of three).
pub fn memory_bandwidth(bytes: usize, threads: usize) -> f64 {
    let n = (bytes / 4).max(1 << 16);
    let v: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let threads = threads.max(1);
    let chunk = n.div_ceil(threads);
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let total: f32 = std::thread::scope(|s| {
            let hs: Vec<_> = v
                .chunks(chunk)
                .map(|c| {
                    s.spawn(move || {
                        // Eight lanes so the sum vectorizes.
                        let mut acc = [0f32; 8];
                        for b in c.chunks_exact(8) {
                            for j in 0..8 {
                                acc[j] += b[j];
                            }
                        }
                        acc.iter().sum::<f32>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0.0)).sum()
        });
        std::hint::black_box(total);
        best = best.max((n * 4) as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

/// The largest regular file at `path` (itself if it is a file).
pub fn file_to_read(path: &Path) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    let dir = std::fs::read_dir(path).map_err(|e| RuntimeError::Input(format!("{}: {e}", path.display())))?;
    dir.filter_map(|e| e.ok())
        .filter_map(|e| e.metadata().ok().filter(|m| m.is_file()).map(|m| (m.len(), e.path())))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| RuntimeError::Input(format!("{}: no file to measure the disk with", path.display())))
}

/// Measures the rates (`seconds` per disk measurement), or reads them from `cache` when it
/// holds a measurement of the same disk and thread count and `remeasure` is false.
pub fn rates(
    disk: &Path,
    slot_bytes: usize,
    threads: usize,
    seconds: f64,
    cache: Option<&Path>,
    remeasure: bool,
) -> Result<Rates> {
    use std::os::unix::fs::MetadataExt;
    let file = file_to_read(disk)?;
    let dev = std::fs::metadata(&file).map_err(|e| RuntimeError::Input(format!("{}: {e}", file.display())))?.dev();
    let key = format!("dev{dev}-slot{slot_bytes}-threads{threads}");
    let mut book: serde_json::Map<String, serde_json::Value> =
        cache.and_then(|c| std::fs::read(c).ok()).and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    if !remeasure {
        if let Some(r) = book.get(&key).and_then(|v| serde_json::from_value::<Rates>(v.clone()).ok()) {
            return Ok(Rates { cached: true, ..r });
        }
    }
    let io = |block: usize, depth: usize| -> Result<f64> {
        let (bps, _) = sluice_experts::io::read_bandwidth(&file, block, depth, seconds, block > (1 << 17))
            .map_err(|e| RuntimeError::Input(format!("measuring {}: {e}", file.display())))?;
        Ok(bps / 1e9)
    };
    let r = Rates {
        memory_gb_s: memory_bandwidth(512 << 20, threads) / 1e9,
        disk_gb_s: io(slot_bytes.max(4096), 32)?,
        disk_small_gb_s: io(128 << 10, 2)?,
        threads,
        disk_file: file.display().to_string(),
        cached: false,
    };
    if let Some(c) = cache {
        book.insert(key, serde_json::to_value(&r).unwrap_or_default());
        if let Some(d) = c.parent() {
            let _ = std::fs::create_dir_all(d);
        }
        let _ = std::fs::write(c, serde_json::to_vec_pretty(&book).unwrap_or_default());
    }
    Ok(r)
}

/// Where a hit rate comes from.
#[derive(Clone, Debug, serde::Serialize)]
pub struct HitRate {
    pub rate: f64,
    /// `trace` (the trace replayed through an LRU cache of this many slots) or `uniform` (the
    /// share of the experts the cache holds: what routing with no locality gives).
    pub source: &'static str,
    pub slots: u64,
}

/// A routing trace's cache requests, checked against the model.
pub fn trace_requests(trace: &Path, sizes: &ModelSizes) -> Result<Vec<(u16, Vec<u16>)>> {
    let (h, recs) = sluice_experts::trace::read(trace).map_err(RuntimeError::Input)?;
    if h.n_expert as u64 * sizes.sparse_layers as u64 != sizes.experts || recs.is_empty() {
        return Err(RuntimeError::Input(format!(
            "{}: a trace of {} experts in {} layers ({} records) does not match this model",
            trace.display(),
            h.n_expert,
            h.n_layer,
            recs.len()
        )));
    }
    Ok(sluice_experts::trace::requests(&recs))
}

/// Hit rate of an LRU cache of `slots` slots: replaying `reqs` if given, else the uniform
/// estimate.
pub fn hit_rate(reqs: Option<&[(u16, Vec<u16>)]>, slots: u64, sizes: &ModelSizes) -> HitRate {
    let slots = slots.min(sizes.experts);
    let Some(reqs) = reqs else {
        let rate = if sizes.experts == 0 { 1.0 } else { slots as f64 / sizes.experts as f64 };
        return HitRate { rate, source: "uniform", slots };
    };
    let r = sluice_experts::trace::simulate_policy(reqs, sluice_experts::Policy::Lru, (slots as usize).max(1));
    HitRate { rate: r.hit_rate, source: "trace", slots }
}

/// What `fit` predicts.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Prediction {
    pub memory_bytes: u64,
    /// `resident` or `stream` (as `place` would decide with this much memory available).
    pub placement: &'static str,
    pub reason: String,
    pub quota_bytes: Option<u64>,
    pub hit_rate: Option<HitRate>,
    /// Bytes a decode step reads from memory (dense weights but the embedding table, and the
    /// token's experts), and from disk when streamed or mapped.
    pub memory_bytes_per_token: u64,
    pub stream_disk_bytes_per_token: Option<u64>,
    pub mmap_disk_bytes_per_token: Option<u64>,
    /// Upper bounds on decode tok/s: every expert in memory; streamed at the predicted quota;
    /// memory-mapped with the page cache holding what the dense weights leave.
    pub resident_tok_s: f64,
    pub stream_tok_s: Option<f64>,
    pub mmap_tok_s: Option<f64>,
    pub mmap_hit_rate: Option<HitRate>,
}

/// Predicts placement and decode bounds for `sizes` with `memory` bytes available.
pub fn predict(sizes: &ModelSizes, memory: u64, r: &Rates, trace: Option<&Path>) -> Result<Prediction> {
    let mem_bytes = sizes.dense_bytes.saturating_sub(sizes.embedding_bytes) + sizes.active_expert_bytes();
    let mem_time = mem_bytes as f64 / (r.memory_gb_s * 1e9);
    let resident_tok_s = 1.0 / mem_time.max(1e-12);
    let d = decide(ExpertMode::Auto, None, Some(memory), sizes.dense_bytes, sizes.expert_bytes, sizes.state_bytes)?;
    let mut p = Prediction {
        memory_bytes: memory,
        placement: "resident",
        reason: String::new(),
        quota_bytes: None,
        hit_rate: None,
        memory_bytes_per_token: mem_bytes,
        stream_disk_bytes_per_token: None,
        mmap_disk_bytes_per_token: None,
        resident_tok_s,
        stream_tok_s: None,
        mmap_tok_s: None,
        mmap_hit_rate: None,
    };
    match d {
        Decision::Resident { reason, .. } => p.reason = reason,
        Decision::Stream { quota } => {
            let slots = quota / sizes.slot_bytes.max(1);
            if slots == 0 {
                return Err(RuntimeError::Input(format!(
                    "it does not fit: {} GB available leaves no room for one expert beside {} GB of dense weights and state",
                    memory as f64 / 1e9,
                    (sizes.dense_bytes + sizes.state_bytes) as f64 / 1e9
                )));
            }
            let per_token_slots = (sizes.sparse_layers * sizes.experts_per_token) as f64;
            let reqs = trace.map(|t| trace_requests(t, sizes)).transpose()?;
            let h = hit_rate(reqs.as_deref(), slots, sizes);
            let disk = ((1.0 - h.rate) * per_token_slots * sizes.slot_bytes as f64) as u64;
            p.placement = "stream";
            p.reason = format!(
                "the model ({:.2} GB) does not fit in {:.2} GB with headroom; experts stream through a {:.2} GB cache",
                (sizes.dense_bytes + sizes.expert_bytes) as f64 / 1e9,
                memory as f64 / 1e9,
                quota as f64 / 1e9
            );
            p.quota_bytes = Some(quota);
            p.stream_tok_s = Some(1.0 / (mem_time + disk as f64 / (r.disk_gb_s * 1e9)));
            p.stream_disk_bytes_per_token = Some(disk);
            p.hit_rate = Some(h);
            // The page cache holds what the dense weights and state leave; it faults pages in
            // (with readahead) rather than reading whole experts.
            let page_cache = memory.saturating_sub(sizes.dense_bytes + sizes.state_bytes);
            let hm = hit_rate(reqs.as_deref(), page_cache / sizes.slot_bytes.max(1), sizes);
            let mdisk = ((1.0 - hm.rate) * sizes.active_expert_bytes() as f64) as u64;
            p.mmap_tok_s = Some(1.0 / (mem_time + mdisk as f64 / (r.disk_small_gb_s * 1e9)));
            p.mmap_disk_bytes_per_token = Some(mdisk);
            p.mmap_hit_rate = Some(hm);
        }
    }
    Ok(p)
}

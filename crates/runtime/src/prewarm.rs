//! Domain pre-warming: before the first token, fill the expert cache with the experts a
//! previous routing trace used most, so that a task like the traced one starts with a warm
//! cache. The output is unchanged (the cache only decides what is read when); what changes
//! is the time to the first tokens and their hit rate.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use std::path::Path;
use std::time::Instant;

/// What a prewarm did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Prewarmed {
    /// Distinct experts the trace used, and how many of them the cache now holds.
    pub in_trace: usize,
    pub resident: usize,
    /// Share of the trace's routing decisions the resident experts cover.
    pub coverage: f64,
    pub bytes_read: u64,
    pub seconds: f64,
}

/// The trace's experts, most used first (ties: lower layer, then lower id), with their counts.
pub fn ranked(trace: &Path, n_layer: usize, n_expert: usize) -> Result<Vec<((u32, u32), u64)>> {
    let (h, recs) = sluice_experts::trace::read(trace).map_err(RuntimeError::Input)?;
    if h.n_layer != n_layer || h.n_expert != n_expert {
        return Err(RuntimeError::Input(format!(
            "{}: recorded on a model of {} layers and {} experts; this one has {n_layer} and {n_expert}",
            trace.display(),
            h.n_layer,
            h.n_expert
        )));
    }
    let mut counts = std::collections::HashMap::<(u32, u32), u64>::new();
    for r in &recs {
        for e in &r.experts {
            *counts.entry((r.layer as u32, *e as u32)).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    Ok(v)
}

/// Warms `e`'s expert cache from `trace`. `None` when the experts are not streamed (resident
/// or mapped experts have no cache to warm).
pub fn prewarm(e: &mut Engine, trace: &Path) -> Result<Option<Prewarmed>> {
    let Some(s) = e.streaming.clone() else { return Ok(None) };
    let moe = e.model.cfg.moe.as_ref().ok_or_else(|| RuntimeError::Input("not an MoE model".into()))?;
    let ranked = ranked(trace, e.model.cfg.n_layer, moe.n_expert)?;
    let total: u64 = ranked.iter().map(|r| r.1).sum();
    let slots = s.quota() / s.slot_bytes().max(1);
    let take = ranked.len().min(slots);
    // Coldest first, hottest last: recency-based eviction then keeps the hottest longest.
    let keys: Vec<(u32, u32)> = ranked[..take].iter().rev().map(|r| r.0).collect();
    let before = e.model.experts.stats().bytes_read;
    let t0 = Instant::now();
    let resident = s.prewarm(&keys).map_err(|x| RuntimeError::Input(x.to_string()))?;
    let covered: u64 = ranked[..take].iter().map(|r| r.1).sum();
    let p = Prewarmed {
        in_trace: ranked.len(),
        resident,
        coverage: if total == 0 { 0.0 } else { covered as f64 / total as f64 },
        bytes_read: e.model.experts.stats().bytes_read - before,
        seconds: t0.elapsed().as_secs_f64(),
    };
    e.reset_stats_base();
    e.prewarmed = Some(p.clone());
    Ok(Some(p))
}

//! Pinned routing (lossy, opt-in): each routed layer may choose only among a fixed set of its
//! experts, as if the others had been pruned from the model — the router's top k is taken
//! over the allowed experts alone, and the weights are what the model's gating gives over
//! them. With the set resident, decoding reads no expert at all; the price is that the output
//! is no longer the model's. Nothing turns this on but `--pin-experts`, and everything that
//! reports on the run says it is on.

use crate::error::Result;
use crate::expert::{ExpertFetch, ExpertSource, ExpertStats};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct PinnedRouting {
    inner: Arc<dyn ExpertSource>,
    /// `[layer][expert]`: whether the router may choose it (empty for dense layers).
    allowed: Vec<Vec<bool>>,
    /// Experts allowed per routed layer.
    per_layer: usize,
    /// Off: the model's exact routing (a comparison against it, on the same weights).
    enabled: AtomicBool,
}

impl PinnedRouting {
    /// Restricts `inner`'s model to `allowed[layer]` (expert ids) in each routed layer.
    pub fn new(inner: Arc<dyn ExpertSource>, n_expert: usize, allowed: &[Vec<u32>]) -> PinnedRouting {
        let per_layer = allowed.iter().map(|a| a.len()).max().unwrap_or(0);
        let allowed = allowed
            .iter()
            .map(|a| {
                if a.is_empty() {
                    return Vec::new();
                }
                let mut m = vec![false; n_expert];
                for &e in a {
                    if let Some(x) = m.get_mut(e as usize) {
                        *x = true;
                    }
                }
                m
            })
            .collect();
        PinnedRouting { inner, allowed, per_layer, enabled: AtomicBool::new(true) }
    }

    /// Turns the restriction on or off (off: exact routing).
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::SeqCst)
    }

    pub fn per_layer(&self) -> usize {
        self.per_layer
    }
}

impl ExpertSource for PinnedRouting {
    fn fetch<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        self.inner.fetch(layer, experts)
    }

    fn fetch_resident<'s>(&'s self, layer: usize, experts: &[u32]) -> Result<Box<dyn ExpertFetch<'s> + 's>> {
        self.inner.fetch_resident(layer, experts)
    }

    fn route_mask(&self, layer: usize) -> Option<&[bool]> {
        if !self.enabled() {
            return None;
        }
        self.allowed.get(layer).filter(|m| !m.is_empty()).map(|m| m.as_slice())
    }

    fn wants_prefetch(&self, layer: usize) -> bool {
        self.inner.wants_prefetch(layer)
    }

    fn prefetch(&self, layer: usize, experts: &[u32]) {
        self.inner.prefetch(layer, experts)
    }

    fn resident_bytes(&self) -> usize {
        self.inner.resident_bytes()
    }

    fn expert_bytes(&self) -> usize {
        self.inner.expert_bytes()
    }

    fn describe(&self) -> String {
        format!(
            "{}; LOSSY pinned routing{}: each layer chooses among {} fixed experts only",
            self.inner.describe(),
            if self.enabled() { "" } else { " (off now)" },
            self.per_layer
        )
    }

    fn stats(&self) -> ExpertStats {
        self.inner.stats()
    }
}

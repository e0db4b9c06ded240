//! Self-speculation: the target model drafts for itself, each routed layer using only the
//! experts its cache holds at that moment (`CachedOnly`): the chosen experts that are not
//! resident are left out and the token's routing weights are scaled over the ones that are.
//! Drafting therefore reads nothing from the expert store, and it runs on the target's own
//! state — the context before the draft is exactly the target's — which is cut back to where
//! it was before the verify pass runs.
//!
//! The draft's routing is also a forecast: the experts it chose but had to leave out are the
//! ones the verify pass will most likely miss, so (with `guide`) they are handed to the
//! cache's prefetcher while the draft continues, and their reads overlap drafting instead of
//! stalling the verify pass. `report` says how many such hints the verify pass then used.

use super::draft::{draft_sampling, draw};
use super::verify::rewind_state;
use super::{Draft, Proposer, SpecMethod, SpecOptions};
use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::sampler::{Sampler, SamplerConfig};
use sluice_model::expert::CachedOnly;
use sluice_model::{Logits, Model, SeqState, Snapshot};
use std::collections::HashSet;

pub struct CachedDraft<'a> {
    model: &'a Model,
    view: CachedOnly<'a>,
    sampler: Sampler,
    p_min: f32,
    /// The hints of the last round, waiting for the verify pass's routing.
    hinted: Vec<(u32, u32)>,
    totals: Totals,
}

#[derive(Default)]
struct Totals {
    used: u64,
    left_out: u64,
    hinted: u64,
    /// Hints whose expert the verify pass then routed to (in the same layer).
    hinted_used: u64,
    /// Distinct experts the verify passes routed to, and how many of them had been hinted.
    verify_experts: u64,
}

impl<'a> CachedDraft<'a> {
    /// Drafts for `target` from its resident experts; `guide`: hint the left-out ones to the
    /// prefetcher.
    pub fn new(
        target: &'a Engine,
        sampling: &SamplerConfig,
        spec: &SpecOptions,
        guide: bool,
    ) -> Result<CachedDraft<'a>> {
        let model = &target.model;
        if model.cfg.moe.is_none() {
            return Err(RuntimeError::Input(format!(
                "{}: --spec self drafts with the experts the cache holds, and this model has no routed experts (use --spec ngram or draft)",
                target.path.display()
            )));
        }
        let cfg = draft_sampling(sampling, spec, 0x5851_F42D_4C95_7F2D);
        Ok(CachedDraft {
            model,
            view: CachedOnly::new(&*model.experts, guide),
            sampler: Sampler::new(cfg),
            p_min: spec.p_min,
            hinted: Vec::new(),
            totals: Totals::default(),
        })
    }

    /// Drafts up to `k` tokens after `context` on `kv` (which holds all of it but the last
    /// token); `kv` is left longer, for the caller to cut back.
    fn draft(&mut self, kv: &mut SeqState, context: &[u32], k: usize, out: &mut Draft) -> Result<()> {
        let mut tok = *context.last().expect("the context holds the prompt");
        for i in 0..k {
            if kv.len() + 1 >= kv.max_len() {
                out.stop = Some("context full");
                break;
            }
            let logits = self.model.forward_via(&self.view, kv, &[tok], Logits::Last)?;
            let (t, q, conf) = draw(&mut self.sampler, &logits);
            if conf < self.p_min as f64 {
                out.stop = Some("low draft confidence");
                break;
            }
            out.push(t, Some(q));
            tok = t;
            if i + 1 == k {
                break;
            }
        }
        Ok(())
    }
}

impl Proposer for CachedDraft<'_> {
    fn method(&self) -> SpecMethod {
        SpecMethod::Cached
    }

    fn propose(&mut self, _context: &[u32], _k: usize, out: &mut Draft) -> Result<()> {
        out.stop = Some("no target state to draft on");
        Ok(())
    }

    fn propose_on(
        &mut self,
        kv: &mut SeqState,
        snap: &mut Option<Snapshot>,
        context: &[u32],
        k: usize,
        out: &mut Draft,
    ) -> Result<()> {
        let t0 = std::time::Instant::now();
        let n0 = kv.len();
        if kv.rewinds_by_snapshot() {
            snap.get_or_insert_with(|| kv.snapshot());
        }
        let r = self.draft(kv, context, k, out);
        // Back to where the target was, whatever happened.
        if rewind_state(kv, n0, snap.as_ref())? != n0 {
            return Err(RuntimeError::Input(
                "internal: the target's state could not be cut back after drafting".into(),
            ));
        }
        let c = self.view.take_counts();
        self.totals.used += c.used;
        self.totals.left_out += c.left_out;
        self.totals.hinted += c.hinted.len() as u64;
        self.hinted = c.hinted;
        out.drafting_secs = Some(t0.elapsed().as_secs_f64());
        r
    }

    fn wants_routes(&self) -> bool {
        true
    }

    fn verified(&mut self, used: &HashSet<(u32, u32)>) {
        let hinted: HashSet<(u32, u32)> = std::mem::take(&mut self.hinted).into_iter().collect();
        self.totals.hinted_used += hinted.iter().filter(|h| used.contains(h)).count() as u64;
        self.totals.verify_experts += used.len() as u64;
    }

    fn accepted(&mut self, _kept: usize, _hidden: Option<&[f32]>) -> Result<()> {
        Ok(())
    }

    fn report(&self) -> Option<serde_json::Value> {
        let t = &self.totals;
        let share = |a: u64, b: u64| if b == 0 { serde_json::Value::Null } else { (a as f64 / b as f64).into() };
        Some(serde_json::json!({
            "draft_experts_run": t.used,
            "draft_experts_left_out": t.left_out,
            "draft_resident_share": share(t.used, t.used + t.left_out),
            "guided_prefetch": {
                "hinted": t.hinted,
                "used_by_verify": t.hinted_used,
                "precision": share(t.hinted_used, t.hinted),
                "verify_experts": t.verify_experts,
            },
        }))
    }
}

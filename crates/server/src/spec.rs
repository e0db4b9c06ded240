//! Speculative decoding in the server. A request that drafts proposes a few tokens to follow
//! its text — by looking up the latest n-gram of its text (prompt and output) earlier in that
//! text and taking what followed (`ngram`), with the server's draft model, a smaller model of
//! the same vocabulary run greedily on the request's own state (`draft`), with the
//! checkpoint's multi-token-prediction head fed the target's hidden rows of the request
//! (`mtp`), or with the target itself on the request's state, each routed layer using only the
//! experts the cache holds (`self`: drafting reads nothing, and the experts it had to leave
//! out are handed to the prefetcher for the verify pass) — and the batch step runs its last
//! token and the drafts as one item beside every other sequence's tokens;
//! the verifier keeps the drafts the target agrees with (`sluice_runtime::spec::verify`). A
//! verify pass's rows are the bits of plain decode's (the kernels are batch-invariant), so a
//! greedy request gets plain decode's tokens and log-probabilities exactly, and a sampled one
//! plain sampling's distribution (every proposer here drafts greedily, so deterministically:
//! the one-hot rejection rule applies).
//!
//! Draft length: a greedy request's adapts each round (the controller of `sluice run --spec`,
//! fed the step's wall time), since its tokens do not depend on it. A sampled request drafts
//! what the proposer gives up to its `draft_max`, a length that depends on its own text only:
//! what it draws from its generator, and so its output, is then the same alone or in any
//! batch and from run to run, which a length chosen from measured times would not be.

use sluice_model::{SeqState, Snapshot};
use sluice_runtime::spec::adapt::Adapt;
use sluice_runtime::spec::cached::CachedDraft;
use sluice_runtime::spec::draft::DraftModel;
use sluice_runtime::spec::mtp::MtpDrafter;
use sluice_runtime::spec::{ngram, Draft, Proposer, SpecMethod, SpecOptions};
use sluice_runtime::{Engine, SamplerConfig};
use std::sync::Arc;

/// The n-gram lengths looked up, longest first (those of `sluice run --spec ngram`).
const NGRAM_MIN: usize = 2;
const NGRAM_MAX: usize = 4;

/// Why this server cannot draft by `method` (`target` served, `draft` its draft model), if it
/// cannot: the one rule behind a request's 400 and a refused `--spec` default.
pub fn unavailable(method: SpecMethod, target: &Engine, draft: Option<&Engine>) -> Option<&'static str> {
    match method {
        SpecMethod::Draft if draft.is_none() => {
            Some("\"draft\" needs a draft model, and this server has none (`sluice serve --draft-model PATH`)")
        }
        SpecMethod::Cached if target.model.cfg.moe.is_none() => Some(
            "\"self\" drafts with the experts the cache holds, and this model has no routed experts (\"ngram\" works for any model)",
        ),
        SpecMethod::Mtp if target.model.mtp.is_none() => Some(if target.model.cfg.mtp.is_some() {
            "\"mtp\" needs the model's multi-token-prediction head, which this server did not load (`sluice serve --spec mtp` loads it)"
        } else {
            "\"mtp\" needs a multi-token-prediction head, and this model has none"
        }),
        _ => None,
    }
}

/// Where a sequence's drafts come from.
enum Source {
    Ngram,
    /// Its own state in the server's draft model (boxed: a state is large).
    Draft(Box<DraftModel>),
    /// The target's multi-token-prediction head, with a cache of its own for this sequence.
    Mtp(Box<MtpDrafter>),
    /// The target through the experts its cache holds, stopping below this confidence.
    Cached(f32),
    /// Not drafting: drafting failed on this sequence (it decodes plainly from then on), the
    /// model has no head for `mtp`, or a sampled request asked for `self`, whose drafts
    /// depend on what the cache holds, and so on the requests beside it: its output would no
    /// longer be the same bits alone and in a batch (greedy output does not depend on the
    /// drafts).
    Off,
}

/// A drafting sequence's speculation state.
pub struct SeqSpec {
    source: Source,
    /// The draft-length controller (greedy requests), else a fixed `draft_max`.
    adapt: Option<Adapt>,
    draft_max: usize,
    /// This step's verify item: the sequence's last token, then the drafts (just the last
    /// token when nothing is drafted).
    pub batch: Vec<u32>,
    /// The state's length before the step, and a snapshot there for states that rewind by
    /// snapshot (recurrent layers, sliding windows).
    pub start: usize,
    pub snap: Option<Snapshot>,
}

impl SeqSpec {
    /// Speculation by `method`: n-gram lookup, `draft` (`draft`: the server's draft model
    /// and the positions of this sequence's state in it), `mtp` (the target's head, with a
    /// cache of `max_len` positions) or `self`; a model drafting stops when its token's
    /// probability is below `p_min`.
    pub fn new(
        method: SpecMethod,
        draft_max: usize,
        greedy: bool,
        target: &Engine,
        draft: Option<&Arc<Engine>>,
        max_len: usize,
        p_min: f32,
    ) -> SeqSpec {
        let source = match (method, draft) {
            (SpecMethod::Draft, Some(d)) => Source::Draft(Box::new(DraftModel::greedy(d.clone(), max_len, p_min))),
            (SpecMethod::Mtp, _) if target.model.mtp.is_some() => {
                Source::Mtp(Box::new(MtpDrafter::new(&target.model, max_len, SamplerConfig::default(), p_min)))
            }
            (SpecMethod::Cached, _) if greedy => Source::Cached(p_min),
            (SpecMethod::Ngram, _) => Source::Ngram,
            _ => Source::Off,
        };
        SeqSpec {
            source,
            adapt: greedy.then(|| Adapt::new(0, draft_max, true)),
            draft_max,
            batch: Vec::new(),
            start: 0,
            snap: None,
        }
    }

    /// Whether the proposer reads the target's hidden rows (`feed`, `observe`): every
    /// position the target runs for this sequence, prompt included, must reach it.
    pub fn wants_hidden(&self) -> bool {
        matches!(self.source, Source::Mtp(_))
    }

    /// The target's final-normed hidden rows of positions it ran outside a verify step
    /// (prompt chunks, plain decode steps), in order.
    pub fn feed(&mut self, hidden: &[f32]) {
        if let Source::Mtp(m) = &mut self.source {
            if m.accepted(hidden).is_err() {
                self.source = Source::Off;
            }
        }
    }

    /// Plans a step: `batch` becomes the last generated token and up to `room` drafts to
    /// follow `prompt` + `generated`, `state` (of `target`) holding all of it but the last
    /// token; `state` is as it was after (a snapshot at its length may be left in `snap`).
    /// Returns how many were drafted.
    pub fn plan(
        &mut self,
        target: &Engine,
        state: &mut SeqState,
        prompt: &[u32],
        generated: &[u32],
        room: usize,
    ) -> usize {
        let k = match self.adapt.as_mut() {
            Some(a) => a.choose(room).0,
            None => self.draft_max.min(room),
        };
        self.batch.clear();
        self.batch.push(*generated.last().expect("a decoding sequence has generated a token"));
        self.snap = None;
        if k == 0 {
            return 0;
        }
        let ctx: Vec<u32> = prompt.iter().chain(generated).copied().collect();
        let mut d = Draft::default();
        let r = match &mut self.source {
            Source::Ngram => {
                d.tokens.extend_from_slice(ngram::lookup(&ctx, NGRAM_MIN, NGRAM_MAX, k));
                Ok(())
            }
            Source::Draft(m) => m.propose(&ctx, k, &mut d),
            Source::Mtp(m) => m.propose(&target.model, &ctx, k, &mut d),
            Source::Cached(p_min) => {
                let so = SpecOptions { p_min: *p_min, ..Default::default() };
                CachedDraft::new(target, &SamplerConfig::default(), &so, true)
                    .and_then(|mut c| c.propose_on(state, &mut self.snap, &ctx, k, &mut d))
            }
            Source::Off => Ok(()),
        };
        match r {
            Ok(()) => self.batch.extend_from_slice(&d.tokens[..d.tokens.len().min(k)]),
            Err(e) => {
                eprintln!("sluice: drafting failed on a request ({e}); it decodes without drafts");
                self.source = Source::Off;
            }
        }
        self.batch.len() - 1
    }

    /// The drafts of this step (none before a step is planned and after it is verified).
    pub fn drafts(&self) -> &[u32] {
        self.batch.get(1..).unwrap_or(&[])
    }

    /// Tells the proposer and the controller how the step went: `drafted` drafts, `kept` of
    /// them kept, the step took `secs`; `hidden` holds the target's rows of the positions the
    /// sequence keeps (when `wants_hidden`).
    pub fn observe(&mut self, drafted: usize, kept: usize, secs: f64, hidden: &[f32]) {
        if let Some(a) = self.adapt.as_mut() {
            a.observe(drafted, kept, secs, 0.0);
        }
        let r = match &mut self.source {
            Source::Draft(m) => m.accepted(kept, None),
            Source::Mtp(m) => m.accepted(hidden),
            _ => Ok(()),
        };
        if r.is_err() {
            self.source = Source::Off;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_last_ngram_within_the_room() {
        // Any model: n-gram lookup reads only the text.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/qwen3_moe");
        let e = Engine::load(&dir, sluice_runtime::EngineOptions { threads: 1, ..Default::default() }).unwrap();
        let mut st = e.new_state();
        // "5 6" was followed by "7 8 9 2" in the prompt.
        let prompt = [1, 5, 6, 7, 8, 9, 2, 3];
        let mut s = SeqSpec::new(SpecMethod::Ngram, 4, false, &e, None, 0, 0.5);
        let mut plan = |s: &mut SeqSpec, generated: &[u32], room| s.plan(&e, &mut st, &prompt, generated, room);
        assert_eq!(plan(&mut s, &[5, 6], 8), 4);
        assert_eq!(s.batch, vec![6, 7, 8, 9, 2]);
        assert_eq!(s.drafts(), &[7, 8, 9, 2]);
        // The room (max_tokens, context) bounds the drafts; no room: no drafts.
        assert_eq!(plan(&mut s, &[5, 6], 2), 2);
        assert_eq!(s.batch, vec![6, 7, 8]);
        assert_eq!(plan(&mut s, &[5, 6], 0), 0);
        assert_eq!(s.batch, vec![6]);
        // Nothing to look up.
        assert_eq!(plan(&mut s, &[42], 8), 0);
    }
}

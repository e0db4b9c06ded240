//! Speculative decoding: a proposer guesses the next few tokens, the target model runs the
//! last token and the guesses in one forward pass, and keeps the guesses it would have
//! produced itself, plus one token of its own.
//!
//! ```text
//! pending token t (sampled, not yet run), drafts d1..dk from the proposer
//! target pass over [t, d1, …, dk]  →  k + 1 rows of logits (row i follows d_i)
//! for i in 1..=k: keep d_i by the acceptance rule on row i−1; at the first refusal draw
//!   a replacement from that row and stop; if all are kept, draw one more from row k
//! cut the target's state back to [t, kept drafts] (verify.rs), tell the proposer
//! ```
//!
//! Output is lossless:
//!
//! * greedy: the tokens and the logits each was chosen from are the bits plain decoding
//!   gives (the forward pass is batch-invariant: a pass over k + 1 tokens gives each row the
//!   bits of k + 1 one-token passes; `tests/spec.rs` checks it for every state kind);
//! * sampling: the acceptance rule (verify.rs) makes every token distributed exactly as
//!   plain sampling's, with the same temperature, top-k, top-p, min-p and penalties (the
//!   target distribution is the sampler's own `candidates`). Seeds: a speculative run with a
//!   given seed is reproducible, and its output follows the same distribution as plain
//!   sampling, but it draws from the generator in another order (acceptance tests and
//!   replacements), so individual samples differ from plain sampling's with that seed.
//!
//! The prompt's last token is run by the first verify pass, so the first generated token is
//! speculated like the others.
//!
//! Proposers, one per file: n-gram lookup over the text so far (`ngram.rs`), a smaller draft
//! model (`draft.rs`), the checkpoint's multi-token-prediction head (`mtp.rs`), the target
//! itself through the experts its cache holds (`cached.rs`). How many tokens to draft each
//! round is chosen in `adapt.rs`.

pub mod adapt;
pub mod cached;
pub mod draft;
pub mod mtp;
pub mod ngram;
pub mod verify;

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::{GenerateOptions, Generation, StopReason};
use crate::sampler::{Candidates, Sampler};
use sluice_model::{Logits, SeqState, Snapshot};
use std::collections::{BTreeMap, HashSet};
use std::time::Instant;
pub use verify::Acceptance;

/// Where drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecMethod {
    Ngram,
    Draft,
    Mtp,
    /// The target model itself, each routed layer using only the experts resident in its
    /// cache (`--spec self`).
    Cached,
}

impl SpecMethod {
    pub fn parse(s: &str) -> std::result::Result<SpecMethod, String> {
        match s {
            "ngram" | "lookup" => Ok(SpecMethod::Ngram),
            "draft" => Ok(SpecMethod::Draft),
            "mtp" => Ok(SpecMethod::Mtp),
            "self" => Ok(SpecMethod::Cached),
            o => Err(format!("unknown --spec `{o}` (ngram, draft, mtp, self)")),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SpecMethod::Ngram => "ngram",
            SpecMethod::Draft => "draft",
            SpecMethod::Mtp => "mtp",
            SpecMethod::Cached => "self",
        }
    }
}

#[derive(Clone, Debug)]
pub struct SpecOptions {
    /// The most tokens drafted per round.
    pub draft_max: usize,
    /// The fewest tokens worth verifying: shorter drafts are dropped, and the adaptive choice
    /// never goes below it (0: it may decode plainly when drafting does not pay).
    pub draft_min: usize,
    /// Choose the draft length from measured acceptance and verify cost (else `draft_max`).
    pub adaptive: bool,
    /// A draft model or head stops drafting when its token's probability is below this.
    pub p_min: f32,
    /// N-gram sizes tried by the lookup proposer, longest first.
    pub ngram_min: usize,
    pub ngram_max: usize,
    /// The draft model's (or head's) sampling temperature, if not the target's.
    pub draft_temperature: Option<f32>,
    /// `--spec self`: hand the experts a draft chose but did not have to the prefetcher.
    pub guide_prefetch: bool,
    #[doc(hidden)]
    pub acceptance: Acceptance,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            draft_max: 16,
            draft_min: 0,
            adaptive: true,
            p_min: 0.5,
            ngram_min: 2,
            ngram_max: 4,
            draft_temperature: None,
            guide_prefetch: true,
            acceptance: Acceptance::Exact,
        }
    }
}

impl SpecOptions {
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.draft_max == 0 {
            return Err("--draft-max must be at least 1 (leave out --spec to decode without drafts)".into());
        }
        if self.draft_max > 64 {
            return Err(format!("--draft-max {} is more than the 64 this supports", self.draft_max));
        }
        if self.draft_min > self.draft_max {
            return Err(format!("--draft-min {} is more than --draft-max {}", self.draft_min, self.draft_max));
        }
        if !(0.0..=1.0).contains(&self.p_min) {
            return Err(format!("--draft-p-min must be in [0, 1], got {}", self.p_min));
        }
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return Err(format!("n-gram sizes must satisfy 1 ≤ min ≤ max, got {}..{}", self.ngram_min, self.ngram_max));
        }
        if let Some(t) = self.draft_temperature {
            if !(t >= 0.0 && t.is_finite()) {
                return Err(format!("the draft temperature must be a finite number ≥ 0, got {t}"));
            }
        }
        Ok(())
    }
}

/// A proposal: tokens and, per token, the distribution it was drawn from (`None`: chosen
/// deterministically).
#[derive(Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub dists: Vec<Option<Candidates>>,
    /// Why it stopped before the length asked for, if it did.
    pub stop: Option<&'static str>,
    /// Seconds spent drawing the drafted tokens, where the proposer tells them apart from
    /// catching up on the tokens before (which the draft-length choice does not charge per
    /// drafted token).
    pub drafting_secs: Option<f64>,
}

impl Draft {
    pub fn push(&mut self, token: u32, dist: Option<Candidates>) {
        self.tokens.push(token);
        self.dists.push(dist);
    }

    fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.dists.truncate(n);
    }
}

/// A source of draft tokens. It keeps its own state; the verifier tells it after each round
/// how many of its tokens were kept.
pub trait Proposer {
    fn method(&self) -> SpecMethod;

    /// Whether it reads the target's final hidden states (`start`, `accepted`).
    fn wants_hidden(&self) -> bool {
        false
    }

    /// A new sequence: the target ran every prompt token but the last (`prompt_head`);
    /// `prompt_hidden` holds their hidden rows when `wants_hidden`.
    fn start(&mut self, _prompt_head: &[u32], _prompt_hidden: Option<&[f32]>) -> Result<()> {
        Ok(())
    }

    /// Up to `k` tokens to follow `context` (every token so far; the target has run all but
    /// the last).
    fn propose(&mut self, context: &[u32], k: usize, out: &mut Draft) -> Result<()>;

    /// `propose`, given the target's state (which holds every token of `context` but the
    /// last): a proposer that drafts with the target model itself may run positions on it,
    /// and must leave it as it found it. `snap` is the state's snapshot at its current
    /// length, shared with the verify pass: a proposer that needs one to rewind takes it
    /// there (`get_or_insert_with`), so it is taken once a round. The default ignores both.
    fn propose_on(
        &mut self,
        _kv: &mut SeqState,
        _snap: &mut Option<Snapshot>,
        context: &[u32],
        k: usize,
        out: &mut Draft,
    ) -> Result<()> {
        self.propose(context, k, out)
    }

    /// Whether it wants to see which experts each verify pass routed to (`verified`).
    fn wants_routes(&self) -> bool {
        false
    }

    /// The (layer, expert) pairs the last verify pass routed to.
    fn verified(&mut self, _used: &HashSet<(u32, u32)>) {}

    /// What it has to say about itself for `--stats`.
    fn report(&self) -> Option<serde_json::Value> {
        None
    }

    /// The target kept `kept` tokens of the last proposal (none if there was none) and drew
    /// one of its own after them. `hidden`: the target's hidden rows of the `1 + kept`
    /// positions it ran and kept, when `wants_hidden`.
    fn accepted(&mut self, kept: usize, hidden: Option<&[f32]>) -> Result<()>;
}

/// What a speculative run did.
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    pub method: &'static str,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Draft tokens kept.
    pub accepted: u64,
    /// Verify passes.
    pub rounds: u64,
    /// Sum of the draft lengths chosen (before the proposer had its say).
    pub chosen_sum: u64,
    /// Rounds per chosen draft length.
    pub chosen: BTreeMap<usize, u64>,
    /// Rounds per reason for the chosen length.
    pub reasons: BTreeMap<&'static str, u64>,
    /// Proposals per reason they stopped short.
    pub stops: BTreeMap<&'static str, u64>,
    /// Per draft position: (times verified, times kept).
    pub by_position: Vec<(u64, u64)>,
    /// Rounds whose rewind restored a snapshot and ran kept tokens again.
    pub reruns: u64,
    pub draft_secs: f64,
    pub verify_secs: f64,
    /// Expert-cache misses during verify passes (streamed experts).
    pub verify_misses: u64,
    /// The adaptive controller's estimates at the end.
    pub estimates: serde_json::Value,
    /// The proposer's own report, if it has one (`--spec self`: the experts its drafts ran
    /// and left out, and the precision of its prefetch hints).
    pub proposer: serde_json::Value,
}

impl SpecStats {
    /// Mean draft tokens verified per round.
    pub fn mean_k(&self) -> f64 {
        self.drafted as f64 / self.rounds.max(1) as f64
    }

    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Generated tokens per verify pass.
    pub fn tokens_per_pass(&self) -> f64 {
        (self.accepted + self.rounds) as f64 / self.rounds.max(1) as f64
    }

    /// The summary `--json` reports.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "method": self.method,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "mean_k": self.mean_k(),
        })
    }

    /// Everything, for `--stats`.
    pub fn details(&self) -> serde_json::Value {
        let mut v = self.json();
        v["acceptance"] = self.acceptance().into();
        v["tokens_per_pass"] = self.tokens_per_pass().into();
        v["mean_k_chosen"] = (self.chosen_sum as f64 / self.rounds.max(1) as f64).into();
        v["chosen_k"] = self
            .chosen
            .iter()
            .map(|(k, n)| (k.to_string(), serde_json::json!(n)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        v["k_reasons"] = self
            .reasons
            .iter()
            .map(|(k, n)| (k.to_string(), serde_json::json!(n)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        v["draft_stops"] = self
            .stops
            .iter()
            .map(|(k, n)| (k.to_string(), serde_json::json!(n)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        v["accepted_by_position"] =
            self.by_position.iter().map(|(d, a)| serde_json::json!([d, a])).collect::<Vec<_>>().into();
        v["reruns"] = self.reruns.into();
        v["draft_s"] = self.draft_secs.into();
        v["verify_s"] = self.verify_secs.into();
        v["verify_misses"] = self.verify_misses.into();
        v["estimates"] = self.estimates.clone();
        if !self.proposer.is_null() {
            v["proposer"] = self.proposer.clone();
        }
        v
    }

    /// A few lines for humans.
    pub fn lines(&self) -> String {
        let mut s = format!(
            "spec {}: {} rounds, {} drafted, {} kept ({:.1}%), {:.2} tokens per target pass, mean k {:.2} (chosen {:.2}); draft {:.3} s, verify {:.3} s, {} rewinds by re-running",
            self.method,
            self.rounds,
            self.drafted,
            self.accepted,
            100.0 * self.acceptance(),
            self.tokens_per_pass(),
            self.mean_k(),
            self.chosen_sum as f64 / self.rounds.max(1) as f64,
            self.draft_secs,
            self.verify_secs,
            self.reruns
        );
        let list =
            |m: &BTreeMap<&'static str, u64>| m.iter().map(|(k, n)| format!("{k} ×{n}")).collect::<Vec<_>>().join(", ");
        s.push_str(&format!(
            "\n  chosen k: {}",
            self.chosen.iter().map(|(k, n)| format!("{k}×{n}")).collect::<Vec<_>>().join(" ")
        ));
        s.push_str(&format!("\n  why: {}", list(&self.reasons)));
        if !self.stops.is_empty() {
            s.push_str(&format!("\n  drafts cut short: {}", list(&self.stops)));
        }
        if let Some(g) = self.proposer.get("guided_prefetch") {
            let run = self.proposer["draft_experts_run"].as_u64().unwrap_or(0);
            let out = self.proposer["draft_experts_left_out"].as_u64().unwrap_or(0);
            s.push_str(&format!(
                "\n  drafts ran {run} resident experts and left out {out}; {} left-out experts hinted to the prefetcher, {} of them used by the verify pass",
                g["hinted"], g["used_by_verify"]
            ));
        }
        if self.verify_misses > 0 {
            s.push_str(&format!(
                "\n  expert misses in verify passes: {:.1} per pass",
                self.verify_misses as f64 / self.rounds.max(1) as f64
            ));
        }
        s
    }
}

/// Builds the proposer `method` names. `draft` is the loaded draft model for `Draft`.
pub fn proposer<'a>(
    method: SpecMethod,
    target: &'a Engine,
    draft: Option<Engine>,
    opts: &GenerateOptions,
    spec: &SpecOptions,
) -> Result<Box<dyn Proposer + 'a>> {
    spec.validate().map_err(RuntimeError::Input)?;
    Ok(match method {
        SpecMethod::Ngram => Box::new(ngram::NgramProposer::new(spec.ngram_min, spec.ngram_max)),
        SpecMethod::Draft => {
            let d = draft.ok_or_else(|| RuntimeError::Input("--spec draft needs --draft-model PATH".into()))?;
            Box::new(draft::DraftModel::new(d, target, &opts.sampler, spec)?)
        }
        SpecMethod::Mtp => Box::new(mtp::MtpProposer::new(target, &opts.sampler, spec)?),
        SpecMethod::Cached => Box::new(cached::CachedDraft::new(target, &opts.sampler, spec, spec.guide_prefetch)?),
    })
}

/// `generate` with speculative decoding: the same tokens as plain greedy decoding, or tokens
/// distributed as plain sampling's (see the module's documentation). `on_step` sees each new
/// token with the row of logits it was chosen from, and returns false to stop.
pub fn generate_spec(
    engine: &Engine,
    kv: &mut SeqState,
    prompt: &[u32],
    opts: &GenerateOptions,
    spec: &SpecOptions,
    proposer: &mut dyn Proposer,
    on_step: &mut dyn FnMut(u32, &[f32]) -> bool,
) -> Result<(Generation, SpecStats)> {
    opts.sampler.validate().map_err(RuntimeError::Input)?;
    spec.validate().map_err(RuntimeError::Input)?;
    if prompt.is_empty() {
        return Err(RuntimeError::Input("the prompt is empty".into()));
    }
    kv.reset();
    let model = &engine.model;
    let (vocab, hd) = (model.cfg.vocab_size, model.cfg.hidden);
    let t0 = Instant::now();
    // Every prompt token but the last: the first verify pass runs it.
    let head = &prompt[..prompt.len() - 1];
    let want = if proposer.wants_hidden() { Logits::HiddenOnly } else { Logits::None };
    let mut prompt_hidden = Vec::new();
    for c in head.chunks(opts.prefill_chunk.max(1)) {
        let (_, h) = model.forward_hidden(kv, c, want, None)?;
        prompt_hidden.extend(h);
    }
    proposer.start(head, proposer.wants_hidden().then_some(&prompt_hidden[..]))?;
    drop(prompt_hidden);
    let prefill_secs = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut stats = SpecStats {
        method: proposer.method().as_str(),
        by_position: vec![(0, 0); spec.draft_max],
        ..Default::default()
    };
    let mut adapt = adapt::Adapt::new(spec.draft_min, spec.draft_max, spec.adaptive);
    let mut sampler = Sampler::new(opts.sampler.clone());
    let mut ctx: Vec<u32> = prompt.to_vec();
    let mut tokens = Vec::new();
    let mut stop = StopReason::Length;
    let mut draft = Draft::default();
    let misses = || model.experts.stats().misses;
    'rounds: while tokens.len() < opts.max_new_tokens && kv.len() < kv.max_len() {
        // Room for drafts: the round yields up to k + 1 tokens and runs k + 1 positions.
        let room = (opts.max_new_tokens - tokens.len() - 1).min(kv.max_len() - kv.len() - 1);
        let (k, why) = adapt.choose(room);
        stats.rounds += 1;
        stats.chosen_sum += k as u64;
        *stats.chosen.entry(k).or_default() += 1;
        *stats.reasons.entry(why).or_default() += 1;
        draft.truncate(0);
        draft.stop = None;
        draft.drafting_secs = None;
        let td = Instant::now();
        // The snapshot a rewind by snapshot restores, at the length before the round.
        let mut snap = None;
        if k > 0 {
            proposer.propose_on(kv, &mut snap, &ctx, k, &mut draft)?;
            draft.truncate(k);
            if draft.tokens.len() < spec.draft_min.min(k) {
                draft.stop.get_or_insert("shorter than --draft-min");
                draft.truncate(0);
            }
            if let Some(s) = draft.stop {
                *stats.stops.entry(s).or_default() += 1;
            }
        }
        let draft_s = td.elapsed().as_secs_f64();
        let kd = draft.tokens.len();

        // Verify.
        let tv = Instant::now();
        let m0 = misses();
        let n0 = kv.len();
        if kd > 0 && kv.rewinds_by_snapshot() && snap.is_none() {
            snap = Some(kv.snapshot());
        }
        let mut batch = Vec::with_capacity(kd + 1);
        batch.push(*ctx.last().expect("the context holds the prompt"));
        batch.extend_from_slice(&draft.tokens);
        let mut routes = RouteSet::default();
        let obs: Option<&mut dyn sluice_model::trace::Observer> =
            if proposer.wants_routes() { Some(&mut routes) } else { None };
        let (rows, hidden) = model.forward_hidden(kv, &batch, Logits::All, obs)?;
        if proposer.wants_routes() {
            proposer.verified(&routes.0);
        }
        let mut out: Vec<(u32, usize)> = Vec::with_capacity(kd + 1);
        for i in 0..=kd {
            let p = sampler.candidates(&rows[i * vocab..(i + 1) * vocab]);
            if i < kd {
                let x = draft.tokens[i];
                let q = draft.dists[i].as_ref();
                stats.by_position[i].0 += 1;
                if verify::accept(&mut sampler, &p, x, q, spec.acceptance) {
                    stats.by_position[i].1 += 1;
                    sampler.record(x);
                    out.push((x, i));
                    continue;
                }
                let y = sampler.draw(&verify::residual(&p, x, q));
                sampler.record(y);
                out.push((y, i));
                break;
            }
            let y = sampler.draw(&p);
            sampler.record(y);
            out.push((y, i));
        }
        let kept = out.len() - 1;
        if verify::rewind_target(engine, kv, n0 + 1 + kept, snap.as_ref(), &batch)? {
            stats.reruns += 1;
        }
        let verify_s = tv.elapsed().as_secs_f64();
        stats.verify_misses += misses() - m0;
        stats.drafted += kd as u64;
        stats.accepted += kept as u64;
        stats.draft_secs += draft_s;
        stats.verify_secs += verify_s;
        adapt.observe(kd, kept, verify_s, draft.drafting_secs.unwrap_or(draft_s));
        proposer.accepted(kept, proposer.wants_hidden().then(|| &hidden[..(kept + 1) * hd]))?;

        for (t, row) in out {
            ctx.push(t);
            tokens.push(t);
            if !on_step(t, &rows[row * vocab..(row + 1) * vocab]) {
                stop = StopReason::Cancelled;
                break 'rounds;
            }
            if (!opts.ignore_eos && engine.eos.contains(&t)) || opts.stop_tokens.contains(&t) {
                stop = StopReason::Eos;
                break 'rounds;
            }
            if tokens.len() == opts.max_new_tokens {
                break 'rounds;
            }
        }
    }
    stats.estimates = adapt.summary();
    stats.proposer = proposer.report().unwrap_or_default();
    let g = Generation {
        tokens,
        stop,
        prompt_tokens: prompt.len(),
        reused_tokens: 0,
        prefill_secs,
        decode_secs: t1.elapsed().as_secs_f64(),
    };
    Ok((g, stats))
}

/// The (layer, expert) pairs a pass routed to.
#[derive(Default)]
struct RouteSet(HashSet<(u32, u32)>);

impl sluice_model::trace::Observer for RouteSet {
    fn routing(&mut self, layer: usize, _pos: usize, experts: &[u32], _weights: &[f32]) {
        self.0.extend(experts.iter().map(|e| (layer as u32, *e)));
    }
}

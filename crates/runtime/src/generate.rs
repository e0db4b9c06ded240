//! The generation loop: prefill the prompt in chunks, then sample and decode one token at a
//! time until a stop token or the token budget.
//!
//! `generate_cached` keeps a sequence's state between calls (a chat's turns): when the new
//! prompt extends the tokens whose state is held, only the new tokens run; otherwise the
//! state goes back to the first position that differs (attention state is cut there; a
//! recurrent state returns to the snapshot taken at the end of the previous prompt, or to the
//! start when the prompts part before it) and runs from there.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::sampler::{Sampler, SamplerConfig};
use sluice_model::trace::Observer;
use sluice_model::{Logits, SeqState, Snapshot};
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Keep going past end-of-sequence tokens (benchmarks, goldens).
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass during prefill (results do not depend on it).
    pub prefill_chunk: usize,
    /// More tokens that stop generation, besides the model's end-of-sequence tokens (a chat
    /// template's end of turn). Not affected by `ignore_eos`.
    pub stop_tokens: Vec<u32>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 128,
            sampler: SamplerConfig::default(),
            ignore_eos: false,
            prefill_chunk: 256,
            stop_tokens: Vec::new(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    Length,
    /// The caller's callback asked to stop.
    Cancelled,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length => "length",
            StopReason::Cancelled => "cancelled",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose state was kept from an earlier call (`generate_cached`), not run.
    pub reused_tokens: usize,
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

impl Generation {
    /// Prefill rate over the prompt tokens that were run.
    pub fn prefill_tok_s(&self) -> f64 {
        (self.prompt_tokens - self.reused_tokens) as f64 / self.prefill_secs.max(1e-9)
    }

    /// Decode rate over the tokens that needed a forward pass of their own.
    pub fn decode_tok_s(&self) -> f64 {
        let steps = self.tokens.len().saturating_sub(1);
        steps as f64 / self.decode_secs.max(1e-9)
    }
}

/// A shorter-lived handle on an optional observer.
fn reborrow<'a>(o: &'a mut Option<&mut dyn Observer>) -> Option<&'a mut dyn Observer> {
    match o {
        Some(x) => Some(&mut **x),
        None => None,
    }
}

/// Runs `prompt` through the model at the start of `kv` and returns the last position's logits.
pub fn prefill(
    engine: &Engine,
    kv: &mut SeqState,
    prompt: &[u32],
    chunk: usize,
    mut obs: Option<&mut dyn Observer>,
) -> Result<Vec<f32>> {
    if prompt.is_empty() {
        return Err(RuntimeError::Input("the prompt is empty".into()));
    }
    let chunk = chunk.max(1);
    let mut logits = Vec::new();
    for (i, c) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        logits = engine.model.forward(kv, c, if last { Logits::Last } else { Logits::None }, reborrow(&mut obs))?;
    }
    Ok(logits)
}

/// Generates after `prompt` (the cache is reset first). `on_token` sees each new token and
/// returns false to stop; `obs`, if given, sees every intermediate and routing decision.
pub fn generate(
    engine: &Engine,
    kv: &mut SeqState,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
    mut obs: Option<&mut dyn Observer>,
) -> Result<Generation> {
    opts.sampler.validate().map_err(RuntimeError::Input)?;
    kv.reset();
    let t0 = Instant::now();
    let logits = prefill(engine, kv, prompt, opts.prefill_chunk, reborrow(&mut obs))?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let (tokens, stop, decode_secs) = decode(engine, kv, logits, opts, on_token, obs)?;
    Ok(Generation { tokens, stop, prompt_tokens: prompt.len(), reused_tokens: 0, prefill_secs, decode_secs })
}

/// Samples from `logits` and decodes token by token: (tokens, why it stopped, seconds).
fn decode(
    engine: &Engine,
    kv: &mut SeqState,
    mut logits: Vec<f32>,
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
    mut obs: Option<&mut dyn Observer>,
) -> Result<(Vec<u32>, StopReason, f64)> {
    let mut sampler = Sampler::new(opts.sampler.clone());
    let mut tokens = Vec::new();
    let mut stop = StopReason::Length;
    let t1 = Instant::now();
    while tokens.len() < opts.max_new_tokens {
        let tok = sampler.sample(&logits);
        tokens.push(tok);
        if !on_token(tok) {
            stop = StopReason::Cancelled;
            break;
        }
        if (!opts.ignore_eos && engine.eos.contains(&tok)) || opts.stop_tokens.contains(&tok) {
            stop = StopReason::Eos;
            break;
        }
        if tokens.len() == opts.max_new_tokens {
            break;
        }
        if kv.len() >= kv.max_len() {
            break;
        }
        logits = engine.model.forward(kv, &[tok], Logits::Last, reborrow(&mut obs))?;
    }
    Ok((tokens, stop, t1.elapsed().as_secs_f64()))
}

/// The tokens whose state a `SeqState` holds, kept beside it between `generate_cached` calls,
/// and for a state with recurrent layers a snapshot at the end of the last prompt.
#[derive(Default)]
pub struct PromptCache {
    tokens: Vec<u32>,
    snapshot: Option<Snapshot>,
}

impl PromptCache {
    pub fn new() -> PromptCache {
        PromptCache::default()
    }

    /// The tokens whose state is held.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Forgets everything (the state must be reset with it).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.snapshot = None;
    }
}

/// Like `generate`, but keeps what `kv` already holds of `prompt` (see the module's
/// documentation). `kv` must be the state `cache` describes: fresh for an empty cache.
/// Results are the bits `generate` gives for the same prompt.
pub fn generate_cached(
    engine: &Engine,
    kv: &mut SeqState,
    cache: &mut PromptCache,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
    mut obs: Option<&mut dyn Observer>,
) -> Result<Generation> {
    opts.sampler.validate().map_err(RuntimeError::Input)?;
    if prompt.is_empty() {
        return Err(RuntimeError::Input("the prompt is empty".into()));
    }
    if cache.tokens.len() != kv.len() {
        kv.reset();
        cache.clear();
    }
    let r = (|| {
        let t0 = Instant::now();
        let keep = rewind(kv, cache, prompt)?;
        let logits = prefill(engine, kv, &prompt[keep..], opts.prefill_chunk, reborrow(&mut obs))?;
        cache.tokens.clear();
        cache.tokens.extend_from_slice(prompt);
        cache.snapshot = kv.has_recurrent().then(|| kv.snapshot());
        let prefill_secs = t0.elapsed().as_secs_f64();
        let (tokens, stop, decode_secs) = decode(engine, kv, logits, opts, on_token, reborrow(&mut obs))?;
        // The state holds every generated token but the last (never run).
        cache.tokens.extend_from_slice(&tokens);
        cache.tokens.truncate(kv.len());
        Ok(Generation { tokens, stop, prompt_tokens: prompt.len(), reused_tokens: keep, prefill_secs, decode_secs })
    })();
    if r.is_err() {
        kv.reset();
        cache.clear();
    }
    r
}

/// Brings `kv` back to the longest prefix of `prompt` it can keep (at least one prompt token is
/// left to run, for the logits); returns that prefix's length.
fn rewind(kv: &mut SeqState, cache: &mut PromptCache, prompt: &[u32]) -> Result<usize> {
    let common = cache.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
    let keep = common.min(prompt.len() - 1);
    if keep == kv.len() {
        return Ok(keep);
    }
    if !kv.has_recurrent() {
        kv.truncate(keep)?;
        cache.tokens.truncate(keep);
        return Ok(keep);
    }
    match &cache.snapshot {
        Some(s) if s.len() <= keep && s.len() <= kv.len() => {
            kv.restore(s)?;
            cache.tokens.truncate(s.len());
            Ok(s.len())
        }
        _ => {
            kv.reset();
            cache.clear();
            Ok(0)
        }
    }
}

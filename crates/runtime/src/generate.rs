//! The generation loop: prefill the prompt in chunks, then sample and decode one token at a
//! time until a stop token or the token budget.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::sampler::{Sampler, SamplerConfig};
use sluice_model::trace::Observer;
use sluice_model::{Logits, SeqState};
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    pub sampler: SamplerConfig,
    /// Keep going past end-of-sequence tokens (benchmarks, goldens).
    pub ignore_eos: bool,
    /// Prompt tokens per forward pass during prefill (results do not depend on it).
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 128,
            sampler: SamplerConfig::default(),
            ignore_eos: false,
            prefill_chunk: 256,
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
    pub prefill_secs: f64,
    pub decode_secs: f64,
}

impl Generation {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_secs.max(1e-9)
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
    let mut logits = prefill(engine, kv, prompt, opts.prefill_chunk, reborrow(&mut obs))?;
    let prefill_secs = t0.elapsed().as_secs_f64();
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
        if !opts.ignore_eos && engine.eos.contains(&tok) {
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
    Ok(Generation { tokens, stop, prompt_tokens: prompt.len(), prefill_secs, decode_secs: t1.elapsed().as_secs_f64() })
}

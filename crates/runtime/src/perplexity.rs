//! Perplexity with llama.cpp's `llama-perplexity` chunking, so the numbers compare: the token
//! stream is cut into chunks of `ctx` tokens; each chunk starts a fresh context (its first
//! token replaced by BOS when the model adds one); only the predictions of the second half
//! of each chunk are scored.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use sluice_model::Logits;

#[derive(Clone, Debug)]
pub struct PerplexityResult {
    pub ppl: f64,
    /// Standard error of the estimate (same formula as llama-perplexity).
    pub ppl_err: f64,
    pub chunks: usize,
    pub ctx: usize,
    pub tokens_scored: usize,
    pub seconds: f64,
}

/// Log-probability of `target` under `logits` (computed in f64).
pub fn log_prob(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    let sum: f64 = logits.iter().map(|v| (*v as f64 - max).exp()).sum();
    logits[target as usize] as f64 - max - sum.ln()
}

/// Perplexity of `tokens` in chunks of `ctx`, at most `max_chunks` (0: all).
pub fn perplexity(
    engine: &Engine,
    tokens: &[u32],
    ctx: usize,
    max_chunks: usize,
    batch: usize,
) -> Result<PerplexityResult> {
    if ctx < 4 {
        return Err(RuntimeError::Input(format!("context {ctx} is too small for perplexity (at least 4)")));
    }
    let mut n_chunk = tokens.len() / ctx;
    if max_chunks > 0 {
        n_chunk = n_chunk.min(max_chunks);
    }
    if n_chunk == 0 {
        return Err(RuntimeError::Input(format!(
            "the text has {} tokens, fewer than one chunk of {ctx}",
            tokens.len()
        )));
    }
    let bos = if engine.add_bos() { engine.model.cfg.bos_token } else { None };
    let vocab = engine.model.cfg.vocab_size;
    let first = ctx / 2;
    let t0 = std::time::Instant::now();
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut kv = engine.model.new_state(ctx);
    for c in 0..n_chunk {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        kv.reset();
        // Only the scored half needs logits.
        let mut logits = Vec::with_capacity((ctx - first) * vocab);
        let batch = batch.max(1);
        for (i, part) in chunk.chunks(batch).enumerate() {
            let start = i * batch;
            let from = first.saturating_sub(start);
            logits.extend(engine.model.forward(&mut kv, part, Logits::From(from), None)?);
        }
        for j in first..ctx - 1 {
            let row = j - first;
            let lp = log_prob(&logits[row * vocab..(row + 1) * vocab], tokens[c * ctx + j + 1]);
            nll -= lp;
            nll2 += lp * lp;
            count += 1;
        }
    }
    let mean = nll / count as f64;
    let var = (nll2 / count as f64 - mean * mean).max(0.0);
    let ppl = mean.exp();
    Ok(PerplexityResult {
        ppl,
        ppl_err: ppl * (var / (count as f64 - 1.0).max(1.0)).sqrt(),
        chunks: n_chunk,
        ctx,
        tokens_scored: count,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

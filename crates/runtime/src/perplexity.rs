//! Perplexity with llama.cpp's `llama-perplexity` chunking, so the numbers compare: the token
//! stream is cut into chunks of `ctx` tokens; each chunk starts a fresh context (its first
//! token replaced by BOS when the model adds one); only the predictions of the second half
//! of each chunk are scored.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use sluice_model::{Logits, SeqState};

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
    log_prob_with(logits, target, softmax_norm(logits))
}

/// The softmax's normalizer of `logits` in f64: (max, ln Σ exp(logit − max)); their sum is
/// the log-sum-exp.
pub fn softmax_norm(logits: &[f32]) -> (f64, f64) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b)) as f64;
    (max, logits.iter().map(|v| (*v as f64 - max).exp()).sum::<f64>().ln())
}

/// `log_prob` with the normalizer `softmax_norm` gave for the same row.
pub fn log_prob_with(logits: &[f32], target: u32, (max, ln_sum): (f64, f64)) -> f64 {
    logits[target as usize] as f64 - max - ln_sum
}

/// How a text is cut into scored chunks.
pub(crate) struct Chunks<'a> {
    tokens: &'a [u32],
    ctx: usize,
    bos: Option<u32>,
    /// Chunks scored.
    pub n: usize,
    /// The first position of a chunk whose prediction is scored.
    pub first: usize,
}

impl<'a> Chunks<'a> {
    pub fn new(engine: &Engine, tokens: &'a [u32], ctx: usize, max_chunks: usize) -> Result<Chunks<'a>> {
        if ctx < 4 {
            return Err(RuntimeError::Input(format!("context {ctx} is too small for perplexity (at least 4)")));
        }
        let mut n = tokens.len() / ctx;
        if max_chunks > 0 {
            n = n.min(max_chunks);
        }
        if n == 0 {
            return Err(RuntimeError::Input(format!(
                "the text has {} tokens, fewer than one chunk of {ctx}",
                tokens.len()
            )));
        }
        let bos = if engine.add_bos() { engine.model.cfg.bos_token } else { None };
        Ok(Chunks { tokens, ctx, bos, n, first: ctx / 2 })
    }

    /// Chunk `c` as the model runs it.
    pub fn tokens(&self, c: usize) -> Vec<u32> {
        let mut chunk = self.tokens[c * self.ctx..(c + 1) * self.ctx].to_vec();
        if let Some(b) = self.bos {
            chunk[0] = b;
        }
        chunk
    }

    /// The token that follows position `j` of chunk `c` in the text.
    pub fn next_token(&self, c: usize, j: usize) -> u32 {
        self.tokens[c * self.ctx + j + 1]
    }
}

/// Runs `chunk` from an empty state and returns the logits of its rows from `first` on.
pub(crate) fn chunk_logits(
    engine: &Engine,
    kv: &mut SeqState,
    chunk: &[u32],
    first: usize,
    batch: usize,
) -> Result<Vec<f32>> {
    kv.reset();
    let vocab = engine.model.cfg.vocab_size;
    let mut logits = Vec::with_capacity((chunk.len() - first) * vocab);
    let batch = batch.max(1);
    for (i, part) in chunk.chunks(batch).enumerate() {
        let from = first.saturating_sub(i * batch);
        logits.extend(engine.model.forward(kv, part, Logits::From(from), None)?);
    }
    Ok(logits)
}

/// Perplexity of `tokens` in chunks of `ctx`, at most `max_chunks` (0: all).
pub fn perplexity(
    engine: &Engine,
    tokens: &[u32],
    ctx: usize,
    max_chunks: usize,
    batch: usize,
) -> Result<PerplexityResult> {
    let chunks = Chunks::new(engine, tokens, ctx, max_chunks)?;
    let vocab = engine.model.cfg.vocab_size;
    let t0 = std::time::Instant::now();
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    let mut kv = engine.model.new_state(ctx);
    for c in 0..chunks.n {
        // Only the scored half needs logits.
        let logits = chunk_logits(engine, &mut kv, &chunks.tokens(c), chunks.first, batch)?;
        for j in chunks.first..ctx - 1 {
            let row = j - chunks.first;
            let lp = log_prob(&logits[row * vocab..(row + 1) * vocab], chunks.next_token(c, j));
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
        chunks: chunks.n,
        ctx,
        tokens_scored: count,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

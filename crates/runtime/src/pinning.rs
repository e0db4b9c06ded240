//! `--pin-experts N --pin-trace TRACE` (lossy, opt-in): each routed layer of the model may
//! choose only among the N experts of that layer a previous routing trace used most
//! (`sluice_model::pinned`). When the experts stream, the pinned set is read into the cache
//! before the first token, so a cache that holds it reads nothing while decoding. What it
//! costs in output quality is measured by `sluice perplexity` with the same flags: the
//! perplexity with and without the restriction on the same text, and the KL divergence of
//! the restricted next-token distributions from the exact ones (`routing_cost`).

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::perplexity::{chunk_logits, log_prob_with, softmax_norm, Chunks};
use sluice_model::pinned::PinnedRouting;
use sluice_model::ExpertSource;
use std::path::Path;
use std::sync::Arc;

/// What pinning chose.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Pinned {
    pub lossy: bool,
    pub trace: String,
    /// Experts allowed per routed layer, of `n_expert`.
    pub per_layer: usize,
    pub n_expert: usize,
    /// Share of the trace's routing decisions that fell in the pinned sets.
    pub trace_coverage: f64,
    /// Pinned experts the trace never chose (a layer it used fewer than N experts of is
    /// filled up with the lowest ids).
    pub filled: usize,
    /// Pinned experts resident after loading them (streamed experts; `None`: resident model).
    pub resident: Option<usize>,
    pub bytes_read: u64,
}

/// The N most used experts of each routed layer in `trace` (ties: lower id), filled up with
/// the lowest unused ids where the trace used fewer; (sets, covered decisions, all decisions, filled).
fn choose(e: &Engine, trace: &Path, n: usize) -> Result<(Vec<Vec<u32>>, u64, u64, usize)> {
    let cfg = &e.model.cfg;
    let moe = cfg.moe.as_ref().ok_or_else(|| {
        RuntimeError::Input("--pin-experts applies to MoE models; this one has no routed experts".into())
    })?;
    if n < moe.n_expert_used || n > moe.n_expert {
        return Err(RuntimeError::Input(format!(
            "--pin-experts {n}: each token uses {} experts of {} per layer, so N must be between {} and {}",
            moe.n_expert_used, moe.n_expert, moe.n_expert_used, moe.n_expert
        )));
    }
    let ranked = crate::prewarm::ranked(trace, cfg.n_layer, moe.n_expert)?;
    let total: u64 = ranked.iter().map(|(_, c)| c).sum();
    let mut sets = vec![Vec::new(); cfg.n_layer];
    let mut covered = 0;
    for ((l, x), c) in &ranked {
        let s = &mut sets[*l as usize];
        if s.len() < n {
            s.push(*x);
            covered += c;
        }
    }
    let mut filled = 0;
    for (l, s) in sets.iter_mut().enumerate() {
        if !cfg.is_sparse(l) {
            s.clear();
            continue;
        }
        let mut id = 0;
        while s.len() < n {
            if !s.contains(&id) {
                s.push(id);
                filled += 1;
            }
            id += 1;
        }
    }
    Ok((sets, covered, total, filled))
}

/// Restricts `e`'s routing to the `n` experts per layer `trace` used most, and loads them
/// into the cache when experts stream.
pub fn pin(e: &mut Engine, trace: &Path, n: usize) -> Result<Pinned> {
    let (sets, covered, total, filled) = choose(e, trace, n)?;
    let n_expert = e.model.cfg.moe.as_ref().map_or(0, |m| m.n_expert);
    let p = Arc::new(PinnedRouting::new(e.model.experts.clone(), n_expert, &sets));
    e.model.experts = p.clone();
    e.pinned = Some(p);
    let (mut resident, mut bytes_read) = (None, 0);
    if let Some(s) = e.streaming.clone() {
        let before = s.stats().bytes_read;
        let keys: Vec<(u32, u32)> =
            sets.iter().enumerate().flat_map(|(l, v)| v.iter().map(move |x| (l as u32, *x))).collect();
        resident = Some(s.prewarm(&keys).map_err(|x| RuntimeError::Input(x.to_string()))?);
        bytes_read = s.stats().bytes_read - before;
        e.reset_stats_base();
    }
    let r = Pinned {
        lossy: true,
        trace: trace.display().to_string(),
        per_layer: n,
        n_expert,
        trace_coverage: covered as f64 / total.max(1) as f64,
        filled,
        resident,
        bytes_read,
    };
    e.pin_report = Some(r.clone());
    Ok(r)
}

/// Pinned against exact routing on the same text.
#[derive(Clone, Debug, serde::Serialize)]
pub struct RoutingCost {
    pub ppl_exact: f64,
    pub ppl_pinned: f64,
    /// Mean over scored positions of KL(exact ‖ pinned) of the next-token distributions, in nats.
    pub kl_mean: f64,
    /// The largest KL of one position.
    pub kl_max: f64,
    /// Share of positions whose most likely token is the same under both.
    pub top1_agreement: f64,
    pub tokens_scored: usize,
    pub chunks: usize,
    pub ctx: usize,
    pub seconds: f64,
}

/// KL(p ‖ q) of the softmaxes of two rows of logits whose log-sum-exps are `lp` and `lq`, in f64.
fn kl(p: &[f32], lp: f64, q: &[f32], lq: f64) -> f64 {
    p.iter()
        .zip(q)
        .map(|(a, b)| {
            let la = *a as f64 - lp;
            la.exp() * (la - (*b as f64 - lq))
        })
        .sum::<f64>()
        .max(0.0)
}

/// Scores `tokens` in llama-perplexity's chunks twice — routing exact, then pinned — and
/// compares the two next-token distributions at every scored position.
pub fn routing_cost(e: &Engine, tokens: &[u32], ctx: usize, max_chunks: usize, batch: usize) -> Result<RoutingCost> {
    let p = e.pinned.as_ref().ok_or_else(|| RuntimeError::Input("routing_cost needs --pin-experts".into()))?;
    let chunks = Chunks::new(e, tokens, ctx, max_chunks)?;
    let vocab = e.model.cfg.vocab_size;
    let t0 = std::time::Instant::now();
    let (mut nll_exact, mut nll_pinned, mut kl_sum, mut kl_max, mut agree, mut n) =
        (0f64, 0f64, 0f64, 0f64, 0usize, 0usize);
    let mut kv = e.model.new_state(ctx);
    let r = (|| -> Result<()> {
        for c in 0..chunks.n {
            let chunk = chunks.tokens(c);
            p.set_enabled(false);
            let exact = chunk_logits(e, &mut kv, &chunk, chunks.first, batch)?;
            p.set_enabled(true);
            let pinned = chunk_logits(e, &mut kv, &chunk, chunks.first, batch)?;
            for j in chunks.first..ctx - 1 {
                let row = j - chunks.first;
                let (a, b) = (&exact[row * vocab..(row + 1) * vocab], &pinned[row * vocab..(row + 1) * vocab]);
                let next = chunks.next_token(c, j);
                let (na, nb) = (softmax_norm(a), softmax_norm(b));
                nll_exact -= log_prob_with(a, next, na);
                nll_pinned -= log_prob_with(b, next, nb);
                let d = kl(a, na.0 + na.1, b, nb.0 + nb.1);
                kl_sum += d;
                kl_max = kl_max.max(d);
                agree += (sluice_kernels::ops::argmax(a) == sluice_kernels::ops::argmax(b)) as usize;
                n += 1;
            }
        }
        Ok(())
    })();
    p.set_enabled(true);
    r?;
    Ok(RoutingCost {
        ppl_exact: (nll_exact / n as f64).exp(),
        ppl_pinned: (nll_pinned / n as f64).exp(),
        kl_mean: kl_sum / n as f64,
        kl_max,
        top1_agreement: agree as f64 / n as f64,
        tokens_scored: n,
        chunks: chunks.n,
        ctx,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

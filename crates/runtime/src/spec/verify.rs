//! The verifier's rules: which drafted tokens the target keeps, what it samples instead, and
//! how a state goes back to the kept prefix.
//!
//! Acceptance is the standard speculative rejection sampling. At a drafted position the target
//! distribution is `p` (the sampler's own pipeline on that row of logits, penalties counting
//! the tokens kept before it) and the draft token `x` was drawn from `q`:
//!
//! * keep `x` with probability `min(1, p(x) / q(x))`;
//! * otherwise draw from `normalize(max(0, p − q))` and stop there.
//!
//! The token that results is distributed exactly as `p`, whatever `q` is, so the output of a
//! speculative run is distributed exactly as plain sampling's. A deterministic proposer
//! (n-gram lookup) is the one-hot case `q = δ(x)`: keep `x` with probability `p(x)`, else draw
//! from `p` without `x`. Greedy decoding is the one-hot case of `p`: keep `x` exactly when it
//! is the argmax, else take the argmax, so tokens are those of plain greedy decoding.

use crate::engine::Engine;
use crate::error::Result;
use crate::sampler::{Candidates, Sampled, Sampler};
use sluice_model::{Logits, SeqState, Snapshot};

/// How drafted tokens are accepted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Acceptance {
    /// Rejection sampling: lossless.
    #[default]
    Exact,
    /// Keeps every drafted token. Wrong on purpose: the statistical tests show they can tell.
    #[doc(hidden)]
    AlwaysAccept,
}

/// Whether the target keeps draft token `x` (drawn from `q`; `None`: chosen deterministically)
/// where its own distribution is `p`.
pub fn accept(sampler: &mut Sampler, p: &Candidates, x: u32, q: Option<&Candidates>, rule: Acceptance) -> bool {
    if rule == Acceptance::AlwaysAccept {
        return true;
    }
    let px = p.prob(x);
    if px <= 0.0 {
        return false;
    }
    if sampler.is_greedy() {
        return p.ids[0] == x;
    }
    let qx = q.map_or(1.0, |q| q.prob(x));
    if qx <= 0.0 || px >= qx {
        return true;
    }
    sampler.uniform() < px / qx
}

/// Verifies a draft token `x` chosen deterministically (n-gram lookup) at one position whose
/// logits are `logits`: keeps it or draws the target's own token instead, by the rules above,
/// and reports and records the token taken as `Sampler::sample_full` would. Returns whether
/// it was `x`.
pub fn verify_one(sampler: &mut Sampler, logits: &[f32], x: u32, logprobs: Option<usize>) -> (Sampled, bool) {
    let p = sampler.candidates(logits);
    let kept = accept(sampler, &p, x, None, Acceptance::Exact);
    let token = if kept { x } else { sampler.draw(&residual(&p, x, None)) };
    (sampler.take(logits, token, logprobs), kept)
}

/// The distribution to draw from after rejecting a token drawn from `q` (`None`: the one-hot
/// `δ(x)`): `max(0, p − q)`, normalized. Falls back to `p` where that is all zero (only
/// possible through rounding, as `p = q` never rejects).
pub fn residual(p: &Candidates, x: u32, q: Option<&Candidates>) -> Candidates {
    let mut ids = Vec::with_capacity(p.ids.len());
    let mut weights = Vec::with_capacity(p.ids.len());
    for (id, w) in p.ids.iter().zip(&p.weights) {
        let pi = w / p.total;
        let qi = match q {
            Some(q) => q.prob(*id),
            None => (*id == x) as u8 as f64,
        };
        let r = pi - qi;
        if r > 0.0 {
            ids.push(*id);
            weights.push(r);
        }
    }
    let total: f64 = weights.iter().sum();
    if ids.is_empty() || total <= 0.0 {
        return p.clone();
    }
    Candidates { ids, weights, total }
}

/// Brings the target's state back to `len` positions after a verify pass that ran `tokens`
/// from `snap`'s length on: cut it where attention state allows, else restore the snapshot
/// taken before the pass and run the kept tokens again (recurrent state and sliding windows
/// come out the same bits as if only they had run). Returns whether it ran tokens again.
pub fn rewind_target(
    engine: &Engine,
    kv: &mut SeqState,
    len: usize,
    snap: Option<&Snapshot>,
    tokens: &[u32],
) -> Result<bool> {
    if len >= kv.len() {
        return Ok(false);
    }
    if kv.can_truncate(len) {
        kv.truncate(len)?;
        return Ok(false);
    }
    let snap = snap.ok_or_else(|| {
        crate::error::RuntimeError::Input("internal: a state that rewinds by snapshot has none".into())
    })?;
    kv.restore(snap)?;
    let again = &tokens[..len - snap.len()];
    if !again.is_empty() {
        engine.model.forward(kv, again, Logits::None, None)?;
    }
    Ok(true)
}

/// Brings a proposer's own state back to at most `len` positions: cut where it can, else the
/// snapshot (if taken at or before `len`), else empty. Returns the length it holds.
pub fn rewind_state(state: &mut SeqState, len: usize, snap: Option<&Snapshot>) -> Result<usize> {
    if len >= state.len() {
        return Ok(state.len());
    }
    if state.can_truncate(len) {
        state.truncate(len)?;
    } else {
        match snap {
            Some(s) if s.len() <= len && s.len() <= state.len() => state.restore(s)?,
            _ => state.reset(),
        }
    }
    Ok(state.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerConfig;

    fn dist(p: &[(u32, f64)]) -> Candidates {
        Candidates { ids: p.iter().map(|x| x.0).collect(), weights: p.iter().map(|x| x.1).collect(), total: 1.0 }
    }

    #[test]
    fn residual_removes_the_draft_mass() {
        let p = dist(&[(0, 0.5), (1, 0.3), (2, 0.2)]);
        let r = residual(&p, 0, None);
        assert_eq!(r.ids, vec![1, 2]);
        assert!((r.prob(1) - 0.6).abs() < 1e-12);
        let q = dist(&[(1, 0.6), (2, 0.4)]);
        let r = residual(&p, 1, Some(&q));
        assert_eq!(r.ids, vec![0]);
    }

    #[test]
    fn one_step_is_distributed_as_p() {
        // Accept-or-resample at one position, many times: frequencies follow p.
        let p = dist(&[(0, 0.5), (1, 0.3), (2, 0.2)]);
        let q = dist(&[(0, 0.1), (1, 0.1), (2, 0.8)]);
        let mut s = Sampler::new(SamplerConfig { temperature: 1.0, seed: 9, ..Default::default() });
        let mut counts = [0usize; 3];
        let n = 60000;
        for _ in 0..n {
            let x = s.draw(&q);
            let t =
                if accept(&mut s, &p, x, Some(&q), Acceptance::Exact) { x } else { s.draw(&residual(&p, x, Some(&q))) };
            counts[t as usize] += 1;
        }
        for (i, want) in [0.5, 0.3, 0.2].iter().enumerate() {
            let got = counts[i] as f64 / n as f64;
            assert!((got - want).abs() < 0.01, "token {i}: {got} vs {want}");
        }
    }
}

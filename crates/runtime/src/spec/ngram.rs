//! Prompt lookup: drafts by finding the latest n-gram of the text so far earlier in the text
//! (prompt and generated tokens alike) and proposing what followed it there. Longer n-grams
//! are tried first, from `n_max` down to `n_min`; the most recent earlier match wins. The
//! proposal is deterministic (the one-hot case of the acceptance rule).

use super::{Draft, Proposer, SpecMethod};
use crate::error::Result;

pub struct NgramProposer {
    n_max: usize,
    n_min: usize,
}

impl NgramProposer {
    pub fn new(n_min: usize, n_max: usize) -> NgramProposer {
        NgramProposer { n_max: n_max.max(1), n_min: n_min.clamp(1, n_max.max(1)) }
    }
}

/// The continuation (up to `k` tokens) after the most recent earlier occurrence of the last
/// `n` tokens of `ctx`, longest `n` first.
pub fn lookup(ctx: &[u32], n_min: usize, n_max: usize, k: usize) -> &[u32] {
    let len = ctx.len();
    for n in (n_min..=n_max).rev() {
        if len <= n {
            continue;
        }
        let pat = &ctx[len - n..];
        // Starts j < len - n: the match ends before the pattern's own last token, so at least
        // one token follows it.
        if let Some(j) = (0..len - n).rev().find(|&j| ctx[j..j + n] == *pat) {
            let from = j + n;
            return &ctx[from..(from + k).min(len)];
        }
    }
    &[]
}

impl Proposer for NgramProposer {
    fn method(&self) -> SpecMethod {
        SpecMethod::Ngram
    }

    fn propose(&mut self, context: &[u32], k: usize, out: &mut Draft) -> Result<()> {
        let cont = lookup(context, self.n_min, self.n_max, k);
        if cont.is_empty() {
            out.stop = Some("no n-gram match");
        }
        for t in cont {
            out.push(*t, None);
        }
        Ok(())
    }

    fn accepted(&mut self, _kept: usize, _hidden: Option<&[f32]>) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_most_recent_match_wins() {
        // "1 2 3" occurs twice; the latest one is followed by 9.
        let ctx = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 1, 2, 3];
        assert_eq!(lookup(&ctx, 1, 3, 2), &[9, 8]);
        // No 3-gram match: falls back to shorter n.
        let ctx = [5, 6, 7, 1, 2, 6, 7];
        assert_eq!(lookup(&ctx, 1, 3, 4), &[1, 2, 6, 7]);
        assert_eq!(lookup(&ctx, 3, 3, 4), &[] as &[u32]);
        // A run: the continuation stops at the end of the text.
        assert_eq!(lookup(&[4, 4, 4], 1, 2, 5), &[4]);
    }
}

//! Speculative decoding in the server. A request that drafts looks up the latest n-gram of its
//! text (prompt and output) earlier in that text and proposes what followed; the batch step
//! then runs its last token and the drafts as one item beside every other sequence's tokens,
//! and the verifier keeps the drafts the target agrees with (`sluice_runtime::spec::verify`).
//! A verify pass's rows are the bits of plain decode's (the kernels are batch-invariant), so a
//! greedy request gets plain decode's tokens and log-probabilities exactly, and a sampled one
//! plain sampling's distribution (the rejection rule for a deterministic draft).
//!
//! Draft length: a greedy request's adapts each round (the controller of `sluice run --spec`,
//! fed the step's wall time), since its tokens do not depend on it. A sampled request drafts
//! what the lookup finds up to its `draft_max`, a length that depends on its own text only:
//! what it draws from its generator, and so its output, is then the same alone or in any
//! batch and from run to run, which a length chosen from measured times would not be.

use sluice_model::Snapshot;
use sluice_runtime::spec::adapt::Adapt;
use sluice_runtime::spec::ngram;

/// The n-gram lengths looked up, longest first (those of `sluice run --spec ngram`).
const NGRAM_MIN: usize = 2;
const NGRAM_MAX: usize = 4;

/// A drafting sequence's speculation state.
pub struct SeqSpec {
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
    pub fn new(draft_max: usize, greedy: bool) -> SeqSpec {
        SeqSpec {
            adapt: greedy.then(|| Adapt::new(0, draft_max, true)),
            draft_max,
            batch: Vec::new(),
            start: 0,
            snap: None,
        }
    }

    /// Plans a step: `batch` becomes the last generated token and up to `room` drafts looked
    /// up in `prompt` + `generated`. Returns how many were drafted.
    pub fn plan(&mut self, prompt: &[u32], generated: &[u32], room: usize) -> usize {
        let k = match self.adapt.as_mut() {
            Some(a) => a.choose(room).0,
            None => self.draft_max.min(room),
        };
        self.batch.clear();
        self.batch.push(*generated.last().expect("a decoding sequence has generated a token"));
        self.snap = None;
        if k > 0 {
            let ctx: Vec<u32> = prompt.iter().chain(generated).copied().collect();
            self.batch.extend_from_slice(ngram::lookup(&ctx, NGRAM_MIN, NGRAM_MAX, k));
        }
        self.batch.len() - 1
    }

    /// The drafts of this step (none before a step is planned and after it is verified).
    pub fn drafts(&self) -> &[u32] {
        self.batch.get(1..).unwrap_or(&[])
    }

    /// Tells the controller how the step went: `drafted` drafts, `kept` of them kept, the
    /// step took `secs`.
    pub fn observe(&mut self, drafted: usize, kept: usize, secs: f64) {
        if let Some(a) = self.adapt.as_mut() {
            a.observe(drafted, kept, secs, 0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_last_ngram_within_the_room() {
        // "5 6" was followed by "7 8 9 2" in the prompt.
        let prompt = [1, 5, 6, 7, 8, 9, 2, 3];
        let mut s = SeqSpec::new(4, false);
        assert_eq!(s.plan(&prompt, &[5, 6], 8), 4);
        assert_eq!(s.batch, vec![6, 7, 8, 9, 2]);
        assert_eq!(s.drafts(), &[7, 8, 9, 2]);
        // The room (max_tokens, context) bounds the drafts; no room: no drafts.
        assert_eq!(s.plan(&prompt, &[5, 6], 2), 2);
        assert_eq!(s.batch, vec![6, 7, 8]);
        assert_eq!(s.plan(&prompt, &[5, 6], 0), 0);
        assert_eq!(s.batch, vec![6]);
        // Nothing to look up.
        assert_eq!(s.plan(&prompt, &[42], 8), 0);
    }
}

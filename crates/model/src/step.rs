//! The seam through which a whole single-token step — embedding to logits — runs off the
//! CPU's threads (on a GPU, by `sluice-cuda`), keeping the hidden state on the device from
//! layer to layer instead of crossing the bus for every product.
//!
//! Unlike the per-product seams (`DenseCompute`, `ExpertCompute`) an implementation does not
//! promise the CPU's bits: its norms, attention and activations are its own arithmetic. It
//! promises its own determinism instead: the same tokens give the same bits whatever its
//! expert tiers hold. The host's `SeqState` stays the sequence's record: a step appends the
//! keys and values it computed, so any later pass — on the CPU or through this seam — sees
//! the whole sequence.

use crate::error::Result;
use crate::model::{Logits, Model};
use crate::state::SeqState;

pub trait StepCompute: Send + Sync {
    /// Runs `token` at position `state.len()` and returns (logits, final-normed hidden row)
    /// as `Model::forward_hidden` would for one token, having appended the step's keys and
    /// values to `state` (not committed: the caller commits or aborts). `None`: it does not
    /// take this step (the CPU path runs it), having touched nothing.
    fn step(&self, m: &Model, state: &mut SeqState, token: u32, want: Logits) -> Option<Result<(Vec<f32>, Vec<f32>)>>;

    /// Where steps run and what the device holds, for the placement line.
    fn describe(&self) -> String;

    /// Its counters so far, for `--stats`.
    fn stats_line(&self) -> String;
}

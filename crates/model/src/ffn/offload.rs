//! The seam through which a MoE layer's routed experts are computed off the CPU's threads
//! (on a GPU, by `sluice-cuda`): the block hands over the experts it fetched, resident on the
//! host, and the tokens each serves; the implementation returns each (token, rank) slot's
//! output row. An implementation must give the bits the CPU gives (the gated FFN of
//! `gated_ffn`, row by row), so that where experts are computed never changes the output.

use crate::config::Activation;
use crate::error::Result;
use crate::expert::ExpertWeights;

/// One call's experts: expert `ids[i]` of layer `layer`, weights `weights[i]` (host memory),
/// serving the (token, rank) slots `slots[i]` (slot `s` is token `s / k` of `x`).
pub struct ExpertBatch<'a> {
    pub layer: usize,
    pub activation: Activation,
    pub ids: &'a [u32],
    pub weights: &'a [ExpertWeights<'a>],
    pub slots: &'a [&'a [usize]],
    pub k: usize,
    /// (n, hidden)
    pub x: &'a [f32],
}

pub trait ExpertCompute: Send + Sync {
    /// Writes row `s` of `y` (n·k × hidden) for every slot of the batch and returns true, or
    /// returns false, touching nothing, when it cannot compute these experts (a weight
    /// format it has no kernel for): the CPU computes them then.
    fn compute(&self, batch: &ExpertBatch<'_>, y: &mut [f32]) -> Result<bool>;

    /// Where experts are computed and what its tier holds, for the placement line.
    fn describe(&self) -> String;

    /// Its counters so far (hits, misses, bytes copied, ...), for `--stats`.
    fn stats_line(&self) -> String;
}

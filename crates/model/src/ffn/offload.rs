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

/// What the CPU's threads took for the experts a layer left to them, so that an
/// implementation can weigh copying a missed expert against computing it where it is.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuWork {
    /// Bytes of the experts' weights.
    pub bytes: usize,
    /// Σ over the experts of (weights × tokens served): the multiply-adds.
    pub macs: usize,
    /// Experts and tokens (the most any one expert served).
    pub experts: usize,
    pub max_tokens: usize,
    pub ns: u64,
}

pub trait ExpertCompute: Send + Sync {
    /// Which of the batch's experts this implementation takes (true) and which the CPU's
    /// threads compute where they are (false), at the same time. Default: all of them.
    fn assign(&self, batch: &ExpertBatch<'_>) -> Vec<bool> {
        vec![true; batch.ids.len()]
    }

    /// The CPU's time for the experts `assign` left to it.
    fn observe_cpu(&self, _work: CpuWork) {}

    /// Writes row `s` of `y` (n·k × hidden) for every slot of the batch and returns true, or
    /// returns false, touching nothing, when it cannot compute these experts (a weight
    /// format it has no kernel for): the CPU computes them then.
    fn compute(&self, batch: &ExpertBatch<'_>, y: &mut [f32]) -> Result<bool>;

    /// Where experts are computed and what its tier holds, for the placement line.
    fn describe(&self) -> String;

    /// Its counters so far (hits, misses, bytes copied, ...), for `--stats`.
    fn stats_line(&self) -> String;
}

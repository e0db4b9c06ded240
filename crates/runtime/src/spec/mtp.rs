//! Drafting with the target's own multi-token-prediction head. The head at position `p` reads
//! the target's final hidden state at `p` and the token at `p + 1` and predicts the token at
//! `p + 2`. The first draft of a round comes from the hidden states the target's last pass
//! produced (for the tokens it kept) and the pending token; each further draft feeds the
//! head's own hidden output back with the draft before it. After verification the head's
//! cache is cut back to the entries built from the target's real hidden states.

use super::draft::{draft_sampling, draw};
use super::{Draft, Proposer, SpecMethod, SpecOptions};
use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::sampler::{Sampler, SamplerConfig};
use sluice_model::{Logits, Model, SeqState};

/// The head's drafting state for one sequence; the model is passed to each call, so that a
/// server can keep one per sequence beside a shared model.
pub struct MtpDrafter {
    /// The head's attention cache.
    state: SeqState,
    /// The target's hidden rows not yet fed to the head (positions `state.len()..`).
    queue: Vec<f32>,
    /// The head's length before the last round's drafts.
    true_len: usize,
    drafted: bool,
    sampler: Sampler,
    p_min: f32,
}

impl MtpDrafter {
    /// A drafter for `model`'s head (the caller checked it has one) with a cache of `max_len`
    /// positions, drawing with `sampling` (greedy: deterministic drafts).
    pub fn new(model: &Model, max_len: usize, sampling: SamplerConfig, p_min: f32) -> MtpDrafter {
        MtpDrafter {
            state: model.new_mtp_state(max_len),
            queue: Vec::new(),
            true_len: 0,
            drafted: false,
            sampler: Sampler::new(sampling),
            p_min,
        }
    }

    /// A new sequence: the target's hidden rows of the positions it ran.
    pub fn start(&mut self, hidden: &[f32]) {
        self.state.reset();
        self.queue.clear();
        self.queue.extend_from_slice(hidden);
        self.drafted = false;
    }

    /// Up to `k` tokens to follow `context`, whose every position but the last the target ran
    /// and handed over (`start`, `accepted`).
    pub fn propose(&mut self, model: &Model, context: &[u32], k: usize, out: &mut Draft) -> Result<()> {
        let hd = model.cfg.hidden;
        let rows = self.queue.len() / hd;
        if rows == 0 {
            out.stop = Some("no hidden state yet");
            return Ok(());
        }
        let a = self.state.len();
        if a + rows + 1 != context.len() {
            return Err(RuntimeError::Input(format!(
                "internal: the head holds {a} positions and {rows} hidden rows wait, for a context of {}",
                context.len()
            )));
        }
        if a + rows + k > self.state.max_len() {
            out.stop = Some("head's context full");
            return Ok(());
        }
        // Feed the target's hidden rows, each with the token that followed it.
        let (mut logits, mut h) =
            model.mtp_forward(&mut self.state, &self.queue, &context[a + 1..], Logits::Last, None)?;
        self.queue.clear();
        self.true_len = self.state.len();
        self.drafted = true;
        for i in 0..k {
            let (t, q, conf) = draw(&mut self.sampler, &logits);
            if conf < self.p_min as f64 {
                out.stop = Some("low draft confidence");
                break;
            }
            out.push(t, Some(q));
            if i + 1 == k {
                break;
            }
            (logits, h) = model.mtp_forward(&mut self.state, &h, &[t], Logits::Last, None)?;
        }
        Ok(())
    }

    /// After a step: the head's cache is cut back to the entries made from the target's real
    /// hidden states, and `hidden` (the rows of the positions the target ran and kept) waits
    /// for the next draft.
    pub fn accepted(&mut self, hidden: &[f32]) -> Result<()> {
        if self.drafted {
            // Entries past the real hidden states came from the head's own guesses.
            self.state.truncate(self.true_len)?;
            self.drafted = false;
        }
        self.queue.extend_from_slice(hidden);
        Ok(())
    }
}

pub struct MtpProposer<'a> {
    model: &'a Model,
    head: MtpDrafter,
}

impl<'a> MtpProposer<'a> {
    pub fn new(target: &'a Engine, sampling: &SamplerConfig, spec: &SpecOptions) -> Result<MtpProposer<'a>> {
        if target.model.mtp.is_none() {
            return Err(RuntimeError::Input(format!(
                "{}: --spec mtp needs a multi-token-prediction head, and this model has none loaded{}",
                target.path.display(),
                if target.model.cfg.mtp.is_none() { " (its checkpoint declares none)" } else { "" }
            )));
        }
        let cfg = draft_sampling(sampling, spec, 0x94D0_49BB_1331_11EB);
        let head = MtpDrafter::new(&target.model, target.options.max_context, cfg, spec.p_min);
        Ok(MtpProposer { model: &target.model, head })
    }
}

impl Proposer for MtpProposer<'_> {
    fn method(&self) -> SpecMethod {
        SpecMethod::Mtp
    }

    fn wants_hidden(&self) -> bool {
        true
    }

    fn start(&mut self, _prompt_head: &[u32], prompt_hidden: Option<&[f32]>) -> Result<()> {
        self.head.start(prompt_hidden.unwrap_or(&[]));
        Ok(())
    }

    fn propose(&mut self, context: &[u32], k: usize, out: &mut Draft) -> Result<()> {
        self.head.propose(self.model, context, k, out)
    }

    fn accepted(&mut self, _kept: usize, hidden: Option<&[f32]>) -> Result<()> {
        self.head.accepted(hidden.unwrap_or(&[]))
    }
}

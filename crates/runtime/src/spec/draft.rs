//! Drafting with a second, smaller model that shares the target's vocabulary. It keeps its
//! own state, catches up on the tokens the target produced since its last draft, then samples
//! up to `k` tokens one by one with the target's sampling settings (penalties aside; its own
//! temperature if one is given), reporting the distribution each was drawn from. It stops
//! early when its chosen token's probability falls below the confidence threshold.

use super::verify::rewind_state;
use super::{Draft, Proposer, SpecMethod, SpecOptions};
use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::sampler::{Candidates, Sampler, SamplerConfig};
use sluice_model::{Logits, SeqState, Snapshot};
use std::sync::Arc;

pub struct DraftModel {
    engine: Arc<Engine>,
    state: SeqState,
    /// The tokens `state` holds.
    done: Vec<u32>,
    /// A snapshot at the length the last draft started from (recurrent or windowed models).
    snap: Option<Snapshot>,
    /// The context length the last draft followed.
    base: usize,
    /// A proposal waits for its verdict.
    proposed: bool,
    sampler: Sampler,
    p_min: f32,
}

impl DraftModel {
    /// Drafts with `draft` for `target`; refuses a draft whose vocabulary differs.
    pub fn new(
        draft: impl Into<Arc<Engine>>,
        target: &Engine,
        sampling: &SamplerConfig,
        spec: &SpecOptions,
    ) -> Result<DraftModel> {
        let draft = draft.into();
        check_vocab(target, &draft)?;
        let cfg = draft_sampling(sampling, spec, 0xD1B5_4A32_D192_ED03);
        let state = draft.new_state();
        Ok(DraftModel::with_state(draft, state, cfg, spec.p_min))
    }

    /// Drafts greedily with `draft` (whose vocabulary the caller checked against the
    /// target's, `check_vocab`), shared with other sequences, in a state of `max_len`
    /// positions: a deterministic proposer, whose drafts depend on the context alone.
    pub fn greedy(draft: Arc<Engine>, max_len: usize, p_min: f32) -> DraftModel {
        let state = draft.model.new_state(max_len);
        DraftModel::with_state(draft, state, SamplerConfig::default(), p_min)
    }

    fn with_state(engine: Arc<Engine>, state: SeqState, cfg: SamplerConfig, p_min: f32) -> DraftModel {
        DraftModel {
            engine,
            state,
            done: Vec::new(),
            snap: None,
            base: 0,
            proposed: false,
            sampler: Sampler::new(cfg),
            p_min,
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Runs `tokens` after what the state holds, in chunks; the last row's logits if `last`.
    fn catch_up(&mut self, tokens: &[u32], last: bool) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        for (i, c) in tokens.chunks(256).enumerate() {
            let want = if last && (i + 1) * 256 >= tokens.len() { Logits::Last } else { Logits::None };
            logits = self.engine.model.forward(&mut self.state, c, want, None)?;
        }
        Ok(logits)
    }
}

/// Refuses a draft model whose vocabulary is not the target's: the same number of tokens
/// and the same text for every id.
pub fn check_vocab(target: &Engine, draft: &Engine) -> Result<()> {
    let (t, d) = (target.model.cfg.vocab_size, draft.model.cfg.vocab_size);
    let name = |e: &Engine| e.path.display().to_string();
    if t != d {
        return Err(RuntimeError::Input(format!(
            "the draft model {} has {d} token rows, the target {} has {t}: a draft model must share the target's vocabulary",
            name(draft),
            name(target)
        )));
    }
    if let (Some(a), Some(b)) = (&target.tokenizer, &draft.tokenizer) {
        if a.vocab_size() != b.vocab_size() {
            return Err(RuntimeError::Input(format!(
                "the draft model's tokenizer has {} tokens, the target's {}: a draft model must share the target's vocabulary",
                b.vocab_size(),
                a.vocab_size()
            )));
        }
        for id in 0..a.vocab_size() as u32 {
            let (x, y) = (a.token_text(id), b.token_text(id));
            if x != y {
                return Err(RuntimeError::Input(format!(
                    "token {id} is {:?} in the target's vocabulary ({}) and {:?} in the draft model's ({}): a draft model must share the target's vocabulary",
                    x.unwrap_or_default(),
                    name(target),
                    y.unwrap_or_default(),
                    name(draft)
                )));
            }
        }
    }
    Ok(())
}

/// The sampling a proposer drafts with: the target's (greedy stays greedy), at the draft
/// temperature if one is given, without penalties, its generator seeded apart (`salt`) from
/// the target's.
pub fn draft_sampling(sampling: &SamplerConfig, spec: &SpecOptions, salt: u64) -> SamplerConfig {
    SamplerConfig {
        temperature: if sampling.temperature == 0.0 {
            0.0
        } else {
            spec.draft_temperature.unwrap_or(sampling.temperature)
        },
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
        seed: sampling.seed ^ salt,
        ..sampling.clone()
    }
}

/// The probability of the most likely token under the plain softmax of `logits`, and that token.
pub fn top_prob(logits: &[f32]) -> (u32, f64) {
    let best = sluice_kernels::ops::argmax(logits);
    let max = logits[best] as f64;
    let sum: f64 = logits.iter().map(|v| (*v as f64 - max).exp()).sum();
    (best as u32, 1.0 / sum)
}

/// Draws the next draft token from `logits`: (token, its distribution, its confidence).
pub fn draw(sampler: &mut Sampler, logits: &[f32]) -> (u32, Candidates, f64) {
    if sampler.is_greedy() {
        let (t, p) = top_prob(logits);
        return (t, Candidates::one_hot(t), p);
    }
    let c = sampler.candidates(logits);
    let t = sampler.draw(&c);
    let p = c.prob(t);
    (t, c, p)
}

impl Proposer for DraftModel {
    fn method(&self) -> SpecMethod {
        SpecMethod::Draft
    }

    fn propose(&mut self, context: &[u32], k: usize, out: &mut Draft) -> Result<()> {
        if context.len() > self.state.max_len() {
            out.stop = Some("draft model's context full");
            return Ok(());
        }
        // Catch up from the longest prefix of the context its state can keep (at least the
        // last token runs, for the logits).
        let common = self.done.iter().zip(context).take_while(|(a, b)| a == b).count().min(context.len() - 1);
        let kept = rewind_state(&mut self.state, common, self.snap.as_ref())?;
        self.done.truncate(kept);
        let mut logits = self.catch_up(&context[kept..], true)?;
        self.done = context.to_vec();
        self.base = context.len();
        self.proposed = true;
        self.snap = self.state.rewinds_by_snapshot().then(|| self.state.snapshot());
        let t0 = std::time::Instant::now();
        let model = &self.engine.model;
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
            if self.state.len() >= self.state.max_len() {
                out.stop = Some("draft model's context full");
                break;
            }
            logits = model.forward(&mut self.state, &[t], Logits::Last, None)?;
            self.done.push(t);
        }
        out.drafting_secs = Some(t0.elapsed().as_secs_f64());
        Ok(())
    }

    fn start(&mut self, prompt_head: &[u32], _prompt_hidden: Option<&[f32]>) -> Result<()> {
        // Run what the target ran, so that the first draft has only the last token to run.
        let keep = self.done.iter().zip(prompt_head).take_while(|(a, b)| a == b).count();
        let kept = rewind_state(&mut self.state, keep, self.snap.as_ref())?;
        self.done.truncate(kept);
        self.proposed = false;
        if prompt_head.len() > kept && prompt_head.len() < self.state.max_len() {
            self.catch_up(&prompt_head[kept..], false)?;
            self.done = prompt_head.to_vec();
        }
        Ok(())
    }

    fn accepted(&mut self, kept: usize, _hidden: Option<&[f32]>) -> Result<()> {
        // The state holds the context and the drafts it ran; keep the accepted ones.
        if !std::mem::take(&mut self.proposed) {
            return Ok(());
        }
        let want = self.base + kept;
        if self.done.len() > want {
            let len = rewind_state(&mut self.state, want, self.snap.as_ref())?;
            self.done.truncate(len);
        }
        Ok(())
    }
}

//! Continuous batching. One thread owns the model; requests join and leave the running batch
//! at token boundaries. Every step is one `Model::forward_batch` over the active sequences:
//! the next token of each decoding sequence, and a chunk of the prompt of each sequence still
//! in prefill (the step's prefill tokens are capped, so running streams keep flowing while a
//! long prompt comes in). Each MoE layer so fetches the union of the batch's experts once.
//!
//! A sequence's logits are the same bits as when it runs alone (`forward_batch`'s promise),
//! and each request samples with its own sampler and generator: its tokens do not depend on
//! what runs beside it.
//!
//! A request that speculates (`spec`) runs its last token and the drafts its proposer made
//! before the step (n-gram lookup, the draft model, the MTP head or the cached experts: see
//! `spec`) as one item of the step, and keeps the drafts the verifier accepts: several tokens a
//! step, the same tokens and log-probabilities as plain decode for greedy requests.
//!
//! The scheduler knows nothing of HTTP: jobs arrive on a channel with a channel for their
//! events; a job whose event receiver is gone (the client left) is cancelled and its slot and
//! memory freed at the next step.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::prefix::{PrefixCache, PromptEnd};
use crate::spec::SeqSpec;
use crate::text::{Chunk, OutputText, TokenInfo};
use sluice_model::Snapshot;
use sluice_model::{BatchItem, Logits, SeqState};
use sluice_runtime::spec::verify;
use sluice_runtime::spec::SpecMethod;
use sluice_runtime::{Engine, Sampled, Sampler, SamplerConfig};
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// One batch item's results: its logits and its final-normed hidden rows.
type Rows = (Vec<f32>, Vec<f32>);

/// A request, as the scheduler sees it.
pub struct Job {
    pub prompt: Vec<u32>,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Tokens that end the output (not part of it).
    pub stop_tokens: Vec<u32>,
    /// Texts that end the output (not part of it).
    pub stop_strings: Vec<String>,
    /// Special tokens whose text is part of the output (tool-call tags).
    pub literal_tokens: Vec<(u32, String)>,
    /// Report log-probabilities with this many top tokens.
    pub logprobs: Option<usize>,
    /// Draft up to this many tokens a step, this way (None: plain decode).
    pub spec: Option<(SpecMethod, usize)>,
    /// Bytes of sequence state reserved for it while it runs.
    pub reserve: u64,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    /// Its place in the server, taken when it was accepted (`None` only while the HTTP
    /// side builds it); the place is given back when the job is dropped.
    pub place: Option<Place>,
}

/// One accepted request's claim on a slot or a queue entry. Admission counts waiting and
/// running requests in one counter, so there is no moment, between a job leaving the queue
/// and its slot being published, when neither count includes it. Dropping the job (it
/// finished, failed, was cancelled or refused at shutdown) gives the place back.
pub struct Place(Arc<Shared>);

impl Place {
    /// Takes a place if fewer than `limit` are held.
    pub fn take(shared: &Arc<Shared>, limit: usize) -> Option<Place> {
        shared
            .occupied
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < limit).then_some(n + 1))
            .ok()
            .map(|_| Place(shared.clone()))
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.0.occupied.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Debug)]
pub enum Event {
    Chunk(Chunk),
    Done(Done),
    Error(ApiError),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// A stop token or stop string.
    Stop,
    /// max_tokens or the context.
    Length,
}

#[derive(Clone, Debug)]
pub struct Done {
    pub finish: Finish,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose state was reused rather than computed.
    pub cached_tokens: usize,
}

pub enum Cmd {
    Submit(Box<Job>),
    /// Stop admitting; finish what runs within the grace period, then exit.
    Shutdown,
}

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in the batch.
    pub parallel: usize,
    /// Most prompt tokens run in one step.
    pub prefill_chunk: usize,
    /// Positions per sequence.
    pub ctx_size: usize,
    /// Memory for sequence state: running requests' reservations and the prefix cache.
    pub state_budget: u64,
    /// Most bytes the prefix cache holds.
    pub prefix_cache_bytes: u64,
    pub prefix_cache_entries: usize,
    /// How long running requests may go on after a shutdown request.
    pub shutdown_grace: Duration,
    /// The draft model stops drafting when its token's probability is below this.
    pub draft_p_min: f32,
}

/// Counters the HTTP side reads.
#[derive(Default)]
pub struct Shared {
    /// Requests accepted and not yet gone, waiting or running (see [`Place`]).
    pub occupied: AtomicUsize,
    /// Jobs sent and not yet admitted (the HTTP side counts them in).
    pub queued: AtomicUsize,
    pub active: AtomicUsize,
    /// The oldest waiting job waits for memory, not for a slot.
    pub memory_blocked: AtomicBool,
    pub reserved_bytes: AtomicU64,
    pub prefix_entries: AtomicUsize,
    pub prefix_bytes: AtomicU64,
    pub steps: AtomicU64,
    pub last_batch: AtomicUsize,
    /// Tokens run through the model (prompt and generated).
    pub tokens_run: AtomicU64,
    pub tokens_generated: AtomicU64,
    pub stopped: AtomicBool,
}

struct Seq {
    job: Job,
    state: SeqState,
    sampler: Sampler,
    out: OutputText,
    generated: Vec<u32>,
    /// Logits to sample from without running the model (a prompt seen before).
    ready: Option<Vec<f32>>,
    prompt_end: Option<PromptEnd>,
    /// Recurrent-state snapshots where earlier turns ended (for the prefix cache).
    checkpoints: Vec<Snapshot>,
    cached: usize,
    last_token: Option<Instant>,
    spec: Option<SeqSpec>,
}

pub struct Scheduler {
    engine: Arc<Engine>,
    /// The draft model of requests that draft with one.
    draft: Option<Arc<Engine>>,
    cfg: SchedulerConfig,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
    waiting: VecDeque<Job>,
    active: Vec<Seq>,
    prefix: PrefixCache,
    shutdown_at: Option<Instant>,
}

/// Starts the scheduler thread.
pub fn spawn(
    engine: Arc<Engine>,
    draft: Option<Arc<Engine>>,
    cfg: SchedulerConfig,
    shared: Arc<Shared>,
    metrics: Arc<Metrics>,
) -> std::io::Result<(Sender<Cmd>, std::thread::JoinHandle<()>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let prefix = PrefixCache::new(cfg.prefix_cache_bytes, cfg.prefix_cache_entries);
    let s = Scheduler {
        engine,
        draft,
        cfg,
        shared,
        metrics,
        waiting: VecDeque::new(),
        active: Vec::new(),
        prefix,
        shutdown_at: None,
    };
    let h = std::thread::Builder::new().name("sluice-scheduler".into()).spawn(move || s.run(rx))?;
    Ok((tx, h))
}

fn send(job: &Job, e: Event) {
    // A closed channel means the client left; the job is dropped at the next step.
    let _ = job.events.send(e);
}

impl Scheduler {
    fn run(mut self, rx: Receiver<Cmd>) {
        loop {
            if self.active.is_empty() && self.waiting.is_empty() {
                if self.shutdown_at.is_some() {
                    break;
                }
                match rx.recv() {
                    Ok(c) => self.command(c),
                    Err(_) => break,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(c) => self.command(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.command(Cmd::Shutdown);
                        break;
                    }
                }
            }
            self.drop_cancelled();
            if self.shutdown_at.is_some_and(|t| Instant::now() >= t) {
                for s in self.active.drain(..) {
                    send(&s.job, Event::Error(ApiError::unavailable("the server is shutting down", 5)));
                }
                break;
            }
            self.admit();
            self.publish();
            if self.active.is_empty() {
                if !self.waiting.is_empty() {
                    // Waiting for memory that nothing running will free: wait for news.
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(c) => self.command(c),
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => self.command(Cmd::Shutdown),
                    }
                }
                continue;
            }
            self.step();
            self.publish();
        }
        self.shared.stopped.store(true, Ordering::SeqCst);
        self.publish();
    }

    fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Submit(job) => {
                if self.shutdown_at.is_some() {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    send(&job, Event::Error(ApiError::unavailable("the server is shutting down", 5)));
                } else {
                    self.waiting.push_back(*job);
                }
            }
            Cmd::Shutdown => {
                if self.shutdown_at.is_none() {
                    self.shutdown_at = Some(Instant::now() + self.cfg.shutdown_grace);
                }
                for job in self.waiting.drain(..) {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    send(&job, Event::Error(ApiError::unavailable("the server is shutting down", 5)));
                }
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        let gone = before - self.waiting.len();
        if gone > 0 {
            self.shared.queued.fetch_sub(gone, Ordering::SeqCst);
            self.metrics.cancelled.inc_by(gone as u64);
        }
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.events.is_closed() {
                let s = self.active.swap_remove(i);
                self.metrics.cancelled.inc();
                self.retire(s);
            } else {
                i += 1;
            }
        }
    }

    fn reserved(&self) -> u64 {
        self.active.iter().map(|s| s.job.reserve).sum()
    }

    fn admit(&mut self) {
        let mut blocked = false;
        while self.active.len() < self.cfg.parallel {
            let Some(job) = self.waiting.front() else { break };
            let held = self.reserved();
            if held + job.reserve > self.cfg.state_budget {
                blocked = true;
                break;
            }
            let Some(job) = self.waiting.pop_front() else { break };
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
            // A head that reads the target's hidden rows needs every prompt position run: such
            // a request does not continue from a cached prefix.
            let mtp = job.spec.is_some_and(|(m, _)| m == SpecMethod::Mtp);
            let reuse = if mtp { None } else { self.prefix.take(&job.prompt) };
            self.prefix.evict_to(self.cfg.state_budget.saturating_sub(held + job.reserve));
            let (state, cached, ready, prompt_end, mut checkpoints) = match reuse {
                Some(r) => (r.state, r.len, r.logits, r.prompt_end, r.checkpoints),
                None => (self.engine.model.new_state(self.cfg.ctx_size), 0, None, None, Vec::new()),
            };
            // Where this turn continues from is where a branch of the conversation may return.
            if state.has_recurrent() && cached > 0 && checkpoints.last().is_none_or(|c| c.len() < cached) {
                checkpoints.push(state.snapshot());
            }
            self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
            self.metrics.reused_prompt_tokens.inc_by(cached as u64);
            let sampler = Sampler::new(job.sampler.clone());
            let greedy = job.sampler.temperature == 0.0;
            let (draft, ctx, p_min) = (self.draft.as_ref(), self.cfg.ctx_size, self.cfg.draft_p_min);
            let spec = job.spec.map(|(m, k)| SeqSpec::new(m, k, greedy, &self.engine, draft, ctx, p_min));
            let out = OutputText::with_literals(job.stop_strings.clone(), job.literal_tokens.clone());
            self.active.push(Seq {
                job,
                state,
                sampler,
                out,
                generated: Vec::new(),
                ready,
                prompt_end,
                checkpoints,
                cached,
                last_token: None,
                spec,
            });
        }
        self.shared.memory_blocked.store(blocked, Ordering::SeqCst);
    }

    fn publish(&self) {
        let m = &self.metrics;
        let queued = self.shared.queued.load(Ordering::SeqCst);
        m.queue_depth.set(queued as i64);
        m.active.set(self.active.len() as i64);
        self.shared.active.store(self.active.len(), Ordering::SeqCst);
        let reserved = self.reserved();
        self.shared.reserved_bytes.store(reserved, Ordering::SeqCst);
        m.state_reserved_bytes.set(reserved as i64);
        self.shared.prefix_entries.store(self.prefix.len(), Ordering::SeqCst);
        self.shared.prefix_bytes.store(self.prefix.bytes(), Ordering::SeqCst);
        m.prefix_cache_bytes.set(self.prefix.bytes() as i64);
        m.prefix_cache_entries.set(self.prefix.len() as i64);
    }

    /// One forward pass over the batch, then sampling for every sequence that has logits.
    fn step(&mut self) {
        let t0 = Instant::now();
        let mut budget = self.cfg.prefill_chunk.max(1);
        // (index into active, tokens, want)
        let mut plan: Vec<(usize, std::ops::Range<usize>, bool, Logits)> = Vec::new();
        for (i, s) in self.active.iter_mut().enumerate() {
            if s.ready.is_some() {
                continue;
            }
            let pos = s.state.len();
            let n = s.job.prompt.len();
            if pos < n {
                if budget == 0 {
                    continue;
                }
                let end = (pos + budget).min(n);
                budget -= end - pos;
                let want = if s.spec.as_ref().is_some_and(|sp| sp.wants_hidden()) {
                    // Every row's hidden state; the last row's logits are made from it.
                    Logits::HiddenOnly
                } else if end == n {
                    Logits::Last
                } else {
                    Logits::None
                };
                plan.push((i, pos..end, true, want));
            } else {
                let g = s.generated.len();
                let mut want = Logits::Last;
                if let Some(sp) = s.spec.as_mut() {
                    // Room for drafts: the step yields up to 1 + drafts tokens and runs as many
                    // positions.
                    let room =
                        s.job.max_tokens.saturating_sub(g + 1).min(s.state.max_len().saturating_sub(s.state.len() + 1));
                    if sp.plan(&self.engine, &mut s.state, &s.job.prompt, &s.generated, room) > 0 {
                        want = Logits::All;
                        sp.start = s.state.len();
                        if s.state.rewinds_by_snapshot() && sp.snap.is_none() {
                            sp.snap = Some(s.state.snapshot());
                        }
                    }
                }
                plan.push((i, g - 1..g, false, want));
            }
        }
        let mut results: Vec<Option<Result<Rows, String>>> = (0..self.active.len()).map(|_| None).collect();
        if !plan.is_empty() {
            let tokens: usize = plan.iter().map(|p| p.1.len()).sum();
            self.metrics.batch_size.observe(plan.len() as f64);
            self.metrics.batch_tokens.observe(tokens as f64);
            self.shared.last_batch.store(plan.len(), Ordering::SeqCst);
            match self.forward(&plan) {
                Ok(out) => {
                    for ((i, ..), rows) in plan.iter().zip(out) {
                        results[*i] = Some(Ok(rows));
                    }
                }
                Err(_) if plan.len() > 1 => {
                    // Find who failed: each alone (the same bits as together).
                    for p in &plan {
                        results[p.0] = Some(self.forward(std::slice::from_ref(p)).map(|mut v| v.remove(0)));
                    }
                }
                Err(e) => results[plan[0].0] = Some(Err(e)),
            }
            self.shared.tokens_run.fetch_add(tokens as u64, Ordering::Relaxed);
        }
        // Sample, emit, retire; walk backwards so removals keep indices valid.
        for i in (0..self.active.len()).rev() {
            let (mut logits, hidden) = match results[i].take() {
                Some(Ok(rows)) => rows,
                Some(Err(e)) => {
                    let s = self.active.swap_remove(i);
                    self.metrics.failed.inc();
                    send(&s.job, Event::Error(ApiError::internal(format!("the model failed on this request: {e}"))));
                    continue;
                }
                None => match self.active[i].ready.take() {
                    Some(l) => (l, Vec::new()),
                    None => continue,
                },
            };
            let s = &mut self.active[i];
            if let Some(sp) = s.spec.as_mut().filter(|sp| sp.wants_hidden() && s.generated.is_empty()) {
                // A prompt chunk run for its hidden rows: they go to the head, and the
                // prompt's last row's logits are made from its row (the same bits).
                sp.feed(&hidden);
                if s.state.len() == s.job.prompt.len() {
                    let hd = self.engine.model.cfg.hidden;
                    logits = self.engine.model.output_logits(&hidden[hidden.len() - hd..]);
                }
            }
            if logits.is_empty() {
                continue; // a prefill chunk before the prompt's last
            }
            // Drafts planned for this step (None: it did not decode a speculating sequence).
            let drafted = self.active[i].spec.as_ref().and_then(|sp| sp.batch.len().checked_sub(1));
            let finished = match drafted {
                Some(k) if k > 0 => self.verify(i, logits, &hidden, t0.elapsed().as_secs_f64()),
                _ => {
                    if let Some(sp) = self.active[i].spec.as_mut().filter(|_| drafted.is_some()) {
                        sp.observe(0, 0, t0.elapsed().as_secs_f64(), &hidden);
                        sp.batch.clear();
                    }
                    self.sample(i, logits)
                }
            };
            if finished {
                let s = self.active.swap_remove(i);
                self.retire(s);
            }
        }
        self.shared.steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.step_seconds.observe(t0.elapsed().as_secs_f64());
    }

    /// Runs the planned rows as one batch; on an error (or a panic) every state is as before.
    /// Returns each item's (logits, final-normed hidden rows), as `forward_batch` does.
    fn forward(&mut self, plan: &[(usize, std::ops::Range<usize>, bool, Logits)]) -> Result<Vec<Rows>, String> {
        let engine = &self.engine;
        let mut seqs: Vec<Option<&mut Seq>> = self.active.iter_mut().map(Some).collect();
        let mut items = Vec::with_capacity(plan.len());
        for (i, range, prefill, want) in plan {
            let Some(s) = seqs[*i].take() else { return Err("a sequence was planned twice".into()) };
            let Seq { state, job, generated, spec, .. } = s;
            let drafting = spec.as_ref().filter(|sp| !sp.drafts().is_empty());
            let tokens = if *prefill {
                &job.prompt[range.clone()]
            } else if let Some(sp) = drafting {
                &sp.batch[..]
            } else {
                &generated[range.clone()]
            };
            items.push(BatchItem { state, tokens, want: *want });
        }
        let r = catch_unwind(AssertUnwindSafe(|| engine.model.forward_batch(&mut items, None)));
        match r {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(e)) => Err(e.to_string()),
            Err(p) => {
                for it in items.iter_mut() {
                    it.state.abort();
                }
                let msg = p
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "panic".into());
                Err(format!("internal error: {msg}"))
            }
        }
    }

    /// Samples the next token of active sequence `i`; returns whether it finished.
    fn sample(&mut self, i: usize, logits: Vec<f32>) -> bool {
        let keep_prompt_end = self.cfg.prefix_cache_entries > 0;
        let s = &mut self.active[i];
        if s.generated.is_empty() && s.prompt_end.is_none() && keep_prompt_end {
            s.prompt_end = Some(PromptEnd { snapshot: s.state.snapshot(), logits: logits.clone() });
        }
        let picked = s.sampler.sample_full(&logits, s.job.logprobs);
        let len = s.state.len();
        self.emit(i, picked, len)
    }

    /// Verifies the drafts of active sequence `i` against the step's `logits` (one row per
    /// position of its item), emits the tokens kept and the one drawn after them, and brings
    /// its state back to what they leave; returns whether it finished.
    fn verify(&mut self, i: usize, logits: Vec<f32>, hidden: &[f32], step_secs: f64) -> bool {
        let engine = self.engine.clone();
        let vocab = engine.model.cfg.vocab_size;
        let Some(sp) = self.active[i].spec.as_mut() else { return self.sample(i, logits) };
        let batch = std::mem::take(&mut sp.batch);
        let (start, snap) = (sp.start, sp.snap.take());
        let drafted = batch.len() - 1;
        let (mut emitted, mut kept, mut finished) = (0, 0, false);
        for (j, row) in logits.chunks_exact(vocab).enumerate().take(batch.len()) {
            let s = &mut self.active[i];
            let (picked, was_draft) = match batch.get(j + 1) {
                Some(&x) => verify::verify_one(&mut s.sampler, row, x, s.job.logprobs),
                None => (s.sampler.sample_full(row, s.job.logprobs), false),
            };
            emitted += 1;
            kept += usize::from(was_draft);
            // The state will hold the item's first `emitted` positions.
            finished = self.emit(i, picked, start + emitted);
            if finished || !was_draft {
                break;
            }
        }
        self.metrics.spec_drafted_tokens.inc_by(drafted as u64);
        self.metrics.spec_accepted_tokens.inc_by(kept as u64);
        let s = &mut self.active[i];
        if let Some(sp) = s.spec.as_mut() {
            let hd = engine.model.cfg.hidden;
            sp.observe(drafted, kept, step_secs, &hidden[..(emitted * hd).min(hidden.len())]);
        }
        if let Err(e) = verify::rewind_target(&engine, &mut s.state, start + emitted, snap.as_ref(), &batch) {
            if !finished {
                send(&s.job, Event::Error(ApiError::internal(format!("the model failed on this request: {e}"))));
            }
            // The state is not what its tokens say: it must not reach the prefix cache.
            s.state.reset();
            return true;
        }
        finished
    }

    /// Emits token `picked` of active sequence `i`, whose state will then hold `len`
    /// positions; returns whether the sequence finished.
    fn emit(&mut self, i: usize, picked: Sampled, len: usize) -> bool {
        let engine = self.engine.clone();
        let s = &mut self.active[i];
        s.generated.push(picked.token);
        let now = Instant::now();
        match s.last_token {
            None => self.metrics.ttft_seconds.observe((now - s.job.arrived).as_secs_f64()),
            Some(t) => self.metrics.inter_token_seconds.observe((now - t).as_secs_f64()),
        }
        s.last_token = Some(now);
        self.metrics.generated_tokens.inc();
        self.shared.tokens_generated.fetch_add(1, Ordering::Relaxed);
        let Some(tok) = engine.tokenizer.as_ref() else {
            send(&s.job, Event::Error(ApiError::internal("the model has no tokenizer")));
            return true;
        };
        let (chunk, finish) = if s.job.stop_tokens.contains(&picked.token) {
            (s.out.finish(tok).0, Some(Finish::Stop))
        } else {
            let info = TokenInfo { id: picked.token, logprob: picked.logprob, top: picked.top };
            let (mut chunk, stopped) = s.out.push(tok, info);
            if stopped {
                (chunk, Some(Finish::Stop))
            } else if s.generated.len() >= s.job.max_tokens || len + 1 > s.state.max_len() {
                let (rest, stopped) = s.out.finish(tok);
                chunk.text.push_str(&rest.text);
                chunk.tokens.extend(rest.tokens);
                (chunk, Some(if stopped { Finish::Stop } else { Finish::Length }))
            } else {
                (chunk, None)
            }
        };
        if !chunk.is_empty() {
            send(&s.job, Event::Chunk(chunk));
        }
        if let Some(finish) = finish {
            send(
                &s.job,
                Event::Done(Done {
                    finish,
                    prompt_tokens: s.job.prompt.len(),
                    completion_tokens: s.generated.len(),
                    cached_tokens: s.cached,
                }),
            );
            return true;
        }
        false
    }

    /// A sequence leaves the batch: its state goes to the prefix cache.
    fn retire(&mut self, s: Seq) {
        let Seq { job, state, generated, prompt_end, checkpoints, .. } = s;
        let n = state.len();
        let mut tokens = job.prompt;
        tokens.truncate(n);
        if n > tokens.len() {
            tokens.extend_from_slice(&generated[..(n - tokens.len()).min(generated.len())]);
        }
        let prompt_end = prompt_end.filter(|p| p.snapshot.len() <= n);
        self.prefix.insert(tokens, state, prompt_end, checkpoints);
        let room = self.cfg.state_budget.saturating_sub(self.reserved());
        self.prefix.evict_to(room);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_counted_until_their_holders_go() {
        let shared = Arc::new(Shared::default());
        let a = Place::take(&shared, 2).expect("a first place");
        let b = Place::take(&shared, 2).expect("a second place");
        assert!(Place::take(&shared, 2).is_none(), "a third place beyond the limit");
        drop(a);
        let c = Place::take(&shared, 2).expect("the place given back");
        assert!(Place::take(&shared, 2).is_none());
        drop((b, c));
        assert_eq!(shared.occupied.load(Ordering::SeqCst), 0);
    }
}

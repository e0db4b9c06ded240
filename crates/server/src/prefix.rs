//! Prefix reuse: the states of finished sequences, kept in a small LRU keyed by the tokens
//! they hold, so that a request whose prompt extends one (the next turn of a chat, the same
//! prompt again) runs only what it adds.
//!
//! Attention state can be cut back to any common prefix (`SeqState::truncate`); a recurrent
//! state cannot, so an entry also keeps a snapshot at the end of its prompt, with that
//! position's logits, and snapshots where earlier turns ended (checkpoints): a request can
//! continue from the whole sequence (its prompt extends every token the state holds), from a
//! snapshot (its prompt extends the tokens up to it: an earlier prompt, a branch of the
//! conversation), or, with the same prompt, sample from the kept logits without running
//! anything. The results are the same bits as recomputing: a state's contents do not depend on
//! how its tokens were chunked.

use sluice_model::{SeqState, Snapshot};

/// A sequence's state at the end of its prompt, and the logits there.
pub struct PromptEnd {
    pub snapshot: Snapshot,
    pub logits: Vec<f32>,
}

impl PromptEnd {
    fn bytes(&self) -> u64 {
        (self.snapshot.bytes() + 4 * self.logits.len()) as u64
    }
}

struct Entry {
    /// The tokens whose state `state` holds.
    tokens: Vec<u32>,
    state: SeqState,
    prompt_end: Option<PromptEnd>,
    /// Recurrent states at earlier lengths (where earlier turns ended), oldest first.
    checkpoints: Vec<Snapshot>,
    bytes: u64,
    used: u64,
}

/// Most checkpoints kept per sequence.
pub const MAX_CHECKPOINTS: usize = 4;

/// What a new request continues from.
pub struct Reuse {
    pub state: SeqState,
    /// Prompt tokens already in `state`.
    pub len: usize,
    /// The logits after the whole prompt, when the prompt was an earlier one exactly.
    pub logits: Option<Vec<f32>>,
    pub prompt_end: Option<PromptEnd>,
    /// Snapshots at or before `len` (recurrent state), to keep with the sequence.
    pub checkpoints: Vec<Snapshot>,
}

pub struct PrefixCache {
    entries: Vec<Entry>,
    max_bytes: u64,
    max_entries: usize,
    bytes: u64,
    tick: u64,
}

impl PrefixCache {
    pub fn new(max_bytes: u64, max_entries: usize) -> PrefixCache {
        PrefixCache { entries: Vec::new(), max_bytes, max_entries, bytes: 0, tick: 0 }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps a finished sequence's state (`tokens`: what it holds).
    pub fn insert(
        &mut self,
        tokens: Vec<u32>,
        state: SeqState,
        prompt_end: Option<PromptEnd>,
        mut checkpoints: Vec<Snapshot>,
    ) {
        if tokens.is_empty() || self.max_entries == 0 || tokens.len() != state.len() {
            return;
        }
        checkpoints.retain(|c| c.len() <= tokens.len());
        if checkpoints.len() > MAX_CHECKPOINTS {
            checkpoints.drain(..checkpoints.len() - MAX_CHECKPOINTS);
        }
        let bytes = (state.bytes() + 4 * tokens.len()) as u64
            + prompt_end.as_ref().map_or(0, |p| p.bytes())
            + checkpoints.iter().map(|c| c.bytes() as u64).sum::<u64>();
        if bytes > self.max_bytes {
            return;
        }
        // An entry whose tokens the new one extends is of no more use.
        let mut i = 0;
        while i < self.entries.len() {
            if tokens.starts_with(&self.entries[i].tokens) {
                self.remove(i);
            } else {
                i += 1;
            }
        }
        self.tick += 1;
        self.entries.push(Entry { tokens, state, prompt_end, checkpoints, bytes, used: self.tick });
        self.bytes += bytes;
        self.evict_to(self.max_bytes);
        while self.entries.len() > self.max_entries {
            self.evict_one();
        }
    }

    fn remove(&mut self, i: usize) -> Entry {
        let e = self.entries.swap_remove(i);
        self.bytes -= e.bytes;
        e
    }

    fn evict_one(&mut self) {
        if let Some(i) = (0..self.entries.len()).min_by_key(|i| self.entries[*i].used) {
            self.remove(i);
        }
    }

    /// Drops least recently used entries until at most `bytes` are held.
    pub fn evict_to(&mut self, bytes: u64) {
        while self.bytes > bytes && !self.entries.is_empty() {
            self.evict_one();
        }
    }

    /// Takes the entry `prompt` can continue from furthest, brought back to where it
    /// continues; `None` when no entry shares a usable prefix.
    pub fn take(&mut self, prompt: &[u32]) -> Option<Reuse> {
        let n = prompt.len();
        let mut best: Option<(usize, usize, Plan)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let common = e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count();
            let pe_len = e.prompt_end.as_ref().map(|p| p.snapshot.len());
            let mut cands: Vec<(usize, Plan)> = Vec::new();
            if pe_len == Some(n) && common >= n {
                cands.push((n, Plan::Exact));
            }
            if !e.state.has_recurrent() {
                cands.push((common.min(n.saturating_sub(1)), Plan::Truncate));
            } else {
                if common == e.tokens.len() && e.tokens.len() < n {
                    cands.push((e.tokens.len(), Plan::Whole));
                }
                if let Some(p) = pe_len.filter(|p| *p <= common && *p < n) {
                    cands.push((p, Plan::Snapshot));
                }
                for (k, c) in e.checkpoints.iter().enumerate() {
                    if c.len() <= common && c.len() < n {
                        cands.push((c.len(), Plan::Checkpoint(k)));
                    }
                }
            }
            for (len, plan) in cands {
                let better = match &best {
                    None => len > 0,
                    Some((l, _, p)) => len > *l || (len == *l && plan == Plan::Exact && *p != Plan::Exact),
                };
                if better {
                    best = Some((len, i, plan));
                }
            }
        }
        let (len, i, plan) = best?;
        let Entry { mut state, prompt_end, mut checkpoints, .. } = self.remove(i);
        let mut logits = None;
        let mut keep_end = None;
        let ok = match plan {
            Plan::Exact => {
                let pe = prompt_end.expect("an exact plan has a prompt end");
                let r = state.restore(&pe.snapshot).is_ok();
                logits = Some(pe.logits.clone());
                keep_end = Some(pe);
                r
            }
            Plan::Truncate => state.truncate(len).is_ok(),
            Plan::Whole => {
                checkpoints.extend(prompt_end.map(|p| p.snapshot));
                true
            }
            Plan::Snapshot => prompt_end.is_some_and(|pe| {
                let r = state.restore(&pe.snapshot).is_ok();
                checkpoints.push(pe.snapshot);
                r
            }),
            Plan::Checkpoint(k) => state.restore(&checkpoints[k]).is_ok(),
        };
        // Snapshots past the point of return describe tokens the sequence no longer holds.
        checkpoints.retain(|c| c.len() <= len);
        checkpoints.sort_by_key(|c| c.len());
        checkpoints.dedup_by_key(|c| c.len());
        let checkpoints = if state.has_recurrent() { checkpoints } else { Vec::new() };
        (ok && state.len() == len).then_some(Reuse { state, len, logits, prompt_end: keep_end, checkpoints })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Plan {
    /// The same prompt: back to its end, with its logits.
    Exact,
    /// Attention state cut to the common prefix.
    Truncate,
    /// The prompt extends every token held.
    Whole,
    /// Back to the snapshot at the old prompt's end.
    Snapshot,
    /// Back to an earlier checkpoint.
    Checkpoint(usize),
}

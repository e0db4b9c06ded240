//! A sequence's state, per layer: keys and values for attention layers, the convolution tail
//! and the recurrent matrix for Gated DeltaNet layers.
//!
//! Invariants:
//! * every layer holds exactly `len` positions' worth of state once a forward pass returns;
//! * a forward pass is all or nothing: attention layers append past `len` and recurrent
//!   layers write their next state into a second buffer; `commit` makes both current, and a
//!   failed pass leaves the state exactly as it was (`abort`);
//! * keys and values are stored in f32, so prefill and decode read back exactly what they
//!   wrote; a recurrent state is the same bits however the tokens that built it were chunked.
//!
//! A sliding-window layer keeps a bounded tail: the last `window − 1` positions (all a later
//! token can see) plus up to `window` more, dropped in batches so that appending stays cheap.
//!
//! Rewinding: attention state can be cut to any earlier length whose window it still holds
//! (`truncate`, `can_truncate`); a recurrent state cannot, so speculative decoding and prefix
//! reuse take a `snapshot` where they may want to return, and `restore` it.

use crate::config::{MixerKind, ModelConfig};
use crate::error::{ModelError, Result};

/// Keys and values of one attention layer: rows for positions `start..`, `k_dim` and `v_dim`
/// values each (a latent attention layer keeps only its latent, in `k`). `start` stays 0
/// unless the layer has a sliding `window`.
#[derive(Clone, Debug, Default)]
pub struct KvLayer {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub k_dim: usize,
    pub v_dim: usize,
    pub window: Option<usize>,
    pub start: usize,
}

impl KvLayer {
    /// Keeps rows from position `from` on (≥ `start`), up to position `end`.
    fn keep(&mut self, from: usize, end: usize) {
        let (drop, rows) = (from - self.start, end - self.start);
        self.k.truncate(rows * self.k_dim);
        self.v.truncate(rows * self.v_dim);
        self.k.drain(..drop * self.k_dim);
        self.v.drain(..drop * self.v_dim);
        self.start = from;
    }

    /// The first position a token at `len` or later may need.
    fn needed_from(&self, len: usize) -> usize {
        self.window.map_or(0, |w| len.saturating_sub(w - 1))
    }
}

/// A Gated DeltaNet layer's state, double-buffered: `cur` is committed, the other buffer
/// receives the state a forward pass computes.
#[derive(Clone, Debug)]
pub struct RecurrentLayer {
    /// The last `conv_kernel − 1` inputs of the convolution, oldest first (`(K−1) × conv_dim`).
    conv: [Vec<f32>; 2],
    /// Per value head, the `d_k × d_v` state, stored one value column after another
    /// (`[head][j][i]` = S[i, j]) so the update walks contiguous key-sized rows.
    s: [Vec<f32>; 2],
    cur: usize,
    /// The pending buffer holds this pass's result.
    written: bool,
}

impl RecurrentLayer {
    fn new(conv_len: usize, s_len: usize) -> RecurrentLayer {
        RecurrentLayer {
            conv: [vec![0.0; conv_len], vec![0.0; conv_len]],
            s: [vec![0.0; s_len], vec![0.0; s_len]],
            cur: 0,
            written: false,
        }
    }

    /// The committed state (read) and the buffer for the next one (written): conv, then s.
    pub fn split(&mut self) -> (&[f32], &[f32], &mut [f32], &mut [f32]) {
        self.written = true;
        let (c0, c1) = self.conv.split_at_mut(1);
        let (s0, s1) = self.s.split_at_mut(1);
        if self.cur == 0 {
            (&c0[0], &s0[0], &mut c1[0], &mut s1[0])
        } else {
            (&c1[0], &s1[0], &mut c0[0], &mut s0[0])
        }
    }

    pub fn committed(&self) -> (&[f32], &[f32]) {
        (&self.conv[self.cur], &self.s[self.cur])
    }

    fn reset(&mut self) {
        for b in self.conv.iter_mut().chain(self.s.iter_mut()) {
            b.fill(0.0);
        }
        self.written = false;
    }
}

#[derive(Clone, Debug)]
pub enum LayerState {
    Kv(KvLayer),
    Recurrent(RecurrentLayer),
}

pub struct SeqState {
    layers: Vec<LayerState>,
    len: usize,
    max_len: usize,
    /// This state's identity, and how many times positions it had stored were taken back
    /// (`truncate`, `restore`): a device copy of its keys and values made at one (id, edits)
    /// is still a copy of its first positions at the same pair.
    id: u64,
    edits: u64,
    /// The length each of the last `CUTS_KEPT` edits cut back to (the newest last): the
    /// positions below it were not touched by that edit.
    cuts: std::collections::VecDeque<usize>,
}

/// Edits whose cut `SeqState::unchanged_below` remembers: a copy older than that many edits
/// is treated as holding nothing (a speculative decoder edits once per rejected draft).
const CUTS_KEPT: usize = 64;

/// The next `SeqState::id`.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A sliding-window layer's saved tail: its first position, keys and values.
type Tail = (usize, Vec<f32>, Vec<f32>);

/// A copy of a sequence's state at one length, to return to later.
#[derive(Clone, Debug)]
pub struct Snapshot {
    len: usize,
    /// Per layer: the committed (conv, s) of recurrent layers.
    recurrent: Vec<Option<(Vec<f32>, Vec<f32>)>>,
    /// Per layer: a sliding-window layer's visible tail (start, keys, values).
    tails: Vec<Option<Tail>>,
}

impl Snapshot {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes it holds: recurrent state and sliding-window tails (full attention state is not
    /// copied).
    pub fn bytes(&self) -> usize {
        self.recurrent.iter().flatten().map(|(c, s)| 4 * (c.len() + s.len())).sum::<usize>()
            + self.tails.iter().flatten().map(|(_, k, v)| 4 * (k.len() + v.len())).sum::<usize>()
    }
}

impl SeqState {
    /// An empty state for `cfg`'s layers, holding up to `max_len` positions.
    pub fn new(cfg: &ModelConfig, max_len: usize) -> SeqState {
        let layers = cfg
            .layers
            .iter()
            .enumerate()
            .map(|(l, spec)| match spec.mixer {
                MixerKind::Attention { .. } | MixerKind::Mla => {
                    let (k_dim, v_dim) = cfg.kv_widths(l);
                    LayerState::Kv(KvLayer { k_dim, v_dim, window: cfg.window(l), ..Default::default() })
                }
                MixerKind::GatedDeltaNet => {
                    let d = cfg.delta_net.expect("validated: DeltaNet layers have dimensions");
                    let conv = (d.conv_kernel - 1) * d.conv_dim();
                    LayerState::Recurrent(RecurrentLayer::new(conv, d.n_v_heads * d.d_k * d.d_v))
                }
            })
            .collect();
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        SeqState { layers, len: 0, max_len, id, edits: 0, cuts: Default::default() }
    }

    /// Positions stored.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// (id, edits): while both stay the same, the keys and values of every position below
    /// `len()` stay as they were when they were appended.
    pub fn lineage(&self) -> (u64, u64) {
        (self.id, self.edits)
    }

    /// How many leading positions hold the same keys and values now as when this state's
    /// lineage was `then` (and had at least that many positions): what a copy made then still
    /// holds correctly. 0 for another sequence's lineage, or one more than `CUTS_KEPT` edits
    /// ago. Taking positions back (`truncate`, `restore`) leaves those below the cut as they
    /// were, so a copy need only be brought up from the shortest cut since.
    pub fn unchanged_below(&self, then: (u64, u64)) -> usize {
        let (id, edits) = then;
        if id != self.id || edits > self.edits {
            return 0;
        }
        let since = (self.edits - edits) as usize;
        if since > self.cuts.len() {
            return 0;
        }
        self.cuts.iter().rev().take(since).fold(self.len, |m, &c| m.min(c))
    }

    /// Records an edit that kept the first `len` positions as they were.
    fn edited(&mut self, len: usize) {
        self.edits += 1;
        if self.cuts.len() == CUTS_KEPT {
            self.cuts.pop_front();
        }
        self.cuts.push_back(len);
    }

    /// Whether any layer keeps a recurrent state (which cannot be cut back by `truncate`).
    pub fn has_recurrent(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerState::Recurrent(_)))
    }

    /// Whether rewinding needs a snapshot: a recurrent state, or a sliding window that drops
    /// what it no longer needs.
    pub fn rewinds_by_snapshot(&self) -> bool {
        self.layers.iter().any(|l| match l {
            LayerState::Recurrent(_) => true,
            LayerState::Kv(kv) => kv.window.is_some(),
        })
    }

    /// Whether `truncate(len)` can work: always for a fresh sequence or a longer length; for
    /// attention state when every sliding-window layer still holds the window at `len`; never
    /// for a recurrent state.
    pub fn can_truncate(&self, len: usize) -> bool {
        len == 0
            || len >= self.len
            || self.layers.iter().all(|l| match l {
                LayerState::Recurrent(_) => false,
                LayerState::Kv(kv) => kv.start <= kv.needed_from(len),
            })
    }

    /// Forgets every position from `len` on. Always possible for full attention state, and for
    /// `len` 0 (a fresh sequence); a recurrent state cannot be rewound to any other length,
    /// nor a sliding window past what it dropped: restore a snapshot taken there instead.
    pub fn truncate(&mut self, len: usize) -> Result<()> {
        if len >= self.len {
            return Ok(());
        }
        if !self.can_truncate(len) {
            let what =
                if self.has_recurrent() { "a recurrent (Gated DeltaNet) state" } else { "a sliding-window state" };
            return Err(ModelError::Input(format!(
                "{what} cannot be rewound from {} to {len} positions; restore a snapshot taken at {len}",
                self.len
            )));
        }
        self.cut_kv(len);
        self.edited(len);
        if len == 0 {
            for l in &mut self.layers {
                if let LayerState::Recurrent(r) = l {
                    r.reset();
                }
            }
        }
        self.len = len;
        Ok(())
    }

    /// A fresh sequence.
    pub fn reset(&mut self) {
        self.truncate(0).expect("truncating to 0 always works");
    }

    /// Cuts every attention layer back to `len` positions (a sliding window to those it holds;
    /// all of them for 0).
    fn cut_kv(&mut self, len: usize) {
        for l in &mut self.layers {
            if let LayerState::Kv(kv) = l {
                if len == 0 {
                    kv.start = 0;
                }
                let rows = len.saturating_sub(kv.start);
                kv.k.truncate(rows * kv.k_dim);
                kv.v.truncate(rows * kv.v_dim);
            }
        }
    }

    /// Copies what is needed to come back to this length later.
    pub fn snapshot(&self) -> Snapshot {
        let recurrent = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Recurrent(r) => {
                    let (c, s) = r.committed();
                    Some((c.to_vec(), s.to_vec()))
                }
                LayerState::Kv(_) => None,
            })
            .collect();
        let tails = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kv(kv) if kv.window.is_some() => {
                    let from = kv.needed_from(self.len).max(kv.start);
                    let (ks, vs) = ((from - kv.start) * kv.k_dim, (from - kv.start) * kv.v_dim);
                    Some((from, kv.k[ks..].to_vec(), kv.v[vs..].to_vec()))
                }
                _ => None,
            })
            .collect();
        Snapshot { len: self.len, recurrent, tails }
    }

    /// Returns to a snapshot taken from this sequence at a length it has not gone below since.
    pub fn restore(&mut self, snap: &Snapshot) -> Result<()> {
        if snap.len > self.len || snap.recurrent.len() != self.layers.len() {
            return Err(ModelError::Input(format!(
                "cannot restore a snapshot of {} positions into a state of {} positions",
                snap.len, self.len
            )));
        }
        self.cut_kv(snap.len);
        self.edited(snap.len);
        for ((l, saved), tail) in self.layers.iter_mut().zip(&snap.recurrent).zip(&snap.tails) {
            match (l, saved, tail) {
                (LayerState::Recurrent(r), Some((c, s)), _) => {
                    let cur = r.cur;
                    r.conv[cur].copy_from_slice(c);
                    r.s[cur].copy_from_slice(s);
                    r.written = false;
                }
                (LayerState::Kv(kv), _, Some((start, k, v))) => {
                    kv.start = *start;
                    kv.k.clear();
                    kv.k.extend_from_slice(k);
                    kv.v.clear();
                    kv.v.extend_from_slice(v);
                }
                _ => {}
            }
        }
        self.len = snap.len;
        Ok(())
    }

    /// Layer `l`'s state.
    pub fn layer(&self, l: usize) -> &LayerState {
        &self.layers[l]
    }

    /// Appends `n` positions of keys and values to attention layer `l` (rows `k` and `v`,
    /// `n × k_dim` and `n × v_dim`). Every attention layer must be appended the same `n`
    /// before `commit(n)`.
    pub fn append_kv(&mut self, l: usize, k: &[f32], v: &[f32]) {
        let len = self.len;
        let LayerState::Kv(kv) = &mut self.layers[l] else { panic!("layer {l} has no KV cache") };
        debug_assert_eq!(kv.k.len(), (len - kv.start) * kv.k_dim, "layer {l} appended twice");
        kv.k.extend_from_slice(k);
        kv.v.extend_from_slice(v);
    }

    /// Keys and values of attention layer `l` from position `kv_start(l)` on, including
    /// positions appended but not yet committed.
    pub fn kv(&self, l: usize) -> (&[f32], &[f32]) {
        let LayerState::Kv(kv) = &self.layers[l] else { panic!("layer {l} has no KV cache") };
        (&kv.k, &kv.v)
    }

    /// The position of the first row `kv(l)` holds (0 unless the layer has a sliding window).
    pub fn kv_start(&self, l: usize) -> usize {
        let LayerState::Kv(kv) = &self.layers[l] else { panic!("layer {l} has no KV cache") };
        kv.start
    }

    /// Recurrent layer `l`'s committed state and the buffer for its next one.
    pub fn recurrent(&mut self, l: usize) -> &mut RecurrentLayer {
        let LayerState::Recurrent(r) = &mut self.layers[l] else { panic!("layer {l} has no recurrent state") };
        r
    }

    /// Makes the `n` positions a forward pass added current, in every layer.
    pub fn commit(&mut self, n: usize) {
        self.len += n;
        let len = self.len;
        for l in &mut self.layers {
            match l {
                LayerState::Recurrent(r) if r.written => {
                    r.cur = 1 - r.cur;
                    r.written = false;
                }
                // A window drops what no later token can see once it holds a window's worth
                // more than that.
                LayerState::Kv(kv) => {
                    if let Some(w) = kv.window {
                        if len - kv.start >= 2 * w {
                            kv.keep(kv.needed_from(len), len);
                        }
                    }
                }
                _ => {}
            }
        }
    }

    /// Drops what a failed forward pass wrote: the state is as it was before it.
    pub fn abort(&mut self) {
        self.cut_kv(self.len);
        for l in &mut self.layers {
            if let LayerState::Recurrent(r) = l {
                r.written = false;
            }
        }
    }

    /// Bytes held: KV capacity and both buffers of every recurrent state.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Kv(kv) => 4 * (kv.k.capacity() + kv.v.capacity()),
                LayerState::Recurrent(r) => 4 * (r.conv.iter().chain(&r.s).map(|b| b.capacity()).sum::<usize>()),
            })
            .sum()
    }
}

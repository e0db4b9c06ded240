//! SentencePiece-style merging (`tokenizer.ggml.model = "llama"`) as llama.cpp runs it: every
//! character starts as a symbol, and the adjacent pair whose concatenation is the vocabulary
//! entry with the highest score (leftmost on a tie) is merged until no pair forms an entry.
//! Symbols left that are not entries become their UTF-8 bytes as `<0xXX>` tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

const NONE: u32 = u32::MAX;

struct Bigram {
    score: f32,
    left: u32,
    right: u32,
    /// Byte length of the pair when queued; a different length later means it is stale.
    size: u32,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// The greatest is the highest score, then the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    len: u32,
    prev: u32,
    next: u32,
}

pub(crate) struct SpmVocab<'a> {
    pub token_to_id: &'a HashMap<String, u32>,
    pub scores: &'a [f32],
    /// `<0xXX>` token of each byte (or the one-character token of an ASCII byte), if any.
    pub byte_tokens: &'a [u32; 256],
    pub unk: Option<u32>,
}

/// Appends the tokens of `text` (spaces already replaced by U+2581).
pub(crate) fn tokenize(v: &SpmVocab, text: &str, out: &mut Vec<u32>) {
    if text.is_empty() {
        return;
    }
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, c) in text.char_indices() {
        let k = syms.len() as u32;
        syms.push(Sym { start: i as u32, len: c.len_utf8() as u32, prev: k.wrapping_sub(1), next: k + 1 });
    }
    if let Some(last) = syms.last_mut() {
        last.next = NONE;
    }
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: u32, r: u32| {
        if l == NONE || r == NONE {
            return;
        }
        let (ls, rs) = (syms[l as usize], syms[r as usize]);
        let piece = &text[ls.start as usize..(rs.start + rs.len) as usize];
        if let Some(&id) = v.token_to_id.get(piece) {
            let score = v.scores.get(id as usize).copied().unwrap_or(0.0);
            heap.push(Bigram { score, left: l, right: r, size: ls.len + rs.len });
        }
    };
    for i in 1..syms.len() as u32 {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (syms[b.left as usize], syms[b.right as usize]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        syms[b.left as usize].len += r.len;
        syms[b.left as usize].next = r.next;
        syms[b.right as usize].len = 0;
        if r.next != NONE {
            syms[r.next as usize].prev = b.left;
        }
        try_add(&mut heap, &syms, l.prev, b.left);
        try_add(&mut heap, &syms, b.left, r.next);
    }
    let mut i = 0u32;
    while i != NONE {
        let s = syms[i as usize];
        let piece = &text[s.start as usize..(s.start + s.len) as usize];
        match v.token_to_id.get(piece) {
            Some(&id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    let t = v.byte_tokens[b as usize];
                    if t != NONE {
                        out.push(t);
                    } else if let Some(u) = v.unk {
                        out.push(u);
                    }
                }
            }
        }
        i = s.next;
    }
}

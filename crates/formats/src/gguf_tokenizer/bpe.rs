//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): the GPT-2 byte↔character table and merging
//! by merge rank.
//!
//! Merging works as llama.cpp's does: every byte of a pre-tokenized word starts as one symbol
//! (its GPT-2 character), and the adjacent pair with the lowest merge rank (leftmost on a tie)
//! is merged until no listed pair remains. Strings are interned once at load so that a merge
//! is a hash lookup of two integers.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

const NONE: u32 = u32::MAX;

/// The GPT-2 character standing for each byte: printable Latin-1 bytes stand for themselves,
/// the other 68 take U+0100.. in byte order.
pub(crate) fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        let c = if printable {
            b
        } else {
            n += 1;
            255 + n
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

/// The byte a GPT-2 character stands for, if it stands for one.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let c = c as u32;
    let printable = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if c < 256 {
        return if printable(c) { Some(c as u8) } else { None };
    }
    // The (c - 256)-th byte that is not printable.
    let k = c - 256;
    (0..256u32).filter(|b| !printable(*b)).nth(k as usize).map(|b| b as u8)
}

pub(crate) struct BpeModel {
    /// Interned strings: every token text and every merge side and result.
    strings: HashMap<Box<str>, u32>,
    /// Token id of each interned string, or `NONE`.
    sid_token: Vec<u32>,
    /// (left, right) → (rank, merged).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// Interned id of each byte's GPT-2 character, or `NONE`.
    byte_sid: [u32; 256],
    /// Token whose text is exactly this one ASCII byte (llama.cpp's last-resort lookup).
    ascii_token: [u32; 128],
    to_char: [char; 256],
    ignore_merges: bool,
}

/// A pair waiting to be merged: (rank, left, right, left sid, right sid). The heap pops the
/// smallest rank first, then the leftmost.
type Queued = (u32, u32, u32, u32, u32);

#[derive(Clone, Copy)]
struct Sym {
    start: u32,
    end: u32,
    sid: u32,
    prev: u32,
    next: u32,
}

impl BpeModel {
    /// `tokens[i]` is token i's text; `merges` are "left right" strings in rank order.
    pub fn new(tokens: &[String], merges: &[String], ignore_merges: bool) -> Result<BpeModel, String> {
        let mut strings: HashMap<Box<str>, u32> = HashMap::with_capacity(tokens.len() + merges.len() / 4);
        let mut sid_token: Vec<u32> = Vec::with_capacity(tokens.len());
        fn intern(strings: &mut HashMap<Box<str>, u32>, sid_token: &mut Vec<u32>, s: &str) -> u32 {
            if let Some(&id) = strings.get(s) {
                return id;
            }
            let id = sid_token.len() as u32;
            strings.insert(s.into(), id);
            sid_token.push(NONE);
            id
        }
        for (i, t) in tokens.iter().enumerate() {
            let sid = intern(&mut strings, &mut sid_token, t);
            // A later duplicate wins, as in llama.cpp's text→id map.
            sid_token[sid as usize] = i as u32;
        }
        let mut merge_map = HashMap::with_capacity(merges.len());
        let mut joined = String::new();
        for (rank, m) in merges.iter().enumerate() {
            // Split at the first space after the first byte (a side may itself start with a space).
            let pos = m.as_bytes().iter().skip(1).position(|&b| b == b' ').map(|p| p + 1);
            let Some(pos) = pos else {
                return Err(format!("merge {rank} ({m:?}) is not two symbols separated by a space"));
            };
            let (l, r) = (&m[..pos], &m[pos + 1..]);
            let ls = intern(&mut strings, &mut sid_token, l);
            let rs = intern(&mut strings, &mut sid_token, r);
            joined.clear();
            joined.push_str(l);
            joined.push_str(r);
            let js = intern(&mut strings, &mut sid_token, &joined);
            // The first listing of a pair wins.
            merge_map.entry((ls, rs)).or_insert((rank as u32, js));
        }
        let to_char = byte_to_char_table();
        let mut byte_sid = [NONE; 256];
        let mut buf = [0u8; 4];
        for b in 0..256 {
            let s: &str = to_char[b].encode_utf8(&mut buf);
            byte_sid[b] = strings.get(s).copied().unwrap_or(NONE);
        }
        let mut ascii_token = [NONE; 128];
        for b in 0..128u8 {
            let s = [b];
            if let Ok(s) = std::str::from_utf8(&s) {
                if let Some(&sid) = strings.get(s) {
                    ascii_token[b as usize] = sid_token[sid as usize];
                }
            }
        }
        Ok(BpeModel { strings, sid_token, merges: merge_map, byte_sid, ascii_token, to_char, ignore_merges })
    }

    /// Appends the tokens of one pre-tokenized word (raw UTF-8 bytes).
    pub fn encode_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if word.is_empty() {
            return;
        }
        if self.ignore_merges {
            let enc: String = word.iter().map(|b| self.to_char[*b as usize]).collect();
            if let Some(&sid) = self.strings.get(enc.as_str()) {
                let tok = self.sid_token[sid as usize];
                if tok != NONE {
                    out.push(tok);
                    return;
                }
            }
        }
        let n = word.len();
        let mut syms: Vec<Sym> = (0..n)
            .map(|i| Sym {
                start: i as u32,
                end: i as u32 + 1,
                sid: self.byte_sid[word[i] as usize],
                prev: if i == 0 { NONE } else { i as u32 - 1 },
                next: if i + 1 == n { NONE } else { i as u32 + 1 },
            })
            .collect();
        let mut heap: BinaryHeap<Reverse<Queued>> = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: u32, r: u32| {
            if l == NONE || r == NONE {
                return;
            }
            let (ls, rs) = (syms[l as usize].sid, syms[r as usize].sid);
            if ls == NONE || rs == NONE {
                return;
            }
            if let Some(&(rank, _)) = self.merges.get(&(ls, rs)) {
                heap.push(Reverse((rank, l, r, ls, rs)));
            }
        };
        for i in 1..n as u32 {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(Reverse((_, l, r, ls, rs))) = heap.pop() {
            let (lsym, rsym) = (syms[l as usize], syms[r as usize]);
            // Stale if either side was merged away or grew since the pair was queued.
            if lsym.start == lsym.end || rsym.start == rsym.end || lsym.sid != ls || rsym.sid != rs {
                continue;
            }
            let Some(&(_, joined)) = self.merges.get(&(ls, rs)) else { continue };
            let left = &mut syms[l as usize];
            left.end = rsym.end;
            left.sid = joined;
            left.next = rsym.next;
            syms[r as usize].end = rsym.start;
            if rsym.next != NONE {
                syms[rsym.next as usize].prev = l;
            }
            let prev = syms[l as usize].prev;
            push(&mut heap, &syms, prev, l);
            push(&mut heap, &syms, l, rsym.next);
        }
        let mut i = 0u32;
        while i != NONE {
            let s = syms[i as usize];
            let tok = if s.sid == NONE { NONE } else { self.sid_token[s.sid as usize] };
            if tok != NONE {
                out.push(tok);
            } else {
                // Not a token (a merge whose result is not in the vocabulary, or a byte with no
                // token): llama.cpp looks up each byte of the symbol's text as a one-byte token,
                // which finds only ASCII characters and drops the rest.
                let mut buf = [0u8; 4];
                for b in &word[s.start as usize..s.end as usize] {
                    for u in self.to_char[*b as usize].encode_utf8(&mut buf).bytes() {
                        if let Some(&t) = self.ascii_token.get(u as usize) {
                            if t != NONE {
                                out.push(t);
                            }
                        }
                    }
                }
            }
            i = s.next;
        }
    }
}

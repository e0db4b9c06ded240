//! The tokenizer stored in a GGUF file's metadata (`tokenizer.ggml.*`), reproducing what
//! llama.cpp's tokenizer does with it.
//!
//! Two kinds are read:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE. Text is split by the pre-tokenizer that
//!   `tokenizer.ggml.pre` names (see `pretok`), each piece is mapped byte by byte onto the GPT-2
//!   characters and merged by `tokenizer.ggml.merges` rank (see `bpe`).
//! - `tokenizer.ggml.model = "llama"`: SentencePiece as llama.cpp runs it. Spaces become U+2581,
//!   a space is put in front when `tokenizer.ggml.add_space_prefix` says so, and characters are
//!   merged by `tokenizer.ggml.scores` (see `spm`), with `<0xXX>` tokens for what is left over.
//!
//! Before either, special tokens (control, user-defined and unknown types) that occur literally
//! in the text are cut out as single tokens, longest first, exactly as llama.cpp does when it
//! parses special tokens. Which tokens count as special, and which end generation, follow
//! llama.cpp's loader, including its detection of end-of-turn and fill-in-the-middle tokens by
//! their text. Any other `tokenizer.ggml.model`, and any `tokenizer.ggml.pre` not listed in
//! `pretok`, is refused with an error naming the value.
//!
//! Decoding maps BPE token text back through the GPT-2 byte table and SentencePiece `▁` back to
//! spaces and `<0xXX>` tokens to bytes, then reads the bytes as UTF-8 (U+FFFD where a sequence
//! is cut). Unlike llama.cpp's detokenizer it never "cleans up" spaces around punctuation, so
//! `decode(encode(text))` gives the text back.

mod bpe;
mod pretok;
mod special;
mod spm;
#[cfg(test)]
mod tests;

use crate::gguf::{Array, GgufFile, Value};
use crate::Result;
use aho_corasick::AhoCorasick;
use special::{Frag, ALWAYS_USER_DEFINED, EOG_TEXTS, EOM_TEXTS, EOT_TEXTS};
use special::{FIM_MID_TEXTS, FIM_PAD_TEXTS, FIM_PRE_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS, FIM_SUF_TEXTS};
use std::collections::{BTreeSet, HashMap};

// Token attributes (llama.cpp's `llama_token_attr` bits that matter here).
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;
const ATTR_LSTRIP: u16 = 1 << 7;
const ATTR_RSTRIP: u16 = 1 << 8;

const NONE: u32 = u32::MAX;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_TYPES: &str = "tokenizer.ggml.token_type";
const KEY_MERGES: &str = "tokenizer.ggml.merges";

enum Kind {
    Bpe { model: Box<bpe::BpeModel>, pre: pretok::PreTokenizer },
    Spm,
}

/// The tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
pub struct GgufTokenizer {
    kind: Kind,
    tokens: Vec<String>,
    attrs: Vec<u16>,
    token_to_id: HashMap<String, u32>,
    /// SentencePiece scores (empty for BPE).
    scores: Vec<f32>,
    /// SentencePiece byte-fallback token of each byte, or `NONE`.
    byte_tokens: [u32; 256],
    /// Tokens cut out of the text before tokenizing, in the order they are looked for.
    specials: Vec<u32>,
    /// Finds which of `specials` occur in a text at all (pattern i is `specials[i]`).
    special_finder: Option<AhoCorasick>,
    /// What each token decodes to, concatenated; token i is `piece_bytes[piece_off[i]..piece_off[i + 1]]`.
    piece_bytes: Vec<u8>,
    piece_off: Vec<usize>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    /// Tokens that end generation: EOS first, then the rest in id order.
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

/// The array under `key`, or `None` when the key is absent; an error when it is not an array.
fn array<'f>(f: &'f GgufFile, key: &str) -> Result<Option<&'f Array>> {
    match f.get(key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a)),
        Some(_) => Err(f.error(format!("metadata key `{key}` is not an array"))),
    }
}

/// A token id under `key`: `None` when absent or negative (unset), an error when not an integer.
fn token_id_key(f: &GgufFile, key: &str) -> Result<Option<u64>> {
    match f.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(id) => Ok(Some(id)),
            None if v.as_f64().is_some_and(|x| x < 0.0 && x.fract() == 0.0) => Ok(None),
            None => Err(f.error(format!("metadata key `{key}` is not an integer token id"))),
        },
    }
}

/// The lowest id whose text is one of `texts`.
fn find_by_text(map: &HashMap<String, u32>, texts: &[&str]) -> Option<u32> {
    texts.iter().filter_map(|t| map.get(*t).copied()).min()
}

impl GgufTokenizer {
    /// Reads the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<GgufTokenizer> {
        let model = f.meta_str(KEY_MODEL)?;
        let spm = match model {
            "llama" => true,
            "gpt2" => false,
            other => {
                return Err(f.error(format!(
                    "unsupported tokenizer: `{KEY_MODEL}` is {other:?} (supported: \"gpt2\" byte-level BPE, \
                     \"llama\" SentencePiece)"
                )))
            }
        };
        let pre_name = match f.get(KEY_PRE) {
            None => None,
            Some(v) => Some(v.as_str().ok_or_else(|| f.error(format!("metadata key `{KEY_PRE}` is not a string")))?),
        };
        // SentencePiece has no pre-tokenizer (llama.cpp ignores the key for it). For BPE an absent
        // key means "default", as in llama.cpp.
        let pre_cfg = if spm {
            None
        } else {
            let name = pre_name.unwrap_or("default");
            Some(pretok::lookup(name).ok_or_else(|| {
                f.error(format!(
                    "unknown pre-tokenizer: `{KEY_PRE}` is {name:?}; known values: {}",
                    pretok::KNOWN.join(", ")
                ))
            })?)
        };

        // The vocabulary.
        let mut tokens: Vec<String> = match array(f, KEY_TOKENS)? {
            Some(Array::String(v)) => v.clone(),
            Some(_) => return Err(f.error(format!("metadata key `{KEY_TOKENS}` is not an array of strings"))),
            None => return Err(f.error(format!("missing metadata key `{KEY_TOKENS}` (the vocabulary)"))),
        };
        let n = tokens.len();
        if n == 0 {
            return Err(f.error(format!("metadata key `{KEY_TOKENS}` is empty")));
        }
        if n >= NONE as usize {
            return Err(f.error(format!("metadata key `{KEY_TOKENS}` has {n} entries, more than token ids can number")));
        }
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                *t = format!("[EMPTY_{i}]");
            }
        }
        let count_check = |key: &str, len: usize| -> Result<()> {
            if len != n {
                return Err(f.error(format!("metadata key `{key}` has {len} entries but `{KEY_TOKENS}` has {n}")));
            }
            Ok(())
        };
        let scores: Option<Vec<f32>> = match array(f, KEY_SCORES)? {
            None => None,
            Some(Array::F32(v)) => Some(v.clone()),
            Some(Array::I32(v)) => Some(v.iter().map(|x| *x as f32).collect()),
            Some(_) => return Err(f.error(format!("metadata key `{KEY_SCORES}` is not an array of float32 or int32"))),
        };
        if let Some(s) = &scores {
            count_check(KEY_SCORES, s.len())?;
        }
        let types: Option<&Vec<i32>> = match array(f, KEY_TYPES)? {
            None => None,
            Some(Array::I32(v)) => Some(v),
            Some(_) => return Err(f.error(format!("metadata key `{KEY_TYPES}` is not an array of int32"))),
        };
        if let Some(t) = types {
            count_check(KEY_TYPES, t.len())?;
        }
        let mut attrs: Vec<u16> = match types {
            None => vec![ATTR_NORMAL; n],
            Some(t) => t
                .iter()
                .map(|ty| match ty {
                    1 => ATTR_NORMAL,
                    2 => ATTR_UNKNOWN,
                    3 => ATTR_CONTROL,
                    4 => ATTR_USER_DEFINED,
                    5 => ATTR_UNUSED,
                    6 => ATTR_BYTE,
                    _ => 0, // undefined
                })
                .collect(),
        };
        let mut token_to_id: HashMap<String, u32> = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }

        let kind = if spm {
            if scores.is_none() {
                return Err(f.error(format!(
                    "missing metadata key `{KEY_SCORES}` (a SentencePiece vocabulary merges by score)"
                )));
            }
            Kind::Spm
        } else {
            let merges = match array(f, KEY_MERGES)? {
                Some(Array::String(v)) => v,
                Some(_) => return Err(f.error(format!("metadata key `{KEY_MERGES}` is not an array of strings"))),
                None => return Err(f.error(format!("missing metadata key `{KEY_MERGES}` (byte-level BPE needs it)"))),
            };
            let cfg = pre_cfg.as_ref().expect("BPE has a pre-tokenizer");
            let model = bpe::BpeModel::new(&tokens, merges, cfg.ignore_merges)
                .map_err(|e| f.error(format!("metadata key `{KEY_MERGES}`: {e}")))?;
            let pre = pretok::PreTokenizer::new(cfg.exprs)
                .map_err(|e| f.error(format!("pre-tokenizer {:?}: {e}", pre_name.unwrap_or("default"))))?;
            Kind::Bpe { model: Box::new(model), pre }
        };

        // Special token ids: llama.cpp's defaults per tokenizer type, then the metadata.
        let in_range = |id: u64| (id < n as u64).then_some(id as u32);
        let (mut bos, mut eos, mut unk) =
            if spm { (in_range(1), in_range(2), in_range(0)) } else { (in_range(11), in_range(11), None) };
        if pre_cfg.as_ref().is_some_and(|c| c.no_bos) {
            bos = None;
        }
        let (mut eot, mut eom) = (None, None);
        let (mut fim_pre, mut fim_suf, mut fim_mid, mut fim_pad, mut fim_rep, mut fim_sep) =
            (None, None, None, None, None, None);
        for (key, slot) in [
            ("tokenizer.ggml.bos_token_id", &mut bos),
            ("tokenizer.ggml.eos_token_id", &mut eos),
            ("tokenizer.ggml.eot_token_id", &mut eot),
            ("tokenizer.ggml.eom_token_id", &mut eom),
            ("tokenizer.ggml.unknown_token_id", &mut unk),
            ("tokenizer.ggml.fim_pre_token_id", &mut fim_pre),
            ("tokenizer.ggml.fim_suf_token_id", &mut fim_suf),
            ("tokenizer.ggml.fim_mid_token_id", &mut fim_mid),
            ("tokenizer.ggml.fim_pad_token_id", &mut fim_pad),
            ("tokenizer.ggml.fim_rep_token_id", &mut fim_rep),
            ("tokenizer.ggml.fim_sep_token_id", &mut fim_sep),
        ] {
            // An id outside the vocabulary leaves the default (llama.cpp warns and does the same).
            if let Some(id) = token_id_key(f, key)?.and_then(in_range) {
                *slot = Some(id);
            }
        }
        for (key, slot) in [
            ("tokenizer.ggml.prefix_token_id", &mut fim_pre),
            ("tokenizer.ggml.suffix_token_id", &mut fim_suf),
            ("tokenizer.ggml.middle_token_id", &mut fim_mid),
        ] {
            if let Some(id) = token_id_key(f, key)?.and_then(in_range) {
                *slot = Some(id);
            }
        }

        let default_add_bos = spm || pre_cfg.as_ref().is_some_and(|c| c.add_bos);
        let add_bos = f.meta_opt_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
        let add_eos = f.meta_opt_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        let add_space_prefix = f.meta_opt_bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(spm);

        // Tokens recognized by their text become control tokens.
        let promote = |id: Option<u32>, attrs: &mut Vec<u16>| {
            if let Some(id) = id {
                attrs[id as usize] |= ATTR_CONTROL;
            }
        };
        for (slot, texts) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                *slot = find_by_text(&token_to_id, texts);
                promote(*slot, &mut attrs);
            }
        }
        let mut eog: BTreeSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for t in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*t) {
                eog.insert(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        for t in ALWAYS_USER_DEFINED {
            if let Some(&id) = token_to_id.get(*t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        let text_of = |id: u32| tokens[id as usize].as_str();
        let has = |eog: &BTreeSet<u32>, texts: &[&str]| eog.iter().any(|id| texts.contains(&text_of(*id)));
        // With both "<|return|>" and "<|call|>" (gpt-oss), or "<|calls|>" and "<|flush|>"
        // (solar-open), "<|end|>" does not end generation.
        if (has(&eog, &["<|return|>"]) && has(&eog, &["<|call|>", "<|calls|>"]))
            || (has(&eog, &["<|call|>", "<|calls|>"]) && has(&eog, &["<|flush|>"]))
        {
            if let Some(end) = eog.iter().copied().find(|id| text_of(*id) == "<|end|>") {
                eog.remove(&end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        // Where "<|tool_response>" or "<|plamo:eos|>" ends generation, "</s>" is a normal token.
        if has(&eog, &["<|tool_response>", "<|plamo:eos|>"]) {
            if let Some(s) = eog.iter().copied().find(|id| text_of(*id) == "</s>") {
                eog.remove(&s);
                attrs[s as usize] = ATTR_NORMAL;
            }
        }
        let mut eog_list: Vec<u32> = eos.into_iter().collect();
        eog_list.extend(eog.iter().copied().filter(|id| Some(*id) != eos));

        // Special tokens are looked for longest first.
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        specials.sort_by(|a, b| tokens[*b as usize].len().cmp(&tokens[*a as usize].len()).then(a.cmp(b)));
        let special_finder = if specials.is_empty() {
            None
        } else {
            AhoCorasick::new(specials.iter().map(|id| tokens[*id as usize].as_bytes())).ok()
        };

        // Per-model whitespace stripping around special tokens (llama.cpp's rules by name).
        let name = f.get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_lowercase();
        let arch = f.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
        let pre_raw = pre_name.unwrap_or("");
        let set = |attrs: &mut Vec<u16>, text: &str, bit: u16, on: bool| {
            if let Some(&id) = token_to_id.get(text) {
                if on {
                    attrs[id as usize] |= bit;
                } else {
                    attrs[id as usize] &= !bit;
                }
            }
        };
        if ["jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert"].iter().any(|p| pre_raw.contains(p))
            || ["nomic-bert-moe", "jina-bert-v3"].iter().any(|a| arch.contains(a))
        {
            set(&mut attrs, "<mask>", ATTR_LSTRIP, true);
        } else if name.contains("phi-3") || name.contains("phi3") {
            for id in &specials {
                attrs[*id as usize] |= ATTR_RSTRIP;
            }
            set(&mut attrs, "</s>", ATTR_RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set(&mut attrs, t, ATTR_RSTRIP, false);
            }
        } else if name.contains("modern-bert") {
            set(&mut attrs, "[MASK]", ATTR_LSTRIP, true);
        }

        // SentencePiece byte fallback: `<0xXX>`, else the one-character token of an ASCII byte.
        let mut byte_tokens = [NONE; 256];
        if spm {
            for (b, slot) in byte_tokens.iter_mut().enumerate() {
                let hex = format!("<0x{b:02X}>");
                *slot = token_to_id.get(&hex).copied().unwrap_or_else(|| {
                    let one = [b as u8];
                    std::str::from_utf8(&one).ok().and_then(|s| token_to_id.get(s).copied()).unwrap_or(NONE)
                });
            }
        }

        // What each token decodes to.
        let mut piece_bytes = Vec::new();
        let mut piece_off = Vec::with_capacity(n + 1);
        piece_off.push(0);
        for (t, &a) in tokens.iter().zip(&attrs) {
            if a & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
                piece_bytes.extend_from_slice(t.as_bytes());
            } else if a & ATTR_NORMAL != 0 {
                if spm {
                    piece_bytes.extend_from_slice(t.replace('\u{2581}', " ").as_bytes());
                } else {
                    let mut buf = [0u8; 4];
                    for c in t.chars() {
                        match bpe::char_to_byte(c) {
                            Some(b) => piece_bytes.push(b),
                            None => piece_bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes()),
                        }
                    }
                }
            } else if a & ATTR_BYTE != 0 {
                if let Some(b) = parse_byte_token(t) {
                    piece_bytes.push(b);
                }
            }
            piece_off.push(piece_bytes.len());
        }

        Ok(GgufTokenizer {
            kind,
            tokens,
            attrs,
            token_to_id,
            scores: scores.filter(|_| spm).unwrap_or_default(),
            byte_tokens,
            specials,
            special_finder,
            piece_bytes,
            piece_off,
            bos,
            eos,
            unk,
            eog: eog_list,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Token ids of `text`. Special tokens written in the text are always recognized;
    /// `add_special` adds BOS and EOS where the model's metadata asks for them.
    pub fn encode(&self, text: &str, add_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        let frags = self.partition(text);
        match &self.kind {
            Kind::Bpe { model, pre } => {
                // The same word always gives the same tokens.
                let mut cache: HashMap<&str, Vec<u32>> = HashMap::new();
                for fr in &frags {
                    match *fr {
                        Frag::Token(id) => out.push(id),
                        Frag::Text(a, b) => {
                            let piece = &text[a..b];
                            for (wa, wb) in pre.split(piece) {
                                let word = &piece[wa..wb];
                                if let Some(ids) = cache.get(word) {
                                    out.extend_from_slice(ids);
                                    continue;
                                }
                                let mut ids = Vec::new();
                                model.encode_word(word.as_bytes(), &mut ids);
                                out.extend_from_slice(&ids);
                                cache.insert(word, ids);
                            }
                        }
                    }
                }
            }
            Kind::Spm => {
                let vocab = spm::SpmVocab {
                    token_to_id: &self.token_to_id,
                    scores: &self.scores,
                    byte_tokens: &self.byte_tokens,
                    unk: self.unk,
                };
                // A text piece at the start or right after a special token gets the space prefix.
                let mut after_special = true;
                for fr in &frags {
                    match *fr {
                        Frag::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                        Frag::Text(a, b) => {
                            let mut s = String::with_capacity(b - a + 3);
                            if self.add_space_prefix && after_special {
                                s.push(' ');
                            }
                            s.push_str(&text[a..b]);
                            let s = s.replace(' ', "\u{2581}");
                            spm::tokenize(&vocab, &s, &mut out);
                            after_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        out
    }

    /// The text of `ids`. Ids outside the vocabulary are skipped; `skip_special` drops control
    /// and unknown tokens (see `is_special`). Bytes that do not form UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes: Vec<u8> = Vec::with_capacity(ids.len() * 4);
        let mut first = true;
        for &id in ids {
            let Some(&attr) = self.attrs.get(id as usize) else { continue };
            if skip_special && self.is_special(id) {
                continue;
            }
            let mut piece = &self.piece_bytes[self.piece_off[id as usize]..self.piece_off[id as usize + 1]];
            // SentencePiece: the space put in front of the text when encoding is not part of it.
            if first && matches!(self.kind, Kind::Spm) && self.add_space_prefix && attr & ATTR_NORMAL != 0 {
                piece = piece.strip_prefix(b" ").unwrap_or(piece);
            }
            first = false;
            bytes.extend_from_slice(piece);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The text of token `id` as the vocabulary stores it.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(|t| t.as_str())
    }

    /// The id of the token whose text (as stored in the vocabulary) is `piece`.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.token_to_id.get(piece).copied()
    }

    /// The beginning-of-sequence token, if the tokenizer has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the tokenizer has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The tokens that end generation: EOS first, then end-of-turn and the others llama.cpp
    /// treats as end of generation, in id order.
    pub fn eos(&self) -> Vec<u32> {
        self.eog.clone()
    }

    /// Whether `encode(.., true)` starts with BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos && self.bos.is_some()
    }

    /// Whether `encode(.., true)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos && self.eos.is_some()
    }

    /// Control (and unknown-type) tokens: the ones `decode(.., true)` leaves out.
    pub fn is_special(&self, id: u32) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & (ATTR_CONTROL | ATTR_UNKNOWN) != 0)
    }
}

/// The byte of a `<0xXX>` token.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

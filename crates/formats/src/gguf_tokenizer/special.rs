//! Special tokens: the ones llama.cpp recognizes by their text, and cutting special tokens out
//! of input text before it is tokenized.

use super::{GgufTokenizer, ATTR_LSTRIP, ATTR_RSTRIP};

// Tokens llama.cpp recognizes by their text (src/llama-vocab.cpp), used when the metadata does
// not name them by id.
pub(crate) const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
pub(crate) const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
pub(crate) const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
pub(crate) const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
pub(crate) const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
pub(crate) const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
pub(crate) const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
pub(crate) const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
pub(crate) const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];
/// Always rendered (llama.cpp's gpt-oss rule).
pub(crate) const ALWAYS_USER_DEFINED: &[&str] = &["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"];

/// A piece of input text after special tokens are cut out.
pub(crate) enum Frag {
    Text(usize, usize),
    Token(u32),
}

/// C `isspace` in the "C" locale.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

impl GgufTokenizer {
    /// Cuts the special tokens that occur in `text` out of it: for each special token, longest
    /// first, every occurrence in what is still plain text becomes that token.
    pub(crate) fn partition(&self, text: &str) -> Vec<Frag> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Frag::Text(0, text.len())];
        // Only tokens that occur somewhere can cut anything; find those in one pass.
        let present: Vec<bool> = match &self.special_finder {
            Some(ac) => {
                let mut p = vec![false; self.specials.len()];
                for m in ac.find_overlapping_iter(text) {
                    p[m.pattern().as_usize()] = true;
                }
                p
            }
            None => vec![true; self.specials.len()],
        };
        let bytes = text.as_bytes();
        for (k, &id) in self.specials.iter().enumerate() {
            if !present[k] {
                continue;
            }
            let tok = self.tokens[id as usize].as_str();
            let attr = self.attrs[id as usize];
            let mut next = Vec::with_capacity(frags.len() + 2);
            for fr in frags {
                let Frag::Text(mut a, b) = fr else {
                    next.push(fr);
                    continue;
                };
                loop {
                    let Some(rel) = text[a..b].find(tok) else {
                        next.push(Frag::Text(a, b));
                        break;
                    };
                    let m = a + rel;
                    let mut left_end = m;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > a && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > a {
                        next.push(Frag::Text(a, left_end));
                    }
                    next.push(Frag::Token(id));
                    let mut r = m + tok.len();
                    if r < b && attr & ATTR_RSTRIP != 0 {
                        while r < b && is_c_space(bytes[r]) {
                            r += 1;
                        }
                    }
                    if r >= b {
                        break;
                    }
                    a = r;
                }
            }
            frags = next;
        }
        frags
    }
}

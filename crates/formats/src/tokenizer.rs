//! Tokenizers: Hugging Face `tokenizer.json` (through the `tokenizers` crate) and, for GGUF
//! files, the vocabulary stored in the file's metadata (see `gguf_tokenizer`).

use crate::error::{FormatError, Result};
use std::path::Path;

pub enum Tokenizer {
    Hf(Box<tokenizers::Tokenizer>),
    Gguf(Box<crate::gguf_tokenizer::GgufTokenizer>),
}

impl Tokenizer {
    pub fn from_hf_file(path: &Path) -> Result<Tokenizer> {
        let t = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| FormatError::invalid(path, format!("cannot load tokenizer: {e}")))?;
        Ok(Tokenizer::Hf(Box::new(t)))
    }

    /// Token ids of `text`. `add_special` adds what the tokenizer itself adds (e.g. BOS).
    pub fn encode(&self, text: &str, add_special: bool) -> std::result::Result<Vec<u32>, String> {
        match self {
            Tokenizer::Hf(t) => t.encode(text, add_special).map(|e| e.get_ids().to_vec()).map_err(|e| e.to_string()),
            Tokenizer::Gguf(t) => Ok(t.encode(text, add_special)),
        }
    }

    /// Text of `ids`, special tokens included or not.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        match self {
            Tokenizer::Hf(t) => t.decode(ids, skip_special).unwrap_or_default(),
            Tokenizer::Gguf(t) => t.decode(ids, skip_special),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Hf(t) => t.get_vocab_size(true),
            Tokenizer::Gguf(t) => t.vocab_size(),
        }
    }

    /// The text of token `id` as the vocabulary stores it.
    pub fn token_text(&self, id: u32) -> Option<String> {
        match self {
            Tokenizer::Hf(t) => t.id_to_token(id),
            Tokenizer::Gguf(t) => t.token_text(id).map(str::to_string),
        }
    }

    pub fn token_id(&self, piece: &str) -> Option<u32> {
        match self {
            Tokenizer::Hf(t) => t.token_to_id(piece),
            Tokenizer::Gguf(t) => t.token_id(piece),
        }
    }
}

/// Turns a growing token sequence into text deltas without splitting multi-byte characters.
///
/// Decoding token by token is wrong for byte-level vocabularies (one character may span
/// tokens) and for tokenizers that strip a leading space; decoding a short window of context
/// and emitting only the new suffix is right for both.
pub struct TextStream {
    ids: Vec<u32>,
    /// Start of the context window within `ids`.
    prefix: usize,
    /// Tokens already turned into emitted text.
    emitted: usize,
}

impl Default for TextStream {
    fn default() -> Self {
        Self::new()
    }
}

impl TextStream {
    pub fn new() -> TextStream {
        TextStream { ids: Vec::new(), prefix: 0, emitted: 0 }
    }

    /// Adds a token; returns the text that became complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.emitted], true);
        let after = tok.decode(&self.ids[self.prefix..], true);
        if after.ends_with('\u{FFFD}') || after.len() < before.len() || !after.starts_with(&before) {
            // An incomplete character (or a tokenizer that rewrote the context): wait.
            if self.ids.len() - self.emitted < 8 {
                return String::new();
            }
        }
        let delta = after.get(before.len()..).unwrap_or("").to_string();
        self.prefix = self.emitted;
        self.emitted = self.ids.len();
        delta
    }

    /// Whatever is still held back at the end of generation.
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        if self.emitted == self.ids.len() {
            return String::new();
        }
        let before = tok.decode(&self.ids[self.prefix..self.emitted], true);
        let after = tok.decode(&self.ids[self.prefix..], true);
        self.emitted = self.ids.len();
        after.get(before.len()..).unwrap_or("").to_string()
    }
}

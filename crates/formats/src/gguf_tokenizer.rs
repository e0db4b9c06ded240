//! The tokenizer stored in a GGUF file's metadata.

pub struct GgufTokenizer {
    pieces: Vec<String>,
}

impl GgufTokenizer {
    pub fn encode(&self, _text: &str, _add_special: bool) -> Vec<u32> {
        Vec::new()
    }
    pub fn decode(&self, ids: &[u32], _skip_special: bool) -> String {
        ids.iter().filter_map(|i| self.pieces.get(*i as usize)).cloned().collect()
    }
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.pieces.iter().position(|p| p == piece).map(|i| i as u32)
    }
}

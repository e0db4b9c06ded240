//! A request's output text as it is generated: tokens become text without splitting a
//! character (`TextStream`), stop strings end the text (never included, never cut inside a
//! character), and text that may be the start of a stop string is held back until it is known
//! not to be. Each token's log-probabilities travel with the chunk that releases its text.

use sluice_formats::{TextStream, Tokenizer};

/// A generated token and, when asked for, its log-probability and the most likely tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenInfo {
    pub id: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Text released to the client, with the tokens whose text it completes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Chunk {
    pub text: String,
    pub tokens: Vec<TokenInfo>,
}

impl Chunk {
    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.tokens.is_empty()
    }
}

pub struct OutputText {
    stream: TextStream,
    stops: Vec<String>,
    /// Everything decoded so far.
    text: String,
    /// Bytes of `text` released.
    sent: usize,
    /// Tokens not yet released, with the end of their text in `text`.
    pending: Vec<(TokenInfo, usize)>,
    /// Where the text of the last released token ends.
    last_end: usize,
    stopped: bool,
    /// Tokens written out as this text although the tokenizer drops them as special.
    literals: Vec<(u32, String)>,
}

impl OutputText {
    pub fn new(stops: Vec<String>) -> OutputText {
        OutputText::with_literals(stops, Vec::new())
    }

    /// `new`, with tokens whose text is kept although they are special (`<tool_call>` where
    /// a vocabulary marks it as a control token).
    pub fn with_literals(stops: Vec<String>, literals: Vec<(u32, String)>) -> OutputText {
        OutputText {
            literals,
            stream: TextStream::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            sent: 0,
            pending: Vec::new(),
            last_end: 0,
            stopped: false,
        }
    }

    /// All text released so far.
    pub fn released(&self) -> &str {
        &self.text[..self.sent]
    }

    /// Adds a generated token; returns what can be released now and whether a stop string
    /// ended the text (then nothing more is accepted).
    pub fn push(&mut self, tok: &Tokenizer, info: TokenInfo) -> (Chunk, bool) {
        if self.stopped {
            return (Chunk::default(), true);
        }
        let delta = self.stream.push(tok, info.id);
        self.text.push_str(&delta);
        if let Some((_, lit)) = self.literals.iter().find(|(id, _)| *id == info.id) {
            self.text.push_str(lit);
        }
        self.pending.push((info, self.text.len()));
        self.release(false)
    }

    /// The end of generation (a stop token or the length limit): releases what was held back.
    pub fn finish(&mut self, tok: &Tokenizer) -> (Chunk, bool) {
        if self.stopped {
            return (Chunk::default(), true);
        }
        let delta = self.stream.finish(tok);
        self.text.push_str(&delta);
        if let Some(last) = self.pending.last_mut() {
            last.1 = self.text.len();
        }
        self.release(true)
    }

    fn release(&mut self, all: bool) -> (Chunk, bool) {
        if let Some(at) = self.find_stop() {
            self.stopped = true;
            // Tokens whose text starts before the stop string belong to the output.
            let (mut n, mut start) = (0, self.last_end);
            for (_, end) in &self.pending {
                if !(start < at || *end <= at) {
                    break;
                }
                n += 1;
                start = *end;
            }
            let tokens = self.pending.drain(..n).map(|(t, _)| t).collect();
            self.pending.clear();
            let text = self.text[self.sent..at].to_string();
            self.sent = at;
            return (Chunk { text, tokens }, true);
        }
        let upto = if all { self.text.len() } else { self.text.len() - self.held_back() };
        let n = self.pending.iter().take_while(|(_, end)| *end <= upto).count();
        if n > 0 {
            self.last_end = self.pending[n - 1].1;
        }
        let tokens = self.pending.drain(..n).map(|(t, _)| t).collect();
        let text = self.text[self.sent..upto].to_string();
        self.sent = upto;
        (Chunk { text, tokens }, false)
    }

    /// Where the first stop string starts in the unreleased text.
    fn find_stop(&self) -> Option<usize> {
        self.stops.iter().filter_map(|s| self.text[self.sent..].find(s.as_str())).min().map(|i| self.sent + i)
    }

    /// Bytes at the end of the unreleased text that may begin a stop string (a whole
    /// number of characters: stop-string prefixes are cut at character boundaries).
    fn held_back(&self) -> usize {
        let tail = &self.text[self.sent..];
        let mut hold = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > hold && k <= tail.len() && tail.ends_with(&s[..k]) {
                    hold = k;
                }
            }
        }
        hold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tokenizer whose tokens are single bytes of UTF-8 (ids 0..256 are the bytes), through
    /// the Hugging Face byte-level decoder.
    fn byte_tokenizer() -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        let bytes_to_unicode = |b: u8| -> char {
            let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            if printable {
                b as char
            } else {
                // GPT-2's mapping of the other bytes to 256 + n, in byte order.
                let mut n = 0u32;
                for c in 0..b {
                    let p = (b'!'..=b'~').contains(&c) || (0xA1..=0xAC).contains(&c) || (0xAE..=0xFF).contains(&c);
                    if !p {
                        n += 1;
                    }
                }
                char::from_u32(256 + n).expect("valid")
            }
        };
        for b in 0..=255u8 {
            vocab.insert(bytes_to_unicode(b).to_string(), serde_json::json!(b as u32));
        }
        let j = serde_json::json!({
            "version": "1.0",
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        });
        // A file per call: tests run in parallel.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = sluice_formats::scratch_root().join(format!("sluice-text-test-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("tokenizer.json");
        std::fs::write(&p, j.to_string()).unwrap();
        Tokenizer::from_hf_file(&p).unwrap()
    }

    fn info(id: u32) -> TokenInfo {
        TokenInfo { id, logprob: -(id as f32), top: Vec::new() }
    }

    fn run(tok: &Tokenizer, text: &str, stops: &[&str]) -> (Vec<Chunk>, bool) {
        let mut o = OutputText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for b in text.bytes() {
            let (c, stop) = o.push(tok, info(b as u32));
            out.push(c);
            if stop {
                return (out, true);
            }
        }
        let (c, stop) = o.finish(tok);
        out.push(c);
        (out, stop)
    }

    #[test]
    fn deltas_never_split_a_character_and_join_to_the_text() {
        let tok = byte_tokenizer();
        let text = "héllo 世界 🙂!";
        let (chunks, stopped) = run(&tok, text, &[]);
        assert!(!stopped);
        let joined: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(joined, text);
        // Every byte is a token; each released once, in order.
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().map(|t| t.id)).collect();
        assert_eq!(ids, text.bytes().map(|b| b as u32).collect::<Vec<_>>());
        // A chunk that holds part of the emoji holds all of it.
        assert!(chunks.iter().any(|c| c.text == "🙂"));
    }

    #[test]
    fn stop_strings_end_the_text_and_are_not_included() {
        let tok = byte_tokenizer();
        let (chunks, stopped) = run(&tok, "one two STOP three", &["STOP"]);
        assert!(stopped);
        let joined: String = chunks.iter().map(|c| c.text.as_str()).collect();
        assert_eq!(joined, "one two ");
        let ids: Vec<u32> = chunks.iter().flat_map(|c| c.tokens.iter().map(|t| t.id)).collect();
        assert_eq!(ids, "one two ".bytes().map(|b| b as u32).collect::<Vec<_>>());
        // A partial match is held back, then released when it turns out not to be one.
        let (chunks, stopped) = run(&tok, "a STOb c", &["STOP"]);
        assert!(!stopped);
        assert_eq!(chunks.iter().map(|c| c.text.as_str()).collect::<String>(), "a STOb c");
        assert!(chunks.iter().all(|c| !c.text.contains("ST") || c.text.contains("STOb")));
        // The earliest of several stops wins; a multi-byte stop string.
        let (chunks, _) = run(&tok, "xx é yy zz", &["zz", "é"]);
        assert_eq!(chunks.iter().map(|c| c.text.as_str()).collect::<String>(), "xx ");
        // A stop string at the very end (found by finish).
        let (chunks, stopped) = run(&tok, "abc", &["bc"]);
        assert!(stopped);
        assert_eq!(chunks.iter().map(|c| c.text.as_str()).collect::<String>(), "a");
    }
}

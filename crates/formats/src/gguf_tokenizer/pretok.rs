//! Pre-tokenizers of byte-level BPE: the regex splits applied to text before merging, chosen
//! by `tokenizer.ggml.pre` under the names llama.cpp gives them.
//!
//! Each pre-tokenizer is a list of regexes applied in turn: the first splits the text into
//! matches and the gaps between them, the next splits each of those pieces again, and so on
//! (a gap is a piece too, never dropped). The regex strings are llama.cpp's (src/llama-vocab.cpp)
//! and they run here with `fancy-regex` on the real text. llama.cpp runs the ones that use
//! Unicode classes on a "collapsed" copy of the text (every non-ASCII character replaced by one
//! byte standing for its category), which matches the same pieces as Unicode classes do; the
//! ones without Unicode classes it runs on code points with every non-ASCII white space
//! character turned into U+000B, and that is reproduced here (it matters where a literal class
//! holds such a character, as deepseek-llm's `　-。` does).

use fancy_regex::{Regex, RegexBuilder};

/// How a `tokenizer.ggml.pre` value tokenizes, beyond its regexes.
pub(crate) struct PreConfig {
    pub exprs: &'static [&'static str],
    /// A word that is itself in the vocabulary is emitted whole, without merging.
    pub ignore_merges: bool,
    /// Adds BOS unless `tokenizer.ggml.add_bos_token` says otherwise.
    pub add_bos: bool,
    /// This tokenizer has no BOS unless `tokenizer.ggml.bos_token_id` names one.
    pub no_bos: bool,
}

const GPT2: &[&str] = &[r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##];

const DEFAULT: &[&str] = &[
    r##"[\p{P}\$\+<=>\^~\|]+"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
    r##"\p{N}+"##,
    r##"[0-9][0-9][0-9]"##,
];

const LLAMA3: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const JAIS2: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"##,
];

const DEEPSEEK_LLM: &[&str] = &[
    r##"[\r\n]"##,
    r##"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"##,
    r##"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+"##,
    r##"\s+$"##,
    r##"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"##,
    r##"\p{N}+"##,
];

const DEEPSEEK3: &[&str] = &[
    r##"\p{N}{1,3}"##,
    r##"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"##,
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const SPARK2_5: &[&str] = &[
    r##"\p{N}{1,3}"##,
    r##"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"##,
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"##,
    r##"\p{N}"##,
];

const DEEPSEEK_CODER: &[&str] = &[
    r##"[\r\n]"##,
    r##"\s?\p{L}+"##,
    r##"\s?\p{P}+"##,
    r##"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"##,
    r##"\p{N}"##,
];

const FALCON: &[&str] = &[
    r##"[\p{P}\$\+<=>\^~\|`]+"##,
    r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##,
    r##"[0-9][0-9][0-9]"##,
];

const STARCODER: &[&str] =
    &[r##"\p{N}"##, r##"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"##];

const QWEN2: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const QWEN35: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const PORO: &[&str] = &[r##" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"##];

const VIKING: &[&str] = &[r##" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"##, r##"\p{N}"##];

const TEKKEN: &[&str] = &[
    r##"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const GPT4O: &[&str] = &[
    r##"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const BAILINGMOE: &[&str] = &[
    r##"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"##,
];

const SEED_CODER: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const UFAKZEKA: &[&str] = &[r##"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##];

const LAGUNA: &[&str] = &[
    r##"[^\n]+|[\n]+"##,
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

const EXAONE_MOE: &[&str] = &[
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+"##,
];

const MINICPM5: &[&str] = &[
    r##"\p{N}{1,3}"##,
    r##"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"##,
];

/// Every `tokenizer.ggml.pre` value accepted, for messages and tests.
pub(crate) const KNOWN: &[&str] = &[
    "default",
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
    "jina-v5-nano",
    "dbrx",
    "smaug-bpe",
    "jais-2",
    "deepseek-llm",
    "deepseek-coder",
    "deepseek-v3",
    "hunyuan-dense",
    "joyai-llm",
    "hy_v4",
    "spark2_5",
    "falcon",
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "mpt",
    "olmo",
    "jais",
    "trillion",
    "granite-docling",
    "exaone4",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
    "qwen2",
    "deepseek-r1-qwen",
    "kormo",
    "f2llmv2",
    "megrez",
    "stablelm2",
    "hunyuan",
    "solar-open",
    "grok-2",
    "qwen35",
    "poro-chat",
    "bloom",
    "gpt3-finnish",
    "viking",
    "chatglm-bpe",
    "glm4",
    "glm5",
    "tekken",
    "gpt-4o",
    "llama4",
    "kanana2",
    "talkie",
    "minimax-m2",
    "bailingmoe",
    "bailingmoe2",
    "llada-moe",
    "seed-coder",
    "ufakzeka",
    "laguna",
    "exaone-moe",
    "minicpm5",
];

/// The configuration of a `tokenizer.ggml.pre` value, or `None` for one this crate does not know.
pub(crate) fn lookup(pre: &str) -> Option<PreConfig> {
    let plain = |exprs| PreConfig { exprs, ignore_merges: false, add_bos: false, no_bos: false };
    Some(match pre {
        "default" => plain(DEFAULT),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
        | "jina-v5-nano" => PreConfig { exprs: LLAMA3, ignore_merges: true, add_bos: true, no_bos: false },
        "dbrx" | "smaug-bpe" => plain(LLAMA3),
        "jais-2" => plain(JAIS2),
        "deepseek-llm" => plain(DEEPSEEK_LLM),
        "deepseek-coder" => plain(DEEPSEEK_CODER),
        "deepseek-v3" | "hunyuan-dense" | "joyai-llm" | "hy_v4" => plain(DEEPSEEK3),
        "spark2_5" => plain(SPARK2_5),
        "falcon" => plain(FALCON),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => plain(GPT2),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            plain(STARCODER)
        }
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open"
        | "grok-2" => plain(QWEN2),
        "qwen35" => plain(QWEN35),
        "poro-chat" | "bloom" | "gpt3-finnish" => plain(PORO),
        "viking" => plain(VIKING),
        "chatglm-bpe" => PreConfig { exprs: LLAMA3, ignore_merges: false, add_bos: false, no_bos: true },
        "glm4" | "glm5" => PreConfig { exprs: LLAMA3, ignore_merges: true, add_bos: false, no_bos: true },
        "tekken" => PreConfig { exprs: TEKKEN, ignore_merges: true, add_bos: true, no_bos: false },
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => plain(GPT4O),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => plain(BAILINGMOE),
        "seed-coder" => plain(SEED_CODER),
        "ufakzeka" => plain(UFAKZEKA),
        "laguna" => plain(LAGUNA),
        "exaone-moe" => plain(EXAONE_MOE),
        "minicpm5" => PreConfig { exprs: MINICPM5, ignore_merges: true, add_bos: false, no_bos: false },
        _ => return None,
    })
}

struct Split {
    re: Regex,
    /// Run on text whose non-ASCII white space is U+000B (llama.cpp's treatment of regexes
    /// without Unicode classes).
    fold_ws: bool,
}

/// A compiled pre-tokenizer.
pub(crate) struct PreTokenizer {
    splits: Vec<Split>,
}

/// Large enough that no realistic word stops a match; a pathological input that exceeds it
/// leaves the rest of its piece unsplit rather than failing.
const BACKTRACK_LIMIT: usize = 50_000_000;

impl PreTokenizer {
    pub fn new(exprs: &[&str]) -> Result<PreTokenizer, String> {
        let mut splits = Vec::with_capacity(exprs.len());
        for e in exprs {
            let re = RegexBuilder::new(e)
                .backtrack_limit(BACKTRACK_LIMIT)
                .build()
                .map_err(|err| format!("cannot compile pre-tokenizer regex {e:?}: {err}"))?;
            splits.push(Split { re, fold_ws: !e.contains(r"\p{") });
        }
        Ok(PreTokenizer { splits })
    }

    /// Splits `text` into words (byte ranges, in order, covering all of it, none empty).
    pub fn split(&self, text: &str) -> Vec<(usize, usize)> {
        let mut pieces = if text.is_empty() { Vec::new() } else { vec![(0, text.len())] };
        for s in &self.splits {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for &(a, b) in &pieces {
                s.split_piece(&text[a..b], a, &mut next);
            }
            pieces = next;
        }
        pieces
    }
}

fn is_folded_ws(c: char) -> bool {
    !c.is_ascii() && c.is_whitespace()
}

impl Split {
    fn split_piece(&self, piece: &str, base: usize, out: &mut Vec<(usize, usize)>) {
        if self.fold_ws && piece.chars().any(is_folded_ws) {
            // Match on a copy with U+000B for each non-ASCII space, then map offsets back.
            let mut folded = String::with_capacity(piece.len());
            let mut orig = vec![0usize; piece.len() + 1];
            for (o, c) in piece.char_indices() {
                orig[folded.len()] = o;
                folded.push(if is_folded_ws(c) { '\u{b}' } else { c });
            }
            orig[folded.len()] = piece.len();
            let mut tmp = Vec::new();
            self.split_plain(&folded, 0, &mut tmp);
            out.extend(tmp.into_iter().map(|(a, b)| (base + orig[a], base + orig[b])));
        } else {
            self.split_plain(piece, base, out);
        }
    }

    fn split_plain(&self, piece: &str, base: usize, out: &mut Vec<(usize, usize)>) {
        let mut last = 0;
        for m in self.re.find_iter(piece) {
            let Ok(m) = m else { break };
            // Like std::regex_iterator in llama.cpp: the gap before a match is a piece of its
            // own even when the match is empty (an empty match yields no piece itself).
            if m.start() > last {
                out.push((base + last, base + m.start()));
            }
            if m.end() > m.start() {
                out.push((base + m.start(), base + m.end()));
            }
            last = last.max(m.end());
        }
        if last < piece.len() {
            out.push((base + last, base + piece.len()));
        }
    }
}

//! The tokenizer stored in real GGUF files against llama.cpp's `llama-tokenize`.
//!
//! tests/tokenizer/<model>.json holds the ids llama-tokenize gives for tests/tokenizer/varied.txt
//! (tools/golden/make_tokenizer_goldens.sh writes them), and tests/tokenizer/random-<model>.json
//! its ids for 300 random texts of every kind (tools/golden/make_random_tokenizer_goldens.py). The models themselves are not in the
//! repository: they are looked for under $SLUICE_MODELS (default ~/.cache/sluice/models, where
//! tools/models/fetch.sh puts them). A missing model fails its test, naming the step that
//! fetches it; `tools/test.sh` (the README's test command) fetches them before `cargo test`.

use sluice_formats::gguf::GgufFile;
use sluice_formats::gguf_tokenizer::GgufTokenizer;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn models_dir() -> PathBuf {
    match std::env::var_os("SLUICE_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sluice/models"),
    }
}

/// The model's tokenizer. A missing model is a failure, never a skip: the README's test
/// command (`tools/test.sh`) fetches the models first.
fn load(stem: &str) -> Option<GgufTokenizer> {
    let path = models_dir().join(format!("{stem}.gguf"));
    if !path.exists() {
        panic!(
            "{} is missing: run the tests with tools/test.sh, which fetches the real models (or run tools/models/fetch.sh, or set SLUICE_MODELS)",
            path.display()
        );
    }
    let f = GgufFile::open(&path).unwrap_or_else(|e| panic!("{e}"));
    Some(GgufTokenizer::from_gguf(&f).unwrap_or_else(|e| panic!("{e}")))
}

fn varied_text() -> String {
    std::fs::read_to_string(repo_root().join("tests/tokenizer/varied.txt")).expect("tests/tokenizer/varied.txt")
}

fn golden_ids(stem: &str) -> Vec<u32> {
    let path = repo_root().join(format!("tests/tokenizer/{stem}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(v["model"].as_str(), Some(format!("{stem}.gguf").as_str()), "{}", path.display());
    v["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()).expect("an id"))
        .collect()
}

/// Encodes varied.txt, compares with llama-tokenize's ids and decodes back to the text.
fn check(stem: &str) -> Option<GgufTokenizer> {
    let t = load(stem)?;
    let text = varied_text();
    let want = golden_ids(stem);
    let got = t.encode(&text, true);
    if got != want {
        let i = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        let lo = i.saturating_sub(4);
        panic!(
            "{stem}: ids differ from llama-tokenize at {i} (got {} ids, want {}):\n  got  {:?}\n  want {:?}\n  got text  {:?}\n  want text {:?}",
            got.len(),
            want.len(),
            &got[lo..(i + 6).min(got.len())],
            &want[lo..(i + 6).min(want.len())],
            t.decode(&got[lo..(i + 6).min(got.len())], false),
            t.decode(&want[lo..(i + 6).min(want.len())], false),
        );
    }
    // Decoding gives the text back: everything but the BOS that encoding added.
    let body = match t.bos() {
        Some(b) if t.add_bos() && got.first() == Some(&b) => &got[1..],
        _ => &got[..],
    };
    assert_eq!(t.decode(body, false), text, "{stem}: decode(encode(text)) is not the text");
    Some(t)
}

/// varied.txt decoded without special tokens.
fn without_specials(t: &GgufTokenizer) -> String {
    t.decode(&t.encode(&varied_text(), true), true)
}

#[test]
fn smollm2_matches_llama_tokenize() {
    let Some(t) = check("smollm2-135m-instruct-q4_1") else { return };
    // gpt2 BPE, pre "smollm": no BOS added; <|im_end|> is EOS, <|endoftext|> and <reponame>
    // (fill-in-the-middle repo name) also end generation, as llama.cpp decides.
    assert!(!t.add_bos());
    assert_eq!(t.bos(), Some(1));
    assert_eq!(t.eos(), vec![2, 0, 4]);
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.token_id("<|im_start|>"), Some(1));
    assert!(t.is_special(1) && !t.is_special(100));
    let plain = without_specials(&t);
    assert!(!plain.contains("<|im_start|>") && plain.contains("<start_of_turn>"));
}

#[test]
fn qwen25_coder_matches_llama_tokenize() {
    let Some(t) = check("qwen2.5-coder-0.5b-q4_k_m") else { return };
    assert!(!t.add_bos());
    assert_eq!(t.bos(), Some(151643));
    // <|im_end|> first; "</s>" (a plain token in Qwen's vocabulary) and the FIM pad, repo and
    // file-separator tokens end generation too in llama.cpp.
    assert_eq!(t.eos(), vec![151645, 128247, 151643, 151662, 151663, 151664]);
    assert_eq!(t.encode("<|im_start|>user", true), vec![151644, 872]);
    let plain = without_specials(&t);
    assert!(!plain.contains("<|im_end|>") && plain.contains("<tool_call>") && plain.contains("<end_of_turn>"));
}

#[test]
fn gemma3_matches_llama_tokenize() {
    let Some(t) = check("gemma3-270m-q4_k_m") else { return };
    // SentencePiece with BOS, no space prefix.
    assert!(t.add_bos());
    assert_eq!(t.bos(), Some(2));
    assert_eq!(t.eos(), vec![1, 106, 212]);
    assert_eq!(t.encode("", true), vec![2]);
    assert!(t.encode("", false).is_empty());
    let plain = without_specials(&t);
    assert!(!plain.contains("<end_of_turn>") && plain.contains("<|im_end|>") && plain.contains("<table>"));
}

#[test]
fn a_hundred_kilobytes_tokenize_quickly() {
    let text = varied_text().repeat(100_000 / varied_text().len() + 1);
    for stem in ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-q4_k_m", "gemma3-270m-q4_k_m"] {
        let Some(t) = load(stem) else { continue };
        let start = Instant::now();
        let ids = t.encode(&text, true);
        let took = start.elapsed();
        eprintln!("{stem}: {} bytes -> {} tokens in {:.1} ms", text.len(), ids.len(), took.as_secs_f64() * 1e3);
        assert_eq!(t.decode(&ids[usize::from(t.add_bos())..], false), text);
        // Generous: this also runs in unoptimized builds; release takes a few tens of ms.
        assert!(took.as_secs_f64() < 10.0, "{stem}: {took:?}");
    }
}

/// A small deterministic generator (no dependency for a test's random ids).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    fn below(&mut self, n: u32) -> u32 {
        self.next() % n
    }
}

/// tests/tokenizer/random-<model>.json: random texts of every script, controls, emoji,
/// whitespace runs and special tokens' texts, and llama-tokenize's ids for each
/// (tools/golden/make_random_tokenizer_goldens.py writes them).
#[test]
fn random_texts_give_llama_tokenize_ids_and_random_ids_decode() {
    for stem in ["smollm2-135m-instruct-q4_1", "qwen2.5-coder-0.5b-q4_k_m", "gemma3-270m-q4_k_m"] {
        let Some(t) = load(stem) else { continue };
        let path = repo_root().join(format!("tests/tokenizer/random-{stem}.json"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
                .unwrap();
        let cases = v["cases"].as_array().expect("cases");
        assert!(cases.len() >= 300, "{}: {} cases", path.display(), cases.len());
        let mut differ = Vec::new();
        for c in cases {
            let text = c["text"].as_str().expect("text");
            let want: Vec<u32> = c["ids"].as_array().expect("ids").iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let got = t.encode(text, true);
            if got != want {
                differ.push(format!("{text:?}\n  got  {got:?}\n  want {want:?}"));
            }
        }
        assert!(
            differ.is_empty(),
            "{stem}: {} of {} texts tokenize unlike llama-tokenize:\n{}",
            differ.len(),
            cases.len(),
            differ[..differ.len().min(5)].join("\n")
        );
        // Any ids, those past the vocabulary too, decode to some text without a panic.
        let vocab = t.vocab_size() as u32;
        let mut g = Lcg(0x5eed ^ vocab as u64);
        for _ in 0..5000 {
            let ids: Vec<u32> =
                (0..g.below(12)).map(|_| if g.below(8) == 0 { g.next() } else { g.below(vocab) }).collect();
            let _ = t.decode(&ids, g.below(2) == 0);
        }
    }
}

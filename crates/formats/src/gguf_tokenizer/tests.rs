use super::bpe::{byte_to_char_table, char_to_byte};
use super::pretok::{lookup, PreTokenizer, KNOWN};
use super::*;
use crate::gguf::{parse_bytes, GgufWriter};

fn file(meta: Vec<(&str, Value)>) -> GgufFile {
    let mut w = GgufWriter::default();
    for (k, v) in meta {
        w.add(k, v);
    }
    let mut out = Vec::new();
    w.write(&mut out, |_, _| Ok(())).unwrap();
    parse_bytes(&out).unwrap()
}

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// A byte-level BPE vocabulary: the 256 byte characters, a few merges, two control tokens.
fn tiny_bpe_meta(pre: &str) -> Vec<(&'static str, Value)> {
    let table = byte_to_char_table();
    let mut tokens: Vec<String> = table.iter().map(|c| c.to_string()).collect();
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    tokens.push("<|end|>".into());
    tokens.push("<|end|><|x|>".into());
    let n = tokens.len();
    let mut types = vec![1i32; n];
    types[n - 2] = 3;
    types[n - 1] = 3;
    vec![
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String(pre.into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
        ("tokenizer.ggml.merges", strings(&merges)),
        ("tokenizer.ggml.eos_token_id", Value::U32(n as u32 - 2)),
    ]
}

fn tiny_bpe() -> GgufTokenizer {
    GgufTokenizer::from_gguf(&file(tiny_bpe_meta("gpt-2"))).unwrap()
}

/// A SentencePiece vocabulary with scores chosen so that the merge order is forced.
fn tiny_spm() -> GgufTokenizer {
    let mut tokens: Vec<String> =
        ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁ab", "abc", "<0xC3>", "<0xA9>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut scores = vec![0.0f32, 0.0, 0.0, -5.0, -6.0, -6.0, -6.0, -1.0, -2.0, -0.5, -3.0, 0.0, 0.0];
    let mut types = vec![2i32, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6, 6];
    // Equal scores: "xy" and "yz" compete for the middle "y"; the leftmost pair wins.
    for (t, s) in [("x", -6.0), ("y", -6.0), ("z", -6.0), ("xy", -1.0), ("yz", -1.0)] {
        tokens.push(t.into());
        scores.push(s);
        types.push(1);
    }
    let f = file(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(Array::String(tokens))),
        ("tokenizer.ggml.scores", Value::Array(Array::F32(scores))),
        ("tokenizer.ggml.token_type", Value::Array(Array::I32(types))),
    ]);
    GgufTokenizer::from_gguf(&f).unwrap()
}

#[test]
fn byte_table_is_a_bijection() {
    let table = byte_to_char_table();
    let distinct: std::collections::HashSet<char> = table.iter().copied().collect();
    assert_eq!(distinct.len(), 256);
    for (b, c) in table.iter().enumerate() {
        assert_eq!(char_to_byte(*c), Some(b as u8), "byte {b} via {c:?}");
    }
    // Printable bytes stand for themselves; space and newline are the well-known Ġ and Ċ.
    assert_eq!(table[b'a' as usize], 'a');
    assert_eq!(table[b' ' as usize], 'Ġ');
    assert_eq!(table[b'\n' as usize], 'Ċ');
    // Nothing else maps back to a byte.
    let others = (0u32..0x400).filter_map(char::from_u32).filter(|c| !distinct.contains(c));
    for c in others {
        assert_eq!(char_to_byte(c), None, "{c:?}");
    }
}

#[test]
fn spm_merges_by_score_on_a_hand_built_vocab() {
    let t = tiny_spm();
    // "▁abc": ab (-1) first, then ▁ab (-0.5) beats abc (-3); "▁abc" is no token. BOS by default.
    assert_eq!(t.encode("abc", true), vec![1, 9, 6]);
    assert_eq!(t.encode("abc", false), vec![9, 6]);
    // Ties go to the leftmost pair: x y z → xy z.
    let (xy, z) = (t.token_id("xy").unwrap(), t.token_id("z").unwrap());
    assert_eq!(t.encode("xyz", false), vec![3, xy, z]);
    // "é" is not in the vocabulary: its UTF-8 bytes, as <0xC3> <0xA9>.
    assert_eq!(t.encode("é", false), vec![3, 11, 12]);
    // Decoding: ▁ is a space, byte tokens are bytes, the prefix space goes away.
    assert_eq!(t.decode(&t.encode("abc é", true), true), "abc é");
    assert_eq!(t.decode(&[1, 9, 6], false), "<s> abc");
    assert_eq!(t.bos(), Some(1));
    assert_eq!(t.eos(), vec![2]);
    assert!(t.add_bos() && t.is_special(1) && !t.is_special(9));
}

#[test]
fn bpe_merges_by_rank_and_round_trips() {
    let t = tiny_bpe();
    let hello = t.token_id("hello").unwrap();
    let world = t.token_id("Ġworld").unwrap();
    assert_eq!(t.encode("hello world", false), vec![hello, world]);
    // Bytes with no merge stay single byte tokens.
    let ids = t.encode("héllo, wörld!\n", false);
    assert_eq!(t.decode(&ids, false), "héllo, wörld!\n");
    // A control token written in the text is one token; the longest special wins.
    let end = t.token_id("<|end|>").unwrap();
    let endx = t.token_id("<|end|><|x|>").unwrap();
    assert_eq!(t.encode("hello<|end|>", true), vec![hello, end]);
    assert_eq!(t.encode("<|end|><|x|><|end|>", true), vec![endx, end]);
    assert_eq!(t.decode(&[hello, end], true), "hello");
    assert_eq!(t.decode(&[hello, end], false), "hello<|end|>");
    // gpt2 tokenizers add no BOS by default.
    assert!(!t.add_bos());
    assert_eq!(t.eos(), vec![end]);
}

#[test]
fn unknown_pre_tokenizer_and_model_are_refused_by_name() {
    let e = GgufTokenizer::from_gguf(&file(tiny_bpe_meta("mystery-pre"))).err().unwrap().to_string();
    assert!(e.contains("\"mystery-pre\"") && e.contains("tokenizer.ggml.pre"), "{e}");
    let mut meta = tiny_bpe_meta("gpt-2");
    meta[0].1 = Value::String("wordpiece-ish".into());
    let e = GgufTokenizer::from_gguf(&file(meta)).err().unwrap().to_string();
    assert!(e.contains("\"wordpiece-ish\"") && e.contains("tokenizer.ggml.model"), "{e}");
}

#[test]
fn missing_and_mismatched_arrays_name_their_key() {
    let err = |meta: Vec<(&str, Value)>| GgufTokenizer::from_gguf(&file(meta)).err().unwrap().to_string();
    let meta: Vec<_> = tiny_bpe_meta("gpt-2").into_iter().filter(|(k, _)| *k != "tokenizer.ggml.merges").collect();
    assert!(err(meta).contains("`tokenizer.ggml.merges`"));
    let meta: Vec<_> = tiny_bpe_meta("gpt-2").into_iter().filter(|(k, _)| *k != "tokenizer.ggml.tokens").collect();
    assert!(err(meta).contains("`tokenizer.ggml.tokens`"));
    let mut meta = tiny_bpe_meta("gpt-2");
    meta[3].1 = Value::Array(Array::I32(vec![1; 3]));
    let e = err(meta);
    assert!(e.contains("`tokenizer.ggml.token_type` has 3 entries"), "{e}");
    let mut meta = tiny_bpe_meta("gpt-2");
    meta.push(("tokenizer.ggml.scores", Value::Array(Array::F32(vec![0.0; 2]))));
    assert!(err(meta).contains("`tokenizer.ggml.scores` has 2 entries"));
    let mut meta = tiny_bpe_meta("gpt-2");
    meta[4].1 = strings(&["nospace"]);
    assert!(err(meta).contains("`tokenizer.ggml.merges`"));
    let mut meta = tiny_bpe_meta("gpt-2");
    meta[3].1 = Value::Array(Array::F32(vec![1.0]));
    assert!(err(meta).contains("`tokenizer.ggml.token_type` is not an array of int32"));
    // SentencePiece without scores.
    let e = err(vec![
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", strings(&["<unk>", "a"])),
    ]);
    assert!(e.contains("`tokenizer.ggml.scores`"), "{e}");
}

#[test]
fn odd_input_never_panics() {
    let huge_ws = " ".repeat(50_000) + &"\t\n \u{3000}\u{a0}".repeat(5_000);
    let inputs = [
        String::new(),
        " ".into(),
        "\u{FFFD}".into(),
        String::from_utf8_lossy(&[0xED, 0xA0, 0x80, b'a', 0xF4, 0x90]).into_owned(),
        "\u{D7FF}\u{E000}\u{10FFFF}\u{0}".into(),
        huge_ws,
        "'s'S'll'LL'".into(),
        "<|end|".into(),
    ];
    for t in [tiny_bpe(), tiny_spm()] {
        for s in &inputs {
            let ids = t.encode(s, true);
            let back = t.decode(&ids, false);
            if !s.is_empty() && t.tokens.len() > 256 {
                assert_eq!(&back, s, "BPE round trip");
            }
        }
        assert!(t.encode("", false).is_empty());
        let _ = t.decode(&[u32::MAX, 7, 1 << 30, 0], true);
        assert!(!t.is_special(u32::MAX));
    }
}

#[test]
fn every_known_pre_tokenizer_compiles_and_covers_its_text() {
    let text = "Hello, World! don't I'M 12345 3.14159 naïve 世界 Привет مرحبا 🙂 e\u{301}\n\n  \t x  \u{3000}end ";
    for name in KNOWN {
        let cfg = lookup(name).unwrap_or_else(|| panic!("{name} not found"));
        let pre = PreTokenizer::new(cfg.exprs).unwrap_or_else(|e| panic!("{name}: {e}"));
        let words = pre.split(text);
        let mut at = 0;
        for (a, b) in &words {
            assert!(a == &at && b > a, "{name}: gap or empty word at {a}..{b}");
            at = *b;
        }
        assert_eq!(at, text.len(), "{name}");
    }
    assert!(lookup("no-such-pre").is_none());
}

#[test]
fn pre_tokenizer_splits_like_the_regexes() {
    let words = |pre: &str, text: &str| -> Vec<String> {
        let p = PreTokenizer::new(lookup(pre).unwrap().exprs).unwrap();
        p.split(text).into_iter().map(|(a, b)| text[a..b].to_string()).collect()
    };
    assert_eq!(words("gpt-2", "Hello world  foo's"), ["Hello", " world", " ", " foo", "'s"]);
    assert_eq!(words("qwen2", "x = 123;\n\n  y"), ["x", " =", " ", "1", "2", "3", ";\n\n", " ", " y"]);
    assert_eq!(words("llama3", "12345 abc\t\n"), ["123", "45", " abc", "\t\n"]);
    // smollm isolates digits first, so a space before a digit stays alone.
    assert_eq!(words("smollm", "a 12"), ["a", " ", "1", "2"]);
    // deepseek-llm's punctuation class holds U+3000, but llama.cpp matches it as a space.
    assert_eq!(words("deepseek-llm", "!\u{3000}\u{3000}"), ["!", "\u{3000}\u{3000}"]);
}

#[test]
fn tokenizer_is_shareable_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<GgufTokenizer>();
}

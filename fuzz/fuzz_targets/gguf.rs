//! GGUF reader and the tokenizer read from its metadata: nothing may panic, allocate absurdly
//! or hang on any input. Every successful parse is exercised as a loader would use it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_formats::gguf::{parse_bytes, Array, Value};
use sluice_formats::gguf_tokenizer::GgufTokenizer;

/// Reads every element of a metadata value through the public accessors.
fn touch_value(v: &Value) -> usize {
    let mut n = 0usize;
    n += v.as_u64().is_some() as usize;
    n += v.as_f64().map(|x| x.is_nan() as usize).unwrap_or(0);
    n += v.as_str().map(str::len).unwrap_or(0);
    n += v.as_bool().is_some() as usize;
    if let Some(a) = v.as_array() {
        n += touch_array(a);
    }
    n
}

fn touch_array(a: &Array) -> usize {
    let mut n = a.len() + a.is_empty() as usize;
    n += a.as_ints().map(|v| v.len()).unwrap_or(0);
    match a {
        Array::String(v) => n += v.iter().map(String::len).sum::<usize>(),
        Array::Nested(v) => n += v.iter().map(touch_array).sum::<usize>(),
        _ => {}
    }
    n
}

const TEXTS: &[&str] = &[
    "",
    " ",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "The year 2024: 1234567 tokens; don't stop.\n\n\tTabs\r\nand CRLF",
    "héllo wörld — ünïcödé 日本語のテキスト 한국어 emoji 🦀🎉",
    "<|endoftext|><|im_start|>user\n<s></s><unk><|end|>[PAD]<0x41>",
    "\u{2581}\u{2581}x\u{2581}  \u{a0}\u{3000}",
];

fuzz_target!(|data: &[u8]| {
    let Ok(file) = parse_bytes(data) else { return };

    // Every tensor, as the model loader takes it: the blob must lie inside the file.
    let mut sum = 0usize;
    for t in &file.tensors {
        let info = file.tensor_info(&t.name).expect("a listed tensor has an info");
        sum = sum.wrapping_add(info.numel() as usize).wrapping_add(info.shape().len());
        let td = file.tensor(&t.name).expect("a listed tensor can be taken");
        assert_eq!(td.data.len() as u64, t.size);
        assert!(t.offset + t.size <= file.file_len());
        // Read the first and last byte of the data (the blob derefs into the map).
        if let (Some(a), Some(b)) = (td.data.first(), td.data.last()) {
            sum = sum.wrapping_add(*a as usize + *b as usize);
        }
    }
    // Every metadata value, raw and through the typed accessors.
    for (k, v) in &file.metadata {
        sum = sum.wrapping_add(touch_value(v));
        let _ = file.meta_u64(k);
        let _ = file.meta_opt_u64(k);
        let _ = file.meta_opt_f64(k);
        let _ = file.meta_str(k);
        let _ = file.meta_opt_bool(k);
        let _ = file.meta_array(k);
    }
    std::hint::black_box(sum);

    let Ok(tok) = GgufTokenizer::from_gguf(&file) else { return };
    let n = tok.vocab_size() as u32;
    for text in TEXTS {
        for add_special in [false, true] {
            let ids = tok.encode(text, add_special);
            // Every id the encoder produces is in the vocabulary.
            for &id in &ids {
                assert!(id < n, "encode({text:?}) gave id {id} outside a vocabulary of {n}");
            }
            let _ = tok.decode(&ids, false);
            let _ = tok.decode(&ids, true);
        }
    }
    // Decoding arbitrary ids, in range and not, never panics; ids come from the input's tail.
    let mut ids: Vec<u32> = data.rchunks_exact(4).take(64).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
    ids.extend([0, 1, n.saturating_sub(1), n, n.wrapping_add(1), u32::MAX / 2, u32::MAX - 1, u32::MAX]);
    ids.extend(ids.clone().iter().map(|i| i % n.max(1)));
    let _ = tok.decode(&ids, false);
    let _ = tok.decode(&ids, true);
    for &id in &ids {
        let _ = tok.is_special(id);
    }
    let _ = (tok.bos(), tok.eos(), tok.add_bos(), tok.add_eos(), tok.token_id("a"));
});

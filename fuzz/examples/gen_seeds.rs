//! Writes the seed corpora for the fuzz targets (run through `seed.sh`).
//!
//! Usage: gen_seeds REPO_ROOT OUT_DIR. Writes OUT_DIR/gguf/* and OUT_DIR/safetensors/*:
//! - gguf: every `tests/golden/gguf/*.gguf` rewritten "slim" (the same metadata, so the same
//!   tokenizer, and the same tensor names and types, but each tensor one block long), so that a
//!   whole file fits in a few KB under `-max_len`; plus tiny files written from scratch: every
//!   metadata type, a byte-level BPE tokenizer and a SentencePiece one.
//! - safetensors: every `tests/golden/*/model.safetensors` rewritten slim (the same header
//!   entries with one-element shapes), plus a few hand-made headers.

use sluice_formats::gguf::{Array, GgufFile, GgufWriter, Value};
use sluice_kernels::DType;
use std::path::{Path, PathBuf};

fn write_gguf(w: &GgufWriter, path: &Path) {
    let mut out = Vec::new();
    w.write(&mut out, |i, o| {
        let (_, dims, dtype) = &w.tensors[i];
        let n = dims.iter().product::<u64>() / dtype.block_elems() as u64 * dtype.block_bytes() as u64;
        // Small non-zero bytes, different per tensor.
        o.write_all(&(0..n).map(|j| (j as u8).wrapping_mul(31).wrapping_add(i as u8)).collect::<Vec<u8>>())
    })
    .expect("write to memory");
    sluice_formats::gguf::parse_bytes(&out).unwrap_or_else(|e| panic!("{}: does not parse back: {e}", path.display()));
    std::fs::write(path, out).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn slim_gguf(src: &Path, dst: &Path) {
    let f = GgufFile::open(src).unwrap_or_else(|e| panic!("{e}"));
    let mut w = GgufWriter { alignment: f.alignment, ..Default::default() };
    for (k, v) in &f.metadata {
        w.add(k, v.clone());
    }
    for t in &f.tensors {
        // One block in the contiguous dimension, 1 in the others: the same rank and type.
        let mut dims = vec![1u64; t.dims.len()];
        dims[0] = t.dtype.block_elems() as u64;
        w.add_tensor(&t.name, dims, t.dtype);
    }
    write_gguf(&w, dst);
}

fn strings(v: &[&str]) -> Value {
    Value::Array(Array::String(v.iter().map(|s| s.to_string()).collect()))
}

/// The 256 GPT-2 byte characters (printable Latin-1 for themselves, the rest from U+0100).
fn gpt2_byte_chars() -> Vec<String> {
    let mut n = 0u32;
    (0..256u32)
        .map(|b| {
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
            let c = if printable {
                b
            } else {
                n += 1;
                255 + n
            };
            char::from_u32(c).unwrap().to_string()
        })
        .collect()
}

fn tiny_files(dir: &Path) {
    // Every metadata value type, and tensors of several types (one of them empty).
    let mut w = GgufWriter::default();
    w.add("general.architecture", Value::String("llama".into()));
    w.add("u8", Value::U8(1));
    w.add("i8", Value::I8(-1));
    w.add("u16", Value::U16(2));
    w.add("i16", Value::I16(-2));
    w.add("u32", Value::U32(3));
    w.add("i32", Value::I32(-3));
    w.add("f32", Value::F32(0.5));
    w.add("bool", Value::Bool(true));
    w.add("u64", Value::U64(4));
    w.add("i64", Value::I64(-4));
    w.add("f64", Value::F64(-0.25));
    w.add("a.u8", Value::Array(Array::U8(vec![1, 2])));
    w.add("a.i8", Value::Array(Array::I8(vec![-1])));
    w.add("a.u16", Value::Array(Array::U16(vec![1])));
    w.add("a.i16", Value::Array(Array::I16(vec![-1])));
    w.add("a.u32", Value::Array(Array::U32(vec![1])));
    w.add("a.i32", Value::Array(Array::I32(vec![-1])));
    w.add("a.f32", Value::Array(Array::F32(vec![1.5])));
    w.add("a.bool", Value::Array(Array::Bool(vec![true, false])));
    w.add("a.str", strings(&["x", ""]));
    w.add("a.u64", Value::Array(Array::U64(vec![1])));
    w.add("a.i64", Value::Array(Array::I64(vec![-1])));
    w.add("a.f64", Value::Array(Array::F64(vec![1.0])));
    w.add(
        "a.nested",
        Value::Array(Array::Nested(vec![Array::I32(vec![1, 2]), Array::Nested(vec![Array::U8(vec![])])])),
    );
    w.add_tensor("q8", vec![32, 2], DType::Q8_0);
    w.add_tensor("f32", vec![3], DType::F32);
    w.add_tensor("bf16", vec![2, 1, 1, 2], DType::BF16);
    w.add_tensor("q4k", vec![256], DType::Q4_K);
    w.add_tensor("empty", vec![0, 4], DType::F16);
    write_gguf(&w, &dir.join("tiny-all-types.gguf"));

    // Non-default alignment and no tensors.
    let mut w = GgufWriter { alignment: 64, ..Default::default() };
    w.add("general.name", Value::String("aligned".into()));
    w.add_tensor("t", vec![5], DType::F32);
    write_gguf(&w, &dir.join("tiny-align64.gguf"));
    write_gguf(&GgufWriter::default(), &dir.join("tiny-empty.gguf"));

    // Byte-level BPE: the byte characters, a few merges, control tokens found by their text.
    let mut tokens = gpt2_byte_chars();
    let merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ġ Ġ"];
    for m in merges {
        tokens.push(m.replace(' ', ""));
    }
    for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|end|>", "</s>"] {
        tokens.push(t.into());
    }
    let n = tokens.len();
    let mut types = vec![1i32; n];
    for t in &mut types[n - 6..] {
        *t = 3;
    }
    for pre in ["gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "tekken", "default"] {
        let mut w = GgufWriter::default();
        w.add("general.name", Value::String("phi-3 tiny".into()));
        w.add("tokenizer.ggml.model", Value::String("gpt2".into()));
        w.add("tokenizer.ggml.pre", Value::String(pre.into()));
        w.add("tokenizer.ggml.tokens", Value::Array(Array::String(tokens.clone())));
        w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types.clone())));
        w.add("tokenizer.ggml.merges", strings(&merges));
        w.add("tokenizer.ggml.eos_token_id", Value::U32(n as u32 - 6));
        w.add("tokenizer.ggml.bos_token_id", Value::I32(-1));
        w.add("tokenizer.ggml.add_bos_token", Value::Bool(true));
        w.add("tokenizer.ggml.add_eos_token", Value::Bool(true));
        write_gguf(&w, &dir.join(format!("tiny-bpe-{pre}.gguf")));
    }

    // SentencePiece: scores, byte tokens, unknown/control types.
    let mut tokens: Vec<String> =
        ["<unk>", "<s>", "</s>", "▁", "a", "b", "c", "ab", "bc", "▁ab", "abc", "<0xC3>", "<0xA9>", "<0x41>", "<|end|>"]
            .iter()
            .map(|s| s.to_string())
            .collect();
    let mut scores = vec![0.0f32, 0.0, 0.0, -5.0, -6.0, -6.0, -6.0, -1.0, -2.0, -0.5, -3.0, 0.0, 0.0, 0.0, 0.0];
    let mut types = vec![2i32, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 6, 6, 6, 4];
    for (t, s) in [("x", -6.0), ("y", -6.0), ("z", -6.0), ("xy", -1.0), ("yz", -1.0), ("", -9.0)] {
        tokens.push(t.into());
        scores.push(s);
        types.push(1);
    }
    let mut w = GgufWriter::default();
    w.add("tokenizer.ggml.model", Value::String("llama".into()));
    w.add("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)));
    w.add("tokenizer.ggml.scores", Value::Array(Array::F32(scores)));
    w.add("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
    w.add("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.add("tokenizer.ggml.add_space_prefix", Value::Bool(true));
    w.add("tokenizer.ggml.add_eos_token", Value::Bool(true));
    write_gguf(&w, &dir.join("tiny-spm.gguf"));
}

fn slim_safetensors(src: &Path, dst: &Path) {
    let bytes = std::fs::read(src).unwrap_or_else(|e| panic!("{}: {e}", src.display()));
    let tensors = sluice_formats::safetensors::parse_header_bytes(&bytes).unwrap_or_else(|e| panic!("{e}"));
    let slim: Vec<(String, String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, info)| {
            let shape = vec![1usize; info.shape.len()];
            let esz = (info.end - info.start) / info.numel().max(1);
            (name.clone(), info.dtype.clone(), shape, vec![0x3c; esz.max(1)])
        })
        .collect();
    let refs: Vec<(&str, &str, &[usize], &[u8])> =
        slim.iter().map(|(n, d, s, b)| (n.as_str(), d.as_str(), s.as_slice(), b.as_slice())).collect();
    sluice_formats::safetensors::write(dst, &refs).unwrap_or_else(|e| panic!("{}: {e}", dst.display()));
    let back = std::fs::read(dst).unwrap();
    sluice_formats::safetensors::parse_header_bytes(&back).unwrap_or_else(|e| panic!("{e}"));
}

/// A safetensors file: length prefix, header text, data.
fn raw_safetensors(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(0u8, data_len));
    out
}

fn main() {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    let [root, out] = args.as_slice() else {
        eprintln!("usage: gen_seeds REPO_ROOT OUT_DIR");
        std::process::exit(2);
    };
    let gdir = out.join("gguf");
    let sdir = out.join("safetensors");
    std::fs::create_dir_all(&gdir).unwrap();
    std::fs::create_dir_all(&sdir).unwrap();

    let mut golden: Vec<PathBuf> = std::fs::read_dir(root.join("tests/golden/gguf"))
        .expect("tests/golden/gguf")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    golden.sort();
    for p in &golden {
        slim_gguf(p, &gdir.join(format!("slim-{}", p.file_name().unwrap().to_string_lossy())));
    }
    tiny_files(&gdir);

    let mut models: Vec<PathBuf> = std::fs::read_dir(root.join("tests/golden"))
        .expect("tests/golden")
        .filter_map(|e| e.ok().map(|e| e.path().join("model.safetensors")))
        .filter(|p| p.is_file())
        .collect();
    models.sort();
    for p in &models {
        let model = p.parent().unwrap().file_name().unwrap().to_string_lossy().to_string();
        slim_safetensors(p, &sdir.join(format!("slim-{model}.safetensors")));
    }
    let hand: &[(&str, &str, usize)] = &[
        ("empty-object", "{}", 0),
        ("metadata-only", r#"{"__metadata__":{"format":"pt"}}"#, 0),
        ("one-f32", r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#, 16),
        (
            "two-mixed",
            r#"{"__metadata__":{},"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},"ids":{"dtype":"I64","shape":[1],"data_offsets":[6,14]}}"#,
            14,
        ),
        ("scalar", r#"{"s":{"dtype":"U8","shape":[],"data_offsets":[0,1]}}"#, 1),
        ("zero-dim", r#"{"z":{"dtype":"F16","shape":[0,7],"data_offsets":[0,0]}}"#, 0),
        (
            "f8-bool",
            r#"{"e":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"BOOL","shape":[1],"data_offsets":[2,3]}}"#,
            3,
        ),
        // Sizes that overflow (the parser used to panic or wrap on these).
        ("huge-shape", r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}"#, 0),
        ("huge-elems", r#"{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,0]}}"#, 0),
        ("padded", "{\"p\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}    ", 8),
    ];
    for (name, header, data_len) in hand {
        std::fs::write(sdir.join(format!("hand-{name}.safetensors")), raw_safetensors(header, *data_len)).unwrap();
    }
    let count = |d: &Path| std::fs::read_dir(d).unwrap().count();
    println!("wrote {} gguf and {} safetensors seeds under {}", count(&gdir), count(&sdir), out.display());
}

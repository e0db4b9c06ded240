//! Every way a checkpoint can be broken ends in a one-line error that names the file and the
//! problem, never a panic.

use std::path::{Path, PathBuf};
use std::process::Command;

fn golden(fam: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(fam)
}

/// A scratch copy of a golden model directory.
fn copy_model(fam: &str, tag: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("sluice-err-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(golden(fam)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// Runs `sluice logits` on `model`; returns stderr, asserting a clean failure.
fn fails(model: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["logits", "--model"])
        .arg(model)
        .args(["--tokens", "5,6,7"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(1), "expected exit 1, stderr: {err}");
    assert!(!err.contains("panicked"), "panic: {err}");
    err
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(&p, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Rewrites a safetensors header in place, keeping the data section.
fn edit_header(file: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut h: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(h.as_object_mut().unwrap());
    let mut hb = serde_json::to_vec(&h).unwrap();
    while !hb.len().is_multiple_of(8) {
        hb.push(b' ');
    }
    let mut out = (hb.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&hb);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(file, out).unwrap();
}

#[test]
fn missing_path() {
    let e = fails(Path::new("/nonexistent/sluice-model"));
    assert!(e.contains("/nonexistent/sluice-model") && e.contains("no such file"), "{e}");
}

#[test]
fn missing_config() {
    let d = copy_model("qwen3", "noconfig");
    std::fs::remove_file(d.join("config.json")).unwrap();
    let e = fails(&d);
    assert!(e.contains("missing config.json"), "{e}");
}

#[test]
fn missing_weights_file() {
    let d = copy_model("qwen3", "noweights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let e = fails(&d);
    assert!(e.contains("no *.safetensors files"), "{e}");
}

#[test]
fn truncated_safetensors() {
    let d = copy_model("qwen3_moe", "trunc");
    let p = d.join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
}

#[test]
fn unknown_architecture() {
    let d = copy_model("llama", "arch");
    edit_config(&d, |c| {
        c.insert("model_type".into(), "gpt_neox".into());
    });
    let e = fails(&d);
    assert!(e.contains("config.json") && e.contains("unsupported architecture") && e.contains("gpt_neox"), "{e}");
}

#[test]
fn wrong_weight_dtype() {
    let d = copy_model("llama", "dtype");
    edit_header(&d.join("model.safetensors"), |h| {
        let t = h.get_mut("model.layers.0.self_attn.q_proj.weight").unwrap().as_object_mut().unwrap();
        // Same byte size: 96×64 bf16 = 96×32 i32.
        t.insert("dtype".into(), "I32".into());
        t.insert("shape".into(), serde_json::json!([96, 32]));
    });
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("q_proj.weight") && e.contains("dtype I32"), "{e}");
}

#[test]
fn shapes_inconsistent_with_config() {
    let d = copy_model("qwen2_moe", "shape");
    edit_config(&d, |c| {
        c.insert("num_key_value_heads".into(), 1.into());
    });
    let e = fails(&d);
    assert!(e.contains("model.safetensors") && e.contains("k_proj.weight") && e.contains("expected [16, 64]"), "{e}");
}

#[test]
fn missing_tensor() {
    let d = copy_model("mixtral", "missing");
    edit_header(&d.join("model.safetensors"), |h| {
        h.remove("model.layers.1.block_sparse_moe.experts.3.w2.weight");
    });
    let e = fails(&d);
    assert!(e.contains("missing tensor `model.layers.1.block_sparse_moe.experts.3.w2.weight`"), "{e}");
}

#[test]
fn config_value_of_wrong_type() {
    let d = copy_model("olmoe", "type");
    edit_config(&d, |c| {
        c.insert("hidden_size".into(), "big".into());
    });
    let e = fails(&d);
    assert!(e.contains("config.json") && e.contains("`hidden_size`"), "{e}");
}

#[test]
fn impossible_expert_count() {
    let d = copy_model("qwen3_moe", "topk");
    edit_config(&d, |c| {
        c.insert("num_experts_per_tok".into(), 9.into());
    });
    let e = fails(&d);
    assert!(e.contains("9 experts per token out of 8"), "{e}");
}

#[test]
fn token_outside_vocabulary() {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["logits", "--model"])
        .arg(golden("qwen2"))
        .args(["--tokens", "1,99999"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(err.contains("token id 99999 is outside the vocabulary of 384"), "{err}");
}

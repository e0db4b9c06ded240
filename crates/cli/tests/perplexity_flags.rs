//! `sluice perplexity` takes its chunk size from `--ctx-size`/`-c` (llama-perplexity's flag)
//! or, without it, from `--ctx`; contradictory or unusable sizes are refused by name.

use std::path::PathBuf;
use std::process::{Command, Output};

fn repo(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..").join(p)
}

fn perplexity(extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["perplexity", "--json", "--chunks", "1", "-t", "1", "--model"])
        .arg(repo("tests/golden/qwen3"))
        .arg("--file")
        .arg(repo("tests/data/gpl-3.txt"))
        .args(extra)
        .output()
        .unwrap()
}

fn chunk_of(out: &Output) -> u64 {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "perplexity failed: {err}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["ppl"].as_f64().unwrap().is_finite());
    v["ctx"].as_u64().unwrap()
}

#[test]
fn chunk_size_comes_from_ctx_size_or_ctx() {
    assert_eq!(chunk_of(&perplexity(&["--ctx", "24"])), 24);
    assert_eq!(chunk_of(&perplexity(&["-c", "16"])), 16);
    assert_eq!(chunk_of(&perplexity(&["--ctx", "64", "--ctx-size", "32"])), 32);
}

#[test]
fn unusable_chunk_sizes_are_refused_by_name() {
    for (args, needle) in
        [(&["--ctx", "8", "-c", "16"][..], "--ctx 8 is smaller"), (&["-c", "1"][..], "at least 2 tokens")]
    {
        let out = perplexity(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(needle) && !err.contains("panicked"), "{args:?}: {err}");
    }
}

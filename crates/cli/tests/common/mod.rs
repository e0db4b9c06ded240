//! Helpers shared by the CLI tests that drive the `sluice` binary on synthetic models.
#![allow(dead_code)] // each test file uses a part

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The prompt (tiny-moe token ids) the streaming tests generate from.
pub const PROMPT: &str = "17,301,5,88,190,42,7,260,33,410,99,12";

/// Runs `sluice` with `args`; `cache` sets `SLUICE_CACHE` (where measured rates are kept).
pub fn sluice_in(cache: Option<&Path>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sluice"));
    c.args(args);
    if let Some(d) = cache {
        c.env("SLUICE_CACHE", d);
    }
    c.output().unwrap()
}

pub fn sluice(args: &[&str]) -> Output {
    sluice_in(None, args)
}

/// Standard output of a run that must succeed (its standard error in the failure message).
pub fn ok(out: Output) -> String {
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// A fresh scratch directory for one test.
pub fn scratch(tag: &str) -> PathBuf {
    let d = sluice_formats::scratch_root().join(format!("sluice-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Writes tiny-moe in Q8_0 (rows wide enough for a routing topic) with `routing` and the
/// extra synth flags to `out`.
pub fn synth_tiny(out: &Path, routing: &str, extra: &[&str]) {
    let o = s(out);
    let mut args =
        vec!["synth", "--shape", "tiny-moe", "--quant", "q8_0", "--routing", routing, "--check-tokens", "0", "-o", &o];
    args.extend(extra);
    ok(sluice(&args));
}

/// Traces `prompt` (token ids) and `n` tokens of greedy generation, every expert resident.
pub fn trace(model: &Path, trace: &Path, prompt: &str, n: usize) {
    let n = n.to_string();
    ok(sluice(&[
        "run",
        "-m",
        &s(model),
        "--expert-cache",
        "all",
        "--prompt-tokens",
        prompt,
        "-n",
        &n,
        "--trace",
        &s(trace),
    ]));
}

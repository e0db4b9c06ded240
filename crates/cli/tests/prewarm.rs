//! `--prewarm TRACE` fills a streamed model's expert cache from a routing trace before the
//! first token: the same tokens come out, the first tokens hit the cache more, the reads it
//! made are reported apart from generation's, and a trace of another model is refused.

mod common;

use common::{ok, s, scratch, sluice, synth_tiny, trace, PROMPT};
use std::path::Path;

/// Generates 24 tokens with a streamed cache of 156 of the 512 experts (the trace uses about
/// 270), optionally prewarmed.
fn streamed(model: &Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["run", "-m"];
    let m = s(model);
    args.push(&m);
    args.extend([
        "--expert-mode",
        "stream",
        "--expert-cache",
        "64MiB",
        "--no-pressure",
        "--prompt-tokens",
        PROMPT,
        "-n",
        "24",
        "--json",
        "--stats",
    ]);
    args.extend(extra);
    serde_json::from_str(&ok(sluice(&args))).unwrap()
}

#[test]
fn prewarm_warms_without_changing_output() {
    let dir = scratch("prewarm");
    let (m, t) = (dir.join("m.gguf"), dir.join("m.trace"));
    synth_tiny(&m, "skewed", &[]);
    trace(&m, &t, PROMPT, 24);
    let cold = streamed(&m, &[]);
    let warm = streamed(&m, &["--prewarm", &s(&t)]);
    assert_eq!(cold["token_ids"], warm["token_ids"], "prewarming changed the output");
    let p = &warm["experts"]["prewarm"];
    let resident = p["resident"].as_u64().unwrap();
    assert!(resident > 0 && resident <= p["in_trace"].as_u64().unwrap(), "{p}");
    assert!(p["bytes_read"].as_u64().unwrap() > 0);
    assert!(cold["experts"]["prewarm"].is_null());
    // Same prompt, same routing: the warmed run finds more of its experts resident and reads
    // less while generating (its prewarm reads are counted apart).
    let hits = |v: &serde_json::Value| v["experts"]["hit_rate"].as_f64().unwrap();
    let read = |v: &serde_json::Value| v["experts"]["bytes_read"].as_u64().unwrap();
    assert!(hits(&warm) > hits(&cold) + 0.05, "warm {} vs cold {}", hits(&warm), hits(&cold));
    assert!(read(&warm) < read(&cold), "warm {} vs cold {}", read(&warm), read(&cold));

    // A trace of a model of another shape is refused, naming both.
    let other = dir.join("other.trace");
    let m2 = dir.join("m2.gguf");
    synth_tiny(&m2, "uniform", &["--experts", "32"]);
    trace(&m2, &other, PROMPT, 2);
    let out = sluice(&[
        "run",
        "-m",
        &s(&m),
        "--expert-mode",
        "stream",
        "--prompt-tokens",
        PROMPT,
        "-n",
        "1",
        "--prewarm",
        &s(&other),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("32 experts") && err.contains("64"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

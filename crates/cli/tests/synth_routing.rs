//! Skewed synthetic routing shows the popularity skew it is built for, through the whole tool chain:
//! `synth --routing skewed` → `run --trace` → `trace stats`, beside a uniform model of the same
//! shape; and the knobs are checked.

mod common;

use common::{ok, s, scratch, sluice, synth_tiny, trace};
use std::path::Path;

/// 256 pseudo-random token ids of tiny-moe's 512: a tiny model's own greedy text falls into
/// short loops, which would make any routing look local.
fn prompt() -> String {
    let mut x = 12345u64;
    let ids: Vec<String> = (0..256)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % 512).to_string()
        })
        .collect();
    ids.join(",")
}

/// Synthesizes tiny-moe with `routing`, generates from it with a trace, returns the stats.
fn traced(dir: &Path, routing: &str) -> serde_json::Value {
    let tag = routing.split(':').next().unwrap();
    let m = dir.join(format!("{tag}.gguf"));
    let t = dir.join(format!("{tag}.trace"));
    synth_tiny(&m, routing, &[]);
    trace(&m, &t, &prompt(), 1);
    serde_json::from_str(&ok(sluice(&["trace", "stats", &s(&t), "--json"]))).unwrap()
}

#[test]
fn skewed_routing_is_more_local_than_uniform_and_says_so() {
    let dir = scratch("synth-routing");
    let u = traced(&dir, "uniform");
    let sk = traced(&dir, "skewed");
    let o = |v: &serde_json::Value, k: &str| v["traces"][0]["stats"]["overall"][k].as_f64().unwrap();
    // 64 experts, 4 per token: uniform routing caches 4/64 and 8/64 at k and 2k.
    assert!((o(&u, "lru_k") - 0.0625).abs() < 0.03, "uniform lru_k {}", o(&u, "lru_k"));
    // Random prompt tokens have random topics: what shows is the popularity skew (measured
    // here: top 20% take 64% vs 30%, LRU at k 16% vs 6%).
    assert!(o(&sk, "lru_k") > 2.0 * o(&u, "lru_k"), "skewed {} vs uniform {}", o(&sk, "lru_k"), o(&u, "lru_k"));
    assert!(o(&sk, "top20_share") > o(&u, "top20_share") + 0.2);
    assert!(o(&sk, "entropy_ratio") < o(&u, "entropy_ratio") - 0.1);
    // The file says how it routes, and the engine repeats it beside cache figures.
    let info = ok(sluice(&["inspect", dir.join("skewed.gguf").to_str().unwrap()]));
    assert!(info.contains("skewed:pop=0.5,topics=32,share=0.7,stay=0.2"), "{info}");
    let bad = sluice(&["synth", "--shape", "tiny-moe", "--routing", "skewed:share=3", "-o", "/dev/null"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("share must lie in 0..=1"));
    // K-quant blocks of 256 leave no room for a topic in tiny-moe's 256-wide rows.
    let bad = sluice(&["synth", "--shape", "tiny-moe", "--routing", "skewed", "-o", "/dev/null"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("at least two blocks"));
    let _ = std::fs::remove_dir_all(&dir);
}

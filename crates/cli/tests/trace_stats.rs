//! `sluice trace stats` on hand-made traces whose figures are known: JSON, tables, plots and
//! the shift between two traces; and clear errors for bad input.

mod common;

use common::{scratch, sluice};
use sluice_experts::trace::{TraceHeader, TraceWriter};
use std::path::Path;

/// Two layers of 8 experts, top-2, `tokens` tokens. Layer 0 uses experts {a, a+1} with `a`
/// changing every 4 tokens over `palette`; layer 1 uses layer 0's experts shifted by 4.
fn write(path: &Path, tokens: u32, palette: &[u32]) {
    let h = TraceHeader {
        model: "hand-made".into(),
        n_layer: 2,
        n_expert: 8,
        n_expert_used: 2,
        slot_bytes: 1 << 20,
        expert_bytes: 1_000_000,
    };
    let mut w = TraceWriter::create(path, &h).unwrap();
    for t in 0..tokens {
        let a = palette[(t / 4) as usize % palette.len()];
        w.push(0, t as usize, &[a, a + 1]).unwrap();
        w.push(1, t as usize, &[(a + 4) % 8, (a + 5) % 8]).unwrap();
    }
    w.finish().unwrap();
}

#[test]
fn known_traces_give_known_figures_tables_and_plots() {
    let d = scratch("tstats-ok");
    let (a, b) = (d.join("a.trace"), d.join("b.trace"));
    write(&a, 64, &[0, 2]);
    write(&b, 64, &[2, 4]);
    let plots = d.join("plots");
    let out = sluice(&[
        "trace",
        "stats",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--window",
        "4",
        "8",
        "--svg",
        plots.to_str().unwrap(),
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let t = &v["traces"][0];
    let o = &t["stats"]["overall"];
    // Each layer uses 4 experts equally: the top one takes a quarter, the top two half.
    assert_eq!(o["coverage"][0], 0.25);
    assert_eq!(o["coverage"][1], 0.5);
    assert_eq!(o["coverage"][3], 1.0);
    // The set changes every 4 tokens: 48 of 63 consecutive pairs keep both experts.
    let same = 48.0 / 63.0;
    assert!((o["reuse"].as_f64().unwrap() - same).abs() < 1e-12);
    assert!((o["top1_repeat"].as_f64().unwrap() - same).abs() < 1e-12);
    // Windows of 4 tokens hold one pair; windows of 8 both; consecutive 4-windows are disjoint.
    assert_eq!(o["windows"][0]["distinct"], 2.0);
    assert_eq!(o["windows"][0]["jaccard"], 0.0);
    assert_eq!(o["windows"][1]["distinct"], 4.0);
    assert_eq!(o["windows"][1]["jaccard"], 1.0);
    // Layer 1 is layer 0 shifted: fully predictable from it.
    assert_eq!(o["next_layer_precision"], 1.0);
    // Belady never loses to a policy, at any quota.
    for q in t["quotas"].as_array().unwrap() {
        let r = q["results"].as_array().unwrap();
        let opt = r.last().unwrap()["hits"].as_u64().unwrap();
        assert!(r.iter().all(|x| x["hits"].as_u64().unwrap() <= opt), "{q}");
    }
    // Trace a uses {0,1},{2,3}, trace b {2,3},{4,5} in layer 0 (and the same shifted in 1):
    // half of each distribution is shared.
    let s = &v["shift"][0]["shift"];
    assert_eq!(s["total_variation"], 0.5);
    assert!((s["weighted_jaccard"].as_f64().unwrap() - 1.0 / 3.0).abs() < 1e-12);
    // Four plots per trace; the heat map has a cell for every (layer, expert).
    assert_eq!(v["plots"].as_array().unwrap().len(), 8);
    let heat = std::fs::read_to_string(plots.join("a-heat-map.svg")).unwrap();
    assert!(heat.matches("<rect").count() >= 16, "heat map cells missing");
    let hit = std::fs::read_to_string(plots.join("a-hit-rate.svg")).unwrap();
    assert!(hit.contains("belady") && hit.contains("lru"), "hit-rate plot lacks its legend");

    // The table form says the same.
    let out = sluice(&["trace", "stats", a.to_str().unwrap(), "--window", "4", "1000"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("top 10% of experts take 25.0%"), "{text}");
    assert!(text.contains("shorter than the window"), "{text}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn bad_input_is_named() {
    let d = scratch("tstats-bad");
    let junk = d.join("junk.trace");
    std::fs::write(&junk, b"not a trace at all").unwrap();
    let out = sluice(&["trace", "stats", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a sluice routing trace") && !err.contains("panicked"), "{err}");

    let a = d.join("a.trace");
    write(&a, 8, &[0]);
    let out = sluice(&["trace", "stats", a.to_str().unwrap(), "--window", "0"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--window must be at least one"));
    let out = sluice(&["trace", "stats", a.to_str().unwrap(), "--quota", "1KiB"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("smaller than one expert slot"));
    let _ = std::fs::remove_dir_all(&d);
}

//! Pinned routing (`--pin-experts`, lossy): the routers choose only among the pinned experts;
//! pinning every expert changes no bit; pinned experts are loaded first, so a cache that holds
//! them reads nothing while decoding; and the cost report compares with exact routing on the
//! same weights (exact perplexity equal to a plain run's, zero divergence when nothing is
//! restricted). Bad settings are refused with reasons.

mod common;

use common::*;
use sluice_experts::trace::{TraceHeader, TraceWriter};
use sluice_model::trace::Recorder;
use sluice_model::Logits;
use sluice_runtime::perplexity::perplexity;
use sluice_runtime::pinning::{pin, routing_cost};
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

fn golden(name: &str) -> PathBuf {
    tests_dir().join("golden").join(name)
}

fn load(path: &Path, cache_slots: Option<usize>) -> Engine {
    let experts = match cache_slots {
        None => ExpertOptions { mode: ExpertMode::Resident, pressure: false, ..Default::default() },
        Some(n) => {
            let probe = Engine::load(
                path,
                EngineOptions {
                    threads: 1,
                    max_context: 64,
                    experts: ExpertOptions { mode: ExpertMode::Stream, pressure: false, ..Default::default() },
                    mtp: false,
                },
            )
            .unwrap();
            let slot = probe.streaming.as_ref().unwrap().slot_bytes();
            ExpertOptions {
                mode: ExpertMode::Stream,
                cache_bytes: Some((n * slot) as u64),
                pressure: false,
                ..Default::default()
            }
        }
    };
    Engine::load(path, EngineOptions { threads: 1, max_context: 256, experts, mtp: false }).unwrap()
}

/// Routing decisions: (layer, position, experts).
type Routes = Vec<(usize, usize, Vec<u32>)>;

/// Logits of every position of `toks`, and the routing decisions made.
fn run(e: &Engine, toks: &[u32]) -> (Vec<f32>, Routes) {
    let mut rec = Recorder::default();
    let mut kv = e.new_state();
    let l = e.model.forward(&mut kv, toks, Logits::All, Some(&mut rec)).unwrap();
    (l, rec.routes)
}

/// A trace of `toks` through `e`.
fn write_trace(e: &Engine, toks: &[u32], path: &Path) {
    let moe = e.model.cfg.moe.as_ref().unwrap();
    let h = TraceHeader {
        model: "test".into(),
        n_layer: e.model.cfg.n_layer,
        n_expert: moe.n_expert,
        n_expert_used: moe.n_expert_used,
        slot_bytes: 1,
        expert_bytes: 1,
    };
    let mut w = TraceWriter::create(path, &h).unwrap();
    for (l, p, x) in run(e, toks).1 {
        w.push(l, p, &x).unwrap();
    }
    w.finish().unwrap();
}

/// The `n` most used experts per layer in `routes` (ties: lower id).
fn top(routes: &Routes, n: usize) -> HashMap<usize, BTreeSet<u32>> {
    let mut counts: HashMap<(usize, u32), u64> = HashMap::new();
    for (l, _, x) in routes {
        for e in x {
            *counts.entry((*l, *e)).or_default() += 1;
        }
    }
    let mut v: Vec<_> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut out: HashMap<usize, BTreeSet<u32>> = HashMap::new();
    for ((l, e), _) in v {
        let s = out.entry(l).or_default();
        if s.len() < n {
            s.insert(e);
        }
    }
    out
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..40u32).map(|i| (i * 37 + seed * 11 + 5) % 384).collect()
}

#[test]
fn pinned_routing_chooses_among_the_pinned_experts_only() {
    let dir = scratch("pinning-routes");
    let t = dir.join("t.trace");
    // Grouped sigmoid routing with a correction bias (DeepSeek-V3) and softmax top-k (Qwen3).
    for m in ["qwen3_moe", "deepseek_v3"] {
        let exact = load(&golden(m), None);
        let moe = exact.model.cfg.moe.clone().unwrap();
        write_trace(&exact, &prompt(1), &t);
        let want = top(&run(&exact, &prompt(1)).1, moe.n_expert_used + 1);
        let mut e = load(&golden(m), None);
        let r = pin(&mut e, &t, moe.n_expert_used + 1).unwrap();
        assert!(r.lossy && r.trace_coverage > 0.0 && r.trace_coverage < 1.0, "{m}: {r:?}");
        let (pinned_logits, routes) = run(&e, &prompt(2));
        assert!(!routes.is_empty());
        for (l, _, x) in &routes {
            assert_eq!(x.len(), moe.n_expert_used, "{m}");
            assert!(x.iter().all(|e| want[l].contains(e)), "{m}: layer {l} routed to {x:?} outside {:?}", want[l]);
        }
        let (exact_logits, _) = run(&exact, &prompt(2));
        assert!(!same_bits(&exact_logits, &pinned_logits), "{m}: restricting the routing changed nothing");
        // Every expert pinned: the model's own routing, to the bit.
        let mut all = load(&golden(m), None);
        pin(&mut all, &t, moe.n_expert).unwrap();
        assert!(same_bits(&run(&all, &prompt(2)).0, &exact_logits), "{m}: pinning every expert changed the output");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pinned_experts_are_loaded_first_and_decoding_reads_nothing() {
    let dir = scratch("pinning-stream");
    let t = dir.join("t.trace");
    let path = golden("qwen3_moe");
    let resident = load(&path, None);
    write_trace(&resident, &prompt(1), &t);
    let mut pinned_resident = load(&path, None);
    pin(&mut pinned_resident, &t, 4).unwrap();
    // Two routed layers × 4 pinned experts fit a cache of 8 slots.
    let mut e = load(&path, Some(8));
    let r = pin(&mut e, &t, 4).unwrap();
    assert_eq!(r.resident, Some(8), "{r:?}");
    assert!(r.bytes_read > 0);
    let before = e.model.experts.stats();
    let (logits, _) = run(&e, &prompt(3));
    let after = e.model.experts.stats();
    assert_eq!(after.misses, before.misses, "a pinned expert had to be read");
    assert_eq!(after.bytes_read, before.bytes_read);
    // Streaming keeps the bits of the resident run under the same pinning.
    assert!(same_bits(&logits, &run(&pinned_resident, &prompt(3)).0));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_cost_report_compares_with_exact_routing_on_the_same_text() {
    let dir = scratch("pinning-cost");
    let t = dir.join("t.trace");
    let path = golden("qwen3_moe");
    let plain = load(&path, None);
    write_trace(&plain, &prompt(1), &t);
    let text = std::fs::read_to_string(tests_dir().join("data/gpl-3.txt")).unwrap();
    let tokens = plain.encode(&text).unwrap();
    let exact = perplexity(&plain, &tokens, 32, 3, 16).unwrap();
    let mut e = load(&path, None);
    pin(&mut e, &t, 3).unwrap();
    let c = routing_cost(&e, &tokens, 32, 3, 16).unwrap();
    assert_eq!(c.ppl_exact, exact.ppl, "exact routing through the switch is not the plain model");
    assert_eq!(c.ppl_pinned, perplexity(&e, &tokens, 32, 3, 16).unwrap().ppl, "the switch was left off");
    assert!(c.kl_mean > 0.0 && c.kl_max >= c.kl_mean && c.top1_agreement < 1.0, "{c:?}");
    assert_eq!(c.tokens_scored, exact.tokens_scored);
    let mut all = load(&path, None);
    pin(&mut all, &t, 8).unwrap();
    let c = routing_cost(&all, &tokens, 32, 3, 16).unwrap();
    assert_eq!((c.kl_mean, c.top1_agreement, c.ppl_pinned), (0.0, 1.0, exact.ppl), "{c:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_pinning_is_refused_with_reasons() {
    let dir = scratch("pinning-bad");
    let t = dir.join("t.trace");
    let path = golden("qwen3_moe");
    let plain = load(&path, None);
    write_trace(&plain, &prompt(1), &t);
    for n in [2, 9] {
        let err = pin(&mut load(&path, None), &t, n).err().unwrap().to_string();
        assert!(err.contains("between 3 and 8"), "{err}");
    }
    let err = pin(&mut load(&golden("llama"), None), &t, 3).err().unwrap().to_string();
    assert!(err.contains("no routed experts"), "{err}");
    let err = pin(&mut load(&golden("qwen3_next"), None), &t, 3).err().unwrap().to_string();
    assert!(err.contains("recorded on a model of"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

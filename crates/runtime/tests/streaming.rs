//! Streaming experts must not change a bit: every golden (Hugging Face and GGUF) and a
//! synthetic model give the same logits resident, memory-mapped, and streamed through caches
//! from one expert to everything, with each policy, prefetch on and off, queue depths 1 and
//! 32, io_uring and pread, from the model file and from a pack.

mod common;

use common::*;
use sluice_experts::{IoKind, Policy};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::synth::QuantMix;
use sluice_runtime::placement::ExpertMode;
use std::path::{Path, PathBuf};

fn make_pack(model: &Path, dir: &Path) -> PathBuf {
    let out = dir.join(format!("{}.pack", model.file_name().unwrap().to_string_lossy()));
    let (layout, fp) = if model.is_dir() {
        let c = HfCheckpoint::open(model).unwrap();
        (sluice_experts::store::layout_from_hf(&c).unwrap(), sluice_experts::store::hf_fingerprint(&c).unwrap())
    } else {
        let c = GgufCheckpoint::open(model).unwrap();
        (sluice_experts::store::layout_from_gguf(&c).unwrap(), sluice_experts::store::gguf_fingerprint(&c).unwrap())
    };
    sluice_experts::pack::write_pack(&layout, &fp, "test", &out, |_| {}).unwrap();
    out
}

fn models() -> Vec<PathBuf> {
    let t = tests_dir();
    vec![
        synthetic_model("stream", QuantMix::Q4KM),
        t.join("golden/qwen3_moe"),
        t.join("golden/qwen2_moe"),
        t.join("golden/olmoe"),
        t.join("golden/mixtral"),
        t.join("golden/gguf/olmoe-q8_0.gguf"),
        t.join("golden/gguf/mixtral-bf16.gguf"),
        // The hybrids: Gated DeltaNet layers' recurrent state beside streamed experts.
        synthetic_hybrid("stream-hybrid"),
        t.join("golden/qwen3_next"),
        t.join("golden/qwen3_5_moe"),
        t.join("golden/gguf/qwen3_next-q8_0.gguf"),
        t.join("golden/gguf/qwen3_5_moe-bf16.gguf"),
        // Latent attention, sinks and sliding windows, MXFP4 experts, grouped routers.
        t.join("golden/deepseek_v3"),
        t.join("golden/gguf/deepseek_v3-q8_0.gguf"),
        // gpt-oss from Hugging Face: fused experts, rewritten into the kernels' form as they land.
        t.join("golden/gpt_oss"),
        t.join("golden/gpt_oss_mxfp4"),
        t.join("golden/gguf/gpt_oss-bf16.gguf"),
        t.join("golden/gguf/gpt_oss_mxfp4-bf16.gguf"),
        t.join("golden/glm4_moe"),
        t.join("golden/gguf/glm4_moe-q8_0.gguf"),
        t.join("golden/minimax_m2"),
        t.join("golden/gguf/minimax_m2-bf16.gguf"),
    ]
}

#[test]
fn every_placement_gives_the_same_bits() {
    let dir = scratch("packs");
    for m in models() {
        let slot = slot_bytes(&m);
        let reference = run(&load(&m, &Place::resident(), slot));
        let pack = make_pack(&m, &dir);
        let n_experts = {
            let e = load(&m, &Place::stream(1 << 20), slot);
            e.streaming.as_ref().unwrap().layout().experts.iter().map(|l| l.len()).sum::<usize>()
        };
        let configs = vec![
            Place { mode: ExpertMode::Mmap, ..Place::resident() },
            Place::stream(n_experts),
            Place::stream(1),
            Place { prefetch: false, ..Place::stream(1) },
            Place { policy: Policy::LfuAging, ..Place::stream(2) },
            Place { depth: 1, io: IoKind::Pread, ..Place::stream(3) },
            Place { policy: Policy::LfuAging, depth: 1, io: IoKind::Pread, ..Place::stream(n_experts / 2) },
            Place { pack: Some(pack.clone()), ..Place::stream(n_experts / 2) },
            Place { pack: Some(pack.clone()), io: IoKind::Pread, prefetch: false, ..Place::stream(1) },
            Place { pack: Some(pack.clone()), policy: Policy::LfuAging, depth: 1, ..Place::stream(5) },
        ];
        for c in configs {
            let got = run(&load(&m, &c, slot));
            assert!(same_bits(&reference, &got), "{}: {c:?} changed the logits", m.display());
        }
    }
}

#[test]
fn small_caches_miss_and_read_only_what_they_miss() {
    let m = synthetic_model("stats", QuantMix::Q4KM);
    let slot = slot_bytes(&m);
    let dir = scratch("stats-pack");
    let pack = make_pack(&m, &dir);
    // Through a pack every miss is one aligned read of exactly one record.
    let e = load(&m, &Place { pack: Some(pack), prefetch: false, ..Place::stream(3) }, slot);
    run(&e);
    let s = e.model.experts.stats();
    let plan = e.streaming.as_ref().unwrap().layout().plan(0, 0).unwrap().clone();
    assert!(s.misses > 0 && s.evictions > 0, "{s:?}");
    assert!(s.resident_bytes as usize <= 3 * slot);
    let per_expert = plan.payload_bytes() as f64;
    // Without prefetch only misses are loaded; every read byte belongs to a loaded record.
    let sizes: Vec<u64> =
        e.streaming.as_ref().unwrap().layout().experts.iter().flatten().map(|p| p.payload_bytes()).collect();
    let (lo, hi) = (*sizes.iter().min().unwrap(), *sizes.iter().max().unwrap());
    assert!((s.misses * lo..=s.misses * hi).contains(&s.loaded_bytes), "{s:?}");
    let amp = s.bytes_read as f64 / s.loaded_bytes as f64;
    assert!((1.0..=1.1).contains(&amp), "read amplification {amp}");
    let ratio = s.bytes_read as f64 / (s.misses as f64 * per_expert);
    assert!(
        (1.0..=1.1).contains(&ratio),
        "read {} bytes for {} misses of {per_expert} bytes: ratio {ratio}",
        s.bytes_read,
        s.misses
    );
    // A cache holding everything misses each expert at most once.
    let big = load(&m, &Place { prefetch: false, ..Place::stream(1 << 16) }, slot);
    run(&big);
    run(&big);
    let s = big.model.experts.stats();
    assert!(s.misses <= 4 * 16, "{s:?}");
    assert_eq!(s.evictions, 0);
    assert!(s.hits > s.misses);
}

#[test]
fn prefetch_finds_the_next_layers_experts() {
    // Routing of the synthetic model is token-driven, so the next layer's router applied to
    // this layer's input predicts well.
    let m = synthetic_model("prefetch", QuantMix::Q4KM);
    let slot = slot_bytes(&m);
    let e = load(&m, &Place::stream(12), slot);
    run(&e);
    let s = e.model.experts.stats();
    assert!(s.prefetch_issued > 0, "{s:?}");
    let precision = s.prefetch_hits as f64 / s.prefetch_issued as f64;
    assert!(precision > 0.5, "prefetch precision {precision}: {s:?}");
}

#[test]
fn a_quota_below_one_expert_is_refused_with_the_minimum() {
    let m = synthetic_model("minquota", QuantMix::Q4KM);
    let slot = slot_bytes(&m);
    let o = sluice_runtime::placement::ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some(slot as u64 - 1),
        pressure: false,
        ..Default::default()
    };
    let err = sluice_runtime::Engine::load(
        &m,
        sluice_runtime::EngineOptions { threads: 1, max_context: 64, experts: o, mtp: false },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("smaller than one expert") && err.contains(&format!("{slot} bytes")), "{err}");
}

#[test]
fn a_pack_of_another_model_is_refused() {
    let a = synthetic_model("pack-a", QuantMix::Q4KM);
    let b = tests_dir().join("golden/gguf/olmoe-q8_0.gguf");
    let dir = scratch("pack-mismatch");
    let pack_b = make_pack(&b, &dir);
    let o = sluice_runtime::placement::ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some(1 << 30),
        pack: Some(pack_b),
        pressure: false,
        ..Default::default()
    };
    let err = sluice_runtime::Engine::load(
        &a,
        sluice_runtime::EngineOptions { threads: 1, max_context: 64, experts: o, mtp: false },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("made from a different model"), "{err}");
}

#[test]
fn shrinking_and_regrowing_the_quota_keeps_the_bits() {
    // What memory-pressure feedback does: give slots back to the system, later take them
    // again. With io_uring's registered buffers a released slot must be unregistered before
    // its pages go, or reads would land in pages the process no longer maps.
    let m = synthetic_model("regrow", QuantMix::Q4KM);
    let slot = slot_bytes(&m);
    let reference = run(&load(&m, &Place::resident(), slot));
    for io in [IoKind::Uring, IoKind::Pread] {
        let e = load(&m, &Place { io: io.clone(), ..Place::stream(24) }, slot);
        let s = e.streaming.as_ref().unwrap();
        assert!(same_bits(&reference, &run(&e)), "{io:?}: first run");
        let full = s.quota();
        assert_eq!(s.set_quota(slot, "test"), slot);
        assert!(same_bits(&reference, &run(&e)), "{io:?}: one slot");
        assert_eq!(s.set_quota(full, "test"), full);
        assert!(same_bits(&reference, &run(&e)), "{io:?}: regrown");
        assert_eq!(e.model.experts.stats().quota_changes.len(), 2);
    }
}

#[test]
fn a_resident_copy_is_one_block_of_memory_per_layer() {
    let m = synthetic_model("stream-blocks", QuantMix::Q4KM);
    let e = load(&m, &Place::resident(), 0);
    let blocks = e.model.experts.host_memory();
    let sparse = e.model.cfg.sparse_layers().len();
    assert_eq!(blocks.len(), sparse);
    let held: usize = blocks.iter().map(|b| b.len()).sum();
    let bytes = e.model.experts.resident_bytes();
    // Every expert's bytes, each matrix aligned (a little padding between them, no more).
    assert!(held >= bytes && held < bytes + bytes / 10, "{held} bytes for {bytes} of experts");
    // A mapping and a cache own no such memory (the file's pages; slots that come and go).
    let mapped = load(&m, &Place { mode: ExpertMode::Mmap, ..Place::resident() }, 0);
    assert!(mapped.model.experts.host_memory().is_empty());
    let streamed = load(&m, &Place::stream(4), slot_bytes(&m));
    assert!(streamed.model.experts.host_memory().is_empty());
}

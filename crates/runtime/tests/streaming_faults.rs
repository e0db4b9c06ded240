//! A failed read, a short read and a corrupt pack record each fail the request that needed
//! them with a message naming the problem, leave the KV cache and the expert cache
//! consistent, and the next request succeeds with the right bits.

mod common;

use common::*;
use sluice_experts::io::{Fault, FaultPlan};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::synth::QuantMix;
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions};
use std::path::Path;
use std::sync::{Arc, Mutex};

fn engine(model: &Path, slots: usize, pack: Option<std::path::PathBuf>, plan: Arc<Mutex<FaultPlan>>) -> Engine {
    let slot = slot_bytes(model);
    let experts = ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some((slots * slot) as u64),
        pack,
        pressure: false,
        faults: Some(plan),
        ..Default::default()
    };
    Engine::load(model, EngineOptions { threads: 2, max_context: 256, experts }).unwrap()
}

fn check_fault(model: &Path, pack: Option<std::path::PathBuf>, fault: Fault, expect: &str) {
    let reference = run(&load(model, &Place::resident(), slot_bytes(model)));
    let plan = Arc::new(Mutex::new(FaultPlan::default()));
    let e = engine(model, 3, pack, plan.clone());
    plan.lock().unwrap().faults.push_back((7, fault));
    let vocab = e.model.cfg.vocab_size as u32;
    let toks: Vec<u32> = (0..22u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut kv = e.new_cache();
    // Run until the fault hits: it must surface as an error, with the cache left as it was.
    let mut hit = None;
    for t in &toks {
        let before = kv.len();
        match e.model.forward(&mut kv, &[*t], Logits::Last, None) {
            Ok(_) => {}
            Err(err) => {
                assert_eq!(kv.len(), before, "a failed step must not leave positions behind");
                hit = Some(err.to_string());
                break;
            }
        }
    }
    let msg = hit.unwrap_or_else(|| panic!("{fault:?} was never reported"));
    assert!(msg.contains(expect), "{fault:?}: {msg}");
    assert!(msg.contains("layer") && msg.contains("expert"), "{fault:?} does not name the expert: {msg}");
    // The fault is spent: the same engine now gives the reference bits.
    assert!(same_bits(&reference, &run(&e)), "{fault:?}: results differ after recovery");
}

#[test]
fn read_error_is_reported_and_recovered_from() {
    let m = synthetic_model("fault-eio", QuantMix::Q4KM);
    check_fault(&m, None, Fault::Eio, "read error");
}

#[test]
fn short_read_is_reported_and_recovered_from() {
    let m = synthetic_model("fault-short", QuantMix::Q4KM);
    check_fault(&m, None, Fault::Short, "short read");
}

#[test]
fn corrupt_pack_record_is_caught_by_its_checksum() {
    let m = synthetic_model("fault-corrupt", QuantMix::Q4KM);
    let c = GgufCheckpoint::open(&m).unwrap();
    let layout = sluice_experts::store::layout_from_gguf(&c).unwrap();
    let fp = sluice_experts::store::gguf_fingerprint(&c).unwrap();
    let pack = scratch("fault-corrupt-pack").join("m.pack");
    sluice_experts::pack::write_pack(&layout, &fp, "test", &pack, |_| {}).unwrap();
    check_fault(&m, Some(pack), Fault::Corrupt, "checksum mismatch");
}

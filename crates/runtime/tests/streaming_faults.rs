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
    Engine::load(model, EngineOptions { threads: 2, max_context: 256, experts, mtp: false }).unwrap()
}

fn check_fault(model: &Path, pack: Option<std::path::PathBuf>, fault: Fault, expect: &str) {
    let reference = run(&load(model, &Place::resident(), slot_bytes(model)));
    let plan = Arc::new(Mutex::new(FaultPlan::default()));
    let e = engine(model, 3, pack, plan.clone());
    plan.lock().unwrap().faults.push_back((7, fault));
    let vocab = e.model.cfg.vocab_size as u32;
    let toks: Vec<u32> = (0..22u32).map(|i| (i * 37 + 11) % vocab).collect();
    let mut kv = e.new_state();
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

/// Rewrites a pack's JSON index in place: the records start at the next 4 KiB boundary after
/// the index, so an edited index may use the padding up to it.
fn edit_index(pack: &Path, edit: impl Fn(&mut serde_json::Value)) {
    let mut bytes = std::fs::read(pack).unwrap();
    let jlen = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let mut index: serde_json::Value = serde_json::from_slice(&bytes[24..24 + jlen]).unwrap();
    edit(&mut index);
    let text = serde_json::to_vec(&index).unwrap();
    let room = (24 + jlen).div_ceil(4096) * 4096 - 24;
    assert!(text.len() <= room, "edited index of {} bytes does not fit in {room}", text.len());
    bytes[16..24].copy_from_slice(&(text.len() as u64).to_le_bytes());
    bytes[24..24 + room].fill(0);
    bytes[24..24 + text.len()].copy_from_slice(&text);
    std::fs::write(pack, bytes).unwrap();
}

#[test]
fn a_damaged_pack_index_is_refused_by_name() {
    let m = synthetic_model("damaged-index", QuantMix::Q4KM);
    let c = GgufCheckpoint::open(&m).unwrap();
    let layout = sluice_experts::store::layout_from_gguf(&c).unwrap();
    let fp = sluice_experts::store::gguf_fingerprint(&c).unwrap();
    let dir = scratch("damaged-index");
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        ("layers", Box::new(|i| i["layers"] = 1_000_000_000_000u64.into()), "plausible"),
        ("bytes", Box::new(|i| i["records"][0]["parts"][0][3] = 5.into()), "cannot take 5 bytes"),
        ("offset", Box::new(|i| i["records"][3]["offset"] = (u64::MAX - 100).into()), "runs past the end"),
        (
            "shape",
            // Half the rows and half the bytes: a consistent record, but not the model's matrix.
            Box::new(|i| {
                let p = &mut i["records"][1]["parts"][2];
                let (rows, bytes) = (p[1].as_u64().unwrap(), p[3].as_u64().unwrap());
                p[1] = (rows / 2).into();
                p[3] = (bytes / 2).into();
            }),
            "in the pack",
        ),
    ];
    for (name, edit, expect) in cases {
        let pack = dir.join(format!("{name}.pack"));
        sluice_experts::pack::write_pack(&layout, &fp, "test", &pack, |_| {}).unwrap();
        edit_index(&pack, edit);
        let experts = ExpertOptions {
            mode: ExpertMode::Stream,
            cache_bytes: Some(1 << 28),
            pack: Some(pack.clone()),
            pressure: false,
            ..Default::default()
        };
        let err = Engine::load(&m, EngineOptions { threads: 1, max_context: 64, experts, mtp: false })
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(expect) && err.contains(&pack.display().to_string()), "{name}: {err}");
    }
}

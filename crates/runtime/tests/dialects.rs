//! Real checkpoints on the hub use the older config keys (`num_experts`, `rope_theta`,
//! `rope_scaling`); transformers 5 writes `num_local_experts` and `rope_parameters`. Both must
//! describe the same model, to the bit.

use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::path::{Path, PathBuf};

fn golden(fam: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(fam)
}

fn logits(dir: &Path) -> Vec<f32> {
    let e = Engine::load(dir, EngineOptions { threads: 1, ..Default::default() }).unwrap();
    let mut kv = e.new_state();
    e.model.forward(&mut kv, &[5, 17, 100, 3, 250, 42, 7], Logits::All, None).unwrap()
}

/// Copies a golden and rewrites its config.json into the hub-era dialect.
fn hub_dialect(fam: &str) -> PathBuf {
    let dst = std::env::temp_dir().join(format!("sluice-dialect-{fam}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(golden(fam)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let p = dst.join("config.json");
    let mut c: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    if let Some(n) = c.remove("num_local_experts") {
        if fam != "mixtral" {
            c.insert("num_experts".into(), n);
        } else {
            c.insert("num_local_experts".into(), n);
        }
    }
    let mut rp = c.remove("rope_parameters").unwrap();
    let rp = rp.as_object_mut().unwrap();
    c.insert("rope_theta".into(), rp.remove("rope_theta").unwrap());
    let ty = rp.remove("rope_type").unwrap();
    if ty != "default" {
        rp.insert("rope_type".into(), ty);
        c.insert("rope_scaling".into(), serde_json::Value::Object(rp.clone()));
    }
    std::fs::write(&p, serde_json::to_string_pretty(&c).unwrap()).unwrap();
    dst
}

#[test]
fn hub_era_and_transformers5_configs_agree() {
    for fam in ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3", "llama"] {
        let a = logits(&golden(fam));
        let b = logits(&hub_dialect(fam));
        assert!(sluice_kernels::compare::same_bits(&a, &b), "{fam}: dialects disagree");
    }
}

#[test]
fn changing_rope_scaling_changes_the_output() {
    // Guards the test above: the rewritten keys are really read.
    let d = hub_dialect("llama");
    let p = d.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    c["rope_scaling"]["factor"] = 2.0.into();
    std::fs::write(&p, c.to_string()).unwrap();
    let a = logits(&golden("llama"));
    let b = logits(&d);
    assert!(a.iter().zip(&b).any(|(x, y)| x != y));
}

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
    let dst = sluice_formats::scratch_root().join(format!("sluice-dialect-{fam}-{}", std::process::id()));
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

/// A copy of a golden whose routed experts are stored the way the hub's Qwen3.5 checkpoints
/// store them: each layer's experts fused into `experts.gate_up_proj` (experts, 2·ff, hidden;
/// gate rows first) and `experts.down_proj` (experts, hidden, ff).
fn fused_experts(fam: &str) -> PathBuf {
    let src = golden(fam);
    let dst = sluice_formats::scratch_root().join(format!("sluice-fused-{fam}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors" {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
    let st = sluice_formats::safetensors::SafetensorsModel::open(&src).unwrap();
    let mut out: Vec<(String, String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut fused: std::collections::BTreeMap<String, Vec<(usize, String, Vec<u8>)>> = Default::default();
    for name in st.names() {
        let t = st.tensor(name).unwrap();
        let dtype = "BF16".to_string();
        match name.split_once(".mlp.experts.") {
            Some((layer, rest)) => {
                let (e, part) = rest.split_once('.').unwrap();
                fused.entry(layer.to_string()).or_default().push((
                    e.parse().unwrap(),
                    part.to_string(),
                    t.data.to_vec(),
                ));
            }
            None => out.push((name.clone(), dtype, t.shape.clone(), t.data.to_vec())),
        }
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let tc = &cfg["text_config"];
    let (ne, ff, h) = (
        tc["num_experts"].as_u64().unwrap() as usize,
        tc["moe_intermediate_size"].as_u64().unwrap() as usize,
        tc["hidden_size"].as_u64().unwrap() as usize,
    );
    for (layer, mut parts) in fused {
        parts.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
        let (mut gate_up, mut down) = (Vec::new(), Vec::new());
        for e in 0..ne {
            let get = |p: &str| parts.iter().find(|x| x.0 == e && x.1 == p).unwrap().2.clone();
            gate_up.extend(get("gate_proj.weight"));
            gate_up.extend(get("up_proj.weight"));
            down.extend(get("down_proj.weight"));
        }
        out.push((format!("{layer}.mlp.experts.gate_up_proj"), "BF16".into(), vec![ne, 2 * ff, h], gate_up));
        out.push((format!("{layer}.mlp.experts.down_proj"), "BF16".into(), vec![ne, h, ff], down));
    }
    let refs: Vec<(&str, &str, &[usize], &[u8])> =
        out.iter().map(|(n, d, s, b)| (n.as_str(), d.as_str(), s.as_slice(), b.as_slice())).collect();
    sluice_formats::safetensors::write(&dst.join("model.safetensors"), &refs).unwrap();
    dst
}

#[test]
fn fused_expert_tensors_give_the_same_bits_resident_and_streamed() {
    let per_expert = logits(&golden("qwen3_5_moe"));
    let dir = fused_experts("qwen3_5_moe");
    assert!(sluice_kernels::compare::same_bits(&per_expert, &logits(&dir)), "fused experts, resident");
    let experts = sluice_runtime::placement::ExpertOptions {
        mode: sluice_runtime::placement::ExpertMode::Stream,
        cache_bytes: Some(1),
        pressure: false,
        ..Default::default()
    };
    // The smallest cache that holds one expert.
    let probe = Engine::load(
        &dir,
        EngineOptions {
            threads: 1,
            experts: sluice_runtime::placement::ExpertOptions { cache_bytes: Some(1 << 30), ..experts.clone() },
            ..Default::default()
        },
    )
    .unwrap();
    let slot = probe.streaming.as_ref().unwrap().slot_bytes() as u64;
    let e = Engine::load(
        &dir,
        EngineOptions {
            threads: 1,
            experts: sluice_runtime::placement::ExpertOptions { cache_bytes: Some(slot), ..experts },
            ..Default::default()
        },
    )
    .unwrap();
    let mut kv = e.new_state();
    let got = e.model.forward(&mut kv, &[5, 17, 100, 3, 250, 42, 7], Logits::All, None).unwrap();
    assert!(sluice_kernels::compare::same_bits(&per_expert, &got), "fused experts, streamed through one slot");
    assert!(e.model.experts.stats().misses > 0);
}

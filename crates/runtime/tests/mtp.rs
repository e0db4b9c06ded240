//! Multi-token-prediction heads against their references: Qwen3-Next's against an
//! independent PyTorch implementation on transformers' own modules
//! (tools/golden/make_mtp_golden.py), GLM-4.5's against transformers' MTP module itself
//! (tools/golden/make_glm_mtp_golden.py): logits for every position within 1e-3, from the
//! Hugging Face checkpoint and from llama.cpp's conversion, and the same bits whether the head
//! runs over the whole sequence at once or position by position.

use sluice_kernels::compare::{max_abs_diff, same_bits};
use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::path::PathBuf;

fn golden(fam: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(fam)
}

fn engine(fam: &str, threads: usize) -> Engine {
    Engine::load(&golden(fam), EngineOptions { threads, mtp: true, ..Default::default() }).unwrap()
}

/// The golden checkpoints with a head, and their llama.cpp conversions.
const HEADS: [(&str, &str); 2] =
    [("qwen3_next", "qwen3_next_mtp-bf16.gguf"), ("glm4_moe_mtp", "glm4_moe_mtp-bf16.gguf")];

#[test]
fn mtp_heads_match_their_references() {
    for (fam, _) in HEADS {
        check_head(fam);
    }
}

fn check_head(fam: &str) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden(fam).join("mtp_golden.json")).unwrap()).unwrap();
    let tokens: Vec<u32> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let want: Vec<Vec<f32>> = v["mtp_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    let e = engine(fam, 2);
    assert!(e.model.cfg.mtp.is_some(), "{fam}: the golden's head is found");
    let (vocab, h) = (e.model.cfg.vocab_size, e.model.cfg.hidden);
    let mut s = e.new_state();
    let (_, hidden) = e.model.forward_hidden(&mut s, &tokens, Logits::All, None).unwrap();
    let t = tokens.len();
    let mut ms = e.model.new_mtp_state(0);
    let (got, _) = e.model.mtp_forward(&mut ms, &hidden[..(t - 1) * h], &tokens[1..], Logits::All, None).unwrap();
    assert_eq!(got.len(), want.len() * vocab);
    let mut worst = 0f32;
    for (p, w) in want.iter().enumerate() {
        worst = worst.max(max_abs_diff(&got[p * vocab..(p + 1) * vocab], w).unwrap());
    }
    eprintln!("{fam} MTP head: max |logit difference| {worst:e} over {} positions", want.len());
    assert!(worst <= 1e-3, "{fam}: MTP logits differ from the reference by {worst}");

    // Position by position: the same bits.
    let mut ms = e.model.new_mtp_state(0);
    let mut steps = Vec::new();
    for p in 0..t - 1 {
        let (l, _) = e
            .model
            .mtp_forward(&mut ms, &hidden[p * h..(p + 1) * h], &tokens[p + 1..p + 2], Logits::All, None)
            .unwrap();
        steps.extend(l);
    }
    assert!(same_bits(&got, &steps), "{fam}: the head gives other bits position by position");
    // Other thread counts: the same bits.
    let e3 = engine(fam, 3);
    let mut ms = e3.model.new_mtp_state(0);
    let (three, _) = e3.model.mtp_forward(&mut ms, &hidden[..(t - 1) * h], &tokens[1..], Logits::All, None).unwrap();
    assert!(same_bits(&got, &three));
}

#[test]
fn mtp_head_is_an_error_where_there_is_none() {
    let dir = golden("qwen3_5_moe");
    let err = Engine::load(&dir, EngineOptions { threads: 1, mtp: true, ..Default::default() }).err().unwrap();
    assert!(err.to_string().contains("no multi-token-prediction head"), "{err}");
}

#[test]
fn mtp_heads_from_llama_cpp_conversions_match_too() {
    // The same checkpoints converted with their heads (blk.{n_layer}.nextn.*,
    // nextn_predict_layers 1).
    for (fam, file) in HEADS {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(golden(fam).join("mtp_golden.json")).unwrap()).unwrap();
        let tokens: Vec<u32> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        let want: Vec<f32> = v["mtp_logits"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
            .collect();
        let path = golden("gguf").join(file);
        let e = Engine::load(&path, EngineOptions { threads: 2, mtp: true, ..Default::default() }).unwrap();
        let h = e.model.cfg.hidden;
        let mut s = e.new_state();
        let (_, hidden) = e.model.forward_hidden(&mut s, &tokens, Logits::All, None).unwrap();
        let t = tokens.len();
        let mut ms = e.model.new_mtp_state(0);
        let (got, _) = e.model.mtp_forward(&mut ms, &hidden[..(t - 1) * h], &tokens[1..], Logits::All, None).unwrap();
        let d = max_abs_diff(&got, &want).unwrap();
        eprintln!("{file}: MTP head max |logit difference| {d:e}");
        assert!(d <= 1e-3, "{file}: GGUF MTP head differs by {d}");
    }
}

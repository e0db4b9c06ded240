//! Parity with Hugging Face transformers on tiny random checkpoints of every family
//! (`tests/golden/*`, made by `tools/golden/make_goldens.py`), and the invariants that make
//! results reproducible: prefill = incremental decode, and any thread count, to the bit.

use sluice_kernels::compare::{max_abs_diff, same_bits};
use sluice_model::Logits;
use sluice_runtime::{generate, Engine, EngineOptions, GenerateOptions};
use std::path::PathBuf;

const FAMILIES: [&str; 15] = [
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
    "minimax_m2",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_moe_sparse",
    "olmoe",
    "mixtral",
    "qwen2_moe",
    "qwen2_moe_sparse",
    "qwen3",
    "qwen2",
    "llama",
];

fn golden_dir(fam: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(fam)
}

struct Golden {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
    prompt: Vec<u32>,
    greedy: Vec<u32>,
}

fn golden(fam: &str) -> Golden {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden_dir(fam).join("golden.json")).unwrap()).unwrap();
    let ids = |x: &serde_json::Value| -> Vec<u32> {
        x.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
    };
    Golden {
        tokens: ids(&v["tokens"]),
        logits: v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect(),
        prompt: ids(&v["greedy"]["prompt"]),
        greedy: ids(&v["greedy"]["tokens"]),
    }
}

fn load(fam: &str, threads: usize) -> Engine {
    Engine::load(&golden_dir(fam), EngineOptions { threads, ..Default::default() }).unwrap()
}

fn logits_in_chunks(e: &Engine, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut kv = e.new_state();
    let mut out = Vec::new();
    for c in tokens.chunks(chunk) {
        out.extend(e.model.forward(&mut kv, c, Logits::All, None).unwrap());
    }
    out
}

#[test]
fn teacher_forced_logits_match_transformers() {
    for fam in FAMILIES {
        let g = golden(fam);
        let e = load(fam, 2);
        let ours = logits_in_chunks(&e, &g.tokens, g.tokens.len());
        let vocab = e.model.cfg.vocab_size;
        assert_eq!(ours.len(), g.logits.len() * vocab, "{fam}: number of logits");
        let mut max_diff = 0f32;
        for (t, want) in g.logits.iter().enumerate() {
            let got = &ours[t * vocab..(t + 1) * vocab];
            let d = max_abs_diff(got, want).unwrap_or_else(|e| panic!("{fam}: position {t}: {e}"));
            max_diff = max_diff.max(d);
            let mut sorted = want.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            if sorted[0] - sorted[1] > 1e-3 {
                let am = |r: &[f32]| sluice_kernels::ops::argmax(r);
                assert_eq!(am(got), am(want), "{fam}: argmax differs at position {t}");
            }
        }
        eprintln!("{fam}: max |logit difference| {max_diff:.2e}");
        assert!(max_diff <= 1e-3, "{fam}: max |logit difference| {max_diff} > 1e-3");
    }
}

#[test]
fn greedy_continuations_match_transformers() {
    for fam in FAMILIES {
        let g = golden(fam);
        let e = load(fam, 2);
        let mut kv = e.new_state();
        let opts = GenerateOptions { max_new_tokens: g.greedy.len(), ignore_eos: true, ..Default::default() };
        let out = generate(&e, &mut kv, &g.prompt, &opts, &mut |_| true, None).unwrap();
        assert_eq!(out.tokens, g.greedy, "{fam}: greedy continuation differs");
    }
}

#[test]
fn prefill_equals_incremental_decode_bit_for_bit() {
    for fam in FAMILIES {
        let g = golden(fam);
        let e = load(fam, 2);
        let whole = logits_in_chunks(&e, &g.tokens, g.tokens.len());
        for chunk in [1, 7] {
            let parts = logits_in_chunks(&e, &g.tokens, chunk);
            assert!(same_bits(&whole, &parts), "{fam}: chunk {chunk} differs from one prefill");
        }
    }
}

#[test]
fn thread_count_does_not_change_a_bit() {
    for fam in FAMILIES {
        let g = golden(fam);
        let one = logits_in_chunks(&load(fam, 1), &g.tokens, g.tokens.len());
        let two = logits_in_chunks(&load(fam, 2), &g.tokens, g.tokens.len());
        let three = logits_in_chunks(&load(fam, 3), &g.tokens, 5);
        assert!(same_bits(&one, &two), "{fam}: 1 vs 2 threads");
        assert!(same_bits(&one, &three), "{fam}: 1 vs 3 threads");
    }
}

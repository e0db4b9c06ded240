//! The GGUF path against the same oracles: golden checkpoints converted to GGUF by llama.cpp's
//! own converter (`tools/golden/convert_gguf.py`; files in tests/golden/gguf).

use sluice_kernels::compare::max_abs_diff;
use sluice_model::Logits;
use sluice_runtime::perplexity::perplexity;
use sluice_runtime::{Engine, EngineOptions};
use std::path::PathBuf;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests")
}

fn load(p: PathBuf) -> Engine {
    Engine::load(&p, EngineOptions { threads: 2, max_context: 512, ..Default::default() }).unwrap()
}

fn golden(fam: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join("golden").join(fam).join("golden.json")).unwrap())
            .unwrap();
    let tokens = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let logits = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    (tokens, logits)
}

#[test]
fn bf16_gguf_logits_match_transformers() {
    // llama (permuted Q/K, interleaved RoPE, Llama-3 scaling as rope_freqs), qwen2 (bias),
    // qwen3 (QK-norm, YaRN, tied embeddings), and four MoE families (the Qwen ones with every
    // layer sparse: llama.cpp converts neither dense layers of Qwen3-MoE nor of Qwen2-MoE).
    for fam in [
        "llama",
        "qwen2",
        "qwen3",
        "olmoe",
        "mixtral",
        "qwen2_moe_sparse",
        "qwen3_moe_sparse",
        "qwen3_next",
        "qwen3_5_moe",
    ] {
        let e = load(root().join("golden/gguf").join(format!("{fam}-bf16.gguf")));
        let (tokens, want) = golden(fam);
        let mut kv = e.new_state();
        let got = e.model.forward(&mut kv, &tokens, Logits::All, None).unwrap();
        let vocab = e.model.cfg.vocab_size;
        assert_eq!(got.len(), want.len() * vocab, "{fam}: number of logits");
        let mut max_diff = 0f32;
        for (t, w) in want.iter().enumerate() {
            let g = &got[t * vocab..(t + 1) * vocab];
            max_diff = max_diff.max(max_abs_diff(g, w).unwrap_or_else(|e| panic!("{fam}: position {t}: {e}")));
        }
        assert!(max_diff <= 1e-3, "{fam}: max |logit difference| {max_diff}");
    }
}

#[test]
fn q8_0_gguf_perplexity_is_within_half_a_percent_of_safetensors() {
    let text = std::fs::read_to_string(root().join("data/gpl-3.txt")).unwrap();
    for fam in ["olmoe", "mixtral"] {
        let hf = load(root().join("golden").join(fam));
        let gg = load(root().join("golden/gguf").join(format!("{fam}-q8_0.gguf")));
        let t_hf = hf.encode(&text).unwrap();
        let t_gg = gg.encode(&text).unwrap();
        assert_eq!(t_hf, t_gg, "{fam}: the GGUF tokenizer disagrees with tokenizer.json");
        let a = perplexity(&hf, &t_hf, 128, 12, 128).unwrap().ppl;
        let b = perplexity(&gg, &t_gg, 128, 12, 128).unwrap().ppl;
        let rel = (a - b).abs() / a;
        assert!(rel < 0.005, "{fam}: safetensors PPL {a}, GGUF Q8_0 PPL {b} ({:.3}%)", rel * 100.0);
        // And the quantization is really there: not the same bits.
        assert_ne!(a, b);
    }
}

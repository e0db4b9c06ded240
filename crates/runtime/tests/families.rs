//! What sets the DeepSeek-V3, gpt-oss, GLM-4.5 and MiniMax-M2 families apart, checked on
//! their golden checkpoints (tests/golden/*, tools/golden/make_goldens.py and
//! make_mxfp4_golden.py): the latent-attention cache, bounded sliding windows, MXFP4 experts
//! from either format, and GGUF files whose router metadata llama.cpp's converter left out.

use sluice_formats::gguf::{rewrite, GgufFile};
use sluice_kernels::compare::{log_softmax, max_abs_diff, same_bits};
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::state::LayerState;
use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden")
}

fn load(p: &Path) -> Engine {
    Engine::load(p, EngineOptions { threads: 2, max_context: 256, ..Default::default() }).unwrap()
}

fn golden(fam: &str) -> (Vec<u32>, Vec<Vec<f32>>) {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(fam).join("golden.json")).unwrap()).unwrap();
    let tokens = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let logits = v["logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
        .collect();
    (tokens, logits)
}

fn logits(e: &Engine, tokens: &[u32]) -> Vec<f32> {
    let mut kv = e.new_state();
    e.model.forward(&mut kv, tokens, Logits::All, None).unwrap()
}

/// A copy of a golden GGUF with `edit` applied to its metadata and tensor list.
fn edited(name: &str, tag: &str, edit: impl FnOnce(&mut sluice_formats::gguf::GgufWriter)) -> PathBuf {
    let f = GgufFile::open(&root().join("gguf").join(name)).unwrap();
    let dst = sluice_formats::scratch_root().join(format!("sluice-fam-{tag}-{}.gguf", std::process::id()));
    rewrite(&f, &dst, edit).unwrap();
    dst
}

#[test]
fn latent_attention_caches_only_the_latent_and_the_rope_key() {
    for p in [root().join("deepseek_v3"), root().join("gguf/deepseek_v3-bf16.gguf")] {
        let e = load(&p);
        let cfg = &e.model.cfg;
        let m = cfg.mla.expect("a latent-attention model");
        assert_eq!(m.cache_width(), m.kv_lora_rank + m.qk_rope);
        // Per token per layer: kv_lora_rank + rope values (16 + 8 here; 512 + 64 = 576 at
        // DeepSeek-V3's dimensions), never n_head·(nope + rope + value) expanded ones.
        assert_eq!(cfg.kv_bytes_per_token(), (cfg.n_layer * 4 * (16 + 8)) as u64, "{}", p.display());
        let (tokens, _) = golden("deepseek_v3");
        let mut kv = e.new_state();
        e.model.forward(&mut kv, &tokens, Logits::None, None).unwrap();
        for l in 0..cfg.n_layer {
            let LayerState::Kv(c) = kv.layer(l) else { panic!("layer {l} has no cache") };
            assert_eq!(c.k.len(), tokens.len() * (16 + 8), "layer {l}: latent + rope key per token");
            assert!(c.v.is_empty(), "layer {l}: no separate values");
        }
    }
}

#[test]
fn sliding_windows_keep_a_bounded_tail_and_rewind_through_snapshots() {
    let e = load(&root().join("gpt_oss"));
    let cfg = &e.model.cfg;
    let w = cfg.window(0).expect("gpt-oss slides on even layers");
    assert_eq!((w, cfg.window(1)), (8, None));
    let (tokens, _) = golden("gpt_oss");
    let whole = logits(&e, &tokens);
    // Token by token: a sliding layer never holds more than two windows.
    let mut kv = e.new_state();
    let mut snap = None;
    let mut stepped = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        stepped.extend(e.model.forward(&mut kv, &[*t], Logits::All, None).unwrap());
        for l in 0..cfg.n_layer {
            let LayerState::Kv(c) = kv.layer(l) else { panic!() };
            let rows = c.k.len() / c.k_dim;
            match cfg.window(l) {
                Some(w) => assert!(rows < 2 * w, "layer {l} holds {rows} rows after {} tokens", i + 1),
                None => assert_eq!(rows, i + 1),
            }
        }
        if i + 1 == 20 {
            snap = Some(kv.snapshot());
        }
    }
    assert!(same_bits(&whole, &stepped), "token by token differs from one prefill");
    // Rewinding past what the windows dropped needs the snapshot; it then replays exactly.
    assert!(!kv.can_truncate(20) && kv.truncate(20).is_err());
    assert!(kv.can_truncate(tokens.len() - 3));
    kv.restore(snap.as_ref().unwrap()).unwrap();
    let again = e.model.forward(&mut kv, &tokens[20..], Logits::All, None).unwrap();
    let vocab = cfg.vocab_size;
    assert!(same_bits(&again, &whole[20 * vocab..]), "replay after restore differs");
}

#[test]
fn mxfp4_experts_run_the_same_from_hugging_face_blocks_and_from_gguf() {
    // The published layout (U8 blocks of code pairs, E8M0 scales, gate and up in alternate
    // rows) repacked per expert, and llama.cpp's conversion of the same checkpoint: every
    // expert is the same MXFP4 matrix, every other tensor the same bf16, so the same bits.
    let hf = load(&root().join("gpt_oss_mxfp4"));
    let gg = load(&root().join("gguf/gpt_oss_mxfp4-bf16.gguf"));
    let (tokens, want) = golden("gpt_oss_mxfp4");
    let a = logits(&hf, &tokens);
    let b = logits(&gg, &tokens);
    assert!(same_bits(&a, &b), "Hugging Face MXFP4 and GGUF MXFP4 differ");
    // Against transformers (float32 on the unpacked experts): the error is the 8-bit
    // activations' that MXFP4 products take, and it is no larger than llama.cpp's.
    let vocab = hf.model.cfg.vocab_size;
    let theirs = std::fs::read(root().join("gguf/gpt_oss_mxfp4-bf16.llama-logprobs.f32")).unwrap();
    let (mut kl_ours, mut kl_llama, mut worst) = (0f64, 0f64, 0f32);
    for (t, w) in want.iter().enumerate() {
        let got = &a[t * vocab..(t + 1) * vocab];
        worst = worst.max(max_abs_diff(got, w).unwrap());
        let truth = log_softmax(w);
        let ours = log_softmax(got);
        let llama: Vec<f64> = theirs[t * vocab * 4..(t + 1) * vocab * 4]
            .chunks_exact(4)
            .map(|x| f32::from_le_bytes(x.try_into().unwrap()) as f64)
            .collect();
        kl_ours += truth.iter().zip(&ours).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
        kl_llama += truth.iter().zip(&llama).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
    }
    let n = want.len() as f64;
    eprintln!(
        "gpt_oss_mxfp4: max |Δ logit| {worst:.4}; mean KL sluice {:.3e} llama.cpp {:.3e}",
        kl_ours / n,
        kl_llama / n
    );
    assert!(worst < 0.05, "max |logit difference| {worst}");
    assert!(kl_ours <= kl_llama, "mean KL sluice {} > llama.cpp {}", kl_ours / n, kl_llama / n);
}

#[test]
fn deepseek2_gguf_without_a_gating_key_routes_by_its_evidence() {
    // llama.cpp's converter writes expert_gating_func only when the source config names a
    // scoring function; llama.cpp then falls back to softmax. A selection bias in the file
    // is DeepSeek-V3's sigmoid routing: sluice reads it so and says why.
    let name = "deepseek_v3-bf16.gguf";
    let with = load(&root().join("gguf").join(name));
    let key = "deepseek2.expert_gating_func";
    let p = edited(name, "dsv3-nogate", |w| w.metadata.retain(|(k, _)| k != key));
    let without = load(&p);
    let (tokens, _) = golden("deepseek_v3");
    assert!(same_bits(&logits(&with, &tokens), &logits(&without, &tokens)));
    let ck = GgufCheckpoint::open(&p).unwrap();
    assert!(
        ck.notes
            .iter()
            .any(|n| n.contains("sigmoid") && n.contains("exp_probs_b") && n.contains("no expert_gating_func")),
        "{:?}",
        ck.notes
    );
    // Without the bias either, it is DeepSeek-V2's softmax routing: other logits.
    let p2 = edited(name, "dsv3-nogate-nobias", |w| {
        w.metadata.retain(|(k, _)| k != key);
        w.tensors.retain(|t| !t.0.ends_with("exp_probs_b.bias"));
    });
    let ck = GgufCheckpoint::open(&p2).unwrap();
    assert!(ck.notes.iter().any(|n| n.contains("softmax")), "{:?}", ck.notes);
    assert!(!same_bits(&logits(&with, &tokens), &logits(&load(&p2), &tokens)));
}

#[test]
fn a_minimax_gguf_without_a_gating_key_runs() {
    // llama.cpp stops with an internal error on such a file (its graph has no gating function
    // to build); MiniMax-M2 routes with a sigmoid, and sluice reads the file so.
    let name = "minimax_m2-bf16.gguf";
    let p = edited(name, "minimax-nogate", |w| w.metadata.retain(|(k, _)| k != "minimax-m2.expert_gating_func"));
    let (tokens, want) = golden("minimax_m2");
    let got = logits(&load(&p), &tokens);
    let vocab = want[0].len();
    for (t, w) in want.iter().enumerate() {
        assert!(max_abs_diff(&got[t * vocab..(t + 1) * vocab], w).unwrap() <= 1e-3, "position {t}");
    }
    assert!(GgufCheckpoint::open(&p).unwrap().notes.iter().any(|n| n.contains("sigmoid")));
}

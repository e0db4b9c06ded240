//! Speculative decoding is lossless: greedy speculative decoding gives the tokens, and the
//! bits of the logits each token was chosen from, of plain decoding, for every kind of state
//! (attention, Gated DeltaNet, sliding windows, latent attention), with experts resident and
//! streamed through the smallest cache, drafting by n-gram lookup, with a draft model and
//! with a multi-token-prediction head. Sampled output follows plain sampling's distribution
//! (a χ² test that also shows it catches a wrong acceptance rule), and bad settings are
//! refused with messages that say why.

mod common;

use common::*;
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::spec::{self, Acceptance, SpecMethod, SpecOptions, SpecStats};
use sluice_runtime::{generate, prefill, Engine, EngineOptions, GenerateOptions, SamplerConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn golden(name: &str) -> PathBuf {
    tests_dir().join("golden").join(name)
}

/// Loads `path` resident, or streaming its experts through a one-expert cache.
fn engine(path: &Path, streamed: bool, mtp: bool) -> Engine {
    let mut experts = ExpertOptions { mode: ExpertMode::Resident, pressure: false, ..Default::default() };
    if streamed {
        let slot = slot_bytes(path);
        experts = ExpertOptions {
            mode: ExpertMode::Stream,
            cache_bytes: Some(slot as u64),
            pressure: false,
            ..Default::default()
        };
    }
    Engine::load(path, EngineOptions { threads: 1, max_context: 256, experts, mtp }).unwrap()
}

/// A prompt that repeats itself, so lookup finds drafts, some of which the model refuses.
fn repetitive_prompt(vocab: u32) -> Vec<u32> {
    let phrase: Vec<u32> = (0..7u32).map(|i| (i * 53 + 17) % vocab).collect();
    let mut p = Vec::new();
    for r in 0..4 {
        p.extend_from_slice(&phrase);
        p.push((r * 29 + 5) % vocab);
    }
    p
}

/// Plain greedy decoding: the tokens and the logits each was chosen from.
fn plain_greedy(e: &Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut kv = e.new_state();
    let mut logits = prefill(e, &mut kv, prompt, 256, None).unwrap();
    let (mut toks, mut rows) = (Vec::new(), Vec::new());
    loop {
        let t = sluice_kernels::ops::argmax(&logits) as u32;
        toks.push(t);
        rows.push(logits.clone());
        if toks.len() == n {
            return (toks, rows);
        }
        logits = e.model.forward(&mut kv, &[t], Logits::Last, None).unwrap();
    }
}

fn greedy_opts(n: usize) -> GenerateOptions {
    GenerateOptions { max_new_tokens: n, ignore_eos: true, ..Default::default() }
}

/// Speculative greedy decoding: the tokens, their logits, and what it did.
fn spec_greedy(
    e: &Engine,
    prompt: &[u32],
    n: usize,
    method: SpecMethod,
    draft: Option<Engine>,
    so: &SpecOptions,
) -> (Vec<u32>, Vec<Vec<f32>>, SpecStats) {
    let opts = greedy_opts(n);
    let mut p = spec::proposer(method, e, draft, &opts, so).unwrap();
    let mut kv = e.new_state();
    let mut rows = Vec::new();
    let (g, s) = spec::generate_spec(e, &mut kv, prompt, &opts, so, p.as_mut(), &mut |_, r| {
        rows.push(r.to_vec());
        true
    })
    .unwrap();
    (g.tokens, rows, s)
}

fn assert_lossless(what: &str, plain: &(Vec<u32>, Vec<Vec<f32>>), got: &(Vec<u32>, Vec<Vec<f32>>, SpecStats)) {
    assert_eq!(plain.0, got.0, "{what}: tokens differ from plain decoding");
    assert_eq!(plain.1.len(), got.1.len());
    for (i, (a, b)) in plain.1.iter().zip(&got.1).enumerate() {
        assert!(same_bits(a, b), "{what}: the logits of token {i} differ from plain decoding");
    }
    let s = &got.2;
    eprintln!("{what}: {} rounds, {} drafted, {} kept, {} re-runs", s.rounds, s.drafted, s.accepted, s.reruns);
}

/// Fixed-length drafts, so every round drafts.
fn fixed(k: usize) -> SpecOptions {
    SpecOptions { draft_max: k, adaptive: false, ngram_min: 1, ngram_max: 3, ..Default::default() }
}

#[test]
fn a_pass_over_several_tokens_gives_the_bits_of_one_token_passes() {
    for m in ["llama", "qwen3_next", "deepseek_v3", "gpt_oss"] {
        let e = engine(&golden(m), false, false);
        let toks: Vec<u32> = (0..30u32).map(|i| (i * 41 + 3) % 384).collect();
        let mut a = e.new_state();
        e.model.forward(&mut a, &toks[..20], Logits::None, None).unwrap();
        let batch = e.model.forward(&mut a, &toks[20..], Logits::All, None).unwrap();
        let mut b = e.new_state();
        e.model.forward(&mut b, &toks[..20], Logits::None, None).unwrap();
        let mut steps = Vec::new();
        for t in &toks[20..] {
            steps.extend(e.model.forward(&mut b, &[*t], Logits::Last, None).unwrap());
        }
        assert!(same_bits(&batch, &steps), "{m}: a 10-token pass differs from 10 one-token passes");
    }
}

#[test]
fn ngram_greedy_is_lossless_for_every_state_kind() {
    // Attention only, Gated DeltaNet hybrid, latent attention, sliding windows (8 positions:
    // rewinds past the window restore a snapshot), each resident and streamed.
    let n = 40;
    for m in ["llama", "qwen3_next", "deepseek_v3", "gpt_oss", "gguf/gpt_oss-bf16.gguf"] {
        let path = golden(m);
        let moe = !m.starts_with("llama");
        for streamed in if moe { vec![false, true] } else { vec![false] } {
            let e = engine(&path, streamed, false);
            let prompt = repetitive_prompt(e.model.cfg.vocab_size as u32);
            let plain = plain_greedy(&e, &prompt, n);
            for so in [fixed(4), SpecOptions::default()] {
                let got = spec_greedy(&e, &prompt, n, SpecMethod::Ngram, None, &so);
                let what = format!("{m} ngram (streamed: {streamed}, adaptive: {})", so.adaptive);
                assert_lossless(&what, &plain, &got);
                if !so.adaptive {
                    let s = &got.2;
                    assert!(s.accepted > 0, "{what}: no draft was kept: {s:?}");
                    assert!(s.drafted > s.accepted, "{what}: no draft was refused: {s:?}");
                    if e.new_state().rewinds_by_snapshot() {
                        assert!(s.reruns > 0, "{what}: no rewind went through a snapshot");
                    }
                }
            }
        }
    }
}

#[test]
fn draft_model_greedy_is_lossless() {
    // The q8_0 conversion drafts for the bf16 one: close but not the same model.
    let n = 32;
    for fam in ["llama", "qwen3_next", "deepseek_v3", "gpt_oss"] {
        let target = golden(&format!("gguf/{fam}-bf16.gguf"));
        let draft = golden(&format!("gguf/{fam}-q8_0.gguf"));
        let moe = fam != "llama";
        for streamed in if moe { vec![false, true] } else { vec![false] } {
            let e = engine(&target, streamed, false);
            let prompt: Vec<u32> = (0..12u32).map(|i| (i * 71 + 9) % 384).collect();
            let plain = plain_greedy(&e, &prompt, n);
            let so = SpecOptions { p_min: 0.0, ..fixed(5) };
            let got = spec_greedy(&e, &prompt, n, SpecMethod::Draft, Some(engine(&draft, streamed, false)), &so);
            let what = format!("{fam} draft model (streamed: {streamed})");
            assert_lossless(&what, &plain, &got);
            assert!(got.2.accepted > 0, "{what}: nothing kept: {:?}", got.2);
            // Adaptive (a random tiny model is never confident: no cut).
            let so = SpecOptions { p_min: 0.0, ..Default::default() };
            let got = spec_greedy(&e, &prompt, n, SpecMethod::Draft, Some(engine(&draft, false, false)), &so);
            assert_lossless(&format!("{what}, adaptive"), &plain, &got);
        }
    }
}

#[test]
fn draft_model_refusals_happen_and_stay_lossless() {
    // Long drafts from the q8_0 conversion: later positions get refused; output is unchanged.
    let e = engine(&golden("gguf/qwen3_next-bf16.gguf"), false, false);
    let prompt = repetitive_prompt(384);
    let plain = plain_greedy(&e, &prompt, 24);
    let d = engine(&golden("gguf/qwen3_next-q8_0.gguf"), false, false);
    let got = spec_greedy(&e, &prompt, 24, SpecMethod::Draft, Some(d), &SpecOptions { p_min: 0.0, ..fixed(6) });
    assert_lossless("qwen3_next draft, long drafts", &plain, &got);
    assert!(got.2.drafted > got.2.accepted, "{:?}", got.2);
}

#[test]
fn mtp_greedy_is_lossless() {
    for (m, streamed) in [("qwen3_next", false), ("qwen3_next", true), ("glm4_moe_mtp", false), ("glm4_moe_mtp", true)]
    {
        let e = engine(&golden(m), streamed, true);
        let prompt = repetitive_prompt(384);
        let plain = plain_greedy(&e, &prompt, 32);
        for so in [SpecOptions { p_min: 0.0, ..fixed(3) }, SpecOptions { p_min: 0.0, ..Default::default() }] {
            let got = spec_greedy(&e, &prompt, 32, SpecMethod::Mtp, None, &so);
            assert_lossless(&format!("{m} mtp (streamed: {streamed}, adaptive: {})", so.adaptive), &plain, &got);
            if !so.adaptive {
                assert!(got.2.drafted > 0);
            }
        }
    }
}

/// Loads `path` streaming its experts through a cache of `slots` slots.
fn engine_slots(path: &Path, slots: usize) -> Engine {
    let experts = ExpertOptions {
        mode: ExpertMode::Stream,
        cache_bytes: Some((slots * slot_bytes(path)) as u64),
        pressure: false,
        ..Default::default()
    };
    Engine::load(path, EngineOptions { threads: 1, max_context: 256, experts, mtp: false }).unwrap()
}

#[test]
fn self_speculation_greedy_is_lossless_for_every_state_kind() {
    // Drafting through the resident experts only: attention, Gated DeltaNet (rewinds by
    // snapshot), latent attention, sliding windows with sinks; the smallest cache (drafts
    // run on almost no experts), a middling one, and every expert resident (the draft is
    // then the model itself, so every drafted token is kept).
    let n = 32;
    for m in ["qwen3_moe", "qwen3_next", "deepseek_v3", "gguf/gpt_oss-bf16.gguf"] {
        let path = golden(m);
        let resident = engine(&path, false, false);
        let prompt = repetitive_prompt(resident.model.cfg.vocab_size as u32);
        let plain = plain_greedy(&resident, &prompt, n);
        let so = SpecOptions { p_min: 0.0, ..fixed(4) };
        let got = spec_greedy(&resident, &prompt, n, SpecMethod::Cached, None, &so);
        assert_lossless(&format!("{m} self (resident)"), &plain, &got);
        assert_eq!(
            got.2.accepted, got.2.drafted,
            "{m}: with every expert resident the draft is the model: {:?}",
            got.2
        );
        assert_eq!(got.2.proposer["draft_experts_left_out"], 0, "{m}");
        let moe = resident.model.cfg.moe.as_ref().unwrap();
        let half = moe.n_expert * resident.model.cfg.n_layer / 2;
        for slots in [1, half] {
            let e = engine_slots(&path, slots);
            for so in [SpecOptions { p_min: 0.0, ..fixed(4) }, SpecOptions::default()] {
                let got = spec_greedy(&e, &prompt, n, SpecMethod::Cached, None, &so);
                let what = format!("{m} self ({slots} slots, adaptive: {})", so.adaptive);
                assert_lossless(&what, &plain, &got);
                let r = &got.2.proposer;
                if !so.adaptive {
                    assert!(got.2.drafted > 0, "{what}: {:?}", got.2);
                    assert!(r["draft_experts_left_out"].as_u64().unwrap() > 0, "{what}: {r}");
                    assert!(r["guided_prefetch"]["hinted"].as_u64().unwrap() > 0, "{what}: {r}");
                    if slots > 1 {
                        assert!(r["draft_experts_run"].as_u64().unwrap() > 0, "{what}: {r}");
                    }
                }
            }
        }
    }
}

#[test]
fn drafting_from_the_cache_reads_nothing_and_leaves_the_cache_as_it_was() {
    use sluice_model::expert::CachedOnly;
    let path = golden("qwen3_moe");
    let e = engine_slots(&path, 6);
    let s = e.streaming.as_ref().unwrap();
    let mut kv = e.new_state();
    e.model.forward(&mut kv, &[5, 9, 13, 17], Logits::None, None).unwrap();
    let (stats, held) = (e.model.experts.stats(), s.resident_experts());
    let view = CachedOnly::new(&*e.model.experts, false);
    let mut dkv = e.new_state();
    for t in [3u32, 8, 21, 2, 30] {
        e.model.forward_via(&view, &mut dkv, &[t], Logits::Last).unwrap();
    }
    let c = view.take_counts();
    assert!(c.used > 0 && c.left_out > 0, "{c:?}");
    assert!(c.hinted.is_empty());
    let after = e.model.experts.stats();
    assert_eq!((after.hits, after.misses, after.bytes_read), (stats.hits, stats.misses, stats.bytes_read));
    assert_eq!(s.resident_experts(), held, "drafting changed what the cache holds");
    s.check();
    // Guided: the left-out experts go to the prefetcher (reads, but no demand misses).
    let view = CachedOnly::new(&*e.model.experts, true);
    e.model.forward_via(&view, &mut dkv, &[4], Logits::Last).unwrap();
    let c = view.take_counts();
    assert!(!c.hinted.is_empty(), "{c:?}");
    let later = e.model.experts.stats();
    assert_eq!(later.misses, stats.misses);
    assert!(later.prefetch_issued > stats.prefetch_issued, "{later:?}");
}

/// Joint counts of the first two generated tokens over `n` seeds.
fn joint(n: u64, mut run: impl FnMut(u64) -> Vec<u32>) -> HashMap<(u32, u32), u64> {
    let mut h = HashMap::new();
    for seed in 0..n {
        let t = run(seed);
        *h.entry((t[0], t[1])).or_default() += 1;
    }
    h
}

/// Pearson's χ² test that two samples come from one distribution (cells with fewer than 10
/// expected pooled): whether it rejects at the 0.1% level, and the statistic.
fn differ(a: &HashMap<(u32, u32), u64>, b: &HashMap<(u32, u32), u64>) -> (bool, f64, usize) {
    let (na, nb) = (a.values().sum::<u64>() as f64, b.values().sum::<u64>() as f64);
    let mut keys: Vec<_> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    let mut rare = (0.0, 0.0);
    for k in keys {
        let (x, y) = (*a.get(&k).unwrap_or(&0) as f64, *b.get(&k).unwrap_or(&0) as f64);
        if (x + y) * na.min(nb) / (na + nb) < 10.0 {
            rare.0 += x;
            rare.1 += y;
        } else {
            cells.push((x, y));
        }
    }
    if rare.0 + rare.1 > 0.0 {
        cells.push(rare);
    }
    let mut chi = 0.0;
    for (x, y) in &cells {
        let tot = x + y;
        let (ea, eb) = (tot * na / (na + nb), tot * nb / (na + nb));
        chi += (x - ea).powi(2) / ea + (y - eb).powi(2) / eb;
    }
    let df = (cells.len() - 1).max(1) as f64;
    // The 99.9% quantile of χ²(df), Wilson–Hilferty.
    let z = 3.09;
    let crit = df * (1.0 - 2.0 / (9.0 * df) + z * (2.0 / (9.0 * df)).sqrt()).powi(3);
    (chi > crit, chi, cells.len())
}

fn sampling(seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens: 3,
        ignore_eos: true,
        sampler: SamplerConfig { temperature: 1.0, top_k: 5, seed, ..Default::default() },
        ..Default::default()
    }
}

fn sampled_joint(
    e: &Engine,
    prompt: &[u32],
    n: u64,
    spec_run: Option<(&mut dyn spec::Proposer, &SpecOptions)>,
) -> HashMap<(u32, u32), u64> {
    let mut kv = e.new_state();
    match spec_run {
        None => joint(n, |seed| generate(e, &mut kv, prompt, &sampling(seed), &mut |_| true, None).unwrap().tokens),
        Some((p, so)) => joint(n, |seed| {
            let opts = sampling(seed + 1_000_003);
            spec::generate_spec(e, &mut kv, prompt, &opts, so, p, &mut |_, _| true).unwrap().0.tokens
        }),
    }
}

#[test]
fn sampling_follows_plain_sampling_and_the_test_can_tell() {
    const N: u64 = 2000;
    let e = engine(&golden("gguf/llama-bf16.gguf"), false, false);
    // A phrase three times and the start of a fourth: lookup drafts the rest of the phrase.
    let phrase: Vec<u32> = (0..7u32).map(|i| (i * 53 + 17) % 384).collect();
    let mut prompt: Vec<u32> = phrase.iter().cycle().take(3 * 7 + 3).copied().collect();
    prompt.insert(0, 1);
    let plain = sampled_joint(&e, &prompt, N, None);

    // n-gram drafts (deterministic proposals).
    let so = SpecOptions { ngram_min: 1, ..fixed(3) };
    let mut p = spec::ngram::NgramProposer::new(1, 3);
    let got = sampled_joint(&e, &prompt, N, Some((&mut p, &so)));
    let (bad, chi, cells) = differ(&plain, &got);
    eprintln!("ngram: χ² {chi:.1} over {cells} cells");
    assert!(!bad, "n-gram speculative sampling differs from plain sampling: χ² {chi:.1} over {cells} cells");
    let wrong = SpecOptions { acceptance: Acceptance::AlwaysAccept, ..so };
    let got = sampled_joint(&e, &prompt, N, Some((&mut p, &wrong)));
    let (bad, chi, cells) = differ(&plain, &got);
    eprintln!("ngram, always accepting: χ² {chi:.1} over {cells} cells");
    assert!(bad, "the test does not see an always-accept rule: χ² {chi:.1} over {cells} cells");

    // A draft model sampling hotter than the target: q differs from p a lot.
    let so = SpecOptions { p_min: 0.0, draft_temperature: Some(2.5), ..fixed(2) };
    let d = engine(&golden("gguf/llama-q8_0.gguf"), false, false);
    let mut p = spec::draft::DraftModel::new(d, &e, &sampling(0).sampler, &so).unwrap();
    let got = sampled_joint(&e, &prompt, N, Some((&mut p, &so)));
    let (bad, chi, cells) = differ(&plain, &got);
    eprintln!("draft model: χ² {chi:.1} over {cells} cells");
    assert!(!bad, "draft-model speculative sampling differs from plain sampling: χ² {chi:.1} over {cells} cells");
    let wrong = SpecOptions { acceptance: Acceptance::AlwaysAccept, ..so };
    let got = sampled_joint(&e, &prompt, N, Some((&mut p, &wrong)));
    let (bad, chi, cells) = differ(&plain, &got);
    eprintln!("draft model, always accepting: χ² {chi:.1} over {cells} cells");
    assert!(bad, "the test does not see an always-accept rule: χ² {chi:.1} over {cells} cells");
}

#[test]
fn penalties_and_filters_are_applied_to_verified_tokens() {
    // Penalized top-p/min-p sampling, speculative or not, never picks what the pipeline
    // filters out; greedy with a presence penalty gives plain decoding's tokens.
    let e = engine(&golden("llama"), false, false);
    let prompt = repetitive_prompt(384);
    let opts = GenerateOptions {
        sampler: SamplerConfig { presence_penalty: 1.5, frequency_penalty: 0.5, ..Default::default() },
        ..greedy_opts(30)
    };
    let mut kv = e.new_state();
    let plain = generate(&e, &mut kv, &prompt, &opts, &mut |_| true, None).unwrap().tokens;
    let so = SpecOptions { ngram_min: 1, ..fixed(4) };
    let mut p = spec::proposer(SpecMethod::Ngram, &e, None, &opts, &so).unwrap();
    let (g, s) = spec::generate_spec(&e, &mut kv, &prompt, &opts, &so, p.as_mut(), &mut |_, _| true).unwrap();
    assert_eq!(plain, g.tokens, "penalized greedy decoding changed: {s:?}");
}

#[test]
fn bad_settings_are_refused_with_reasons() {
    let e = engine(&golden("gguf/llama-bf16.gguf"), false, false);
    let opts = greedy_opts(4);
    // Another vocabulary: another size, or the same size with other tokens.
    let other = engine(&synthetic_model("spec-vocab", sluice_model::synth::QuantMix::Q4KM), false, false);
    let err =
        spec::proposer(SpecMethod::Draft, &e, Some(other), &opts, &SpecOptions::default()).err().unwrap().to_string();
    assert!(err.contains("vocabulary") && err.contains("512") && err.contains("384"), "{err}");
    let other = engine(&synthetic_384(), false, false);
    let err =
        spec::proposer(SpecMethod::Draft, &e, Some(other), &opts, &SpecOptions::default()).err().unwrap().to_string();
    assert!(err.contains("vocabulary") && err.contains("token "), "{err}");
    // No head.
    let err = spec::proposer(SpecMethod::Mtp, &e, None, &opts, &SpecOptions::default()).err().unwrap().to_string();
    assert!(err.contains("multi-token-prediction head"), "{err}");
    let err = Engine::load(&golden("qwen3_5_moe"), EngineOptions { threads: 1, mtp: true, ..Default::default() })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("no multi-token-prediction head"), "{err}");
    // No drafts.
    let so = SpecOptions { draft_max: 0, ..Default::default() };
    let err = spec::proposer(SpecMethod::Ngram, &e, None, &opts, &so).err().unwrap().to_string();
    assert!(err.contains("--draft-max"), "{err}");
    let mut p = spec::ngram::NgramProposer::new(2, 4);
    let mut kv = e.new_state();
    let err =
        spec::generate_spec(&e, &mut kv, &[1, 2], &opts, &so, &mut p, &mut |_, _| true).err().unwrap().to_string();
    assert!(err.contains("--draft-max"), "{err}");
    let so = SpecOptions { draft_min: 9, draft_max: 4, ..Default::default() };
    assert!(so.validate().unwrap_err().contains("--draft-min"));
    // Draft without a model; self-speculation without experts.
    let err = spec::proposer(SpecMethod::Draft, &e, None, &opts, &SpecOptions::default()).err().unwrap().to_string();
    assert!(err.contains("--draft-model"), "{err}");
    let err = spec::proposer(SpecMethod::Cached, &e, None, &opts, &SpecOptions::default()).err().unwrap().to_string();
    assert!(err.contains("no routed experts"), "{err}");
    assert_eq!(SpecMethod::parse("self"), Ok(SpecMethod::Cached));
    assert!(SpecMethod::parse("bogus").unwrap_err().contains("ngram, draft, mtp, self"));
}

/// A synthetic model with a vocabulary of the goldens' size but other tokens.
fn synthetic_384() -> PathBuf {
    use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthSpec};
    let path = scratch("spec-384").join("synthetic-384.gguf");
    let spec = SynthSpec {
        name: "test-384".into(),
        arch: SynthArch::Qwen3Moe,
        n_layer: 1,
        hidden: 256,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 64,
        n_expert: 4,
        n_expert_used: 2,
        expert_ff: 256,
        vocab: 384,
        context: 256,
        rope_theta: 10000.0,
        quant: QuantMix::Q4KM,
        seed: 3,
        routing: sluice_model::synth::Routing::Uniform,
        delta: None,
        grouped: None,
        mla: None,
    };
    spec.validate().unwrap();
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&spec, builtin_tokenizer(spec.vocab), &mut f, |_| {}).unwrap();
    drop(f);
    path
}

#[test]
fn every_golden_family_speculates_losslessly() {
    // Each golden checkpoint with each proposer that applies to it, greedy: n-gram lookup
    // (resident, and streamed through one expert for MoE models), drafting from the cached
    // experts (MoE, streamed), and its own q8_0 conversion drafting for its bf16 one where
    // llama.cpp converted it. (The heads: `mtp_greedy_is_lossless`.)
    let n = 24;
    let mut fams: Vec<String> = std::fs::read_dir(tests_dir().join("golden"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().join("config.json").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    fams.sort();
    assert!(fams.len() >= 15, "golden checkpoints missing: {fams:?}");
    let so = SpecOptions { p_min: 0.0, ..fixed(4) };
    // A random model's text need not repeat itself: n-gram drafts happen for most families,
    // not necessarily all.
    let mut ngram_drafted = 0;
    for m in &fams {
        let path = golden(m);
        let e = engine(&path, false, false);
        let prompt = repetitive_prompt(e.model.cfg.vocab_size as u32);
        let plain = plain_greedy(&e, &prompt, n);
        let got = spec_greedy(&e, &prompt, n, SpecMethod::Ngram, None, &so);
        assert_lossless(&format!("{m} ngram"), &plain, &got);
        ngram_drafted += usize::from(got.2.drafted > 0);
        if e.model.cfg.moe.is_some() {
            let s = engine(&path, true, false);
            let got = spec_greedy(&s, &prompt, n, SpecMethod::Ngram, None, &so);
            assert_lossless(&format!("{m} ngram (streamed)"), &plain, &got);
            let got = spec_greedy(&s, &prompt, n, SpecMethod::Cached, None, &so);
            assert_lossless(&format!("{m} self (streamed)"), &plain, &got);
            assert!(got.2.drafted > 0, "{m}: self drafted nothing: {:?}", got.2);
        }
        let (bf16, q8) = (golden(&format!("gguf/{m}-bf16.gguf")), golden(&format!("gguf/{m}-q8_0.gguf")));
        if bf16.exists() && q8.exists() {
            let t = engine(&bf16, false, false);
            let plain = plain_greedy(&t, &prompt, n);
            let got = spec_greedy(&t, &prompt, n, SpecMethod::Draft, Some(engine(&q8, false, false)), &so);
            assert_lossless(&format!("{m} draft (q8_0 for bf16)"), &plain, &got);
            assert!(got.2.drafted > 0, "{m}: the draft model drafted nothing: {:?}", got.2);
        }
    }
    eprintln!("n-gram drafts in {ngram_drafted} of {} families", fams.len());
    assert!(2 * ngram_drafted >= fams.len(), "n-gram drafts in {ngram_drafted} of {} families", fams.len());
}

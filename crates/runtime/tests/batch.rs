//! A sequence's logits are the same bits whether it runs alone or in a batch beside others,
//! whatever their lengths, positions and composition, resident and with experts streamed
//! through a cache of a few slots (where the batch fetches the union of its experts).

mod common;

use common::*;
use sluice_model::{BatchItem, Logits};
use std::path::PathBuf;

fn tokens(seed: u32, n: usize, vocab: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 101 + 11) % vocab).collect()
}

/// Three sequences of different lengths: (prompt, then decode tokens).
fn plan(vocab: u32) -> Vec<(Vec<u32>, Vec<u32>)> {
    vec![
        (tokens(1, 7, vocab), tokens(2, 3, vocab)),
        (tokens(3, 12, vocab), tokens(4, 3, vocab)),
        (tokens(5, 1, vocab), tokens(6, 3, vocab)),
    ]
}

fn alone(e: &sluice_runtime::Engine, prompt: &[u32], steps: &[u32]) -> Vec<f32> {
    let mut s = e.new_state();
    let mut out = e.model.forward(&mut s, prompt, Logits::All, None).unwrap();
    for t in steps {
        out.extend(e.model.forward(&mut s, &[*t], Logits::All, None).unwrap());
    }
    out
}

fn batched(e: &sluice_runtime::Engine, seqs: &[(Vec<u32>, Vec<u32>)]) -> Vec<Vec<f32>> {
    let mut states: Vec<_> = seqs.iter().map(|_| e.new_state()).collect();
    let mut outs = vec![Vec::new(); seqs.len()];
    // Prompts together (different lengths), then one decode step for all, then the last
    // two steps with the sequences in reverse order and the middle one absent, then it alone.
    {
        let mut items: Vec<BatchItem> = states
            .iter_mut()
            .zip(seqs)
            .map(|(s, (p, _))| BatchItem { state: s, tokens: p.as_slice(), want: Logits::All })
            .collect();
        for (o, (l, _)) in outs.iter_mut().zip(e.model.forward_batch(&mut items, None).unwrap()) {
            o.extend(l);
        }
    }
    let step = |states: &mut [sluice_model::SeqState], which: &[usize], k: usize, outs: &mut Vec<Vec<f32>>| {
        let toks: Vec<[u32; 1]> = which.iter().map(|i| [seqs[*i].1[k]]).collect();
        let mut refs: Vec<Option<&mut sluice_model::SeqState>> = states.iter_mut().map(Some).collect();
        let mut items: Vec<BatchItem> = which
            .iter()
            .zip(&toks)
            .map(|(i, t)| BatchItem { state: refs[*i].take().unwrap(), tokens: t.as_slice(), want: Logits::All })
            .collect();
        let res = e.model.forward_batch(&mut items, None).unwrap();
        for (i, (l, _)) in which.iter().zip(res) {
            outs[*i].extend(l);
        }
    };
    step(&mut states, &[0, 1, 2], 0, &mut outs);
    step(&mut states, &[2, 0], 1, &mut outs);
    step(&mut states, &[0, 2], 2, &mut outs);
    step(&mut states, &[1], 1, &mut outs);
    step(&mut states, &[1], 2, &mut outs);
    outs
}

#[test]
fn batch_composition_never_changes_a_bit() {
    let t = tests_dir();
    let models: Vec<PathBuf> = vec![
        t.join("golden/qwen3_moe"),
        t.join("golden/qwen3_next"),
        t.join("golden/qwen3_5_moe"),
        t.join("golden/llama"),
        t.join("golden/gguf/mixtral-q8_0.gguf"),
        synthetic_hybrid("batch-hybrid"),
    ];
    for m in models {
        let slot = slot_bytes_or_zero(&m);
        let mut places = vec![Place::resident()];
        if slot > 0 {
            places.push(Place::stream(2));
        }
        for p in places {
            let e = load(&m, &p, slot.max(1));
            let vocab = e.model.cfg.vocab_size as u32;
            let seqs = plan(vocab);
            let got = batched(&e, &seqs);
            for (i, (prompt, steps)) in seqs.iter().enumerate() {
                let want = alone(&e, prompt, steps);
                assert!(same_bits(&want, &got[i]), "{}: {p:?}: sequence {i} differs in a batch", m.display());
            }
        }
    }
}

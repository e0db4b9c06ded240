//! What the model-level GPU tests share: a small synthetic MoE model whose matrices are whole
//! K-quant blocks, and the logits of a prefill followed by single-token decode steps.

use sluice_model::synth::{builtin_tokenizer, write_model, QuantMix, SynthArch, SynthGrouped, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::Engine;
use std::path::{Path, PathBuf};

/// A 3-layer, 16-expert model of `arch` at Q4_K_M (Q4_K and Q6_K matrices); GLM-4.5's
/// layout gets a leading dense layer and a shared expert.
pub fn write_synth(arch: SynthArch, dir: &Path) -> PathBuf {
    let mut s = SynthSpec::named("tiny-moe").expect("built in");
    s.arch = arch;
    s.hidden = 256;
    s.expert_ff = 256;
    s.n_head = 4;
    s.n_head_kv = 2;
    s.head_dim = 64;
    s.n_layer = 3;
    s.n_expert = 16;
    s.n_expert_used = 4;
    s.quant = QuantMix::Q4KM;
    if arch == SynthArch::Glm4Moe {
        s.grouped =
            Some(SynthGrouped { dense_layers: 1, dense_ff: 512, n_shared: 1, n_group: 1, topk_group: 1, scale: 1.0 });
    }
    let path = dir.join(format!("{arch:?}.gguf"));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    write_model(&s, builtin_tokenizer(s.vocab), &mut f, |_| {}).unwrap();
    path
}

/// Logits of a 6-token prefill, then 3 tokens decoded one at a time, as bits.
#[allow(dead_code)] // not every test file uses every helper
pub fn logits(e: &Engine) -> Vec<u32> {
    let mut st = e.new_state();
    let mut bits = Vec::new();
    let prompt = [5u32, 17, 3, 99, 42, 7];
    bits.extend(e.model.forward(&mut st, &prompt, Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    for t in [11u32, 64, 2] {
        bits.extend(e.model.forward(&mut st, &[t], Logits::All, None).unwrap().iter().map(|f| f.to_bits()));
    }
    bits
}

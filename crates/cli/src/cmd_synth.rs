use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};
use sluice_formats::gguf::{GgufFile, Value};
use sluice_model::synth::{builtin_tokenizer, plan, write_model, QuantMix, SynthArch, SynthSpec};
use sluice_model::trace::Observer;
use sluice_model::Logits;
use sluice_runtime::{Engine, EngineOptions};
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A named real shape: qwen3-30b-a3b, olmoe-1b-7b, qwen3-next-80b-a3b, qwen3.5-35b-a3b,
    /// gpt-oss-20b, gpt-oss-120b, glm-4.5-air, deepseek-v3, tiny-moe, demo-moe. The dimension
    /// flags below shrink or change it (e.g. `--layers 12 --experts 128` for a benchmark that
    /// must fit in memory); a shrunk shape keeps at least one routed layer after its leading
    /// dense ones, at most every expert per token and router groups llama.cpp accepts.
    /// deepseek-v3 is 404 GB at Q4_K_M; for a disk of about 60 GB, `--layers 10` (3 dense and 7
    /// routed layers of all 256 experts: 51.6 GB) or `--experts 24` (all 61 layers: 47.1 GB).
    #[arg(long)]
    shape: Option<String>,
    /// Architecture for explicit dims: qwen3moe, olmoe, qwen3next, qwen35moe, gpt-oss, glm4moe or deepseek2.
    #[arg(long)]
    arch: Option<String>,
    #[arg(long)]
    layers: Option<usize>,
    #[arg(long)]
    hidden: Option<usize>,
    #[arg(long)]
    heads: Option<usize>,
    #[arg(long)]
    kv_heads: Option<usize>,
    #[arg(long)]
    head_dim: Option<usize>,
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long)]
    experts_used: Option<usize>,
    #[arg(long)]
    expert_ff: Option<usize>,
    /// Vocabulary size (ignored with --tokenizer-from, whose vocabulary decides).
    #[arg(long)]
    vocab: Option<usize>,
    /// Quantization: q4_k_m (llama.cpp's mix), mxfp4_moe (MXFP4 experts, Q8_0 elsewhere: the
    /// published gpt-oss files) or one format for every matrix (q4_k, q6_k, q8_0, q4_0, mxfp4,
    /// bf16, ...). Default: the shape's own (mxfp4_moe for gpt-oss, q4_k_m otherwise). Where a
    /// K-quant's 256-value blocks do not divide a tensor's rows, llama.cpp's fallback is written
    /// (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0).
    #[arg(long)]
    quant: Option<String>,
    /// Copy the tokenizer (all `tokenizer.*` metadata) from this GGUF file.
    #[arg(long)]
    tokenizer_from: Option<PathBuf>,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How the routers route: `uniform` (each token's experts pseudo-random: pessimistic for a
    /// cache) or `skewed` (popularity skew, token topics, persistence from token to token; set
    /// its knobs as `skewed:pop=0.5,topics=32,share=0.7,stay=0.2` — see docs/routing.md).
    #[arg(long, default_value = "uniform")]
    routing: String,
    /// Random tokens to route through the written model to report expert-usage entropy (0: skip).
    #[arg(long, default_value_t = 256)]
    check_tokens: usize,
    #[arg(long, short = 'o')]
    out: PathBuf,
}

fn spec_from(a: &Args) -> Result<SynthSpec> {
    let mut s = match (&a.shape, &a.arch) {
        (Some(n), _) => SynthSpec::named(n)
            .with_context(|| format!("unknown shape `{n}` (known: {})", SynthSpec::NAMES.join(", ")))?,
        (None, Some(arch)) => {
            let Some(synth_arch) = SynthArch::from_gguf_name(arch) else {
                bail!("unknown --arch `{arch}` (qwen3moe, olmoe, qwen3next, qwen35moe, gpt-oss, glm4moe or deepseek2)")
            };
            // Start from a shape of the family, whose own dimensions the flags then change.
            let base = match synth_arch {
                SynthArch::Qwen3Next | SynthArch::Qwen35Moe => "qwen3-next-80b-a3b",
                SynthArch::GptOss => "gpt-oss-20b",
                SynthArch::Glm4Moe => "glm-4.5-air",
                SynthArch::DeepseekV3 => "deepseek-v3",
                SynthArch::Qwen3Moe | SynthArch::Olmoe => "tiny-moe",
            };
            let mut s = SynthSpec::named(base).expect("built in");
            s.name = "custom".into();
            s.arch = synth_arch;
            s
        }
        (None, None) => bail!("give --shape NAME or --arch with explicit dimensions"),
    };
    let set = |field: &mut usize, v: Option<usize>| {
        if let Some(v) = v {
            *field = v;
        }
    };
    set(&mut s.n_layer, a.layers);
    set(&mut s.hidden, a.hidden);
    set(&mut s.n_head, a.heads);
    set(&mut s.n_head_kv, a.kv_heads);
    set(&mut s.head_dim, a.head_dim);
    set(&mut s.n_expert, a.experts);
    set(&mut s.expert_ff, a.expert_ff);
    set(&mut s.vocab, a.vocab);
    for note in s.conform() {
        eprintln!("shrunk shape: {note}");
    }
    // Given explicitly, experts per token are taken as they are (and validated).
    set(&mut s.n_expert_used, a.experts_used);
    if let Some(q) = &a.quant {
        s.quant = QuantMix::parse(q).with_context(|| format!("unknown --quant `{q}`"))?;
    }
    s.seed = a.seed;
    s.routing = sluice_model::synth::Routing::parse(&a.routing).map_err(|e| anyhow::anyhow!("--routing: {e}"))?;
    Ok(s)
}

pub fn main(a: Args) -> Result<()> {
    let mut spec = spec_from(&a)?;
    let tok_meta: Vec<(String, Value)> = match &a.tokenizer_from {
        Some(p) => {
            let f = GgufFile::open(p)?;
            let meta: Vec<(String, Value)> = f
                .metadata
                .iter()
                .filter(|(k, _)| k.starts_with("tokenizer."))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            let n = f.meta_array("tokenizer.ggml.tokens").map(|t| t.len()).unwrap_or(0);
            if n == 0 {
                bail!("{}: has no tokenizer.ggml.tokens to copy", p.display());
            }
            spec.vocab = n;
            meta
        }
        None => builtin_tokenizer(spec.vocab),
    };
    spec.validate().map_err(|e| anyhow::anyhow!("invalid shape: {e}"))?;
    let total: u64 = plan(&spec).iter().map(|t| t.bytes()).sum();
    eprintln!(
        "writing {} ({} layers, {} experts top-{}, hidden {}, {}): {:.2} GB",
        a.out.display(),
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used,
        spec.hidden,
        spec.quant.name(),
        total as f64 / 1e9
    );
    let tmp = a.out.with_extension("gguf.partial");
    let file = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let mut out = std::io::BufWriter::with_capacity(8 << 20, file);
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .expect("valid template"),
    );
    let t0 = std::time::Instant::now();
    write_model(&spec, tok_meta, &mut out, |n| bar.inc(n)).with_context(|| format!("writing {}", tmp.display()))?;
    out.flush()?;
    out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, &a.out)?;
    bar.finish_and_clear();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!("wrote {:.2} GB in {:.1} s ({:.2} GB/s)", total as f64 / 1e9, secs, total as f64 / 1e9 / secs);
    if a.check_tokens > 0 {
        report_entropy(&a.out, &spec, a.check_tokens, a.seed)?;
    }
    Ok(())
}

/// Counts expert picks per layer.
struct Usage {
    counts: Vec<Vec<u64>>,
}

impl Observer for Usage {
    fn routing(&mut self, layer: usize, _pos: usize, experts: &[u32], _w: &[f32]) {
        for e in experts {
            self.counts[layer][*e as usize] += 1;
        }
    }
}

/// Routes random tokens through the model and prints each layer's expert-usage entropy
/// relative to uniform usage.
fn report_entropy(path: &std::path::Path, spec: &SynthSpec, n_tokens: usize, seed: u64) -> Result<()> {
    let engine = Engine::load(path, EngineOptions { max_context: n_tokens + 1, ..Default::default() })?;
    let mut usage = Usage { counts: vec![vec![0; spec.n_expert]; spec.n_layer] };
    let mut rng = sluice_runtime::sampler::Rng::new(seed ^ 0xE17);
    let tokens: Vec<u32> = (0..n_tokens).map(|_| (rng.next_u64() % spec.vocab as u64) as u32).collect();
    let mut kv = engine.new_state();
    for chunk in tokens.chunks(64) {
        engine.model.forward(&mut kv, chunk, Logits::None, Some(&mut usage))?;
    }
    let hmax = (spec.n_expert as f64).log2();
    let mut rel = Vec::new();
    // Dense layers route nothing.
    for counts in usage.counts.iter().filter(|c| c.iter().any(|n| *n > 0)) {
        rel.push(sluice_experts::trace::stats::entropy_ratio(counts));
    }
    // The entropy a perfectly uniform router would show with this few samples.
    let picks = n_tokens * spec.n_expert_used;
    eprintln!(
        "expert-usage entropy over {n_tokens} random tokens ({picks} picks per layer, max {hmax:.2} bits): min {:.3}, mean {:.3} of uniform",
        rel.iter().cloned().fold(f64::MAX, f64::min),
        rel.iter().sum::<f64>() / rel.len() as f64
    );
    let line: Vec<String> = rel.iter().map(|r| format!("{r:.3}")).collect();
    eprintln!("per routed layer: {}", line.join(" "));
    Ok(())
}

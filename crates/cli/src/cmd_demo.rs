//! The main job: synthesize (once) an MoE model several times larger than the expert cache,
//! stream it through that cache while generating, with live statistics, then check every
//! generated token and logit against a run with all experts resident.

use crate::common::{cache_dir, expert_stats_line, parse_size};
use anyhow::{bail, Context, Result};
use sluice_model::synth::{builtin_tokenizer, plan, write_model, Routing, SynthSpec};
use sluice_model::Logits;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::{Engine, EngineOptions, Sampler, SamplerConfig};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Where the synthetic model is kept between runs.
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Model shape (see `sluice synth`).
    #[arg(long, default_value = "demo-moe")]
    shape: String,
    /// How the synthetic model routes: uniform, or skewed (like real models; see `sluice synth`).
    #[arg(long, default_value = "uniform")]
    routing: String,
    /// Expert cache size; default: an eighth of the experts.
    #[arg(long)]
    expert_cache: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', default_value_t = 48)]
    n: usize,
    #[arg(long, default_value = "The river carries water from the mountains to the sea.")]
    prompt: String,
    #[arg(long, short = 't', default_value_t = 0)]
    threads: usize,
}

/// Logits after every step of a greedy run.
struct Run {
    tokens: Vec<u32>,
    logits: Vec<Vec<f32>>,
}

fn generate(e: &Engine, prompt: &[u32], n: usize, mut each: impl FnMut(usize, u32)) -> Result<Run> {
    let mut kv = e.new_state();
    let mut sampler = Sampler::new(SamplerConfig::default());
    let mut logits = e.model.forward(&mut kv, prompt, Logits::Last, None)?;
    let mut run = Run { tokens: Vec::new(), logits: Vec::new() };
    for i in 0..n {
        let t = sampler.sample(&logits);
        run.tokens.push(t);
        run.logits.push(logits);
        each(i, t);
        logits = e.model.forward(&mut kv, &[t], Logits::Last, None)?;
    }
    Ok(run)
}

pub fn main(a: Args) -> Result<()> {
    let mut spec = SynthSpec::named(&a.shape).with_context(|| format!("unknown shape `{}`", a.shape))?;
    spec.routing = Routing::parse(&a.routing).map_err(|e| anyhow::anyhow!("--routing: {e}"))?;
    spec.validate().map_err(|e| anyhow::anyhow!("shape {}: {e}", a.shape))?;
    let dir = a.dir.clone().unwrap_or_else(|| cache_dir().join("demo"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Uniform keeps the name earlier versions wrote; other routings get their own file.
    let routing = match spec.routing {
        Routing::Uniform => String::new(),
        r => format!("-{}", r.name().replace([':', ',', '='], "_")),
    };
    let path = dir.join(format!("{}-{}{routing}.gguf", spec.name, spec.quant.name().to_lowercase()));
    let expert_bytes: u64 = plan(&spec).iter().filter(|t| t.name.contains("_exps")).map(|t| t.bytes()).sum();
    if !path.exists() {
        eprintln!("synthesizing {} (once; kept in {})", path.display(), dir.display());
        let tmp = path.with_extension("partial");
        let mut f = std::io::BufWriter::with_capacity(8 << 20, std::fs::File::create(&tmp)?);
        write_model(&spec, builtin_tokenizer(spec.vocab), &mut f, |_| {})?;
        f.flush()?;
        drop(f);
        std::fs::rename(&tmp, &path)?;
    }
    let quota = match &a.expert_cache {
        Some(s) => parse_size(s)?,
        None => expert_bytes / 8,
    };
    eprintln!(
        "model: {} layers, {} experts (top-{}), {:.2} GB of experts; expert cache {:.0} MB ({:.1}x smaller)",
        spec.n_layer,
        spec.n_expert,
        spec.n_expert_used,
        expert_bytes as f64 / 1e9,
        quota as f64 / 1e6,
        expert_bytes as f64 / quota as f64
    );
    let opts = |mode, cache| EngineOptions {
        threads: a.threads,
        max_context: 1024,
        experts: ExpertOptions { mode, cache_bytes: cache, ..Default::default() },
        mtp: false,
    };
    let streamed = Engine::load(&path, opts(ExpertMode::Stream, Some(quota)))?;
    eprintln!("sluice: {}", streamed.placement);
    let prompt = streamed.encode(&a.prompt)?;
    let t0 = Instant::now();
    let tok = streamed.tokenizer()?;
    let tty = std::io::stderr().is_terminal();
    let _ = tok;
    // Live figures cover decode steps only (the prompt's forward pass is the first call).
    let mut base = streamed.model.experts.stats();
    let mut t_decode = Instant::now();
    let run = generate(&streamed, &prompt, a.n, |i, _t| {
        if i == 0 {
            base = streamed.model.experts.stats();
            t_decode = Instant::now();
            return;
        }
        let s = streamed.model.experts.stats().since(&base);
        let line = format!(
            "[{:>3}/{}] {:5.1} tok/s | hits {:4.1}% + {:4.1}% by prefetch | read {:5.1} MB/token | IO wait {:4.1} ms/token | prefetch precision {:3.0}%",
            i + 1,
            a.n,
            i as f64 / t_decode.elapsed().as_secs_f64(),
            100.0 * s.hit_rate().unwrap_or(0.0),
            100.0 * s.prefetch_hit_rate().unwrap_or(0.0),
            s.bytes_read as f64 / i as f64 / 1e6,
            s.stall_ns as f64 / i as f64 / 1e6,
            100.0 * s.prefetch_precision().unwrap_or(0.0),
        );
        if tty {
            eprint!("\r\x1b[2K{line}");
        } else if (i + 1) % 8 == 0 || i + 1 == a.n {
            eprintln!("{line}");
        }
    })?;
    let secs = t0.elapsed().as_secs_f64();
    if tty {
        eprintln!();
    }
    let shown: Vec<String> = run.tokens.iter().take(16).map(|t| t.to_string()).collect();
    println!("tokens (a random model's): {} ...", shown.join(" "));
    println!(
        "generated {} tokens in {:.2} s ({:.1} tok/s) with a {:.0} MB expert cache",
        a.n,
        secs,
        a.n as f64 / secs,
        quota as f64 / 1e6
    );
    println!("  {}", expert_stats_line(&streamed, prompt.len() + a.n));
    drop(streamed);

    eprintln!("checking against a run with every expert resident ...");
    let resident = Engine::load(&path, opts(ExpertMode::Resident, None))?;
    let reference = generate(&resident, &prompt, a.n, |_, _| {})?;
    if reference.tokens != run.tokens {
        bail!("streamed tokens differ from the resident run: {:?} vs {:?}", run.tokens, reference.tokens);
    }
    let same = run.logits.len() == reference.logits.len()
        && run.logits.iter().zip(&reference.logits).all(|(x, y)| sluice_kernels::compare::same_bits(x, y));
    if !same {
        bail!("streamed logits differ from the resident run");
    }
    println!("verified: {} tokens and every logit bit-identical to the fully resident run", a.n);
    Ok(())
}

use crate::common::{expert_stats_json, expert_stats_line, parse_tokens, ModelArgs, TraceObserver};
use anyhow::{bail, Result};
use sluice_formats::TextStream;
use sluice_runtime::{generate, GenerateOptions, SamplerConfig};
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (tokenized with the model's tokenizer).
    #[arg(long, short = 'p', conflicts_with = "prompt_tokens")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long)]
    prompt_tokens: Option<String>,
    /// Tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Print expert-cache statistics at the end (hit rate, bytes read, IO stall, prefetch).
    #[arg(long)]
    stats: bool,
    /// Record every routing decision to this file (see `sluice trace simulate`).
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
}

pub fn main(a: Args) -> Result<()> {
    let engine = a.model.load()?;
    let prompt = match (&a.prompt, &a.prompt_tokens) {
        (Some(p), _) => engine.encode(p)?,
        (None, Some(t)) => parse_tokens(t)?,
        (None, None) => bail!("give a prompt with --prompt TEXT or --prompt-tokens 1,2,3"),
    };
    let opts = GenerateOptions {
        max_new_tokens: a.n,
        sampler: SamplerConfig {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: a.seed,
            ..Default::default()
        },
        ignore_eos: a.ignore_eos,
        ..Default::default()
    };
    let mut kv = engine.new_state();
    let mut stream = TextStream::new();
    let tok = engine.tokenizer.as_ref();
    let stdout = std::io::stdout();
    let mut on_token = |id: u32| {
        if !a.json {
            let mut out = stdout.lock();
            let _ = match tok {
                Some(t) => out.write_all(stream.push(t, id).as_bytes()),
                None => write!(out, "{id} "),
            };
            let _ = out.flush();
        }
        true
    };
    let mut tracer = match &a.trace {
        Some(p) => Some(TraceObserver::create(p, &engine)?),
        None => None,
    };
    let obs = tracer.as_mut().map(|t| t as &mut dyn sluice_model::trace::Observer);
    let g = generate(&engine, &mut kv, &prompt, &opts, &mut on_token, obs)?;
    if let Some(t) = tracer {
        if let Some(e) = t.error {
            anyhow::bail!("writing the trace: {e}");
        }
        let n = t.writer.map(|w| w.finish()).transpose()?.unwrap_or(0);
        eprintln!("sluice: wrote {n} routing records to {}", a.trace.as_ref().expect("set").display());
    }
    let n_tok = g.prompt_tokens + g.tokens.len();
    let text = tok.map(|t| t.decode(&g.tokens, true));
    if a.json {
        let v = serde_json::json!({
            "token_ids": g.tokens,
            "text": text,
            "prompt_tokens": g.prompt_tokens,
            "stop": g.stop.as_str(),
            "timings": {
                "prefill_s": g.prefill_secs,
                "decode_s": g.decode_secs,
                "prefill_tok_s": g.prefill_tok_s(),
                "decode_tok_s": g.decode_tok_s(),
            },
            "experts": if a.stats || engine.model.cfg.is_moe() { expert_stats_json(&engine, n_tok) } else { serde_json::Value::Null },
        });
        println!("{v}");
    } else {
        if let Some(t) = tok {
            print!("{}", stream.finish(t));
        }
        println!();
        eprintln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; stop: {}]",
            g.prompt_tokens,
            g.prefill_tok_s(),
            g.tokens.len(),
            g.decode_tok_s(),
            g.stop.as_str()
        );
        if a.stats && engine.model.cfg.is_moe() {
            eprintln!("[{}]", expert_stats_line(&engine, n_tok));
        }
    }
    Ok(())
}

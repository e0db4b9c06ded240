use crate::common::ModelArgs;
use anyhow::{bail, Context, Result};
use sluice_runtime::perplexity::perplexity;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    file: std::path::PathBuf,
    /// Tokens per chunk (as llama-perplexity's -c); without it, `--ctx` if given, else 512.
    #[arg(long = "ctx-size", short = 'c')]
    ctx_size: Option<usize>,
    /// Score at most this many chunks (0: all).
    #[arg(long, default_value_t = 0)]
    chunks: usize,
    /// Tokens per forward pass (results do not depend on it).
    #[arg(long, default_value_t = 512)]
    batch: usize,
    #[arg(long)]
    json: bool,
}

pub fn main(a: Args) -> Result<()> {
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("reading {}", a.file.display()))?;
    let mut model = a.model.clone();
    let chunk = a.ctx_size.unwrap_or(if model.ctx != 0 { model.ctx } else { 512 });
    if chunk < 2 {
        bail!("a perplexity chunk needs at least 2 tokens (got --ctx-size {chunk})");
    }
    if model.ctx != 0 && model.ctx < chunk {
        bail!("--ctx {} is smaller than the chunk size --ctx-size {chunk}", model.ctx);
    }
    model.ctx = model.ctx.max(chunk);
    let engine = model.load()?;
    let tokens = engine.encode(&text)?;
    if engine.pinned.is_some() {
        // Lossy routing: score with and without it, and compare the distributions.
        let c = sluice_runtime::pinning::routing_cost(&engine, &tokens, chunk, a.chunks, a.batch)?;
        if a.json {
            let mut v = serde_json::to_value(&c)?;
            v["ppl"] = c.ppl_pinned.into();
            v["tokens"] = tokens.len().into();
            v["pinned_routing"] = serde_json::to_value(&engine.pin_report)?;
            println!("{v}");
        } else {
            println!(
                "{} tokens, {} chunks of {}: PPL = {:.4} with pinned routing (LOSSY), {:.4} exact; KL(exact || pinned) = {:.5} nats per token (max {:.4}), same top token at {:.1}% of positions  ({:.1} s)",
                tokens.len(),
                c.chunks,
                c.ctx,
                c.ppl_pinned,
                c.ppl_exact,
                c.kl_mean,
                c.kl_max,
                100.0 * c.top1_agreement,
                c.seconds
            );
        }
        return Ok(());
    }
    let r = perplexity(&engine, &tokens, chunk, a.chunks, a.batch)?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "ppl": r.ppl, "ppl_err": r.ppl_err, "chunks": r.chunks, "ctx": r.ctx,
                "tokens": tokens.len(), "tokens_scored": r.tokens_scored, "seconds": r.seconds,
            })
        );
    } else {
        println!(
            "{} tokens, {} chunks of {}: PPL = {:.4} +/- {:.5}  ({:.1} s)",
            tokens.len(),
            r.chunks,
            r.ctx,
            r.ppl,
            r.ppl_err,
            r.seconds
        );
    }
    Ok(())
}

use crate::common::{parse_tokens, ModelArgs};
use anyhow::{Context, Result};
use sluice_model::Logits;
use std::io::Write;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Comma-separated token ids.
    #[arg(long)]
    tokens: String,
    /// Run the sequence in chunks of this many tokens (1: one token per step, like decode).
    /// The logits are the same whatever the chunk size.
    #[arg(long, default_value_t = 0)]
    chunk: usize,
    /// Write the JSON here instead of standard output.
    #[arg(long)]
    out: Option<std::path::PathBuf>,
}

pub fn main(a: Args) -> Result<()> {
    let tokens = parse_tokens(&a.tokens)?;
    let engine = a.model.load()?;
    let mut kv = engine.new_state();
    let chunk = if a.chunk == 0 { tokens.len() } else { a.chunk };
    let vocab = engine.model.cfg.vocab_size;
    let mut rows: Vec<f32> = Vec::with_capacity(tokens.len() * vocab);
    for c in tokens.chunks(chunk) {
        rows.extend(engine.model.forward(&mut kv, c, Logits::All, None)?);
    }
    let mut s = String::with_capacity(rows.len() * 12);
    s.push_str("{\"logits\":[");
    for (i, row) in rows.chunks(vocab).enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('[');
        for (j, v) in row.iter().enumerate() {
            if j > 0 {
                s.push(',');
            }
            // serde_json writes an f32 in its shortest round-trip form.
            s.push_str(&serde_json::to_string(v)?);
        }
        s.push(']');
    }
    s.push_str("]}\n");
    match &a.out {
        Some(p) => std::fs::write(p, s).with_context(|| format!("writing {}", p.display()))?,
        None => std::io::stdout().lock().write_all(s.as_bytes())?,
    }
    Ok(())
}

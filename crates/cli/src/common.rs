//! Flags and helpers shared by the subcommands that run a model.

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use sluice_runtime::{Engine, EngineOptions};
use std::path::PathBuf;

#[derive(ClapArgs, Clone, Debug)]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json + *.safetensors) or a GGUF file.
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Kernel threads (default: all cores).
    #[arg(long, short = 't', default_value_t = 0)]
    pub threads: usize,
    /// Maximum context length in tokens (default: the model's own).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Engine> {
        let opts = EngineOptions { threads: self.threads, max_context: self.ctx };
        Engine::load(&self.model, opts).with_context(|| format!("loading {}", self.model.display()))
    }

    /// Loads the model for its tokenizer (the weights are mapped, not read).
    pub fn load_tokenizer_only(&self) -> Result<Engine> {
        self.load()
    }
}

/// Parses "1,2,3" (spaces allowed) into token ids.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().with_context(|| format!("`{p}` is not a token id")))
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("no token ids given");
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_lists_parse_or_say_why_not() {
        assert_eq!(parse_tokens("1, 2,3").unwrap(), vec![1, 2, 3]);
        assert!(parse_tokens("1,x").unwrap_err().to_string().contains("`x`"));
        assert!(parse_tokens(" , ").is_err());
    }
}

//! Llama (1, 2, 3.x) and the many checkpoints that reuse its layout: pre-norm decoder, GQA,
//! SwiGLU FFN, optional attention bias, Llama-3 RoPE scaling.

use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Llama)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    if c.opt_bool("mlp_bias")?.unwrap_or(false) {
        return Err(c.error("unsupported value `true` of key `mlp_bias`").into());
    }
    Ok(cfg)
}

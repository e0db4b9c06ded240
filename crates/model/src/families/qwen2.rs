//! Qwen2 / Qwen2.5: a Llama-style decoder with bias on the Q, K and V projections.

use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Qwen2)?;
    cfg.qkv_bias = true;
    Ok(cfg)
}

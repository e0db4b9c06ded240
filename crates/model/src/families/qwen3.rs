//! Qwen3 (dense): no QKV bias; RMSNorm on each query and key head before RoPE.

use crate::config::{Arch, ModelConfig, QkNorm};
use crate::error::Result;
use sluice_formats::JsonConfig;

pub fn config(c: &JsonConfig) -> Result<ModelConfig> {
    let mut cfg = super::common(c, Arch::Qwen3)?;
    cfg.qkv_bias = c.opt_bool("attention_bias")?.unwrap_or(false);
    cfg.qk_norm = QkNorm::PerHead;
    Ok(cfg)
}

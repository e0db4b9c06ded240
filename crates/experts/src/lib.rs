//! Routed experts out of memory: stores (GGUF, safetensors, pack), the hard-quota cache, the
//! IO engine that reads misses straight into cache slots, prefetch, and memory-pressure
//! feedback. `StreamingExperts` implements the model's `ExpertSource`.

pub mod arena;
pub mod cache;
pub mod io;
pub mod layout;
pub mod pack;
pub mod pressure;
pub mod source;
pub mod store;
pub mod trace;

pub use cache::Policy;
pub use source::{IoKind, StreamOptions, StreamingExperts};

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ExpertError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {msg}")]
    Pack { path: PathBuf, msg: String },
    #[error("{0}: not a mixture-of-experts model (nothing to stream)")]
    NotMoe(String),
    #[error("an expert cache of {quota} bytes cannot hold one expert; the minimum is {min} bytes")]
    QuotaTooSmall { quota: u64, min: u64 },
    #[error("{0}")]
    Model(String),
}

impl From<sluice_model::ModelError> for ExpertError {
    fn from(e: sluice_model::ModelError) -> Self {
        ExpertError::Model(e.to_string())
    }
}

pub type Result<T, E = ExpertError> = std::result::Result<T, E>;

//! The runtime: turns a path into a runnable engine (model, experts, tokenizer) and runs the
//! generation loop with sampling.

pub mod bench;
pub mod chat;
pub mod engine;
pub mod error;
pub mod fit;
pub mod generate;
pub mod perplexity;
pub mod pinning;
pub mod placement;
pub mod prewarm;
pub mod sampler;
pub mod spec;

pub use chat::{ChatSession, Turn};
pub use engine::{Engine, EngineOptions, SourceFormat};
pub use error::{Result, RuntimeError};
pub use generate::{generate, generate_cached, prefill, GenerateOptions, Generation, PromptCache, StopReason};
pub use sampler::{Candidates, Sampled, Sampler, SamplerConfig};

//! Models: configs, the forward pass of each family, the KV cache, and the `ExpertSource`
//! trait through which the MoE block reaches its experts.

pub mod attention;
pub mod config;
pub mod error;
pub mod expert;
pub mod families;
pub mod ffn;
pub mod gguf;
pub mod hf;
pub mod kv_cache;
pub mod model;
pub mod rope;
pub mod synth;
pub mod trace;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use error::{ModelError, Result};
pub use expert::{ExpertSource, ResidentExperts};
pub use kv_cache::KvCache;
pub use model::{Logits, Model};
pub use weights::TensorSource;

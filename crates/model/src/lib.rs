//! Models: configs, the forward pass as a stack of layers (a token mixer and a feed-forward
//! block each, chosen per layer), the per-sequence state, and the `ExpertSource` trait through
//! which the MoE block reaches its experts.

pub mod config;
pub mod dense;
pub mod error;
pub mod expert;
pub mod families;
pub mod ffn;
pub mod gguf;
pub mod hf;
pub mod mixer;
pub mod model;
pub mod mtp;
pub mod pinned;
pub mod rope;
pub mod state;
pub mod step;
pub mod synth;
pub mod trace;
pub mod weights;

pub use config::{Arch, ModelConfig};
pub use error::{ModelError, Result};
pub use expert::{ExpertSource, ResidentExperts};
pub use model::{BatchItem, Logits, Model};
pub use state::{SeqState, Snapshot};
pub use weights::TensorSource;

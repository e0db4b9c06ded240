//! Checkpoint formats: safetensors, GGUF, Hugging Face configs and tokenizers.
//! Everything here reads files and validates them; nothing computes.

pub mod blob;
pub mod chat_template;
pub mod error;
pub mod gguf;
pub mod gguf_tokenizer;
pub mod json_config;
pub mod safetensors;
pub mod tokenizer;

pub use blob::Blob;
pub use chat_template::{ChatTemplate, ChatTemplateError, Message, RenderOptions, ToolCall};
pub use error::{FormatError, Result};
pub use json_config::JsonConfig;
pub use tokenizer::{TextStream, Tokenizer};

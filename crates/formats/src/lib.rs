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

static SCRATCH_ROOT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();

extern "C" fn remove_scratch_root() {
    if let Some(d) = SCRATCH_ROOT.get() {
        let _ = std::fs::remove_dir_all(d);
    }
}

/// Scratch space for the tests: `$TMPDIR/sluice-<pid>`, made on first use and removed when the
/// process exits (whether its tests passed or failed), so that test runs leave nothing behind.
#[doc(hidden)]
pub fn scratch_root() -> &'static std::path::Path {
    SCRATCH_ROOT.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("sluice-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&d);
        // SAFETY: registers a function that takes nothing and touches only a `OnceLock` that
        // is set by then; `exit` runs it once, after the tests.
        unsafe { libc::atexit(remove_scratch_root) };
        d
    })
}

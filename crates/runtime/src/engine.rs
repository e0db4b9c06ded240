//! Loading: a path becomes a runnable model with its tokenizer and stop tokens.
//!
//! A directory holding `config.json` is a Hugging Face checkpoint; a file starting with the
//! GGUF magic is a GGUF model. Anything else is refused with a message saying which it is not.

use crate::error::{Result, RuntimeError};
use sluice_formats::{JsonConfig, Tokenizer};
use sluice_kernels::ThreadPool;
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::{ExpertSource, Model, ResidentExperts, TensorSource};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Threads for the kernels (0: every core this process may use).
    pub threads: usize,
    /// Maximum context in tokens (0: the model's own maximum).
    pub max_context: usize,
}

/// Which file format a model came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceFormat {
    Safetensors,
    Gguf,
}

pub struct Engine {
    pub path: PathBuf,
    pub format: SourceFormat,
    pub model: Model,
    pub tokenizer: Option<Tokenizer>,
    /// Tokens that end generation.
    pub eos: Vec<u32>,
    pub options: EngineOptions,
}

impl Engine {
    pub fn load(path: &Path, options: EngineOptions) -> Result<Engine> {
        let threads = if options.threads == 0 { sluice_kernels::pool::available_threads() } else { options.threads };
        let pool = Arc::new(ThreadPool::new(threads));
        if path.is_dir() {
            return Self::load_hf(path, options, pool);
        }
        if !path.exists() {
            return Err(RuntimeError::Input(format!("{}: no such file or directory", path.display())));
        }
        if is_gguf(path)? {
            return Self::load_gguf(path, options, pool);
        }
        Err(RuntimeError::Input(format!(
            "{}: not a model: expected a Hugging Face model directory (with config.json) or a GGUF file",
            path.display()
        )))
    }

    fn load_hf(dir: &Path, options: EngineOptions, pool: Arc<ThreadPool>) -> Result<Engine> {
        let ckpt = HfCheckpoint::open(dir)?;
        let cfg = ckpt.config.clone();
        let experts: Arc<dyn ExpertSource> = Arc::new(ResidentExperts::load(&ckpt as &dyn TensorSource, &cfg)?);
        let model = Model::load(cfg, &ckpt, experts, pool)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() { Some(Tokenizer::from_hf_file(&tok_path)?) } else { None };
        let gen_path = dir.join("generation_config.json");
        let mut eos = model.cfg.eos_tokens.clone();
        if gen_path.exists() {
            if let Some(ids) = JsonConfig::open(&gen_path)?.opt_usize_list("eos_token_id")? {
                eos = ids.into_iter().map(|i| i as u32).collect();
            }
        }
        Ok(Engine { path: dir.to_path_buf(), format: SourceFormat::Safetensors, model, tokenizer, eos, options })
    }

    fn load_gguf(path: &Path, options: EngineOptions, pool: Arc<ThreadPool>) -> Result<Engine> {
        let ckpt = GgufCheckpoint::open(path)?;
        let cfg = ckpt.config.clone();
        let experts: Arc<dyn ExpertSource> = Arc::new(ResidentExperts::load(&ckpt as &dyn TensorSource, &cfg)?);
        let model = Model::load(cfg, &ckpt, experts, pool)?;
        let tok = sluice_formats::gguf_tokenizer::GgufTokenizer::from_gguf(&ckpt.file)?;
        let mut eos = model.cfg.eos_tokens.clone();
        for e in tok.eos() {
            if !eos.contains(&e) {
                eos.push(e);
            }
        }
        let tokenizer = Some(sluice_formats::Tokenizer::Gguf(Box::new(tok)));
        Ok(Engine { path: path.to_path_buf(), format: SourceFormat::Gguf, model, tokenizer, eos, options })
    }

    /// The tokenizer, or an error saying the model has none.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            RuntimeError::Input(format!("{}: the model has no tokenizer; pass token ids instead", self.path.display()))
        })
    }

    /// Token ids of a prompt, with the model's own special tokens (BOS) where it adds them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer()?.encode(text, true).map_err(RuntimeError::Input)
    }

    /// The BOS token id, if the model has one.
    pub fn bos(&self) -> Option<u32> {
        match &self.tokenizer {
            Some(sluice_formats::Tokenizer::Gguf(t)) => t.bos(),
            _ => self.model.cfg.bos_token,
        }
    }

    /// Whether prompts start with BOS (the tokenizer's own setting).
    pub fn add_bos(&self) -> bool {
        match &self.tokenizer {
            Some(sluice_formats::Tokenizer::Gguf(t)) => t.add_bos(),
            Some(sluice_formats::Tokenizer::Hf(t)) => {
                // A Hugging Face tokenizer adds BOS through its post-processor, if it does.
                t.encode("a", true).map(|e| e.get_ids().first() == self.model.cfg.bos_token.as_ref()).unwrap_or(false)
            }
            None => false,
        }
    }

    pub fn new_cache(&self) -> sluice_model::KvCache {
        self.model.new_cache(self.options.max_context)
    }
}

/// Whether `path` starts with the GGUF magic number.
pub fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| sluice_formats::FormatError::io(path, e))?;
    let mut magic = [0u8; 4];
    Ok(f.read_exact(&mut magic).is_ok() && &magic == sluice_formats::gguf::MAGIC)
}

//! Loading: a path becomes a runnable model with its experts placed, its tokenizer and stop
//! tokens.
//!
//! A directory holding `config.json` is a Hugging Face checkpoint; a file starting with the
//! GGUF magic is a GGUF model. Anything else is refused with a message saying which it is not.

use crate::error::{Result, RuntimeError};
use crate::placement::{place, ExpertOptions, OwnedSource, Placement};
use sluice_experts::pressure::PressureMonitor;
use sluice_experts::StreamingExperts;
use sluice_formats::chat_template::{ChatTemplate, Message, RenderOptions};
use sluice_formats::{JsonConfig, Tokenizer};
use sluice_kernels::ThreadPool;
use sluice_model::gguf::GgufCheckpoint;
use sluice_model::hf::HfCheckpoint;
use sluice_model::{Model, ModelConfig, ModelError, TensorSource};
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Clone, Default)]
pub struct EngineOptions {
    /// Threads for the kernels (0: every core this process may use).
    pub threads: usize,
    /// Maximum context in tokens (0: the model's own maximum).
    pub max_context: usize,
    pub experts: ExpertOptions,
    /// Load the checkpoint's multi-token-prediction head (speculative decoding drafts with it).
    pub mtp: bool,
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
    /// Where the experts live and why.
    pub placement: String,
    /// The streaming source, when experts stream.
    pub streaming: Option<Arc<StreamingExperts>>,
    /// How a synthetic model routes (`None` for a real checkpoint).
    pub synthetic_routing: Option<String>,
    /// What `--prewarm` did, if it ran; the expert counters it moved are set aside.
    pub prewarmed: Option<crate::prewarm::Prewarmed>,
    /// Pinned routing (`--pin-experts`, lossy), when on: the switch, and what it chose.
    pub pinned: Option<Arc<sluice_model::pinned::PinnedRouting>>,
    pub pin_report: Option<crate::pinning::Pinned>,
    stats_base: sluice_model::expert::ExpertStats,
    /// The model's chat template, or why there is none.
    chat_template: std::result::Result<ChatTemplate, String>,
    _monitor: Option<PressureMonitor>,
}

enum Checkpoint {
    Hf(HfCheckpoint),
    Gguf(GgufCheckpoint),
}

impl Checkpoint {
    /// Opens a Hugging Face model directory or a GGUF file.
    fn open(path: &Path) -> Result<(Checkpoint, SourceFormat)> {
        if path.is_dir() {
            Ok((Checkpoint::Hf(HfCheckpoint::open(path)?), SourceFormat::Safetensors))
        } else if !path.exists() {
            Err(RuntimeError::Input(format!("{}: no such file or directory", path.display())))
        } else if is_gguf(path)? {
            Ok((Checkpoint::Gguf(GgufCheckpoint::open(path)?), SourceFormat::Gguf))
        } else {
            Err(RuntimeError::Input(format!(
                "{}: not a model: expected a Hugging Face model directory (with config.json) or a GGUF file",
                path.display()
            )))
        }
    }

    fn source(&self) -> &dyn TensorSource {
        match self {
            Checkpoint::Hf(c) => c,
            Checkpoint::Gguf(c) => c,
        }
    }

    fn config(&self) -> &ModelConfig {
        match self {
            Checkpoint::Hf(c) => &c.config,
            Checkpoint::Gguf(c) => &c.config,
        }
    }

    fn file_bytes(&self) -> u64 {
        match self {
            Checkpoint::Hf(c) => c.st.files.iter().map(|f| f.file_len() as u64).sum(),
            Checkpoint::Gguf(c) => c.file.file_len(),
        }
    }

    fn fingerprint(&self) -> sluice_experts::Result<String> {
        match self {
            Checkpoint::Hf(c) => sluice_experts::store::hf_fingerprint(c),
            Checkpoint::Gguf(c) => sluice_experts::store::gguf_fingerprint(c),
        }
    }

    fn layout(&self, pack: Option<&Path>) -> sluice_experts::Result<sluice_experts::layout::Layout> {
        let own = match self {
            Checkpoint::Hf(c) => sluice_experts::store::layout_from_hf(c)?,
            Checkpoint::Gguf(c) => sluice_experts::store::layout_from_gguf(c)?,
        };
        match pack {
            Some(p) => {
                let packed = sluice_experts::pack::open_pack(p, &self.fingerprint()?)?;
                sluice_experts::pack::check_matches(&packed, &own, p)?;
                Ok(packed)
            }
            None => Ok(own),
        }
    }
}

fn expert_err(e: sluice_experts::ExpertError) -> RuntimeError {
    RuntimeError::Model(ModelError::Expert(e.to_string()))
}

/// A model's sizes, read from its files without loading it: what `sluice fit` reasons from.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ModelSizes {
    pub file_bytes: u64,
    /// Every routed expert of every sparse layer, and the rest of the file.
    pub expert_bytes: u64,
    pub dense_bytes: u64,
    pub embedding_bytes: u64,
    /// Sequence state for `ctx` tokens.
    pub state_bytes: u64,
    pub ctx: usize,
    /// One expert's cache slot, and how many experts there are.
    pub slot_bytes: u64,
    pub experts: u64,
    pub sparse_layers: usize,
    pub experts_per_token: usize,
}

impl ModelSizes {
    /// Expert bytes one token reads if nothing is cached (k experts in every sparse layer).
    pub fn active_expert_bytes(&self) -> u64 {
        let one = self.expert_bytes.checked_div(self.experts).unwrap_or(0);
        one * (self.sparse_layers * self.experts_per_token) as u64
    }
}

/// Reads the sizes of the model at `path` (a GGUF file or a Hugging Face directory) for a
/// context of `ctx` tokens (0: the model's own, at most 8192, as `Engine::load` takes it).
pub fn model_sizes(path: &Path, ctx: usize) -> Result<ModelSizes> {
    let (ckpt, _) = Checkpoint::open(path)?;
    let cfg = ckpt.config();
    let ctx = if ctx == 0 { cfg.max_position.min(8192) } else { ctx };
    let src = ckpt.source();
    let expert_bytes = crate::placement::expert_bytes(src, cfg)?;
    let embedding_bytes = src.get(sluice_model::weights::Key::TokEmbd, None)?.map_or(0, |t| t.data.len() as u64);
    let (slot_bytes, experts) = match &cfg.moe {
        Some(_) => {
            let l = ckpt.layout(None).map_err(expert_err)?;
            (l.slot_bytes() as u64, l.experts.iter().map(|x| x.len() as u64).sum())
        }
        None => (0, 0),
    };
    Ok(ModelSizes {
        file_bytes: ckpt.file_bytes(),
        expert_bytes,
        dense_bytes: ckpt.file_bytes().saturating_sub(expert_bytes),
        embedding_bytes,
        state_bytes: cfg.state_bytes(ctx),
        ctx,
        slot_bytes,
        experts,
        sparse_layers: (0..cfg.n_layer).filter(|l| cfg.is_sparse(*l)).count(),
        experts_per_token: cfg.moe.as_ref().map_or(0, |m| m.n_expert_used),
    })
}

impl Engine {
    pub fn load(path: &Path, options: EngineOptions) -> Result<Engine> {
        let threads = if options.threads == 0 { sluice_kernels::pool::available_threads() } else { options.threads };
        let pool = Arc::new(ThreadPool::new(threads));
        let (ckpt, format) = Checkpoint::open(path)?;
        let cfg = ckpt.config().clone();
        let ctx = if options.max_context == 0 { cfg.max_position.min(8192) } else { options.max_context };
        let kv_bytes = cfg.state_bytes(ctx);
        let src = ckpt.source();
        let layout = || ckpt.layout(options.experts.pack.as_deref()).map_err(expert_err);
        let Placement { experts, copy_dense, reason, streaming, monitor } =
            place(src, &cfg, &options.experts, ckpt.file_bytes(), kv_bytes, &layout)?;
        let mut model = if copy_dense {
            Model::load(cfg, &OwnedSource(src), experts, pool)?
        } else {
            Model::load(cfg, src, experts, pool)?
        };
        if options.mtp {
            model.load_mtp(src)?;
        }
        let synthetic_routing = match &ckpt {
            Checkpoint::Gguf(c) => synthetic_routing(&c.file),
            Checkpoint::Hf(_) => None,
        };
        let (tokenizer, eos) = match &ckpt {
            Checkpoint::Hf(_) => hf_tokenizer(path, &model)?,
            Checkpoint::Gguf(c) => {
                let tok = sluice_formats::gguf_tokenizer::GgufTokenizer::from_gguf(&c.file)?;
                let mut eos = model.cfg.eos_tokens.clone();
                for e in tok.eos() {
                    if !eos.contains(&e) {
                        eos.push(e);
                    }
                }
                (Some(Tokenizer::Gguf(Box::new(tok))), eos)
            }
        };
        let chat_template = load_chat_template(path, &ckpt, tokenizer.as_ref(), &model);
        Ok(Engine {
            path: path.to_path_buf(),
            format,
            model,
            tokenizer,
            eos,
            options,
            placement: reason,
            streaming,
            synthetic_routing,
            prewarmed: None,
            pinned: None,
            pin_report: None,
            stats_base: Default::default(),
            chat_template,
            _monitor: monitor,
        })
    }

    /// The expert source's counters since the model was ready (a prewarm's reads excluded:
    /// `prewarmed` reports them).
    pub fn expert_stats(&self) -> sluice_model::expert::ExpertStats {
        self.model.experts.stats().since(&self.stats_base)
    }

    /// Marks the counters as they are now as the start of `expert_stats`.
    pub(crate) fn reset_stats_base(&mut self) {
        self.stats_base = self.model.experts.stats();
    }

    /// What to say beside cache hit rates and prefetch precision measured on this model, if
    /// anything (synthetic routing is not a real model's).
    pub fn routing_note(&self) -> Option<String> {
        self.synthetic_routing.as_deref().map(sluice_model::synth::routing_caveat)
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
            Some(Tokenizer::Gguf(t)) => t.bos(),
            _ => self.model.cfg.bos_token,
        }
    }

    /// Whether prompts start with BOS (the tokenizer's own setting).
    pub fn add_bos(&self) -> bool {
        match &self.tokenizer {
            Some(Tokenizer::Gguf(t)) => t.add_bos(),
            Some(Tokenizer::Hf(t)) => {
                // A Hugging Face tokenizer adds BOS through its post-processor, if it does.
                t.encode("a", true).map(|e| e.get_ids().first() == self.model.cfg.bos_token.as_ref()).unwrap_or(false)
            }
            None => false,
        }
    }

    pub fn new_state(&self) -> sluice_model::SeqState {
        self.model.new_state(self.options.max_context)
    }

    /// Whether prompts end with EOS (the tokenizer's own setting; GGUF only).
    pub fn add_eos(&self) -> bool {
        matches!(&self.tokenizer, Some(Tokenizer::Gguf(t)) if t.add_eos())
    }

    /// The model's chat template, or an error saying the model has none (or why it does not
    /// compile).
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.chat_template.as_ref().map_err(|e| RuntimeError::Input(e.clone()))
    }

    /// Uses `t` instead of the model's own template.
    pub fn set_chat_template(&mut self, t: ChatTemplate) {
        self.chat_template = Ok(t);
    }

    /// The texts the template sees as `bos_token` and `eos_token`: the BOS and EOS tokens'
    /// text, special tokens written out.
    pub fn special_texts(&self) -> (String, String) {
        special_texts(self.tokenizer.as_ref(), &self.model)
    }

    /// The prompt tokens of a conversation, as llama.cpp's server makes them: the template's
    /// text (less a BOS text it starts with when the tokenizer adds BOS itself, and an EOS
    /// text it ends with when the tokenizer adds EOS) tokenized with special tokens parsed
    /// and the tokenizer's own BOS/EOS added.
    pub fn chat_tokens(&self, messages: &[Message], opts: &RenderOptions) -> Result<Vec<u32>> {
        let t = self.chat_template()?;
        let text = t.render(messages, opts).map_err(|e| RuntimeError::Input(e.to_string()))?;
        let mut text = text.as_str();
        if self.add_bos() && !t.bos_token().is_empty() {
            text = text.strip_prefix(t.bos_token()).unwrap_or(text);
        }
        if self.add_eos() && !t.eos_token().is_empty() {
            text = text.strip_suffix(t.eos_token()).unwrap_or(text);
        }
        self.encode(text)
    }

    /// Tokens that end an assistant turn: the end-of-generation tokens, and the end-of-turn
    /// tokens the chat template writes (`<|im_end|>`, `<end_of_turn>`, ...) where the
    /// vocabulary has them as single tokens.
    pub fn chat_stop_tokens(&self) -> Vec<u32> {
        let mut stop = self.eos.clone();
        if let (Ok(t), Some(tok)) = (&self.chat_template, &self.tokenizer) {
            for text in t.end_of_turn_texts() {
                if let Some(id) = tok.token_id(text) {
                    if !stop.contains(&id) {
                        stop.push(id);
                    }
                }
            }
        }
        stop
    }
}

/// The text of BOS and EOS (empty where the model has none).
fn special_texts(tokenizer: Option<&Tokenizer>, model: &Model) -> (String, String) {
    let Some(tok) = tokenizer else { return (String::new(), String::new()) };
    let (bos, eos) = match tok {
        Tokenizer::Gguf(t) => (t.bos(), t.eos_id()),
        Tokenizer::Hf(_) => (model.cfg.bos_token, model.cfg.eos_tokens.first().copied()),
    };
    let text = |id: Option<u32>| id.map(|i| tok.decode(&[i], false)).unwrap_or_default();
    (text(bos), text(eos))
}

/// The chat template of a checkpoint: GGUF metadata, or a Hugging Face directory's files.
fn load_chat_template(
    path: &Path,
    ckpt: &Checkpoint,
    tokenizer: Option<&Tokenizer>,
    model: &Model,
) -> std::result::Result<ChatTemplate, String> {
    let found = match ckpt {
        Checkpoint::Gguf(c) => {
            let (bos, eos) = special_texts(tokenizer, model);
            ChatTemplate::from_gguf(&c.file, &bos, &eos)
        }
        Checkpoint::Hf(_) => ChatTemplate::from_hf_dir(path),
    };
    match found {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(format!(
            "{}: the model has no chat template ({}); give one with --chat-template FILE, or `--chat-template chatml` for llama.cpp's default",
            path.display(),
            match ckpt {
                Checkpoint::Gguf(_) => "no `tokenizer.chat_template` in its GGUF metadata",
                Checkpoint::Hf(_) => "no chat_template.jinja, and no `chat_template` in tokenizer_config.json",
            }
        )),
        Err(e) => Err(e.to_string()),
    }
}

fn hf_tokenizer(dir: &Path, model: &Model) -> Result<(Option<Tokenizer>, Vec<u32>)> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = if tok_path.exists() { Some(Tokenizer::from_hf_file(&tok_path)?) } else { None };
    let gen_path = dir.join("generation_config.json");
    let mut eos = model.cfg.eos_tokens.clone();
    if gen_path.exists() {
        if let Some(ids) = JsonConfig::open(&gen_path)?.opt_usize_list("eos_token_id")? {
            eos = ids.into_iter().map(|i| i as u32).collect();
        }
    }
    Ok((tokenizer, eos))
}

/// The routing a synthetic GGUF declares; files written before the key existed are known by
/// their name (their routing was uniform).
fn synthetic_routing(f: &sluice_formats::gguf::GgufFile) -> Option<String> {
    if let Some(r) = f.get(sluice_model::synth::ROUTING_KEY).and_then(|v| v.as_str()) {
        return Some(r.to_string());
    }
    let name = f.get("general.name").and_then(|v| v.as_str())?;
    name.starts_with("sluice synthetic").then(|| "uniform".to_string())
}

/// Whether `path` starts with the GGUF magic number.
pub fn is_gguf(path: &Path) -> Result<bool> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| sluice_formats::FormatError::io(path, e))?;
    let mut magic = [0u8; 4];
    Ok(f.read_exact(&mut magic).is_ok() && &magic == sluice_formats::gguf::MAGIC)
}

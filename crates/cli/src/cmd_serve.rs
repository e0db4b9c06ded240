use crate::common::{load_draft_model, parse_size, ModelArgs};
use anyhow::{bail, Result};
use sluice_server::{ServerOptions, SpecMethod};
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on (localhost only by default).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Requests generating at once (one batched forward pass per step).
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Context per request in tokens (default: --ctx if given, else the model's own, at most 8192).
    #[arg(long, short = 'c')]
    ctx_size: Option<usize>,
    /// Require `Authorization: Bearer KEY` on /v1/*.
    #[arg(long)]
    api_key: Option<String>,
    /// Requests waiting beyond the free slots before new ones get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Most prompt tokens run per step while other requests generate.
    #[arg(long, default_value_t = 128)]
    prefill_chunk: usize,
    /// Largest request body.
    #[arg(long, default_value = "16MiB")]
    max_body: String,
    /// Memory for sequence state (KV cache, recurrent state) of running requests and cached
    /// prefixes (default: available memory after loading, less headroom).
    #[arg(long, value_name = "SIZE")]
    state_memory: Option<String>,
    /// Most memory for finished sequences' states kept for prefix reuse (0: off).
    #[arg(long, default_value = "1GiB")]
    prefix_cache: String,
    /// The model's name in the API (default: the file or directory name).
    #[arg(long)]
    alias: Option<String>,
    /// Seconds running requests may take to finish after SIGINT/SIGTERM.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    /// Speculative decoding for every request that does not say otherwise: `ngram` drafts by
    /// looking up the request's latest n-gram earlier in its prompt and output, `draft` with
    /// the --draft-model (run greedily on a state of its own per request), `mtp` with the
    /// checkpoint's multi-token-prediction head (loaded for this), `self` with the
    /// model itself, each routed layer using only the experts the cache holds (drafting reads
    /// nothing; the experts it left out are prefetched for the verify pass); the batch step
    /// verifies the drafts (greedy requests: the same tokens and log-probabilities as without;
    /// sampled ones: plain sampling's distribution). Without this flag only requests that ask
    /// (`"spec": "ngram"`, `"draft"`, `"mtp"` or `"self"`) speculate.
    #[arg(long, value_name = "ngram|draft|mtp|self")]
    spec: Option<String>,
    /// A smaller model with the target's vocabulary (e.g. a small quantization of it, or a
    /// small model of the same family) that drafts for requests asking `"spec": "draft"`
    /// (all of them with `--spec draft`). Loaded beside the target; each drafting request
    /// keeps a state in it too.
    #[arg(long, value_name = "PATH")]
    draft_model: Option<std::path::PathBuf>,
    /// The draft model stops drafting when its token's probability is below this.
    #[arg(long, default_value_t = 0.5)]
    draft_p_min: f32,
    /// The most tokens drafted a step (a request may set its own, `"draft_max"`, up to 64).
    #[arg(long, default_value_t = sluice_server::DEFAULT_DRAFT_MAX)]
    draft_max: usize,
}

pub fn main(a: Args) -> Result<()> {
    let mut model = a.model;
    match (a.ctx_size, model.ctx) {
        (Some(c), m) if m != 0 && m != c => bail!("--ctx {m} and --ctx-size {c} disagree; give one"),
        (Some(c), _) => model.ctx = c,
        _ => {}
    }
    if a.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if !(1..=sluice_server::api::DRAFT_MAX_LIMIT).contains(&a.draft_max) {
        bail!("--draft-max must be 1 to {}, got {}", sluice_server::api::DRAFT_MAX_LIMIT, a.draft_max);
    }
    if !(0.0..=1.0).contains(&a.draft_p_min) {
        bail!("--draft-p-min must be a probability (0 to 1), got {}", a.draft_p_min);
    }
    let spec = match a.spec.as_deref() {
        None => None,
        Some("ngram") => Some(SpecMethod::Ngram),
        Some("draft") if a.draft_model.is_none() => bail!("--spec draft needs --draft-model PATH"),
        Some("draft") => Some(SpecMethod::Draft),
        Some("self") => Some(SpecMethod::Cached),
        Some("mtp") => Some(SpecMethod::Mtp),
        Some(m) => bail!("--spec {m}: unknown method (ngram, draft, mtp, self)"),
    };
    let model_id = a.alias.clone().unwrap_or_else(|| {
        model.model.file_name().map_or_else(|| model.model.display().to_string(), |n| n.to_string_lossy().into_owned())
    });
    let opts = ServerOptions {
        host: a.host,
        port: a.port,
        parallel: a.parallel,
        ctx_size: model.ctx,
        api_key: a.api_key.filter(|k| !k.is_empty()),
        max_queue: a.max_queue,
        prefill_chunk: a.prefill_chunk.max(1),
        max_body_bytes: parse_size(&a.max_body)? as usize,
        state_memory: a.state_memory.as_deref().map(parse_size).transpose()?,
        prefix_cache_bytes: parse_size(&a.prefix_cache)?,
        model_id,
        shutdown_grace: Duration::from_secs(a.shutdown_grace),
        spec,
        draft_max: a.draft_max,
        draft_p_min: a.draft_p_min,
    };
    let draft_path = a.draft_model;
    let loader: sluice_server::Loader = Box::new(move || {
        // The multi-token-prediction head is loaded for `--spec mtp` only (it takes memory).
        let target = model.load_with_mtp(spec == Some(SpecMethod::Mtp)).map_err(|e| format!("{e:#}"))?;
        let draft = draft_path
            .map(|path| load_draft_model(&path, model.threads, model.ctx))
            .transpose()
            .map_err(|e| format!("{e:#}"))?;
        Ok(sluice_server::Loaded { target, draft })
    });
    sluice_server::serve(opts, loader).map_err(anyhow::Error::msg)
}

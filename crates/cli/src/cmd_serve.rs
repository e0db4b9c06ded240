use crate::common::{parse_size, ModelArgs};
use anyhow::{bail, Result};
use sluice_server::ServerOptions;
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
    /// looking up the request's latest n-gram earlier in its prompt and output, and the batch
    /// step verifies the drafts (greedy requests: the same tokens and log-probabilities as
    /// without). Without this flag only requests that ask (`"spec": "ngram"`) speculate.
    #[arg(long, value_name = "ngram")]
    spec: Option<String>,
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
    let spec = match a.spec.as_deref() {
        None => None,
        Some("ngram") => Some(a.draft_max),
        Some(m @ ("draft" | "mtp" | "self")) => {
            bail!(
                "--spec {m}: the server drafts by n-gram lookup only (`--spec ngram`); `sluice run --spec {m}` runs it"
            )
        }
        Some(m) => bail!("--spec {m}: unknown method (the server has `ngram`)"),
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
    };
    let loader: sluice_server::Loader = Box::new(move || model.load().map_err(|e| format!("{e:#}")));
    sluice_server::serve(opts, loader).map_err(anyhow::Error::msg)
}

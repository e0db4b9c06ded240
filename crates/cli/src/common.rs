//! Flags and helpers shared by the subcommands that run a model.

use anyhow::{bail, Context, Result};
use clap::Args as ClapArgs;
use sluice_experts::{IoKind, Policy};
use sluice_formats::chat_template::{JsonValue, RenderOptions};
use sluice_formats::ChatTemplate;
use sluice_model::expert::ExpertStats;
use sluice_runtime::placement::{ExpertMode, ExpertOptions};
use sluice_runtime::spec::{SpecMethod, SpecOptions};
use sluice_runtime::{Engine, EngineOptions, GenerateOptions, SamplerConfig};
use std::path::PathBuf;

#[derive(ClapArgs, Clone, Debug)]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json + *.safetensors) or a GGUF file; or either
    /// at an http(s):// or s3:// URL (the dense weights are fetched once, experts on demand).
    #[arg(long, short = 'm')]
    pub model: PathBuf,
    /// Kernel threads (default: all cores).
    #[arg(long, short = 't', default_value_t = 0)]
    pub threads: usize,
    /// Maximum context length in tokens (default: the model's own).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Expert cache size for streaming (e.g. 6GiB, 512MiB), or `all` to keep every expert
    /// resident. Default: resident if the model fits in available memory, else streaming with
    /// a cache sized from available memory.
    #[arg(long, value_name = "SIZE|all")]
    pub expert_cache: Option<String>,
    /// Where experts live: auto, resident, mmap (the page cache decides), stream.
    #[arg(long, default_value = "auto")]
    pub expert_mode: String,
    /// Eviction policy of the expert cache: lru or lfu (LFU with aging).
    #[arg(long, default_value = "lru")]
    pub policy: String,
    /// Do not prefetch the next layer's predicted experts.
    #[arg(long)]
    pub no_prefetch: bool,
    /// Expert reads in flight at once (for a model at a URL: connections, with twice as many
    /// reads in flight so that back-to-back ones queue and are fetched together).
    #[arg(long, default_value_t = 32)]
    pub io_depth: usize,
    /// IO engine: auto, uring, pread.
    #[arg(long, default_value = "auto")]
    pub io: String,
    /// Read experts from this pack (made by `sluice pack` from the same model).
    #[arg(long)]
    pub pack: Option<PathBuf>,
    /// Do not shrink the expert cache under memory pressure.
    #[arg(long)]
    pub no_pressure: bool,
    /// Before the first token, fill the expert cache with the experts this routing trace (from
    /// `run --trace` on a similar task) used most. Changes timing, never output.
    #[arg(long, value_name = "TRACE")]
    pub prewarm: Option<PathBuf>,
    /// LOSSY, opt-in: each routed layer may choose only among the N experts of that layer the
    /// --pin-trace trace used most (the top k is taken over them, as if the others were pruned);
    /// they are loaded first, so a cache that holds them reads nothing while decoding. The
    /// output is no longer the model's: `sluice perplexity` with the same flags says by how much.
    #[arg(long, value_name = "N", requires = "pin_trace")]
    pub pin_experts: Option<usize>,
    /// The routing trace (`run --trace`) --pin-experts chooses from.
    #[arg(long, value_name = "TRACE", requires = "pin_experts")]
    pub pin_trace: Option<PathBuf>,
    /// Compute the routed experts on the NVIDIA GPU (device 0), which keeps up to SIZE of
    /// them in its memory (e.g. 8GiB) and copies the others from host memory when chosen
    /// (where --expert-cache and --expert-mode keep them). Needs the NVIDIA driver and NVRTC
    /// at run time. The dense matrices (every layer's projections, dense and shared FFNs, the
    /// output head) go to the GPU's memory too, beside the tier, unless --cpu-dense. Passes
    /// of several tokens (prefill) send each product to the GPU and give the CPU's bits;
    /// single-token decode steps run whole on the GPU where the model's layers allow it (its
    /// own float rounding, the same bits whatever the tier holds) unless --gpu-per-product.
    #[arg(long, value_name = "SIZE")]
    pub gpu_experts: Option<String>,
    /// With --gpu-experts: keep the dense matrices' products on the CPU.
    #[arg(long, requires = "gpu_experts")]
    pub cpu_dense: bool,
    /// With --gpu-experts: run decode steps on the host, sending each product to the GPU
    /// (the CPU's bits), instead of whole on the GPU (where the model's layers allow it:
    /// attention, norms and the KV cache in VRAM; logits within float rounding of the
    /// CPU's, the same bits whatever the VRAM tier holds).
    #[arg(long, requires = "gpu_experts")]
    pub gpu_per_product: bool,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// Flags of a model at a URL.
#[derive(ClapArgs, Clone, Debug)]
pub struct RemoteArgs {
    /// For a model at a URL: the local disk tier (the dense weights, and expert records up to
    /// --disk-cache-size). Default: ~/.cache/sluice/remote.
    #[arg(long, value_name = "DIR")]
    pub disk_cache: Option<PathBuf>,
    /// For a model at a URL: bytes of experts the disk tier keeps (e.g. 20GiB; 0: none, every
    /// miss of the expert cache is a remote read).
    #[arg(long, value_name = "SIZE", default_value = "0")]
    pub disk_cache_size: String,
    /// For an s3:// model: the S3-compatible endpoint (default: AWS_ENDPOINT_URL, else AWS).
    #[arg(long, value_name = "URL")]
    pub s3_endpoint: Option<String>,
}

/// Opens the model at `url` (its header and dense weights fetched into the local tier if they
/// are not there yet) and says which it was.
pub fn open_remote(url: &str, o: &sluice_remote::RemoteOptions) -> Result<sluice_remote::Mirror> {
    let m = sluice_remote::open(url, o).with_context(|| format!("opening {url}"))?;
    if m.fetched_bytes > 0 {
        eprintln!(
            "sluice: {url}: fetched the header and dense weights ({:.1} MB) in {:.1} s into {}",
            m.fetched_bytes as f64 / 1e6,
            m.fetch_seconds,
            m.local.display()
        );
    } else {
        eprintln!("sluice: {url}: header and dense weights ({:.1} MB) already local", m.dense_bytes as f64 / 1e6);
    }
    Ok(m)
}

impl RemoteArgs {
    pub fn options(&self) -> Result<sluice_remote::RemoteOptions> {
        let mut o = sluice_remote::RemoteOptions::new();
        if let Some(d) = &self.disk_cache {
            o.dir = d.clone();
        }
        o.disk_quota = parse_size(&self.disk_cache_size).context("--disk-cache-size")?;
        o.s3_endpoint = self.s3_endpoint.clone();
        Ok(o)
    }
}

/// Sampling flags of the commands that generate (`run`, `chat`).
#[derive(ClapArgs, Clone, Debug)]
pub struct SamplingArgs {
    /// Tokens to generate (per reply, in a chat).
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    pub n: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Drop tokens less likely than this fraction of the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Subtracted once from the logit of every token already generated (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time it was generated (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Do not stop at end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
}

impl SamplingArgs {
    pub fn generate_options(&self) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: self.n,
            sampler: SamplerConfig {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed,
                min_p: self.min_p,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
            },
            ignore_eos: self.ignore_eos,
            ..Default::default()
        }
    }
}

/// Speculative decoding flags.
#[derive(ClapArgs, Clone, Debug)]
pub struct SpecArgs {
    /// Speculative decoding: draft tokens with `ngram` (lookup in the prompt and the text so
    /// far), `draft` (a smaller model with the same vocabulary, --draft-model), `mtp` (the
    /// checkpoint's multi-token-prediction head) or `self` (the model itself, each layer
    /// using only the experts its cache holds: drafting reads nothing) and verify them in one
    /// pass of the model. Greedy output is the same tokens; sampled output has the same
    /// distribution.
    #[arg(long, value_name = "ngram|draft|mtp|self")]
    pub spec: Option<String>,
    /// The draft model for `--spec draft` (a Hugging Face directory or GGUF file).
    #[arg(long, value_name = "PATH")]
    pub draft_model: Option<PathBuf>,
    /// The most tokens drafted per round.
    #[arg(long, default_value_t = 16)]
    pub draft_max: usize,
    /// The fewest drafted tokens worth verifying (0: decode plainly when drafting does not pay).
    #[arg(long, default_value_t = 0)]
    pub draft_min: usize,
    /// Always draft --draft-max tokens, instead of choosing the length from the measured
    /// acceptance and verify cost.
    #[arg(long)]
    pub draft_fixed: bool,
    /// A draft model or head stops drafting when its token's probability is below this.
    #[arg(long, default_value_t = 0.5)]
    pub draft_p_min: f32,
    /// The longest n-gram `--spec ngram` looks up.
    #[arg(long, default_value_t = 4)]
    pub ngram_max: usize,
    /// The shortest n-gram `--spec ngram` looks up.
    #[arg(long, default_value_t = 2)]
    pub ngram_min: usize,
    /// `--spec self`: do not hand the experts a draft chose but did not have in the cache
    /// to the prefetcher (by default they are read while the draft goes on, ahead of the
    /// verify pass that will want them).
    #[arg(long)]
    pub no_draft_prefetch: bool,
}

impl SpecArgs {
    /// The method asked for, if any (`--draft-model` alone means `draft`).
    pub fn method(&self) -> Result<Option<SpecMethod>> {
        let m = match (&self.spec, &self.draft_model) {
            (None, None) => return Ok(None),
            (None, Some(_)) => SpecMethod::Draft,
            (Some(s), _) => SpecMethod::parse(s).map_err(anyhow::Error::msg)?,
        };
        if self.draft_model.is_some() && m != SpecMethod::Draft {
            bail!("--draft-model goes with --spec draft, not --spec {}", m.as_str());
        }
        if m == SpecMethod::Draft && self.draft_model.is_none() {
            bail!("--spec draft needs --draft-model PATH");
        }
        self.options().validate().map_err(anyhow::Error::msg)?;
        Ok(Some(m))
    }

    pub fn options(&self) -> SpecOptions {
        SpecOptions {
            draft_max: self.draft_max,
            draft_min: self.draft_min,
            adaptive: !self.draft_fixed,
            p_min: self.draft_p_min,
            ngram_min: self.ngram_min,
            ngram_max: self.ngram_max,
            guide_prefetch: !self.no_draft_prefetch,
            ..Default::default()
        }
    }

    /// Loads the draft model for `target`, with `model`'s settings (threads, experts) and
    /// the target's context.
    pub fn load_draft(&self, model: &ModelArgs, target: &Engine) -> Result<Option<Engine>> {
        let Some(path) = &self.draft_model else { return Ok(None) };
        load_draft_model(path, model.threads, target.new_state().max_len()).map(Some)
    }
}

/// Loads a draft model: `threads` kernel threads, `ctx` positions, its experts placed by the
/// default rule (a draft model is small), no head of its own.
pub fn load_draft_model(path: &std::path::Path, threads: usize, ctx: usize) -> Result<Engine> {
    let opts = EngineOptions { threads, max_context: ctx, experts: ExpertOptions::default(), mtp: false };
    Engine::load(path, opts).with_context(|| format!("loading the draft model {}", path.display()))
}

/// Flags of the commands that talk to a model through its chat template (`run --chat`, `chat`).
#[derive(ClapArgs, Clone, Debug)]
pub struct ChatArgs {
    /// A system message to start the conversation with.
    #[arg(long)]
    pub system: Option<String>,
    /// The chat template to use instead of the model's own: a Jinja file, or `chatml`
    /// (llama.cpp's default for models without one).
    #[arg(long, value_name = "FILE|chatml")]
    pub chat_template: Option<String>,
    /// Tools the model may call: a JSON file holding a list of OpenAI function definitions
    /// (`[{"type": "function", "function": {"name", "description", "parameters"}}]`). Tool calls
    /// in the reply are reported.
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,
    /// Render with `enable_thinking` false (models that think first answer directly).
    #[arg(long)]
    pub no_thinking: bool,
}

impl ChatArgs {
    /// Whether any of these flags was given.
    pub fn any(&self) -> bool {
        self.system.is_some() || self.chat_template.is_some() || self.tools.is_some() || self.no_thinking
    }

    /// Puts `--chat-template` in place of the model's template.
    pub fn apply_template(&self, e: &mut Engine) -> Result<()> {
        let Some(t) = &self.chat_template else { return Ok(()) };
        let (bos, eos) = e.special_texts();
        let template = if t == "chatml" {
            ChatTemplate::chatml(&bos, &eos)
        } else {
            let src = std::fs::read_to_string(t).with_context(|| format!("reading the chat template {t}"))?;
            ChatTemplate::new(&src, t, &bos, &eos)?
        };
        e.set_chat_template(template);
        Ok(())
    }

    /// The template variables these flags ask for.
    pub fn render_options(&self) -> Result<RenderOptions> {
        let tools = match &self.tools {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                let v = JsonValue::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
                if v.at(0).is_none() && !text.trim_start().starts_with('[') {
                    bail!("{}: expected a JSON list of tool definitions", p.display());
                }
                Some(v)
            }
        };
        Ok(RenderOptions { tools, enable_thinking: Some(!self.no_thinking), ..Default::default() })
    }
}

/// Parses a byte size: `6GiB`, `512MiB`, `1.5G`, `300MB`, `4096`.
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().with_context(|| format!("`{s}` is not a size (try 6GiB or 512MiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "kb" => 1e3,
        "m" | "mib" => 1024.0 * 1024.0,
        "mb" => 1e6,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "gb" => 1e9,
        "t" | "tib" => 1024f64.powi(4),
        "tb" => 1e12,
        u => bail!("unknown size unit `{u}` in `{s}` (use KiB, MiB, GiB, KB, MB, GB)"),
    };
    if !(v.is_finite() && v >= 0.0) {
        bail!("`{s}` is not a size");
    }
    Ok((v * mult) as u64)
}

impl ModelArgs {
    pub fn expert_options(&self) -> Result<ExpertOptions> {
        let mut o = ExpertOptions {
            mode: ExpertMode::parse(&self.expert_mode).with_context(|| {
                format!("unknown --expert-mode `{}` (auto, resident, mmap, stream)", self.expert_mode)
            })?,
            policy: Policy::parse(&self.policy)
                .with_context(|| format!("unknown --policy `{}` (lru, lfu)", self.policy))?,
            prefetch: !self.no_prefetch,
            depth: self.io_depth.max(1),
            io: match self.io.as_str() {
                "auto" => IoKind::Auto,
                "uring" | "io_uring" => IoKind::Uring,
                "pread" => IoKind::Pread,
                o => bail!("unknown --io `{o}` (auto, uring, pread)"),
            },
            pack: self.pack.clone(),
            pressure: !self.no_pressure,
            ..Default::default()
        };
        match self.expert_cache.as_deref() {
            None => {}
            Some("all") => o.mode = ExpertMode::Resident,
            Some(s) => o.cache_bytes = Some(parse_size(s)?),
        }
        if o.pack.is_some() && o.mode == ExpertMode::Auto {
            o.mode = ExpertMode::Stream;
        }
        Ok(o)
    }
}

impl ModelArgs {
    pub fn load(&self) -> Result<Engine> {
        self.load_with_mtp(false)
    }

    /// The local path to open, and for a model at a URL the reader of its experts (the
    /// dense weights are fetched first if they are not local yet).
    fn resolve(&self) -> Result<(PathBuf, Option<std::sync::Arc<sluice_remote::TieredReader>>)> {
        let name = self.model.to_string_lossy();
        if !sluice_remote::is_remote(&name) {
            return Ok((self.model.clone(), None));
        }
        if self.pack.is_some() {
            bail!("--pack reads a local file; it cannot be combined with a model at a URL");
        }
        let m = open_remote(&name, &self.remote.options()?)?;
        Ok((m.local, Some(m.reader)))
    }

    /// Loads the model, with its multi-token-prediction head when `mtp`.
    pub fn load_with_mtp(&self, mtp: bool) -> Result<Engine> {
        let (path, reader) = self.resolve()?;
        let mut experts = self.expert_options()?;
        if let Some(r) = reader {
            experts.io = IoKind::Ranges(r);
        }
        let opts = EngineOptions { threads: self.threads, max_context: self.ctx, experts, mtp };
        let mut e = Engine::load(&path, opts).with_context(|| format!("loading {}", self.model.display()))?;
        if let Some(size) = &self.gpu_experts {
            if !e.model.cfg.is_moe() {
                bail!("--gpu-experts: {} has no routed experts", self.model.display());
            }
            let quota = parse_size(size).context("--gpu-experts")? as usize;
            let gpu = std::sync::Arc::new(sluice_cuda::Gpu::open(0).context("--gpu-experts")?);
            let mut dense = None;
            if !self.cpu_dense {
                // Whatever the expert tier leaves of the device's memory, less room for the
                // buffers a pass allocates there.
                let budget = gpu.total_mem.saturating_sub(quota).saturating_sub(2 << 30);
                let d = sluice_cuda::dense::CudaDense::upload(gpu.clone(), &e.model, budget)
                    .context("--gpu-experts: uploading the dense weights")?;
                eprintln!("sluice: {}", sluice_model::dense::DenseCompute::describe(&d));
                let d = std::sync::Arc::new(d);
                e.model.dense_compute = Some(d.clone());
                dense = Some(d);
            }
            let c = sluice_cuda::experts::CudaExperts::with_gpu(gpu, quota, e.model.experts.expert_bytes())
                .context("--gpu-experts")?;
            eprintln!("sluice: {}", sluice_model::ffn::offload::ExpertCompute::describe(&c));
            let w = c.warm(&*e.model.experts, &e.model.cfg).context("--gpu-experts: warming the VRAM tier")?;
            eprintln!("sluice: {w}");
            let c = std::sync::Arc::new(c);
            e.model.expert_compute = Some(c.clone());
            match dense.filter(|_| !self.gpu_per_product) {
                Some(d) => match sluice_cuda::step::CudaStep::new(&e.model, d, Some(c)) {
                    Ok(s) => {
                        eprintln!("sluice: {}", sluice_model::step::StepCompute::describe(&s));
                        e.model.step_compute = Some(std::sync::Arc::new(s));
                    }
                    Err(why) => eprintln!(
                        "sluice: decode steps run on the host with each product on the GPU: the whole-step path does not run {why}"
                    ),
                },
                None => eprintln!("sluice: decode steps run on the host with each product on the GPU"),
            }
        }
        if e.model.cfg.is_moe() {
            eprintln!("sluice: {}", e.placement);
        }
        if let (Some(n), Some(t)) = (self.pin_experts, &self.pin_trace) {
            let p = sluice_runtime::pinning::pin(&mut e, t, n)
                .with_context(|| format!("--pin-experts {n} --pin-trace {}", t.display()))?;
            eprintln!(
                "sluice: LOSSY: --pin-experts {n}: each routed layer chooses among {n} of its {} experts only (the ones {} used most: {:.0}% of its routing decisions); output differs from the model's{}",
                p.n_expert,
                t.display(),
                100.0 * p.trace_coverage,
                match p.resident {
                    Some(r) => format!("; {r} pinned experts loaded ({:.1} MB)", p.bytes_read as f64 / 1e6),
                    None => String::new(),
                }
            );
        }
        if let Some(t) = &self.prewarm {
            match sluice_runtime::prewarm::prewarm(&mut e, t).with_context(|| format!("--prewarm {}", t.display()))? {
                Some(p) => eprintln!(
                    "sluice: prewarmed {} of the {} experts {} used ({:.0}% of its routing decisions): {:.1} MB in {:.2} s",
                    p.resident,
                    p.in_trace,
                    t.display(),
                    100.0 * p.coverage,
                    p.bytes_read as f64 / 1e6,
                    p.seconds
                ),
                None => eprintln!("sluice: --prewarm has nothing to do: the experts are not streamed"),
            }
        }
        Ok(e)
    }

    /// Loads the model for its tokenizer (the weights are mapped, not read).
    pub fn load_tokenizer_only(&self) -> Result<Engine> {
        self.load()
    }
}

/// Where sluice keeps what it makes once and reuses (demo models, measured rates):
/// `$SLUICE_CACHE`, else `~/.cache/sluice`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SLUICE_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/sluice")))
        .unwrap_or_else(|| PathBuf::from(".sluice-cache"))
}

/// Parses "1,2,3" (spaces allowed) into token ids.
pub fn parse_tokens(s: &str) -> Result<Vec<u32>> {
    let ids: Vec<u32> = s
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|p| p.parse::<u32>().with_context(|| format!("`{p}` is not a token id")))
        .collect::<Result<_>>()?;
    if ids.is_empty() {
        bail!("no token ids given");
    }
    Ok(ids)
}

/// The expert source's counters as JSON, per token where that makes sense.
pub fn expert_stats_json(e: &Engine, tokens: usize) -> serde_json::Value {
    let mut v = stats_json(&e.expert_stats(), &e.placement, tokens);
    v["prewarm"] = serde_json::to_value(&e.prewarmed).unwrap_or_default();
    if let Some(p) = &e.pin_report {
        v["pinned_routing"] = serde_json::to_value(p).unwrap_or_default();
    }
    v["routing_note"] = e.routing_note().map_or(serde_json::Value::Null, Into::into);
    gpu_stats_json(e, &mut v);
    v
}

/// The GPU's counters (`--gpu-experts`), added to a JSON stats object.
pub fn gpu_stats_json(e: &Engine, v: &mut serde_json::Value) {
    if let Some(c) = &e.model.expert_compute {
        v["gpu_experts"] = c.stats_line().into();
        v["gpu_placement"] = c.describe().into();
    }
    if let Some(d) = &e.model.dense_compute {
        v["gpu_dense"] = d.stats_line().into();
        v["gpu_dense_placement"] = d.describe().into();
    }
    if let Some(s) = &e.model.step_compute {
        v["gpu_step"] = s.stats_line().into();
        v["gpu_step_placement"] = s.describe().into();
    }
}

/// Expert-cache counters over `tokens` tokens as JSON. Rates are over demand accesses (the
/// experts the MoE blocks asked for): `hit_rate` counts those found resident from an earlier
/// demand, `prefetch_hit_rate` those a prefetch brought in, `miss_rate` those read on demand.
pub fn stats_json(s: &ExpertStats, placement: &str, tokens: usize) -> serde_json::Value {
    let per = |v: u64| if tokens == 0 { 0.0 } else { v as f64 / tokens as f64 };
    serde_json::json!({
        "placement": placement,
        "accesses": s.accesses(),
        "hits": s.hits,
        "misses": s.misses,
        "hit_rate": s.hit_rate(),
        "prefetch_hit_rate": s.prefetch_hit_rate(),
        "miss_rate": s.miss_rate(),
        "evictions": s.evictions,
        "bytes_read": s.bytes_read,
        "bytes_read_per_token": per(s.bytes_read),
        "loaded_bytes": s.loaded_bytes,
        "read_amplification": if s.loaded_bytes == 0 { serde_json::Value::Null } else { (s.bytes_read as f64 / s.loaded_bytes as f64).into() },
        "io_stall_s": s.stall_ns as f64 / 1e9,
        "io_stall_ms_per_token": per(s.stall_ns) / 1e6,
        "prefetch_issued": s.prefetch_issued,
        "prefetch_hits": s.prefetch_hits,
        "prefetch_wasted": s.prefetch_wasted,
        "prefetch_precision": s.prefetch_precision(),
        "quota_bytes": s.quota_bytes,
        "resident_bytes": s.resident_bytes,
        "buffered_io": s.buffered_io,
        "tiers": s.tiers.iter().map(|t| serde_json::json!({"tier": t.tier, "reads": t.reads, "bytes": t.bytes, "bytes_per_token": per(t.bytes), "read_s": t.read_ns as f64 / 1e9, "mean_read_ms": if t.reads == 0 { serde_json::Value::Null } else { (t.read_ns as f64 / t.reads as f64 / 1e6).into() }, "errors": t.errors, "merged": t.merged})).collect::<Vec<_>>(),
        "quota_changes": s.quota_changes.iter().map(|(t, a, b, why)| serde_json::json!({"t_s": t, "from": a, "to": b, "reason": why})).collect::<Vec<_>>(),
    })
}

/// One line of expert-cache stats for humans, with the caveats that apply to this model.
pub fn expert_stats_line(e: &Engine, tokens: usize) -> String {
    let mut line = stats_line(&e.expert_stats(), tokens);
    if let Some(note) = e.routing_note() {
        line.push_str(&format!("\n  note: {note}"));
    }
    for g in gpu_stats_lines(e) {
        line.push_str(&format!("\n  {g}"));
    }
    line
}

/// The GPU's counters (`--gpu-experts`) for humans: its experts', then its dense products'.
pub fn gpu_stats_lines(e: &Engine) -> Vec<String> {
    let experts = e.model.expert_compute.as_ref().map(|c| c.stats_line());
    let steps = e.model.step_compute.as_ref().map(|s| s.stats_line());
    experts.into_iter().chain(e.model.dense_compute.as_ref().map(|d| d.stats_line())).chain(steps).collect()
}

/// One line of expert-cache counters over `tokens` tokens.
pub fn stats_line(s: &ExpertStats, tokens: usize) -> String {
    let t = tokens.max(1) as f64;
    let pct = |r: Option<f64>| 100.0 * r.unwrap_or(0.0);
    let pf = s.prefetch_precision().map_or(String::new(), |p| format!(", prefetch precision {:.0}%", 100.0 * p));
    let tiers: String = s
        .tiers
        .iter()
        .map(|x| {
            format!(
                "; {} tier: {} reads{}, {:.1} MB/token, {:.1} ms/read{}",
                x.tier,
                x.reads,
                if x.merged > 0 { format!(" ({} more coalesced into them)", x.merged) } else { String::new() },
                x.bytes as f64 / t / 1e6,
                x.read_ns as f64 / x.reads.max(1) as f64 / 1e6,
                if x.errors > 0 { format!(", {} errors", x.errors) } else { String::new() }
            )
        })
        .collect();
    format!(
        "experts: {} accesses: {:.1}% hits, {:.1}% served by prefetch, {:.1}% misses; {:.1} MB read/token, IO stall {:.1} ms/token{pf}, cache {:.2} GiB{}{}{tiers}",
        s.accesses(),
        pct(s.hit_rate()),
        pct(s.prefetch_hit_rate()),
        pct(s.miss_rate()),
        s.bytes_read as f64 / t / 1e6,
        s.stall_ns as f64 / t / 1e6,
        s.quota_bytes as f64 / (1u64 << 30) as f64,
        if s.quota_changes.is_empty() { String::new() } else { format!(", {} quota changes", s.quota_changes.len()) },
        if s.buffered_io { ", buffered reads (O_DIRECT refused: the page cache holds copies)" } else { "" }
    )
}

/// Records routing decisions to a trace file.
pub struct TraceObserver {
    pub writer: Option<sluice_experts::trace::TraceWriter>,
    pub error: Option<std::io::Error>,
}

impl TraceObserver {
    pub fn create(path: &std::path::Path, e: &Engine) -> Result<TraceObserver> {
        let cfg = &e.model.cfg;
        let moe =
            cfg.moe.as_ref().with_context(|| format!("{}: not an MoE model; nothing to trace", e.path.display()))?;
        let expert_bytes = e.model.experts.expert_bytes() as u64;
        let slot_bytes = match &e.streaming {
            Some(s) => s.slot_bytes() as u64,
            // The slot a streaming cache would use: three ranges widened to 4 KiB pages.
            None => (expert_bytes + 6 * 4096).div_ceil(4096) * 4096,
        };
        let h = sluice_experts::trace::TraceHeader {
            model: e.path.display().to_string(),
            n_layer: cfg.n_layer,
            n_expert: moe.n_expert,
            n_expert_used: moe.n_expert_used,
            slot_bytes,
            expert_bytes,
        };
        let w = sluice_experts::trace::TraceWriter::create(path, &h)
            .with_context(|| format!("creating {}", path.display()))?;
        Ok(TraceObserver { writer: Some(w), error: None })
    }
}

impl sluice_model::trace::Observer for TraceObserver {
    fn routing(&mut self, layer: usize, pos: usize, experts: &[u32], _w: &[f32]) {
        if let Some(w) = &mut self.writer {
            if let Err(e) = w.push(layer, pos, experts) {
                self.error = Some(e);
                self.writer = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("6GiB").unwrap(), 6 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1.5G").unwrap(), 3 << 29);
        assert_eq!(parse_size("300MB").unwrap(), 300_000_000);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("6 parsecs").unwrap_err().to_string().contains("unit"));
        assert!(parse_size("lots").is_err());
    }

    #[test]
    fn token_lists_parse_or_say_why_not() {
        assert_eq!(parse_tokens("1, 2,3").unwrap(), vec![1, 2, 3]);
        assert!(parse_tokens("1,x").unwrap_err().to_string().contains("`x`"));
        assert!(parse_tokens(" , ").is_err());
    }
}

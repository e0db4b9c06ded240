//! Routes and handlers: request in, validated job to the scheduler, events out as JSON or
//! Server-Sent Events in OpenAI's wire format.

use crate::api::{self, Params, Prompt};
use crate::error::{ApiError, ErrorKind};
use crate::scheduler::{Cmd, Done, Event, Finish, Job, Place};
use crate::text::{Chunk, TokenInfo};
use crate::{App, Ready, Status};
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use sluice_formats::chat_template::{parse_tool_calls_offered, tool_names, JsonValue, Message, RenderOptions};
use sluice_formats::Tokenizer;
use sluice_runtime::spec::SpecMethod;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedReceiver;

type AppState = State<Arc<App>>;

pub(crate) fn router(app: Arc<App>) -> Router {
    let limit = app.opts.max_body_bytes;
    Router::new()
        .route("/", get(index))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/sluice/stats", get(stats))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(app)
}

const ENDPOINTS: [&str; 7] =
    ["/", "/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/sluice/stats"];

/// Checks the API key on /v1/* and counts every request by endpoint and status.
async fn guard(State(app): AppState, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let endpoint = ENDPOINTS.iter().find(|e| **e == path).copied().unwrap_or("other");
    let resp = match (&app.opts.api_key, path.starts_with("/v1/")) {
        (Some(key), true) if !authorized(&req, key) => ApiError::new(
            ErrorKind::Unauthorized,
            "missing or wrong API key: send `Authorization: Bearer KEY` with the key given to --api-key",
        )
        .into_response(),
        _ => next.run(req).await,
    };
    app.metrics.requests.with_label_values(&[endpoint, resp.status().as_str()]).inc();
    resp
}

fn authorized(req: &Request, key: &str) -> bool {
    let Some(h) = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let Some(given) = h.strip_prefix("Bearer ").map(str::trim) else { return false };
    // Constant time in the key's length.
    let (a, b) = (given.as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> ApiError {
    ApiError::new(ErrorKind::NotFound, format!("no such endpoint: {} {}", req.method(), req.uri().path()))
}

async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(ErrorKind::MethodNotAllowed, format!("{} is not allowed on {}", req.method(), req.uri().path()))
}

async fn index() -> Html<&'static str> {
    Html(include_str!("web/index.html"))
}

async fn health(State(app): AppState) -> Response {
    let status = app.status.read().unwrap_or_else(|e| e.into_inner());
    match &*status {
        Status::Ready(_) if !app.shutting_down.load(Ordering::SeqCst) => {
            (StatusCode::OK, Json(json!({"status": "ok"}))).into_response()
        }
        Status::Ready(_) => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "shutting down"}))).into_response(),
        Status::Loading => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading model"}))).into_response(),
        Status::Failed(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({"status": "error", "error": e}))).into_response()
        }
    }
}

async fn metrics(State(app): AppState) -> Response {
    if let Ok(r) = app.ready_even_if_stopping() {
        app.metrics.set_experts(&app.opts.model_id, &r.engine.model.experts.stats());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], app.metrics.render()).into_response()
}

impl App {
    fn ready_even_if_stopping(&self) -> Result<Arc<Ready>, ()> {
        match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Ready(r) => Ok(r.clone()),
            _ => Err(()),
        }
    }
}

async fn models(State(app): AppState) -> Json<Value> {
    let meta = app.ready_even_if_stopping().ok().map(|r| {
        let c = &r.engine.model.cfg;
        json!({
            "n_ctx": r.ctx_size, "n_ctx_train": c.max_position, "n_vocab": c.vocab_size, "n_layer": c.n_layer,
            "moe": c.is_moe(), "placement": r.engine.placement,
        })
    });
    Json(json!({
        "object": "list",
        "data": [{"id": app.opts.model_id, "object": "model", "created": app.created, "owned_by": "sluice", "meta": meta}],
    }))
}

/// Live statistics for the web page: the expert cache and the scheduler.
async fn stats(State(app): AppState) -> Result<Json<Value>, ApiError> {
    let r = app.ready_even_if_stopping().map_err(|_| ApiError::unavailable("the model is loading", 2))?;
    let e = &r.engine;
    let s = e.model.experts.stats();
    let sh = &app.shared;
    let tokens_run = sh.tokens_run.load(Ordering::Relaxed);
    let cfg = &e.model.cfg;
    let sparse: Vec<usize> = (0..cfg.n_layer).filter(|l| cfg.is_sparse(*l)).collect();
    let (resident, slot_bytes, max_quota) = match &e.streaming {
        Some(st) => (json!(st.resident_experts()), st.slot_bytes() as u64, st.max_quota() as u64),
        None => (Value::Null, 0, 0),
    };
    Ok(Json(json!({
        "model": app.opts.model_id,
        "uptime_s": app.started.elapsed().as_secs_f64(),
        "placement": e.placement,
        "experts": {
            "moe": cfg.is_moe(),
            "streaming": e.streaming.is_some(),
            "n_layer": cfg.n_layer,
            "n_expert": cfg.moe.as_ref().map_or(0, |m| m.n_expert),
            "n_expert_used": cfg.moe.as_ref().map_or(0, |m| m.n_expert_used),
            "sparse_layers": sparse,
            "resident": resident,
            "hits": s.hits,
            "misses": s.misses,
            "prefetch_hits": s.prefetch_hits,
            "prefetch_issued": s.prefetch_issued,
            "evictions": s.evictions,
            "hit_rate": s.hit_rate(),
            "bytes_read": s.bytes_read,
            "bytes_read_per_token": if tokens_run == 0 { 0.0 } else { s.bytes_read as f64 / tokens_run as f64 },
            "stall_s": s.stall_ns as f64 / 1e9,
            "quota_bytes": s.quota_bytes,
            "resident_bytes": s.resident_bytes,
            "slot_bytes": slot_bytes,
            "max_quota_bytes": max_quota,
        },
        "scheduler": {
            "active": sh.active.load(Ordering::SeqCst),
            "queued": sh.queued.load(Ordering::SeqCst),
            "parallel": app.opts.parallel,
            "last_batch": sh.last_batch.load(Ordering::SeqCst),
            "steps": sh.steps.load(Ordering::Relaxed),
            "tokens_run": tokens_run,
            "tokens_generated": sh.tokens_generated.load(Ordering::Relaxed),
            "ctx_size": r.ctx_size,
            "state_budget_bytes": r.state_budget,
            "state_reserved_bytes": sh.reserved_bytes.load(Ordering::SeqCst),
            "prefix_cache_entries": sh.prefix_entries.load(Ordering::SeqCst),
            "prefix_cache_bytes": sh.prefix_bytes.load(Ordering::SeqCst),
        },
    })))
}

fn body_bytes(b: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    b.map_err(|r| {
        if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(ErrorKind::PayloadTooLarge, "the request body is larger than the server accepts (--max-body)")
        } else {
            ApiError::bad_request(format!("cannot read the request body: {}", r.body_text()))
        }
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn endpoint(self) -> &'static str {
        match self {
            Kind::Chat => "/v1/chat/completions",
            Kind::Completion => "/v1/completions",
        }
    }
}

async fn chat(State(app): AppState, body: Result<Bytes, BytesRejection>) -> Response {
    handle(app, body, Kind::Chat).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(app): AppState, body: Result<Bytes, BytesRejection>) -> Response {
    handle(app, body, Kind::Completion).await.unwrap_or_else(IntoResponse::into_response)
}

/// What a prompt became: tokens, and what ends its output.
struct Prepared {
    prompt: Vec<u32>,
    stop_tokens: Vec<u32>,
    stop_texts: Vec<String>,
    /// With tools: the names of the functions offered.
    tools: Option<Vec<String>>,
    literal_tokens: Vec<(u32, String)>,
}

async fn handle(app: Arc<App>, body: Result<Bytes, BytesRejection>, kind: Kind) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    let body = body_bytes(body)?;
    let req = api::parse_body(&body)?;
    let params = api::params(&req, kind == Kind::Chat)?;
    let prompt_param = if kind == Kind::Chat { "messages" } else { "prompt" };
    // The prompt's shape is checked before the model is needed.
    let input = match kind {
        Kind::Chat => {
            let raw = req.messages.as_ref().ok_or_else(|| ApiError::invalid("messages", "`messages` is required"))?;
            let messages = Message::list_from_json(raw.get()).map_err(|e| ApiError::invalid("messages", e))?;
            if messages.is_empty() {
                return Err(ApiError::invalid("messages", "`messages` must not be empty"));
            }
            let tools = match (&req.tools, params.use_tools) {
                (Some(t), true) if t.get() != "null" => {
                    let v = JsonValue::parse(t.get()).map_err(|e| ApiError::invalid("tools", e))?;
                    if !t.get().trim_start().starts_with('[') {
                        return Err(ApiError::invalid("tools", "`tools` must be a list"));
                    }
                    (!v.is_empty()).then_some(v)
                }
                _ => None,
            };
            Input::Chat(messages, tools)
        }
        Kind::Completion => Input::Completion(api::prompt(&req)?),
    };
    let ready = app.ready()?;
    let engine = ready.engine.clone();
    let ignore_eos = params.ignore_eos;
    let prepared = tokio::task::spawn_blocking(move || prepare(&engine, input, ignore_eos))
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt: {e}")))??;
    let (job, rx) = make_job(&app, &ready, &prepared, &params, prompt_param, arrived)?;
    submit(&app, &ready, job)?;
    let fmt = Formatter::new(&app, &ready, kind, &params, prepared.tools.clone());
    if params.stream {
        Ok(stream_response(app.clone(), fmt, rx, arrived))
    } else {
        collect(app, fmt, rx, arrived).await
    }
}

enum Input {
    Chat(Vec<Message>, Option<JsonValue>),
    Completion(Prompt),
}

fn prepare(engine: &sluice_runtime::Engine, input: Input, ignore_eos: bool) -> Result<Prepared, ApiError> {
    let tok = engine.tokenizer().map_err(|e| ApiError::internal(e.to_string()))?;
    let p = match input {
        Input::Chat(messages, tools) => {
            let template = engine.chat_template().map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            let offered = tools.as_ref().map(tool_names);
            let has_tools = offered.is_some();
            let opts = RenderOptions { tools, ..RenderOptions::default() };
            let prompt =
                engine.chat_tokens(&messages, &opts).map_err(|e| ApiError::invalid("messages", e.to_string()))?;
            // End-of-turn texts that are not single tokens in this vocabulary stop as text.
            let stop_texts = template
                .end_of_turn_texts()
                .into_iter()
                .filter(|t| tok.token_id(t).is_none())
                .map(String::from)
                .collect();
            // Tool-call tags some vocabularies mark as control tokens (dropped when decoding).
            let literal_tokens = if has_tools {
                ["<tool_call>", "</tool_call>"]
                    .iter()
                    .filter_map(|t| tok.token_id(t).map(|id| (id, t.to_string())))
                    .filter(|(id, _)| tok.decode(&[*id], true).is_empty())
                    .collect()
            } else {
                Vec::new()
            };
            Prepared { prompt, stop_tokens: engine.chat_stop_tokens(), stop_texts, tools: offered, literal_tokens }
        }
        Input::Completion(Prompt::Text(s)) => {
            let prompt = engine.encode(&s).map_err(|e| ApiError::invalid("prompt", e.to_string()))?;
            Prepared {
                prompt,
                stop_tokens: engine.eos.clone(),
                stop_texts: Vec::new(),
                tools: None,
                literal_tokens: Vec::new(),
            }
        }
        Input::Completion(Prompt::Tokens(t)) => {
            let vocab = engine.model.cfg.vocab_size;
            if let Some(bad) = t.iter().find(|id| **id as usize >= vocab) {
                return Err(ApiError::invalid(
                    "prompt",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
            Prepared {
                prompt: t,
                stop_tokens: engine.eos.clone(),
                stop_texts: Vec::new(),
                tools: None,
                literal_tokens: Vec::new(),
            }
        }
    };
    Ok(Prepared { stop_tokens: if ignore_eos { Vec::new() } else { p.stop_tokens }, ..p })
}

/// Checks the context, the token budget and memory; builds the job.
fn make_job(
    app: &App,
    ready: &Ready,
    p: &Prepared,
    params: &Params,
    prompt_param: &str,
    arrived: Instant,
) -> Result<(Job, UnboundedReceiver<Event>), ApiError> {
    let n = p.prompt.len();
    let ctx = ready.ctx_size;
    let cfg = &ready.engine.model.cfg;
    if n == 0 {
        return Err(ApiError::invalid(prompt_param, "the prompt is empty"));
    }
    if n >= ctx {
        return Err(ApiError::invalid(
            prompt_param,
            format!("the prompt has {n} tokens; the context holds {ctx} (--ctx-size), leaving no room to generate"),
        ));
    }
    let per_token = cfg.state_bytes(2).saturating_sub(cfg.state_bytes(1));
    let fixed = cfg.state_bytes(1).saturating_sub(per_token);
    let max_tokens = match params.max_tokens {
        Some(m) => {
            if n + m > ctx {
                return Err(ApiError::invalid(
                    "max_tokens",
                    format!(
                        "the context holds {ctx} tokens (--ctx-size); the request asks for {} ({n} in the prompt, {m} to generate)",
                        n + m
                    ),
                ));
            }
            m
        }
        None => {
            // Up to the end of the context, or of the memory for sequence state.
            let fit = match per_token {
                0 => usize::MAX,
                b => (ready.state_budget.saturating_sub(fixed) / b) as usize,
            };
            (ctx.min(fit)).saturating_sub(n).max(1)
        }
    };
    let spec = match params.spec.unwrap_or(app.opts.spec) {
        None => None,
        Some(m) => {
            if let Some(why) = crate::spec::unavailable(m, &ready.engine, ready.draft.as_deref()) {
                return Err(ApiError::invalid("spec", format!("`spec`: {why}")));
            }
            Some((m, params.draft_max.unwrap_or(app.opts.draft_max)))
        }
    };
    // A request drafting with the draft model keeps a state in it too.
    let draft_state = match (&spec, &ready.draft) {
        (Some((SpecMethod::Draft, k)), Some(d)) => d.model.cfg.state_bytes(n + max_tokens + k),
        // The head's cache: one attention layer's keys and values.
        (Some((SpecMethod::Mtp, k)), _) => {
            let (a, b) = (0..=cfg.n_layer).map(|l| cfg.kv_widths(l)).max_by_key(|(a, b)| a + b).unwrap_or((0, 0));
            ((a + b) * (n + max_tokens + k) * 4) as u64
        }
        _ => 0,
    };
    let reserve = cfg.state_bytes(n + max_tokens) + draft_state;
    if reserve > ready.state_budget {
        return Err(ApiError::invalid(
            "max_tokens",
            format!(
                "{} tokens of sequence state need {reserve} bytes; the server has {} for sequence state",
                n + max_tokens,
                ready.state_budget
            ),
        ));
    }
    let mut stop = params.stop.clone();
    stop.extend(p.stop_texts.iter().cloned());
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let job = Job {
        prompt: p.prompt.clone(),
        max_tokens,
        sampler: params.sampler.clone(),
        stop_tokens: p.stop_tokens.clone(),
        stop_strings: stop,
        logprobs: params.logprobs,
        spec,
        literal_tokens: p.literal_tokens.clone(),
        reserve,
        events: tx,
        arrived,
        place: None,
    };
    Ok((job, rx))
}

/// Queues the job, or says why not (429: the queue is full; 503: it is full of requests
/// waiting for memory).
fn submit(app: &App, ready: &Ready, mut job: Job) -> Result<(), ApiError> {
    let sh = &app.shared;
    let Some(place) = Place::take(sh, app.opts.parallel + app.opts.max_queue) else {
        if sh.memory_blocked.load(Ordering::SeqCst) {
            app.metrics.rejected.with_label_values(&["memory"]).inc();
            return Err(ApiError::unavailable(
                "not enough memory for more sequences and the queue is full; try again later",
                2,
            ));
        }
        app.metrics.rejected.with_label_values(&["queue_full"]).inc();
        return Err(ApiError {
            retry_after: Some(1),
            ..ApiError::new(ErrorKind::QueueFull, "the server is busy: the request queue is full; try again later")
        });
    };
    job.place = Some(place);
    sh.queued.fetch_add(1, Ordering::SeqCst);
    if ready.tx.send(Cmd::Submit(Box::new(job))).is_err() {
        sh.queued.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::unavailable("the server is shutting down", 5));
    }
    Ok(())
}

fn random_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}{:08x}", getrandom::u64().unwrap_or(0), getrandom::u32().unwrap_or(0))
}

/// A log-probability as JSON (non-finite ones as OpenAI writes them).
fn lp(v: f32) -> Value {
    if v.is_finite() {
        json!(v as f64)
    } else {
        json!(-9999.0)
    }
}

/// Builds response bodies and stream chunks for one request.
struct Formatter {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    /// With tools: the names of the functions offered.
    tools: Option<Vec<String>>,
    engine: Arc<sluice_runtime::Engine>,
    /// All text so far.
    text: String,
    /// Streaming with tools: bytes of `text` sent as content.
    sent: usize,
    /// Completions: where the next token's text starts.
    offset: usize,
}

const TOOL_OPEN: &str = "<tool_call>";

impl Formatter {
    fn new(app: &App, ready: &Ready, kind: Kind, params: &Params, tools: Option<Vec<String>>) -> Formatter {
        Formatter {
            kind,
            id: random_id(if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }),
            created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model: app.opts.model_id.clone(),
            include_usage: params.include_usage,
            logprobs: params.logprobs.is_some(),
            tools,
            engine: ready.engine.clone(),
            text: String::new(),
            sent: 0,
            offset: 0,
        }
    }

    fn tok(&self) -> Option<&Tokenizer> {
        self.engine.tokenizer.as_ref()
    }

    fn piece(&self, id: u32) -> String {
        self.tok().map_or_else(String::new, |t| t.decode(&[id], false))
    }

    /// Chat logprobs entries of `tokens`.
    fn chat_logprobs(&self, tokens: &[TokenInfo]) -> Vec<Value> {
        tokens
            .iter()
            .map(|t| {
                let s = self.piece(t.id);
                let top: Vec<Value> = t
                    .top
                    .iter()
                    .map(|(id, l)| {
                        let p = self.piece(*id);
                        json!({"token": p, "logprob": lp(*l), "bytes": p.as_bytes()})
                    })
                    .collect();
                json!({"token": s, "logprob": lp(t.logprob), "bytes": s.as_bytes(), "top_logprobs": top})
            })
            .collect()
    }

    /// Completions logprobs of `tokens` (their text starting at `self.offset`).
    fn completion_logprobs(&mut self, tokens: &[TokenInfo]) -> Value {
        let (mut toks, mut lps, mut tops, mut offs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for t in tokens {
            let s = self.piece(t.id);
            offs.push(self.offset);
            self.offset += s.len();
            let mut top = serde_json::Map::new();
            for (id, l) in &t.top {
                top.insert(self.piece(*id), lp(*l));
            }
            toks.push(json!(s));
            lps.push(lp(t.logprob));
            tops.push(Value::Object(top));
        }
        json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs})
    }

    fn usage(d: &Done) -> Value {
        json!({
            "prompt_tokens": d.prompt_tokens,
            "completion_tokens": d.completion_tokens,
            "total_tokens": d.prompt_tokens + d.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
        })
    }

    fn finish_reason(d: &Done, tool_calls: bool) -> &'static str {
        match (tool_calls, d.finish) {
            (true, _) => "tool_calls",
            (false, Finish::Stop) => "stop",
            (false, Finish::Length) => "length",
        }
    }

    fn tool_calls_json(calls: &[sluice_formats::chat_template::ToolCall], streaming: bool) -> Vec<Value> {
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": c.id.clone().unwrap_or_else(|| random_id("call")),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if streaming {
                    v["index"] = json!(i);
                }
                v
            })
            .collect()
    }

    fn envelope(&self, choices: Value) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let mut v = json!({
            "id": self.id, "object": object, "created": self.created, "model": self.model,
            "system_fingerprint": concat!("sluice-", env!("CARGO_PKG_VERSION")),
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// The chunks that open a stream.
    fn start(&self) -> Vec<Value> {
        match self.kind {
            Kind::Chat => vec![self.envelope(json!([{
                "index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null
            }]))],
            Kind::Completion => Vec::new(),
        }
    }

    /// Text that may go out as content now (with tools, text from a tool call on is held).
    fn content_to_send(&mut self, text: &str) -> String {
        self.text.push_str(text);
        let Some(offered) = &self.tools else {
            self.sent = self.text.len();
            return text.to_string();
        };
        let rest = &self.text[self.sent..];
        // A reply that opens with `{` may be a bare call object: hold it all until the end.
        let opening = rest.trim_start();
        if self.sent == 0 && !offered.is_empty() && (opening.is_empty() || opening.starts_with('{')) {
            return String::new();
        }
        let upto = match rest.find(TOOL_OPEN) {
            Some(i) => i,
            None => {
                // Hold back what may be the start of a tool call.
                let mut hold = 0;
                for (k, _) in TOOL_OPEN.char_indices().skip(1) {
                    if rest.ends_with(&TOOL_OPEN[..k]) {
                        hold = k;
                    }
                }
                rest.len() - hold
            }
        };
        // Once a tool call has started, everything after it is held until the end.
        let out = rest[..upto].to_string();
        self.sent += upto;
        out
    }

    fn chunk(&mut self, c: Chunk) -> Vec<Value> {
        match self.kind {
            Kind::Chat => {
                let content = self.content_to_send(&c.text);
                let logprobs =
                    if self.logprobs { json!({"content": self.chat_logprobs(&c.tokens)}) } else { Value::Null };
                if content.is_empty() && (!self.logprobs || c.tokens.is_empty()) {
                    return Vec::new();
                }
                vec![self.envelope(json!([{
                    "index": 0, "delta": {"content": content}, "logprobs": logprobs, "finish_reason": null
                }]))]
            }
            Kind::Completion => {
                if c.text.is_empty() && (!self.logprobs || c.tokens.is_empty()) {
                    return Vec::new();
                }
                self.text.push_str(&c.text);
                let logprobs = if self.logprobs { self.completion_logprobs(&c.tokens) } else { Value::Null };
                vec![self.envelope(json!([{
                    "index": 0, "text": c.text, "logprobs": logprobs, "finish_reason": null
                }]))]
            }
        }
    }

    fn done(&mut self, d: &Done) -> Vec<Value> {
        let mut out = Vec::new();
        match self.kind {
            Kind::Chat => {
                let mut calls = Vec::new();
                if let Some(offered) = &self.tools {
                    let (content, c) = parse_tool_calls_offered(&self.text, offered);
                    calls = c;
                    let held = if calls.is_empty() {
                        self.text[self.sent..].to_string()
                    } else {
                        // What the parser kept as content that was not sent yet.
                        let sent = &self.text[..self.sent];
                        content.strip_prefix(sent.trim_start()).map_or(String::new(), |s| s.to_string())
                    };
                    let mut delta = serde_json::Map::new();
                    if !held.trim().is_empty() || (calls.is_empty() && !held.is_empty()) {
                        delta.insert("content".into(), json!(held));
                    }
                    if !calls.is_empty() {
                        delta.insert("tool_calls".into(), json!(Self::tool_calls_json(&calls, true)));
                    }
                    if !delta.is_empty() {
                        out.push(self.envelope(json!([{
                            "index": 0, "delta": delta, "logprobs": null, "finish_reason": null
                        }])));
                    }
                }
                out.push(self.envelope(json!([{
                    "index": 0, "delta": {}, "logprobs": null, "finish_reason": Self::finish_reason(d, !calls.is_empty())
                }])));
            }
            Kind::Completion => {
                out.push(self.envelope(json!([{
                    "index": 0, "text": "", "logprobs": null, "finish_reason": Self::finish_reason(d, false)
                }])));
            }
        }
        if self.include_usage {
            let mut u = self.envelope(json!([]));
            u["usage"] = Self::usage(d);
            out.push(u);
        }
        out
    }

    /// The whole response of a non-streamed request.
    fn response(&self, text: &str, tokens: &[TokenInfo], d: &Done) -> Value {
        let usage = Self::usage(d);
        match self.kind {
            Kind::Chat => {
                let (content, calls) = match &self.tools {
                    Some(offered) => parse_tool_calls_offered(text, offered),
                    None => (text.to_string(), Vec::new()),
                };
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    if content.is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = json!(Self::tool_calls_json(&calls, false));
                }
                let logprobs = if self.logprobs { json!({"content": self.chat_logprobs(tokens)}) } else { Value::Null };
                json!({
                    "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "system_fingerprint": concat!("sluice-", env!("CARGO_PKG_VERSION")),
                    "choices": [{
                        "index": 0, "message": message, "logprobs": logprobs,
                        "finish_reason": Self::finish_reason(d, !calls.is_empty()),
                    }],
                    "usage": usage,
                })
            }
            Kind::Completion => {
                let mut me = Formatter {
                    offset: 0,
                    text: String::new(),
                    engine: self.engine.clone(),
                    id: self.id.clone(),
                    model: self.model.clone(),
                    tools: None,
                    ..*self
                };
                let logprobs = if self.logprobs { me.completion_logprobs(tokens) } else { Value::Null };
                json!({
                    "id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "system_fingerprint": concat!("sluice-", env!("CARGO_PKG_VERSION")),
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": Self::finish_reason(d, false)}],
                    "usage": usage,
                })
            }
        }
    }
}

async fn collect(
    app: Arc<App>,
    fmt: Formatter,
    mut rx: UnboundedReceiver<Event>,
    arrived: Instant,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let r = loop {
        match rx.recv().await {
            Some(Event::Chunk(c)) => {
                text.push_str(&c.text);
                tokens.extend(c.tokens);
            }
            Some(Event::Done(d)) => break Ok(Json(fmt.response(&text, &tokens, &d)).into_response()),
            Some(Event::Error(e)) => break Err(e),
            None => break Err(ApiError::internal("the request was dropped by the scheduler")),
        }
    };
    app.metrics.request_seconds.with_label_values(&[fmt.kind.endpoint()]).observe(arrived.elapsed().as_secs_f64());
    r
}

struct StreamState {
    app: Arc<App>,
    fmt: Formatter,
    rx: UnboundedReceiver<Event>,
    pending: VecDeque<SseEvent>,
    done: bool,
    arrived: Instant,
}

fn sse_json(v: &Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

fn stream_response(app: Arc<App>, fmt: Formatter, rx: UnboundedReceiver<Event>, arrived: Instant) -> Response {
    let pending: VecDeque<SseEvent> = fmt.start().iter().map(sse_json).collect();
    let st = StreamState { app, fmt, rx, pending, done: false, arrived };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok::<_, Infallible>(e), st));
            }
            if st.done {
                return None;
            }
            let (events, finished) = match st.rx.recv().await {
                Some(Event::Chunk(c)) => (st.fmt.chunk(c), false),
                Some(Event::Done(d)) => (st.fmt.done(&d), true),
                Some(Event::Error(e)) => (vec![e.body()], true),
                None => (vec![ApiError::internal("the request was dropped by the scheduler").body()], true),
            };
            st.pending.extend(events.iter().map(sse_json));
            if finished {
                st.pending.push_back(SseEvent::default().data("[DONE]"));
                st.done = true;
                st.app
                    .metrics
                    .request_seconds
                    .with_label_values(&[st.fmt.kind.endpoint()])
                    .observe(st.arrived.elapsed().as_secs_f64());
            }
        }
    });
    Sse::new(stream).keep_alive(KeepAlive::new().interval(Duration::from_secs(2))).into_response()
}

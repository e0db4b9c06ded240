//! `sluice serve`: an OpenAI-compatible HTTP server with continuous batching.
//!
//! The server binds first and loads the model in the background (`GET /health` answers 503
//! until it is ready). HTTP handlers (axum on tokio) validate each request, render and
//! tokenize its prompt, and hand it to the scheduler thread (`scheduler`), which owns the
//! model and runs every active sequence in one batched forward pass per step. Events come
//! back over a channel per request and go out as JSON or Server-Sent Events.

pub mod api;
pub mod error;
mod http;
pub mod metrics;
pub mod prefix;
pub mod scheduler;
mod spec;
pub mod text;

pub use error::{ApiError, ErrorKind};

use metrics::Metrics;
use scheduler::{Cmd, SchedulerConfig, Shared};
pub use sluice_runtime::spec::SpecMethod;
use sluice_runtime::Engine;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct ServerOptions {
    pub host: String,
    pub port: u16,
    /// Most sequences generating at once.
    pub parallel: usize,
    /// Positions per sequence (0: the model's own maximum, at most 8192).
    pub ctx_size: usize,
    /// Required as `Authorization: Bearer KEY` on /v1/* when set.
    pub api_key: Option<String>,
    /// Most requests waiting beyond the free slots (more get 429, or 503 when waiting for memory).
    pub max_queue: usize,
    /// Most prompt tokens run in one step (running streams keep flowing during a long prefill).
    pub prefill_chunk: usize,
    /// Largest request body in bytes.
    pub max_body_bytes: usize,
    /// Memory for sequence state (KV and recurrent) of running requests and the prefix cache
    /// (None: available memory after loading, less headroom).
    pub state_memory: Option<u64>,
    /// Most bytes of finished sequences' states kept for prefix reuse (0: none).
    pub prefix_cache_bytes: u64,
    /// The model's name in the API (`/v1/models`, responses).
    pub model_id: String,
    /// How long running requests may finish after SIGINT/SIGTERM.
    pub shutdown_grace: Duration,
    /// Speculate this way unless a request says otherwise (None: only requests that ask,
    /// `"spec": "ngram"` or `"draft"`).
    pub spec: Option<SpecMethod>,
    /// The most tokens drafted a step, unless a request says (`"draft_max"`).
    pub draft_max: usize,
    /// The draft model stops drafting when its token's probability is below this.
    pub draft_p_min: f32,
}

/// The most tokens drafted a step for a request that asks to speculate and does not say.
pub const DEFAULT_DRAFT_MAX: usize = 16;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 4,
            ctx_size: 0,
            api_key: None,
            max_queue: 64,
            prefill_chunk: 128,
            max_body_bytes: 16 << 20,
            state_memory: None,
            prefix_cache_bytes: 1 << 30,
            model_id: "model".into(),
            shutdown_grace: Duration::from_secs(30),
            spec: None,
            draft_max: DEFAULT_DRAFT_MAX,
            draft_p_min: 0.5,
        }
    }
}

/// Loads the model (runs on a thread of its own while the server answers).
pub type Loader = Box<dyn FnOnce() -> Result<Loaded, String> + Send>;

/// What a `Loader` loads: the model served and, for speculation, a draft model.
pub struct Loaded {
    pub target: Engine,
    /// A smaller model of the same vocabulary that drafts for requests asking `"spec": "draft"`.
    pub draft: Option<Engine>,
}

impl From<Engine> for Loaded {
    fn from(target: Engine) -> Loaded {
        Loaded { target, draft: None }
    }
}

/// The loaded model and its scheduler.
pub(crate) struct Ready {
    pub engine: Arc<Engine>,
    pub draft: Option<Arc<Engine>>,
    pub tx: std::sync::mpsc::Sender<Cmd>,
    pub ctx_size: usize,
    pub state_budget: u64,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

pub(crate) enum Status {
    Loading,
    Ready(Arc<Ready>),
    Failed(String),
}

pub(crate) struct App {
    pub opts: ServerOptions,
    pub status: RwLock<Status>,
    pub shutting_down: AtomicBool,
    pub shared: Arc<Shared>,
    pub metrics: Arc<Metrics>,
    pub started: Instant,
    pub created: u64,
    stop: tokio::sync::Notify,
}

impl App {
    pub fn ready(&self) -> Result<Arc<Ready>, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
        match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Ready(r) => Ok(r.clone()),
            Status::Loading => Err(ApiError::unavailable("the model is loading", 5)),
            Status::Failed(e) => Err(ApiError::internal(format!("the model failed to load: {e}"))),
        }
    }

    fn set_status(&self, s: Status) {
        *self.status.write().unwrap_or_else(|e| e.into_inner()) = s;
    }

    fn loaded(&self, loaded: Loaded) {
        if let Some(d) = &loaded.draft {
            if let Err(e) = sluice_runtime::spec::draft::check_vocab(&loaded.target, d) {
                return self.failed(e.to_string());
            }
        }
        if let Some(m) = self.opts.spec {
            if let Some(why) = spec::unavailable(m, &loaded.target, loaded.draft.as_ref()) {
                return self.failed(format!("--spec {}: {why}", m.as_str()));
            }
        }
        let engine = Arc::new(loaded.target);
        let draft = loaded.draft.map(Arc::new);
        let cfg = &engine.model.cfg;
        let max = cfg.max_position.max(1);
        let ctx_size = match self.opts.ctx_size {
            0 => max.min(8192),
            n if n > max => {
                eprintln!("sluice: --ctx-size {n} is more than the model's {max} positions; using {max}");
                max
            }
            n => n,
        };
        let state_budget = self.opts.state_memory.unwrap_or_else(|| {
            let avail = sluice_runtime::placement::mem_available().unwrap_or(4 << 30);
            avail.saturating_sub((1 << 30) + avail / 20)
        });
        let scfg = SchedulerConfig {
            parallel: self.opts.parallel.max(1),
            prefill_chunk: self.opts.prefill_chunk.max(1),
            ctx_size,
            state_budget,
            prefix_cache_bytes: self.opts.prefix_cache_bytes,
            prefix_cache_entries: if self.opts.prefix_cache_bytes == 0 { 0 } else { 4 * self.opts.parallel.max(4) },
            shutdown_grace: self.opts.shutdown_grace,
            draft_p_min: self.opts.draft_p_min,
        };
        match scheduler::spawn(engine.clone(), draft.clone(), scfg, self.shared.clone(), self.metrics.clone()) {
            Ok((tx, thread)) => {
                eprintln!(
                    "sluice: serving {} ({} positions per sequence, {} in parallel, {:.2} GiB for sequence state)",
                    self.opts.model_id,
                    ctx_size,
                    self.opts.parallel.max(1),
                    state_budget as f64 / (1u64 << 30) as f64
                );
                if let Some(d) = &draft {
                    eprintln!("sluice: drafting with {} for requests that ask (\"spec\": \"draft\")", d.path.display());
                }
                self.set_status(Status::Ready(Arc::new(Ready {
                    engine,
                    draft,
                    tx,
                    ctx_size,
                    state_budget,
                    thread: Mutex::new(Some(thread)),
                })));
                if self.shutting_down.load(Ordering::SeqCst) {
                    self.stop_scheduler();
                }
            }
            Err(e) => self.failed(format!("starting the scheduler: {e}")),
        }
    }

    fn failed(&self, e: String) {
        eprintln!("sluice: loading the model failed: {e}");
        self.set_status(Status::Failed(e));
        self.stop.notify_one();
    }

    fn stop_scheduler(&self) {
        if let Status::Ready(r) = &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            let _ = r.tx.send(Cmd::Shutdown);
        }
    }

    /// Waits for the scheduler thread to finish its last requests.
    fn join_scheduler(&self) {
        let r = match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Ready(r) => r.clone(),
            _ => return,
        };
        let h = r.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    fn load_error(&self) -> Option<String> {
        match &*self.status.read().unwrap_or_else(|e| e.into_inner()) {
            Status::Failed(e) => Some(e.clone()),
            _ => None,
        }
    }
}

async fn run(
    listener: tokio::net::TcpListener,
    opts: ServerOptions,
    loader: Loader,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let app = Arc::new(App {
        opts,
        status: RwLock::new(Status::Loading),
        shutting_down: AtomicBool::new(false),
        shared: Arc::new(Shared::default()),
        metrics: Arc::new(Metrics::new()),
        started: Instant::now(),
        created: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        stop: tokio::sync::Notify::new(),
    });
    let (load_tx, load_rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("sluice-load".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(loader))
                .unwrap_or_else(|_| Err("the loader panicked".into()));
            let _ = load_tx.send(r);
        })
        .map_err(|e| format!("starting the loader: {e}"))?;
    let a = app.clone();
    tokio::spawn(async move {
        match load_rx.await {
            Ok(Ok(loaded)) => a.loaded(loaded),
            Ok(Err(e)) => a.failed(e),
            Err(_) => a.failed("the loader went away".into()),
        }
    });
    let a = app.clone();
    let signal = async move {
        tokio::select! {
            _ = shutdown => eprintln!("sluice: shutting down: no new requests; finishing those running"),
            _ = a.stop.notified() => {}
        }
        a.shutting_down.store(true, Ordering::SeqCst);
        a.stop_scheduler();
    };
    let router = http::router(app.clone());
    axum::serve(listener, router.into_make_service())
        .with_graceful_shutdown(signal)
        .await
        .map_err(|e| format!("serving: {e}"))?;
    let a = app.clone();
    tokio::task::spawn_blocking(move || a.join_scheduler()).await.map_err(|e| e.to_string())?;
    match app.load_error() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-http")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))
}

fn bind(opts: &ServerOptions) -> Result<std::net::TcpListener, String> {
    let l = std::net::TcpListener::bind((opts.host.as_str(), opts.port))
        .map_err(|e| format!("binding {}:{}: {e}", opts.host, opts.port))?;
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    Ok(l)
}

/// Serves until SIGINT or SIGTERM (then stops accepting, lets running requests finish within
/// the grace period, and returns). Fails when binding or loading the model fails.
pub fn serve(opts: ServerOptions, loader: Loader) -> Result<(), String> {
    let l = bind(&opts)?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    eprintln!("sluice: listening on http://{addr} (loading the model)");
    let rt = runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(l).map_err(|e| e.to_string())?;
        run(listener, opts, loader, shutdown_signal()).await
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// A server running on threads of its own (tests, embedding).
pub struct ServerHandle {
    pub addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<(), String>>>,
}

impl ServerHandle {
    /// Shuts down as SIGTERM would, and waits.
    pub fn shutdown(mut self) -> Result<(), String> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), String> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| "the server thread panicked".to_string())?,
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// Binds (port 0: any free port), then serves on a thread of its own.
pub fn spawn(opts: ServerOptions, loader: Loader) -> Result<ServerHandle, String> {
    let l = bind(&opts)?;
    let addr = l.local_addr().map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("sluice-server".into())
        .spawn(move || {
            let rt = runtime()?;
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(l).map_err(|e| e.to_string())?;
                run(listener, opts, loader, async move {
                    let _ = rx.await;
                })
                .await
            })
        })
        .map_err(|e| e.to_string())?;
    Ok(ServerHandle { addr, stop: Some(tx), thread: Some(thread) })
}

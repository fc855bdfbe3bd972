//! The local server: OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/models`) and Anthropic (`/v1/messages`, `/v1/messages/count_tokens`)
//! APIs, a chat page at `/`, `/health` and `/metrics` (Prometheus), over
//! one engine running on its own thread; an access log line per request.
//!
//! The only crate that knows HTTP and wire JSON. One model, one sequence at
//! a time, a bounded FIFO queue; the kept model state is the conversation
//! prefix, so an agent's next turn prefills only its new tokens. A client
//! that disconnects cancels its generation (between prefill chunks or
//! tokens).

pub mod access;
pub mod anthropic;
pub mod anthropic_request;
pub mod conn;
pub mod constrain;
pub mod error;
pub mod fields;
pub mod gen;
pub mod metrics;
pub mod openai;
pub mod origin;
pub mod parse;
pub mod prompt;
pub mod request_log;
pub mod responses;
pub mod sampling;
pub mod script;
pub mod worker;

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use slipstream_engine::{BackendChoice, Engine, EngineConfig, SlipModel, StateCache, TextCodec};

use crate::error::{ApiError, Flavor};
use crate::worker::{Backend, Info, Worker};

/// Settings of a server.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// Required in `Authorization: Bearer` or `x-api-key` when set.
    pub api_key: Option<String>,
    /// Requests that may wait while one runs.
    pub queue: usize,
    /// Most tokens of prompt plus reply; the model's own limit when `None`.
    pub max_context: Option<usize>,
    /// Largest request body accepted; `None`: what a prompt of the context
    /// could take ([`slipstream_engine::text_bytes_bound`]: 24 bytes a
    /// token, at least 1 MiB).
    pub max_body_bytes: Option<usize>,
    /// The id `/v1/models` lists and requests name.
    pub model_id: String,
    /// Accept any model name in requests (for clients with fixed names).
    pub any_model: bool,
    /// Keep-alive interval of streams while nothing else is sent.
    pub ping_interval: Duration,
    /// Jinja source of a chat template that replaces the model's own
    /// (`--chat-template FILE`).
    pub chat_template: Option<String>,
    /// Template variables every request starts from
    /// (`--chat-template-kwargs`, e.g. `enable_thinking`,
    /// `preserve_thinking`); a request's own settings win.
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Web origins (e.g. `http://localhost:3000`, or `*`) whose pages may
    /// call the API besides the server's own chat page.
    pub allowed_origins: Vec<String>,
    /// Append every API request to this file as JSON lines (see
    /// [`request_log`]).
    pub log_requests: Option<PathBuf>,
    /// Log each rendered prompt at `info` on the target `slipstream::prompt`.
    pub log_prompts: bool,
    /// Sampling settings from flags (`serve --temperature` ...): over the
    /// checkpoint's, under a request's own (see [`sampling`]).
    pub sampling: slipstream_engine::GenerationDefaults,
    /// Read deadlines and the connection limit (see [`conn`]).
    pub conn_limits: conn::ConnLimits,
    /// Speculative decoding for every generation (off by default): the
    /// replies are the same, drafted tokens verified in one pass.
    pub speculation: slipstream_engine::Speculation,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8091,
            api_key: None,
            queue: 8,
            max_context: None,
            max_body_bytes: None,
            model_id: "slipstream".into(),
            any_model: false,
            ping_interval: Duration::from_secs(2),
            chat_template: None,
            chat_template_kwargs: serde_json::Map::new(),
            allowed_origins: Vec::new(),
            log_requests: None,
            log_prompts: false,
            sampling: Default::default(),
            conn_limits: conn::ConnLimits::default(),
            speculation: slipstream_engine::Speculation::default(),
        }
    }
}

/// What generates tokens.
#[derive(Debug, Clone)]
pub enum BackendSpec {
    /// A `.slip` model; with `prompt_cache` (directory, most bytes) the
    /// conversation prefix survives restarts: snapshots are taken at prefill
    /// chunk boundaries and a prompt restores its longest cached prefix.
    Model {
        path: PathBuf,
        /// The model at `path` when the caller already opened it (for
        /// memory planning), so it is not opened and hashed again.
        opened: Option<OpenedModel>,
        /// How the engine opens, where it runs included.
        engine: EngineConfig,
        prompt_cache: Option<(PathBuf, u64)>,
        /// The RAM tier of conversation states above the prompt cache.
        state_cache: StateCacheSpec,
    },
    /// TEST FACILITY: the model at `path` is opened for its tokenizer and
    /// template only; each request emits the script's reply to its prompt,
    /// verbatim, instead of sampling. See [`script::Script`].
    Script {
        path: PathBuf,
        engine: EngineConfig,
        script: script::Script<String>,
    },
}

/// A model opened (and so verified) by the caller, handed to the server.
#[derive(Clone)]
pub struct OpenedModel(pub Arc<SlipModel>);

impl std::fmt::Debug for OpenedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "OpenedModel({})", self.0.dir.display())
    }
}

/// Sizing of the RAM state cache (`slipstream_engine::StateCache`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCacheSpec {
    /// Most bytes held; `None`: a quarter of `memory`, at most 8 GiB.
    /// `Some(0)` keeps one conversation only (the most valuable: its tokens
    /// over its age in requests).
    pub max_bytes: Option<u64>,
    /// The memory the process may use, as the caller detected it
    /// (`slipstream_engine::MachineMemory::usable`); `None`: unknown, the
    /// default cache then holds 1 GiB.
    pub memory: Option<u64>,
    /// Tokens between checkpoints inside a prefill; `None`: the model's
    /// default (`Engine::default_checkpoint_interval`).
    pub checkpoint_interval: Option<usize>,
}

impl StateCacheSpec {
    /// The cache this spec describes for `engine`.
    fn build(&self, engine: &Engine) -> StateCache {
        const DEFAULT_CAP: u64 = 8 << 30;
        let max_bytes = self.max_bytes.unwrap_or_else(|| {
            self.memory
                .map(|a| (a / 4).min(DEFAULT_CAP))
                .unwrap_or(1 << 30)
        });
        let interval = self
            .checkpoint_interval
            .unwrap_or_else(|| engine.default_checkpoint_interval());
        StateCache::new(usize::try_from(max_bytes).unwrap_or(usize::MAX), interval)
    }
}

/// Shared state of the handlers.
pub struct App {
    pub config: ServerConfig,
    pub worker: Worker,
    pub codec: Arc<TextCodec>,
    pub info: Info,
    pub max_context: usize,
    /// Largest request body accepted (see [`ServerConfig::max_body_bytes`]).
    pub max_body_bytes: usize,
    pub started: std::time::Instant,
    /// Where API requests are recorded (`--log-requests`).
    pub request_log: Option<Arc<request_log::RequestLog>>,
    pub metrics: metrics::Metrics,
    /// The tokenizer as constrained decoding sees it, built on first use.
    pub constraints: std::sync::OnceLock<Result<Arc<constrain::Constraints>, String>>,
}

impl App {
    /// Whether `headers` carry the API key (always true when none is set).
    pub fn key_accepted(&self, headers: &HeaderMap) -> bool {
        match self.config.api_key.as_deref().filter(|k| !k.is_empty()) {
            None => true,
            Some(key) => presented_key(headers)
                .is_some_and(|k| constant_time_eq(k.as_bytes(), key.as_bytes())),
        }
    }

    /// Checks a request's model name.
    pub fn check_model(&self, model: &str, flavor: Flavor) -> Result<(), ApiError> {
        if self.config.any_model || model == self.config.model_id || model.is_empty() {
            return Ok(());
        }
        Err(ApiError::not_found(
            flavor,
            format!(
                "the model `{model}` does not exist; this server serves `{}`",
                self.config.model_id
            ),
        )
        .code("model_not_found"))
    }

    /// Renders `conv` with the server's template and default template
    /// variables; a template error is the client's (400).
    pub fn render(
        &self,
        conv: &prompt::Conversation,
        flavor: Flavor,
    ) -> Result<prompt::Rendered, ApiError> {
        let conv = conv
            .clone()
            .with_defaults(&self.config.chat_template_kwargs);
        prompt::render(&conv, self.info.template.as_deref())
            .map_err(|e| ApiError::bad_request(flavor, e))
    }
}

/// The context a server runs with: `requested` (`--max-context`), or the
/// model's `max_position` (max_position_embeddings) when `None`. More than
/// the model's positions is an error, never a silent cut.
pub fn context_limit(requested: Option<usize>, max_position: usize) -> anyhow::Result<usize> {
    match requested {
        None => Ok(max_position.max(1)),
        Some(0) => bail!("--max-context must be at least 1"),
        Some(n) if n > max_position => bail!(
            "--max-context {n} is more than this model supports: it was trained for {max_position} positions (max_position_embeddings); use --max-context {max_position} or less"
        ),
        Some(n) => Ok(n),
    }
}

/// Refuses a non-loopback bind without an API key, and an empty or blank
/// key (it would match nothing a client can send, or everything).
pub fn check_bind(host: &str, api_key: Option<&str>) -> anyhow::Result<()> {
    if api_key.is_some_and(|k| k.trim().is_empty()) {
        bail!("--api-key is empty or only whitespace; give a real key or leave the flag out");
    }
    let loopback = match host.parse::<IpAddr>() {
        Ok(ip) => ip.is_loopback(),
        Err(_) => host.eq_ignore_ascii_case("localhost"),
    };
    if !loopback && api_key.is_none_or(str::is_empty) {
        bail!(
            "refusing to listen on {host} without --api-key: anyone who can reach this address could use the model (bind 127.0.0.1, or set a key)"
        );
    }
    Ok(())
}

fn open_backend(
    spec: BackendSpec,
    speculation: slipstream_engine::Speculation,
) -> anyhow::Result<(Backend, Arc<TextCodec>, Info)> {
    let (path, opened, engine_config, script, prompt_cache, state_cache) = match spec {
        BackendSpec::Model {
            path,
            opened,
            engine,
            prompt_cache,
            state_cache,
        } => (path, opened, engine, None, prompt_cache, state_cache),
        // A script's replies need the tokenizer and template only.
        BackendSpec::Script {
            path,
            engine,
            script,
        } => (
            path,
            None,
            EngineConfig {
                backend: BackendChoice::Cpu,
                ..engine
            },
            Some(script),
            None,
            StateCacheSpec::default(),
        ),
    };
    let mut engine = match opened {
        Some(OpenedModel(file)) => Engine::from_model(file, engine_config),
        None => Engine::open(&path, engine_config),
    }
    .with_context(|| format!("opening model {}", path.display()))?;
    // The CPU needs no set-up; another backend is named beside the store.
    let backend_note = engine.backend_note().map(str::to_string);
    engine.set_speculation(speculation)?;
    let speculation_note = engine.speculation_note();
    let codec = Arc::new(
        engine
            .codec
            .take()
            .context("this model has no tokenizer; the server needs one")?,
    );
    let info = Info {
        eos: engine.eos_tokens().to_vec(),
        max_position: engine.model_config().max_position_embeddings,
        template: engine.template.take().map(Arc::new),
        template_source: engine.file.manifest.chat_template.clone(),
        store: [
            Some(engine.store_description()),
            backend_note,
            speculation_note,
        ]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(", "),
        vocab_size: engine.model_config().vocab_size,
        generation: engine.generation_defaults(),
    };
    let cache = match prompt_cache {
        Some((dir, max_bytes)) => {
            let cache = Arc::new(
                engine
                    .open_prompt_cache(&dir, max_bytes)
                    .with_context(|| format!("opening prompt cache {}", dir.display()))?,
            );
            let hook_cache = cache.clone();
            engine.set_prefill_hook(Some(Box::new(move |cp| {
                if let Err(e) = hook_cache.insert(cp.state, cp.resident) {
                    tracing::warn!("prompt cache insert failed: {e}");
                }
            })));
            Some(cache)
        }
        None => None,
    };
    let backend = match script {
        None => {
            let states = state_cache.build(&engine);
            tracing::info!(
                "state cache: {} MB, a checkpoint every {} prompt tokens",
                states.stats().max_bytes >> 20,
                states.interval()
            );
            Backend::Engine(Box::new(engine), cache, Box::new(states))
        }
        Some(script) => Backend::Script {
            script: script.try_map(|text| codec.encode(text))?,
            codec: codec.clone(),
            eos: info.eos.first().copied(),
        },
    };
    Ok((backend, codec, info))
}

/// A server listening on its own runtime.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub app: Arc<App>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl RunningServer {
    /// Blocks until the server stops (Ctrl-C or an error).
    pub fn wait(mut self) -> anyhow::Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("server thread panicked"))?,
            None => Ok(()),
        }
    }

    /// Stops listening.
    pub fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// Opens the model, binds and starts serving on a background runtime.
pub fn start(config: ServerConfig, backend: BackendSpec) -> anyhow::Result<RunningServer> {
    check_bind(&config.host, config.api_key.as_deref())?;
    let speculation = config.speculation.clone();
    let (worker, codec, info) =
        Worker::start(config.queue, move || open_backend(backend, speculation))?;
    launch(config, worker, codec, info)
}

/// Opens the model on this thread, serves HTTP from a background runtime,
/// and runs the engine on this thread until the server stops (Ctrl-C);
/// `announce` sees the server once it listens. For `slipstream serve`: on
/// the main thread the engine's prefill buffers stay in glibc's main heap,
/// which keeps buffers of any size for reuse (see `slipstream_engine::heap`;
/// measured ~4 % faster prefill at 3k tokens than on a spawned thread).
pub fn serve_here(
    config: ServerConfig,
    backend: BackendSpec,
    announce: impl FnOnce(&RunningServer),
) -> anyhow::Result<()> {
    check_bind(&config.host, config.api_key.as_deref())?;
    let speculation = config.speculation.clone();
    let (worker, codec, info, engine) =
        Worker::here(config.queue, move || open_backend(backend, speculation))?;
    let mut server = launch(config, worker, codec, info)?;
    announce(&server);
    // Keep the shutdown sender (dropping it stops the server) but not the
    // app: once the HTTP runtime stops and drops its handles, the worker's
    // last one goes and the engine loop ends.
    let shutdown = server.shutdown.take();
    let thread = server.thread.take();
    drop(server);
    engine.run();
    drop(shutdown);
    match thread {
        Some(t) => t
            .join()
            .map_err(|_| anyhow::anyhow!("server thread panicked"))?,
        None => Ok(()),
    }
}

/// Binds and starts serving `worker` on a background runtime.
fn launch(
    config: ServerConfig,
    worker: Worker,
    codec: Arc<TextCodec>,
    mut info: Info,
) -> anyhow::Result<RunningServer> {
    let max_context = context_limit(config.max_context, info.max_position)?;
    if let Some(src) = &config.chat_template {
        let template = slipstream_engine::ChatTemplate::new(src).context("--chat-template")?;
        info.template = Some(Arc::new(template));
    }
    let request_log = match &config.log_requests {
        Some(path) => Some(Arc::new(request_log::RequestLog::open(path)?)),
        None => None,
    };
    let app = Arc::new(App {
        config: config.clone(),
        worker,
        codec,
        info,
        max_context,
        max_body_bytes: config
            .max_body_bytes
            .unwrap_or_else(|| slipstream_engine::text_bytes_bound(max_context)),
        started: std::time::Instant::now(),
        request_log,
        metrics: metrics::Metrics::default(),
        constraints: Default::default(),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let host = if config.host.eq_ignore_ascii_case("localhost") {
        "127.0.0.1".to_string()
    } else {
        config.host.clone()
    };
    let ip: IpAddr = host
        .parse()
        .with_context(|| format!("--host {host:?} is not an IP address"))?;
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(SocketAddr::new(
            ip,
            config.port,
        )))
        .with_context(|| format!("binding {host}:{}", config.port))?;
    let addr = listener.local_addr()?;
    let router = router(app.clone());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let limits = config.conn_limits;
    let thread = std::thread::Builder::new()
        .name("slipstream-http".into())
        .spawn(move || {
            rt.block_on(async move {
                conn::serve(listener, router, limits, async move {
                    tokio::select! {
                        _ = rx => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                })
                .await;
                Ok::<(), anyhow::Error>(())
            })
        })?;
    Ok(RunningServer {
        addr,
        app,
        shutdown: Some(tx),
        thread: Some(thread),
    })
}

/// All routes.
pub fn router(app: Arc<App>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::create))
        .route(
            "/v1/responses/{id}",
            get(responses::stored).delete(responses::stored),
        )
        .route("/v1/models", get(openai::models))
        .route("/v1/models/{id}", get(openai::model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/metrics", get(metrics::metrics))
        .layer(middleware::from_fn_with_state(app.clone(), auth));
    Router::new()
        .route("/", get(page))
        .route("/health", get(health))
        .merge(api)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            app.clone(),
            origin::cross_site_guard,
        ))
        // Around the fallback too: a client calling a route this server
        // lacks shows in the log.
        .layer(middleware::from_fn_with_state(
            app.clone(),
            request_log::record,
        ))
        // Outermost: every request gets its access line.
        .layer(middleware::from_fn_with_state(
            app.clone(),
            access::log_requests,
        ))
        .layer(DefaultBodyLimit::max(app.max_body_bytes))
        .with_state(app)
}

/// The API's error shape by path.
pub fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

async fn auth(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if let Some(key) = app.config.api_key.as_deref().filter(|k| !k.is_empty()) {
        let flavor = flavor_of(req.uri().path());
        let given = presented_key(req.headers());
        match given {
            None => {
                return ApiError::unauthorized(
                    flavor,
                    "missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                )
                .into_response()
            }
            Some(k) if !constant_time_eq(k.as_bytes(), key.as_bytes()) => {
                return ApiError::unauthorized(flavor, "invalid API key").into_response()
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

fn presented_key(h: &HeaderMap) -> Option<String> {
    if let Some(v) = h.get("x-api-key").and_then(|v| v.to_str().ok()) {
        return Some(v.trim().to_string());
    }
    let v = h.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = v.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim().to_string())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::not_found(flavor_of(&path), format!("no route {path}")).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::new(
        flavor_of(&path),
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {} not allowed on {path}", req.method()),
    )
    .into_response()
}

/// Liveness for anyone; with an API key set, the details (model, store,
/// queue, the last request's figures) only for requests that carry it.
async fn health(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if !app.key_accepted(&headers) {
        return Json(serde_json::json!({"status": "ok"})).into_response();
    }
    let st = &app.worker.state;
    let last = st
        .last_stats
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    Json(serde_json::json!({
        "status": "ok",
        "model": app.config.model_id,
        "max_context": app.max_context,
        "store": app.info.store,
        "busy": st.busy.load(Ordering::SeqCst),
        "queue": {"pending": st.pending.load(Ordering::SeqCst), "capacity": app.worker.capacity},
        "served": st.served.load(Ordering::SeqCst),
        "uptime_s": app.started.elapsed().as_secs_f64(),
        "last": last,
    }))
    .into_response()
}

const PAGE: &str = include_str!("../static/chat.html");

async fn page(State(app): State<Arc<App>>) -> Response {
    let html = PAGE
        .replace(
            "{{MODEL_JSON}}",
            &serde_json::to_string(&app.config.model_id)
                .unwrap_or_default()
                .replace('<', "\\u003c"),
        )
        .replace("{{MODEL}}", &html_escape(&app.config.model_id))
        .replace(
            "{{NEEDS_KEY}}",
            if app.config.api_key.is_some() {
                "true"
            } else {
                "false"
            },
        );
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'",
            ),
        ],
        Html(html),
    )
        .into_response()
}

fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::context_limit;

    #[test]
    fn max_context_above_the_model_is_an_error_naming_its_limit() {
        assert_eq!(context_limit(None, 4096).unwrap(), 4096);
        assert_eq!(context_limit(Some(1000), 4096).unwrap(), 1000);
        assert_eq!(context_limit(Some(4096), 4096).unwrap(), 4096);
        let e = context_limit(Some(8192), 4096).unwrap_err().to_string();
        assert!(e.contains("8192") && e.contains("4096 positions"), "{e}");
        assert!(context_limit(Some(0), 4096).is_err());
    }
}

//! `slipstream serve`: the local OpenAI/Anthropic server and chat page.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use slipstream_server::{BackendSpec, ServerConfig};

use crate::speculate_args::SpeculateArgs;
use crate::store_args::StoreArgs;
use slipstream_engine::parse_size;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// A .slip model directory, or a GGUF file run in place (no repack; a
    /// checksum table is built on first use); the embedded demo model when
    /// omitted.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Address to listen on. Anything but loopback requires --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the chosen address is printed).
    #[arg(long, default_value_t = 8091)]
    pub port: u16,
    /// Most tokens of prompt plus reply (default: the model's limit).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Require this key in `Authorization: Bearer` or `x-api-key`.
    /// Also read from SLIPSTREAM_API_KEY.
    #[arg(long, env = "SLIPSTREAM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Requests that may wait while one runs; more get 429 (OpenAI) or 529
    /// (Anthropic).
    #[arg(long, default_value_t = 8)]
    pub queue: usize,
    /// Largest request body, e.g. 8M (default: 24 bytes per token of the
    /// context, at least 1M; more text than that cannot fit the context).
    #[arg(long, value_parser = parse_size)]
    pub max_body: Option<u64>,
    /// Model id listed by /v1/models (default: the model directory's name).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Accept any model name in requests (clients with fixed model names,
    /// e.g. Claude Code).
    #[arg(long)]
    pub any_model: bool,
    /// Compute threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The expert store, memory and backend, as for `slipstream run`.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Speculative decoding, as for `slipstream run`.
    #[command(flatten)]
    pub speculation: SpeculateArgs,
    /// Persist conversation prefixes in this directory (snapshots at prefill
    /// chunk boundaries), so a restarted server prefills only new tokens.
    #[arg(long)]
    pub prompt_cache: Option<PathBuf>,
    /// Most bytes the prompt cache holds (least recently used evicted).
    #[arg(long, value_parser = parse_size, default_value = "8G")]
    pub prompt_cache_size: u64,
    /// A web origin whose pages may call the API (e.g.
    /// http://localhost:3000; `*` for any); repeat for several. Without
    /// it only the server's own chat page may.
    #[arg(long, value_name = "ORIGIN")]
    pub allow_origin: Vec<String>,
    /// Most memory the RAM cache of conversation states holds, e.g. 4G
    /// (0 keeps just one conversation). Agents' turns restore from it and prefill only
    /// their new tokens. Default: a quarter of the available memory, at
    /// most 8G.
    #[arg(long, value_parser = parse_size)]
    pub state_cache_ram: Option<u64>,
    /// Tokens between state checkpoints inside a prompt (default: the
    /// model's, where the checkpoints of a long prompt cost at most its KV).
    #[arg(long)]
    pub state_checkpoint_interval: Option<usize>,
    /// A chat template (Jinja, or a tokenizer_config.json holding one) to
    /// use instead of the model's own.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Template variables every request starts from, as a JSON object,
    /// e.g. '{"enable_thinking": false, "preserve_thinking": true}'; a
    /// request's own `chat_template_kwargs` and thinking settings win.
    #[arg(long, value_name = "JSON")]
    pub chat_template_kwargs: Option<String>,
    /// Append every API request to this file, one JSON line each (method,
    /// path, user agent, body): to see what a client sends. The file holds
    /// the conversations in full.
    #[arg(long, value_name = "FILE")]
    pub log_requests: Option<PathBuf>,
    /// Log each request's rendered prompt (the text the model reads) to
    /// stderr, at info on the target `slipstream::prompt`.
    #[arg(long)]
    pub log_prompts: bool,
    /// Default sampling settings, over the model's generation_config.json
    /// and under each request's own.
    #[command(flatten)]
    pub sampling: crate::sampling_args::SamplingArgs,
    /// Seconds a client has to send a request's headers (also how long an
    /// idle connection stays open between requests).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    pub header_timeout: f64,
    /// Seconds a client has to send a request's whole body, from the end of
    /// its headers.
    #[arg(long, default_value_t = 60.0, value_name = "SECONDS")]
    pub body_timeout: f64,
    /// Most connections open at once; more are answered 503 and closed.
    #[arg(long, default_value_t = 128)]
    pub max_connections: usize,
    /// TEST FACILITY, not for use: replies come verbatim from this JSON
    /// script instead of the model: a list of strings (given in turn) and
    /// rules `{"when": TEXT | [TEXT...], "reply": TEXT, "times": N}` that
    /// answer the prompts containing every `when` text. Lets tests drive
    /// tool calls and whole agent clients through the wire formats.
    #[arg(long, hide = true)]
    pub test_script: Option<PathBuf>,
}

/// Builds the server's settings from the arguments (no I/O but opening the
/// model at `model` for memory planning, the chat template file and the
/// test script); prints the `[memory]` plan line.
pub fn server_settings(args: &ServeArgs, model: PathBuf) -> Result<(ServerConfig, BackendSpec)> {
    let file = crate::store_args::open_model(&model)?;
    settings_for_model(args, file)
}

/// [`server_settings`] for a model already opened: the server takes it over.
pub fn settings_for_model(
    args: &ServeArgs,
    file: slipstream_format::SlipModel,
) -> Result<(ServerConfig, BackendSpec)> {
    let model = file.dir.clone();
    slipstream_server::check_bind(&args.host, args.api_key.as_deref())?;
    if args.queue == 0 {
        bail!("--queue must be at least 1");
    }
    let seconds = |flag: &str, s: f64| {
        if s.is_finite() && s > 0.0 && s <= 86400.0 {
            Ok(Duration::from_secs_f64(s))
        } else {
            Err(anyhow::anyhow!(
                "{flag} must be more than 0 and at most 86400 seconds, not {s}"
            ))
        }
    };
    let conn_limits = slipstream_server::conn::ConnLimits {
        header_timeout: seconds("--header-timeout", args.header_timeout)?,
        body_timeout: seconds("--body-timeout", args.body_timeout)?,
        max_connections: match args.max_connections {
            0 => bail!("--max-connections must be at least 1"),
            n => n,
        },
    };
    let plan = args.store.plan(&file, args.max_context.unwrap_or(32768))?;
    let engine = plan.engine;
    let model_id = args.model_name.clone().unwrap_or_else(|| {
        let stem = model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "slipstream".into());
        if args.model.is_none() {
            "slipstream-demo".into()
        } else {
            stem
        }
    });
    let chat_template = match &args.chat_template {
        Some(p) => Some(crate::read_chat_template(p)?),
        None => None,
    };
    let chat_template_kwargs = match &args.chat_template_kwargs {
        Some(s) => crate::parse_template_kwargs(s)?,
        None => Default::default(),
    };
    args.sampling
        .resolve_for_run(&Default::default(), 0)
        .map_err(|e| anyhow::anyhow!("sampling flags: {e}"))?;
    let config = ServerConfig {
        host: args.host.clone(),
        port: args.port,
        api_key: args.api_key.as_deref().map(|k| k.trim().to_string()),
        queue: args.queue,
        max_context: args.max_context,
        max_body_bytes: args
            .max_body
            .map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
        model_id,
        any_model: args.any_model,
        ping_interval: Duration::from_secs(2),
        chat_template,
        chat_template_kwargs,
        allowed_origins: args.allow_origin.clone(),
        log_requests: args.log_requests.clone(),
        log_prompts: args.log_prompts,
        sampling: args.sampling.overrides(),
        conn_limits,
        speculation: args.speculation.settings(),
    };
    let backend = match &args.test_script {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("reading test script {}", p.display()))?;
            let script = slipstream_server::script::Script::from_json(&text)
                .map_err(|e| anyhow::anyhow!("test script {}: {e}", p.display()))?;
            BackendSpec::Script {
                path: model,
                engine,
                script,
            }
        }
        None => BackendSpec::Model {
            path: model,
            opened: Some(slipstream_server::OpenedModel(std::sync::Arc::new(file))),
            engine,
            prompt_cache: args
                .prompt_cache
                .clone()
                .map(|dir| (dir, args.prompt_cache_size)),
            state_cache: slipstream_server::StateCacheSpec {
                max_bytes: args.state_cache_ram,
                memory: plan.machine.usable(),
                checkpoint_interval: args.state_checkpoint_interval.map(|n| n.max(1)),
            },
        },
    };
    Ok((config, backend))
}

/// Runs the server until Ctrl-C.
pub fn serve_command(args: ServeArgs) -> Result<()> {
    if let Some(n) = args.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build_global()
            .context("setting up compute threads")?;
    }
    // Refuse a bad bind before spending time on the model.
    slipstream_server::check_bind(&args.host, args.api_key.as_deref())?;
    let (config, backend) = match &args.model {
        Some(p) => server_settings(&args, p.clone())?,
        None => settings_for_model(
            &args,
            crate::demo::open_demo_model(&|_| {}).context("preparing the embedded demo model")?,
        )?,
    };
    // The engine runs on this (the main) thread: see `serve_here`.
    slipstream_server::serve_here(config, backend, announce)
}

/// Says where the server listens, for people and (the last line) scripts.
fn announce(server: &slipstream_server::RunningServer) {
    let app = &server.app;
    eprintln!(
        "slipstream serving {} on http://{} (context {} tokens, queue {}, {}{})",
        app.config.model_id,
        server.addr,
        app.max_context,
        app.config.queue,
        app.info.store,
        if app.config.api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );
    eprintln!("  chat page:  http://{}/", server.addr);
    eprintln!("  OpenAI:     OPENAI_BASE_URL=http://{}/v1", server.addr);
    eprintln!("  Anthropic:  ANTHROPIC_BASE_URL=http://{}", server.addr);
    // Machine-readable line for scripts and tests.
    println!("listening on {}", server.addr);
    use std::io::Write;
    let _ = std::io::stdout().flush();
}

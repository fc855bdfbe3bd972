//! `slipstream bench agent`: replays a recorded agent session against a
//! server and, optionally, a peer (llama.cpp's `llama-server` on the same
//! weights), one after the other, and reports per request the prompt
//! tokens, the tokens reused from the server's cache, the new (prefilled)
//! tokens and the time to first token, and the whole session's time.
//!
//! Every request is sent as the transcript recorded it, whatever the server
//! generated before (see [`transcript`]), over OpenAI chat completions or
//! Anthropic messages, streamed, greedy, with few generated tokens, so the
//! figures are those of prompt handling. A server
//! is either given by URL or started here (`slipstream serve` on a `.slip`
//! model, `llama-server` on a GGUF: see [`servers`]); a started server's
//! log goes to `OUT/logs/`, and before it starts the other runtime's model
//! files leave the page cache (the pages of one would take memory from the
//! other). Results (`results.csv`, `results.json`, `table.md`, the
//! `agent-*.svg/png` charts) are rewritten after every request, so an
//! interrupted run keeps what it measured.

pub mod client;
pub mod report;
pub mod servers;
pub mod transcript;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use report::{AgentReport, Meta, Row, Session};
use servers::{LlamaCaching, ServerProcess};
use transcript::{Api, Transcript};

/// A server to replay the session against.
#[derive(Clone, Debug)]
pub enum Target {
    /// Already running at this base URL (`http://host:port`).
    Url(String),
    /// `slipstream serve` on a `.slip` model, started here.
    Slipstream {
        runner: PathBuf,
        model: PathBuf,
        /// More `slipstream serve` arguments.
        extra: Vec<String>,
    },
    /// `llama-server` on a GGUF, started here.
    LlamaServer {
        bin: PathBuf,
        gguf: PathBuf,
        caching: LlamaCaching,
        /// More `llama-server` arguments.
        extra: Vec<String>,
    },
}

/// Everything a replay needs.
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// The transcript file; `None`: the bundled session.
    pub transcript: Option<PathBuf>,
    /// (name, target) in order: the first is the one the time-to-first-token
    /// bound is checked on, the second the one it is compared with.
    pub targets: Vec<(String, Target)>,
    /// The wire API every request goes through.
    pub api: Api,
    /// The model name to send (default: the first id of `/v1/models`).
    pub model_name: Option<String>,
    /// Most tokens generated per request.
    pub max_tokens: usize,
    /// Compute threads of the servers started here.
    pub threads: usize,
    /// Context size of the servers started here.
    pub ctx_size: usize,
    pub request_timeout: Duration,
    pub startup_timeout: Duration,
    /// Send a one-token request before the session (not counted).
    pub warmup: bool,
    /// Prefill tokens per second for the bound (default: measured).
    pub prefill_rate: Option<f64>,
    pub out_dir: PathBuf,
    pub commit: Option<String>,
    /// Print a line per request on stderr.
    pub progress: bool,
}

/// Replays the transcript against every target and writes the results.
pub fn run_agent_bench(opts: &AgentOptions) -> Result<AgentReport> {
    if opts.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if opts.targets.is_empty() {
        bail!("nothing to replay against: give --server URL or --model M.slip");
    }
    let transcript = match &opts.transcript {
        Some(p) => Transcript::read(p)?,
        None => Transcript::parse(transcript::BUNDLED).context("in the bundled transcript")?,
    };
    std::fs::create_dir_all(opts.out_dir.join("logs"))
        .with_context(|| format!("creating {}", opts.out_dir.display()))?;
    let mut report = AgentReport {
        meta: Meta {
            stamp: crate::machine::Stamp::now(opts.commit.as_deref()),
            transcript: opts.transcript.as_ref().map_or(
                "bundled (crates/bench/transcripts/agent_session.json)".to_string(),
                |p| p.display().to_string(),
            ),
            requests: transcript.requests.len(),
            api: opts.api,
            max_tokens: opts.max_tokens,
            threads: opts.threads,
            ctx_size: opts.ctx_size,
            finished: false,
        },
        sessions: Vec::new(),
        speedup: None,
        bound: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the HTTP client's runtime")?;
    // Each target's model files, evicted before another target starts.
    let all_files: Vec<PathBuf> = opts
        .targets
        .iter()
        .flat_map(|(_, t)| target_files(t))
        .collect();
    for (name, target) in &opts.targets {
        let own = target_files(target);
        let others: Vec<PathBuf> = all_files
            .iter()
            .filter(|f| !own.contains(f))
            .cloned()
            .collect();
        crate::cache::evict_fadvise(&others)?;
        rt.block_on(replay(opts, &transcript, name, target, &mut report))?;
    }
    report.settle(opts.prefill_rate);
    report.meta.finished = true;
    write_outputs(&opts.out_dir, &report)?;
    Ok(report)
}

/// The model files a target started here reads.
fn target_files(t: &Target) -> Vec<PathBuf> {
    match t {
        Target::Url(_) => Vec::new(),
        Target::Slipstream { model, .. } => crate::cache::model_files(model).unwrap_or_default(),
        Target::LlamaServer { gguf, .. } => vec![gguf.clone()],
    }
}

async fn replay(
    opts: &AgentOptions,
    transcript: &Transcript,
    name: &str,
    target: &Target,
    report: &mut AgentReport,
) -> Result<()> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("building the HTTP client")?;
    let log = |what: &str| {
        opts.out_dir
            .join("logs")
            .join(format!("{}.log", crate::slug(what)))
    };
    let mut process = match target {
        Target::Url(_) => None,
        Target::Slipstream {
            runner,
            model,
            extra,
        } => {
            let port = servers::free_port()?;
            let cmd = servers::slipstream_command(
                runner,
                model,
                port,
                opts.threads,
                opts.ctx_size,
                extra,
            );
            Some(ServerProcess::spawn(cmd, port, &log(name))?)
        }
        Target::LlamaServer {
            bin,
            gguf,
            caching,
            extra,
        } => {
            let port = servers::free_port()?;
            let cmd = servers::llama_command(
                bin,
                gguf,
                port,
                opts.threads,
                opts.ctx_size,
                caching,
                extra,
            );
            Some(ServerProcess::spawn(cmd, port, &log(name))?)
        }
    };
    let base_url = match (&process, target) {
        (Some(p), _) => p.base_url.clone(),
        (None, Target::Url(u)) => u.trim_end_matches('/').to_string(),
        (None, _) => unreachable!("a started target has a process"),
    };
    let startup_s = match process.as_mut() {
        Some(p) => {
            let s = p
                .wait_ready(&client, opts.startup_timeout)
                .await
                .with_context(|| format!("starting {name}: {}", p.command))?;
            if opts.progress {
                eprintln!("[bench agent] {name} ready after {s:.1} s: {}", p.command);
            }
            Some(s)
        }
        None => None,
    };
    let model = match &opts.model_name {
        Some(m) => m.clone(),
        None => first_model_id(&client, &base_url)
            .await
            .with_context(|| format!("asking {base_url}/v1/models for a model name"))?,
    };
    let url = format!("{base_url}{}", opts.api.path());
    let warmup_s = if opts.warmup {
        let body = json!({
            "model": model,
            "messages": [{"role": "user", "content": "Say hello."}],
            "stream": true, "max_tokens": 1, "temperature": 0,
        });
        let m = client::measure(&client, &url, &body, opts.request_timeout).await;
        if let Some(e) = m.error {
            bail!("{name}: the warm-up request failed: {e}");
        }
        Some(m.total_s)
    } else {
        None
    };
    let load = crate::machine::LoadWatch::start();
    report.sessions.push(Session {
        runtime: name.to_string(),
        base_url: base_url.clone(),
        command: process.as_ref().map(|p| p.command.clone()),
        model: model.clone(),
        startup_s,
        warmup_s,
        session_s: 0.0,
        failed_requests: 0,
        peak_rss_bytes: None,
        load: load.so_far(),
        rows: Vec::new(),
    });
    let session_start = Instant::now();
    for (i, req) in transcript.requests.iter().enumerate() {
        let body = transcript.body(opts.api, i, &model, opts.max_tokens);
        let started_s = session_start.elapsed().as_secs_f64();
        let measured = client::measure(&client, &url, &body, opts.request_timeout).await;
        let row = Row {
            index: i + 1,
            label: req.label.clone(),
            kind: req.kind,
            started_s,
            new_tokens: measured.new_tokens(),
            measured,
            ttft_bound_s: None,
            within_bound: None,
        };
        if opts.progress {
            eprintln!("[bench agent] {}", progress_line(name, &row));
        }
        let session = report
            .sessions
            .last_mut()
            .context("the session being recorded")?;
        session.failed_requests += usize::from(row.measured.error.is_some());
        session.rows.push(row);
        session.session_s = session_start.elapsed().as_secs_f64();
        report.settle(opts.prefill_rate);
        write_outputs(&opts.out_dir, report)?;
    }
    let session = report
        .sessions
        .last_mut()
        .context("the session being recorded")?;
    session.session_s = session_start.elapsed().as_secs_f64();
    session.load = load.finish();
    session.peak_rss_bytes = process.as_ref().and_then(ServerProcess::peak_rss_bytes);
    drop(process.take());
    Ok(())
}

fn progress_line(name: &str, r: &Row) -> String {
    let m = &r.measured;
    let n = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
    format!(
        "{name} {:>2} {:<18} prompt {:>6} reused {:>6} new {:>6} | ttft {} s | total {:.2} s{}",
        r.index,
        r.label,
        n(m.prompt_tokens),
        n(m.reused_tokens),
        n(r.new_tokens),
        m.ttft_s.map_or("-".to_string(), |t| format!("{t:.2}")),
        m.total_s,
        m.error
            .as_ref()
            .map_or(String::new(), |e| format!(" | FAILED: {e}"))
    )
}

async fn first_model_id(client: &reqwest::Client, base_url: &str) -> Result<String> {
    let v: Value = client
        .get(format!("{base_url}/v1/models"))
        .timeout(Duration::from_secs(30))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    v.pointer("/data/0/id")
        .and_then(Value::as_str)
        .map(str::to_string)
        .context("no model listed: give --model-name")
}

/// Writes results.csv, results.json, table.md and the charts.
pub fn write_outputs(dir: &Path, report: &AgentReport) -> Result<()> {
    crate::report::write_results(
        dir,
        report,
        &report::csv(report),
        &report::markdown(report),
        &report::charts(report),
        "",
    )
}

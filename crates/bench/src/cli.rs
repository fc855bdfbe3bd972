//! The `slipstream bench` command line (the binary only forwards to
//! [`bench_command`]): the matrix, or `slipstream bench agent`.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::agent::servers::LlamaCaching;
use crate::agent::{AgentOptions, Target};
use crate::cache::EvictMethod;
use crate::matrix::{self, CacheMode, CapRuns, MatrixSpec, PeerMode};
use crate::BenchOptions;

/// `slipstream bench`: the matrix's arguments, or a subcommand.
#[derive(clap::Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchCommand {
    #[command(subcommand)]
    pub command: Option<BenchSubcommand>,
    #[command(flatten)]
    pub matrix: BenchArgs,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum BenchSubcommand {
    /// Replay a recorded agent session (turns with tool results, side
    /// requests) against a server and a peer such as llama-server: per
    /// request new tokens, reused tokens, time to first token; the whole
    /// session's time; CSV, JSON, charts.
    Agent(Box<AgentArgs>),
}

/// Arguments of `slipstream bench` (the matrix).
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The .slip model directory, or a GGUF file run in place.
    #[arg(long, required = true)]
    pub model: Option<PathBuf>,
    /// The same weights as GGUF, for --peer.
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// Expert slots per layer, comma separated: numbers, `all` (as many
    /// slots as experts, streaming), `resident` (every expert read at
    /// start) or `auto` (no slot flag: the run's own memory plan, as a plain
    /// `slipstream run`); `none` runs only the peer rows.
    #[arg(long, default_value = "16,64,all")]
    pub slots: String,
    /// Cache policies, comma separated: aging, lfu, lru.
    #[arg(long, default_value = "aging")]
    pub policy: String,
    /// Direct I/O for expert reads, comma separated: auto (slipstream's
    /// default: decided from the slots and the memory), on, off.
    #[arg(long, default_value = "auto")]
    pub direct_io: String,
    /// Activations of slipstream's 4-bit products, comma separated: f32
    /// (exact), int16 or int8 (as `slipstream run --activations`).
    #[arg(long, default_value = "f32")]
    pub activations: String,
    /// Prompt lengths in tokens, comma separated (cut from the bundled KJV text).
    #[arg(long, default_value = "1024,3072,12288,24576")]
    pub prompt_lens: String,
    /// Tokens to generate per run.
    #[arg(long, default_value_t = 512)]
    pub gen: usize,
    /// File cache state before each run: cold (model files evicted) or warm (pre-read); the other runtime's model files are evicted before every run either way.
    #[arg(long, default_value = "cold")]
    pub cache: String,
    /// How a cold cache is made: fadvise (fsync + POSIX_FADV_DONTNEED on
    /// each model file) or drop-caches (the whole page cache; root only).
    #[arg(long, default_value = "fadvise")]
    pub evict: String,
    /// Run settings again inside a cgroup v1 memory cap of this size (page
    /// cache counted), e.g. 8G.
    #[arg(long)]
    pub memory_cap: Option<String>,
    /// Under --memory-cap: `both` (each setting uncapped and capped) or
    /// `capped` (capped only).
    #[arg(long, default_value = "both")]
    pub cap_runs: String,
    /// Slot settings that also run capped (default: every --slots entry).
    #[arg(long)]
    pub cap_slots: Option<String>,
    /// Memory cgroup to create capped runs' cgroups under (default: this
    /// process's own memory cgroup).
    #[arg(long)]
    pub cgroup_parent: Option<PathBuf>,
    /// A peer runtime on the same weights: llama.cpp=DIR (DIR holds llama-bench).
    #[arg(long)]
    pub peer: Option<String>,
    /// Peer settings, comma separated: mmap (mmap on, --repack 0),
    /// mmap-repack (mmap on, default repack), no-mmap (-lm none --repack 0),
    /// no-mmap-repack (-lm none, default repack).
    #[arg(long, default_value = "mmap,no-mmap")]
    pub peer_modes: String,
    /// Compute threads for every runtime (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Per-run limit in seconds; the child is killed and the row recorded
    /// as did-not-finish.
    #[arg(long)]
    pub timeout_s: Option<f64>,
    /// Decode steps left out of the sustained decode rate.
    #[arg(long, default_value_t = 8)]
    pub skip_steps: usize,
    /// Relative change of the repeated first run (decode rate or time to
    /// first token) above which the whole run is marked discarded.
    #[arg(long, default_value_t = 0.05)]
    pub drift_threshold: f64,
    /// Prompt text file instead of the bundled KJV text.
    #[arg(long)]
    pub text: Option<PathBuf>,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Arguments both `slipstream bench` and `slipstream bench agent` take.
#[derive(clap::Args, Debug, Clone)]
pub struct CommonArgs {
    /// Output directory (default: bench-results/<date>-<time>, with
    /// `agent-` before the date for `bench agent`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The `slipstream` binary that runs each slipstream row or serves
    /// --model (default: this one), e.g. a release build of the commit
    /// being measured.
    #[arg(long)]
    pub runner: Option<PathBuf>,
    /// Commit recorded for the results (default: `git rev-parse HEAD` here,
    /// else this binary's build-time commit); give it with --runner.
    #[arg(long)]
    pub commit: Option<String>,
}

impl CommonArgs {
    /// `--out`, else `bench-results/{prefix}<date>-<time>`.
    fn out_dir(&self, prefix: &str) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            PathBuf::from("bench-results").join(format!("{prefix}{}", crate::machine::utc_now().1))
        })
    }

    /// `--runner`, else `default`.
    fn runner(&self, default: PathBuf) -> PathBuf {
        self.runner.clone().unwrap_or(default)
    }
}

/// `--threads`, else every core.
fn threads_or_all_cores(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `v` seconds of `flag`, which must be positive and finite.
fn seconds(flag: &str, v: f64) -> Result<Duration> {
    if v.is_finite() && v > 0.0 {
        Ok(Duration::from_secs_f64(v))
    } else {
        bail!("{flag} {v} must be a positive number of seconds")
    }
}

/// Parses the arguments into options; `runner` is the `slipstream` binary,
/// `gguf_index_dir` where checksum tables of GGUF files run in place go when
/// the file's own directory cannot take one.
pub fn options(
    args: &BenchArgs,
    runner: PathBuf,
    progress: bool,
    gguf_index_dir: Option<PathBuf>,
) -> Result<BenchOptions> {
    let memory_cap = args
        .memory_cap
        .as_deref()
        .map(matrix::parse_size)
        .transpose()
        .map_err(|e| e.context("in --memory-cap"))?;
    let matrix = MatrixSpec {
        slots: matrix::parse_slots(&args.slots)?,
        policies: matrix::parse_policies(&args.policy)?,
        direct_io: matrix::parse_direct_io(&args.direct_io)?,
        activations: matrix::parse_activations(&args.activations)?,
        prompt_lens: matrix::parse_lens(&args.prompt_lens)?,
        gen: args.gen,
        peer_modes: matrix::parse_list("--peer-modes", &args.peer_modes, PeerMode::parse)?,
        memory_cap,
        cap_runs: CapRuns::parse(&args.cap_runs)?,
        cap_slots: args
            .cap_slots
            .as_deref()
            .map(matrix::parse_slots)
            .transpose()?,
    };
    let timeout = args
        .timeout_s
        .map(|t| seconds("--timeout-s", t))
        .transpose()?;
    if !(args.drift_threshold.is_finite() && args.drift_threshold >= 0.0) {
        bail!("--drift-threshold must be a non-negative fraction, e.g. 0.05");
    }
    let model = args.model.clone().context("--model is required")?;
    Ok(BenchOptions {
        model,
        gguf: args.gguf.clone(),
        runner: args.common.runner(runner),
        commit: args.common.commit.clone(),
        matrix,
        peer: args.peer.as_deref().map(matrix::parse_peer).transpose()?,
        cache: CacheMode::parse(&args.cache)?,
        evict: EvictMethod::parse(&args.evict)?,
        threads: threads_or_all_cores(args.threads),
        timeout,
        decode_skip_steps: args.skip_steps,
        drift_threshold: args.drift_threshold,
        out_dir: args.common.out_dir(""),
        cgroup_parent: args.cgroup_parent.clone(),
        text: args.text.clone(),
        progress,
        gguf_index_dir,
    })
}

/// `slipstream bench [agent]`: runs the matrix or the agent replay with
/// `runner` as the slipstream binary (`gguf_index_dir`: see [`options`]).
pub fn bench_command(
    args: BenchCommand,
    runner: PathBuf,
    gguf_index_dir: Option<PathBuf>,
) -> Result<()> {
    match args.command {
        Some(BenchSubcommand::Agent(a)) => agent_command(&a, runner),
        None => matrix_command(&args.matrix, runner, gguf_index_dir),
    }
}

/// Runs the matrix, prints the tables and where the files went.
fn matrix_command(
    args: &BenchArgs,
    runner: PathBuf,
    gguf_index_dir: Option<PathBuf>,
) -> Result<()> {
    let opts = options(args, runner, true, gguf_index_dir)?;
    let report = crate::run_bench(&opts)?;
    print!("{}", crate::report::markdown(&report));
    eprintln!(
        "[bench] wrote {}/results.csv, results.json, table.md and bench-*.svg/png",
        opts.out_dir.display()
    );
    if let Some(d) = &report.drift {
        if d.discarded {
            eprintln!("[bench] DISCARDED: {}", d.note);
        }
    }
    Ok(())
}

/// Arguments of `slipstream bench agent`.
#[derive(clap::Args, Debug, Clone)]
pub struct AgentArgs {
    /// The recorded session (format slipstream-agent-transcript/1; default:
    /// the bundled crates/bench/transcripts/agent_session.json).
    #[arg(long)]
    pub transcript: Option<PathBuf>,
    /// A running server to replay against: its base URL, e.g.
    /// http://127.0.0.1:8091.
    #[arg(long, conflicts_with = "model")]
    pub server: Option<String>,
    /// A .slip model, or a GGUF file (served in place, so both servers can
    /// read the same file): the bench starts `slipstream serve` on it.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// One more `slipstream serve` argument (repeatable), e.g.
    /// --serve-arg=--state-cache-ram=4G.
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// A running peer server to compare with: its base URL.
    #[arg(long, conflicts_with = "gguf")]
    pub peer_server: Option<String>,
    /// The same weights as GGUF: the bench starts llama-server on them
    /// (with --llama-server).
    #[arg(long, requires = "llama_server")]
    pub gguf: Option<PathBuf>,
    /// The llama-server binary, or the directory scripts/build_llama_cpp.sh
    /// wrote (its bin/llama-server).
    #[arg(long, requires = "gguf")]
    pub llama_server: Option<PathBuf>,
    /// One more llama-server argument (repeatable), e.g. --llama-server-arg=-np
    /// --llama-server-arg=1.
    #[arg(long = "llama-server-arg", allow_hyphen_values = true)]
    pub llama_server_args: Vec<String>,
    /// llama-server --ctx-checkpoints: context checkpoints per slot.
    #[arg(long, default_value_t = LlamaCaching::default().ctx_checkpoints)]
    pub ctx_checkpoints: usize,
    /// llama-server --cache-ram: MiB of its RAM prompt cache (-1: no limit).
    #[arg(long, default_value_t = LlamaCaching::default().cache_ram_mib, allow_negative_numbers = true)]
    pub cache_ram_mib: i64,
    /// llama-server --cache-reuse: smallest chunk reused by KV shifting.
    #[arg(long, default_value_t = LlamaCaching::default().cache_reuse)]
    pub cache_reuse: usize,
    /// Name of the peer in the results.
    #[arg(long, default_value = "llama.cpp")]
    pub peer_name: String,
    /// Wire API: openai (chat completions) or anthropic (messages).
    #[arg(long, default_value = "openai")]
    pub api: String,
    /// Model name sent in requests (default: the first of the server's
    /// /v1/models).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Most tokens generated per request: small, so that the replay
    /// measures prompt handling.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Compute threads of the servers the bench starts (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size of the servers the bench starts, in tokens.
    #[arg(long, default_value_t = 65536)]
    pub ctx_size: usize,
    /// Per-request limit in seconds; the request is recorded as failed.
    #[arg(long, default_value_t = 3600.0)]
    pub request_timeout_s: f64,
    /// How long a started server may take to answer /health, in seconds.
    #[arg(long, default_value_t = 1800.0)]
    pub startup_timeout_s: f64,
    /// Send no one-token warm-up request before each session.
    #[arg(long)]
    pub no_warmup: bool,
    /// Prefill tokens per second for the time-to-first-token bound
    /// (1.2 x new tokens / rate + 1 s); default: measured on the request
    /// with the most new tokens.
    #[arg(long)]
    pub prefill_rate: Option<f64>,
    #[command(flatten)]
    pub common: CommonArgs,
}

/// Parses `bench agent` arguments into options; `runner` is the
/// `slipstream` binary.
pub fn agent_options(args: &AgentArgs, runner: PathBuf, progress: bool) -> Result<AgentOptions> {
    let mut targets = Vec::new();
    match (&args.server, &args.model) {
        (Some(url), None) => targets.push(("slipstream".to_string(), Target::Url(check_url(url)?))),
        (None, Some(model)) => {
            if !model.join("manifest.json").is_file() && !slipstream_repack::is_gguf_file(model) {
                bail!(
                    "--model {} is neither a .slip model directory nor a GGUF file",
                    model.display()
                );
            }
            targets.push((
                "slipstream".to_string(),
                Target::Slipstream {
                    runner: args.common.runner(runner),
                    model: model.clone(),
                    extra: args.serve_args.clone(),
                },
            ))
        }
        (None, None) => bail!("give --server URL (a running server) or --model M.slip"),
        (Some(_), Some(_)) => bail!("--server and --model exclude each other"),
    }
    match (&args.peer_server, &args.gguf, &args.llama_server) {
        (Some(url), None, None) => {
            targets.push((args.peer_name.clone(), Target::Url(check_url(url)?)))
        }
        (None, Some(gguf), Some(dir)) => {
            if !gguf.is_file() {
                bail!("--gguf {} is not a file", gguf.display());
            }
            targets.push((
                args.peer_name.clone(),
                Target::LlamaServer {
                    bin: crate::agent::servers::llama_server_bin(dir)?,
                    gguf: gguf.clone(),
                    caching: LlamaCaching {
                        ctx_checkpoints: args.ctx_checkpoints,
                        cache_ram_mib: args.cache_ram_mib,
                        cache_reuse: args.cache_reuse,
                    },
                    extra: args.llama_server_args.clone(),
                },
            ))
        }
        (None, None, None) => {}
        _ => bail!("give either --peer-server URL or --gguf with --llama-server"),
    }
    if let Some(r) = args.prefill_rate {
        if !(r.is_finite() && r > 0.0) {
            bail!("--prefill-rate {r} must be a positive number of tokens per second");
        }
    }
    let threads = threads_or_all_cores(args.threads);
    if threads == 0 {
        bail!("--threads must be at least 1");
    }
    if args.ctx_size == 0 {
        bail!("--ctx-size must be at least 1");
    }
    Ok(AgentOptions {
        transcript: args.transcript.clone(),
        targets,
        api: crate::agent::transcript::Api::parse(&args.api)?,
        model_name: args.model_name.clone(),
        max_tokens: args.max_tokens,
        threads,
        ctx_size: args.ctx_size,
        request_timeout: seconds("--request-timeout-s", args.request_timeout_s)?,
        startup_timeout: seconds("--startup-timeout-s", args.startup_timeout_s)?,
        warmup: !args.no_warmup,
        prefill_rate: args.prefill_rate,
        out_dir: args.common.out_dir("agent-"),
        commit: args.common.commit.clone(),
        progress,
    })
}

fn check_url(url: &str) -> Result<String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!("server URL `{url}` must start with http:// (e.g. http://127.0.0.1:8091)");
    }
    Ok(url.trim_end_matches('/').to_string())
}

/// `slipstream bench agent`: replays, prints the table and where the files went.
fn agent_command(args: &AgentArgs, runner: PathBuf) -> Result<()> {
    let opts = agent_options(args, runner, true)?;
    let report = crate::agent::run_agent_bench(&opts)?;
    print!("{}", crate::agent::report::markdown(&report));
    eprintln!(
        "[bench agent] wrote {}/results.csv, results.json, table.md and agent-*.svg/png",
        opts.out_dir.display()
    );
    Ok(())
}

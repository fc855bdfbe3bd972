//! The `slipstream bench` command line (the binary only forwards to
//! [`bench_command`]).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};

use crate::cache::EvictMethod;
use crate::matrix::{self, CacheMode, CapRuns, MatrixSpec, PeerMode};
use crate::BenchOptions;

/// Arguments of `slipstream bench`.
#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// The .slip model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The same weights as GGUF, for --peer.
    #[arg(long)]
    pub gguf: Option<PathBuf>,
    /// Expert slots per layer, comma separated: numbers, `all` (as many
    /// slots as experts, streaming) or `resident` (every expert read at
    /// start); `none` runs only the peer rows.
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
    /// (exact) or int16 (`slipstream run --activations int16`).
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
    /// Output directory (default: bench-results/<date>-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The `slipstream` binary each slipstream row runs (default: this one),
    /// e.g. a release build of the commit being measured.
    #[arg(long)]
    pub runner: Option<PathBuf>,
    /// Commit recorded for the results (default: `git rev-parse HEAD` here,
    /// else this binary's build-time commit); give it with --runner.
    #[arg(long)]
    pub commit: Option<String>,
}

/// Parses the arguments into options; `runner` is the `slipstream` binary.
pub fn options(args: &BenchArgs, runner: PathBuf, progress: bool) -> Result<BenchOptions> {
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
    let timeout = match args.timeout_s {
        Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
        Some(t) => bail!("--timeout-s {t} must be a positive number of seconds"),
        None => None,
    };
    if !(args.drift_threshold.is_finite() && args.drift_threshold >= 0.0) {
        bail!("--drift-threshold must be a non-negative fraction, e.g. 0.05");
    }
    let out_dir = match &args.out {
        Some(p) => p.clone(),
        None => PathBuf::from("bench-results").join(crate::machine::utc_now().1),
    };
    Ok(BenchOptions {
        model: args.model.clone(),
        gguf: args.gguf.clone(),
        runner: args.runner.clone().unwrap_or(runner),
        commit: args.commit.clone(),
        matrix,
        peer: args.peer.as_deref().map(matrix::parse_peer).transpose()?,
        cache: CacheMode::parse(&args.cache)?,
        evict: EvictMethod::parse(&args.evict)?,
        threads: args
            .threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
        timeout,
        decode_skip_steps: args.skip_steps,
        drift_threshold: args.drift_threshold,
        out_dir,
        cgroup_parent: args.cgroup_parent.clone(),
        text: args.text.clone(),
        progress,
    })
}

/// `slipstream bench`: runs the matrix with `runner` as the slipstream
/// binary, prints the tables and where the files went.
pub fn bench_command(args: BenchArgs, runner: PathBuf) -> Result<()> {
    let opts = options(&args, runner, true)?;
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

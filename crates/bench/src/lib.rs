//! `slipstream bench`: a matrix of benchmark runs that measures the code and
//! not the state of the machine.
//!
//! Every run is a fresh child process (`slipstream run`, or a peer's
//! `llama-bench`) that meets the file cache in the same stated state
//! (cold: the model files evicted; warm: pre-read), optionally inside a
//! cgroup v1 memory cap that counts the page cache too. The first run is
//! repeated at the end; when its sustained decode rate or its time to first
//! token differs from the first run's by more than the threshold (5 %) the
//! whole run is marked discarded (and still written). Output: `results.csv`, `results.json`, `table.md` and three
//! charts as SVG and PNG, rewritten after every run so an interrupted
//! benchmark keeps what it measured, plus one log directory per run.
//!
//! `slipstream bench agent` ([`agent`]) replays a recorded agent session
//! against running servers instead.

pub mod agent;
pub mod cache;
pub mod cgroup;
pub mod chart;
pub mod child;
pub mod cli;
pub mod machine;
pub mod matrix;
pub mod peer;
pub mod prompt;
pub mod report;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use cache::EvictMethod;
use matrix::{CacheMode, MatrixSpec, Peer, RunSpec, Setting, Slots};
use report::{Meta, Record, Report, Status};

/// Everything a benchmark run needs.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// The `.slip` model directory, or a GGUF file run in place.
    pub model: PathBuf,
    /// The same weights as GGUF, for peers.
    pub gguf: Option<PathBuf>,
    /// The `slipstream` binary that runs each slipstream configuration.
    pub runner: PathBuf,
    /// Commit to record instead of the detected one.
    pub commit: Option<String>,
    pub matrix: MatrixSpec,
    pub peer: Option<Peer>,
    pub cache: CacheMode,
    pub evict: EvictMethod,
    /// Compute threads for every runtime.
    pub threads: usize,
    /// Per-run limit; the child is killed and the row marked did-not-finish.
    pub timeout: Option<Duration>,
    /// Decode steps left out of the sustained rate.
    pub decode_skip_steps: usize,
    /// Relative decode change between the first run and its repeat above
    /// which the run is discarded.
    pub drift_threshold: f64,
    /// Where results go (created).
    pub out_dir: PathBuf,
    /// Memory cgroup under which capped runs' cgroups are made (default:
    /// this process's own memory cgroup).
    pub cgroup_parent: Option<PathBuf>,
    /// Prompt text (default: the bundled KJV text).
    pub text: Option<PathBuf>,
    /// Show the progress bar.
    pub progress: bool,
    /// Where checksum tables of a GGUF `model` run in place go when the
    /// file's own directory cannot take one (as `slipstream run` keeps them).
    pub gguf_index_dir: Option<PathBuf>,
}

/// Runs the whole matrix and writes its files; returns the report.
pub fn run_bench(opts: &BenchOptions) -> Result<Report> {
    if opts.matrix.gen == 0 {
        bail!("--gen must be at least 1");
    }
    if opts.threads == 0 {
        bail!("--threads must be at least 1");
    }
    let info = prompt::ModelInfo::read(&opts.model, opts.gguf_index_dir.as_deref())?;
    let slip_files = cache::model_files(&opts.model)?;
    let peer_bin = match &opts.peer {
        Some(p) => {
            let gguf = opts
                .gguf
                .as_ref()
                .context("--peer needs --gguf: the same weights as a GGUF file")?;
            if !gguf.is_file() {
                bail!("--gguf {} is not a file", gguf.display());
            }
            Some(peer::llama_bench(&p.dir)?)
        }
        None => None,
    };
    let mut matrix = opts.matrix.clone();
    if opts.peer.is_none() {
        matrix.peer_modes.clear();
    }
    let cgroup_parent = match matrix.memory_cap {
        Some(cap) => {
            let parent = match &opts.cgroup_parent {
                Some(p) => p.clone(),
                None => cgroup::own_memory_cgroup()?,
            };
            // Fail before the first run, not at the first capped one.
            let probe = cgroup::MemCgroup::create(
                &parent,
                &format!("slipstream-bench-{}-probe", std::process::id()),
                cap,
            )?;
            probe.remove()?;
            Some(parent)
        }
        None => None,
    };
    let text = match &opts.text {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading prompt text {}", p.display()))?,
        None => prompt::KJV.to_string(),
    };

    let mut runs = matrix::expand(&matrix);
    if runs.is_empty() {
        bail!("the matrix is empty");
    }
    let first = runs[0].clone();
    runs.push(first);
    let total = runs.len();

    std::fs::create_dir_all(opts.out_dir.join("runs"))
        .with_context(|| format!("creating {}", opts.out_dir.display()))?;
    if !opts.runner.is_file() {
        bail!("runner {} is not a file", opts.runner.display());
    }
    let mut report = Report {
        meta: Meta {
            stamp: machine::Stamp::now(opts.commit.as_deref()),
            model: opts.model.display().to_string(),
            runner: opts.runner.display().to_string(),
            gguf: opts.gguf.as_ref().map(|g| g.display().to_string()),
            peer: opts
                .peer
                .as_ref()
                .map(|p| format!("{}={}", p.name, p.dir.display())),
            prompt_source: if opts.text.is_some() {
                "--text file".to_string()
            } else {
                prompt::prompt_source(&info).to_string()
            },
            threads: opts.threads,
            gen: matrix.gen,
            cache_mode: opts.cache.name().to_string(),
            evict: match opts.cache {
                CacheMode::Cold => match opts.evict {
                    EvictMethod::Fadvise => "fsync + posix_fadvise(DONTNEED) on every model file",
                    EvictMethod::DropCaches => "sync + drop_caches",
                },
                CacheMode::Warm => "every model file pre-read; capped runs evicted instead",
            }
            .to_string(),
            decode_skip_steps: opts.decode_skip_steps,
            timeout_s: opts.timeout.map(|t| t.as_secs_f64()),
            finished: false,
        },
        drift: None,
        records: Vec::new(),
    };

    let bar = if opts.progress {
        ProgressBar::new(total as u64)
    } else {
        ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::hidden())
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] run {pos}/{len} {wide_msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.enable_steady_tick(Duration::from_millis(250));

    let mut prompts: std::collections::HashMap<usize, Vec<u32>> = Default::default();
    for (index, spec) in runs.iter().enumerate() {
        let repeat_of = (index + 1 == total).then_some(0);
        bar.set_message(format!(
            "{}, prompt {}{}",
            spec.label(),
            spec.prompt_len,
            if repeat_of.is_some() {
                " (drift repeat)"
            } else {
                ""
            }
        ));
        let ids = match prompts.get(&spec.prompt_len) {
            Some(v) => v.clone(),
            None => {
                let v = prompt::prompt_ids(&info, &text, spec.prompt_len)?;
                prompts.insert(spec.prompt_len, v.clone());
                v
            }
        };
        let ctx = RunContext {
            opts,
            info: &info,
            slip_files: &slip_files,
            peer_bin: peer_bin.as_deref(),
            cgroup_parent: cgroup_parent.as_deref(),
        };
        let rec = run_one(&ctx, spec, index, repeat_of, &ids)?;
        let line = format!(
            "[bench] {:>2} {} | prompt {} | {} | ttft {} s | prefill {} tok/s | decode {} tok/s | peak {:.2} GB | steal {}",
            index,
            rec.label,
            rec.prompt_len,
            rec.status.name(),
            rec.ttft_s.map_or("-".into(), |v| format!("{v:.2}")),
            rec.prefill_tok_s.map_or("-".into(), |v| format!("{v:.2}")),
            rec.decode_tok_s.map_or("-".into(), |v| format!("{v:.2}")),
            rec.peak_memory_bytes as f64 / 1e9,
            rec.load
                .steal_fraction
                .map_or("-".into(), |v| format!("{:.1} %", v * 100.0))
        );
        // A bar drawing nowhere (stderr not a terminal) would swallow the line.
        if bar.is_hidden() {
            if opts.progress {
                eprintln!("{line}");
            }
        } else {
            bar.println(line);
        }
        report.records.push(rec);
        bar.inc(1);
        write_outputs(&opts.out_dir, &report)?;
    }
    bar.finish_and_clear();
    report.drift = report::drift(&report.records, opts.drift_threshold);
    report.meta.finished = true;
    write_outputs(&opts.out_dir, &report)?;
    Ok(report)
}

/// Writes results.csv, results.json, table.md and the charts.
pub fn write_outputs(dir: &Path, report: &Report) -> Result<()> {
    report::write_results(
        dir,
        report,
        &report::csv(report),
        &report::markdown(report),
        &report::charts(report),
        "bench-",
    )
}

struct RunContext<'a> {
    opts: &'a BenchOptions,
    info: &'a prompt::ModelInfo,
    slip_files: &'a [PathBuf],
    peer_bin: Option<&'a Path>,
    cgroup_parent: Option<&'a Path>,
}

/// Ids per `--prompt-tokens` argument (one argument may hold at most 128 KiB).
const IDS_PER_ARG: usize = 4096;

pub(crate) fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').chars().take(60).collect()
}

pub(crate) fn shell_words(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().to_string();
    for a in cmd.get_args() {
        let a = a.to_string_lossy();
        s.push(' ');
        if a.len() > 200 {
            s.push_str(&format!("<{} bytes>", a.len()));
        } else {
            s.push_str(&a);
        }
    }
    s
}

/// Last `n` non-empty lines of a file.
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    lines[lines.len().saturating_sub(n)..].join(" / ")
}

fn run_one(
    ctx: &RunContext,
    spec: &RunSpec,
    index: usize,
    repeat_of: Option<usize>,
    ids: &[u32],
) -> Result<Record> {
    let opts = ctx.opts;
    let log_dir = opts.out_dir.join("runs").join(format!(
        "{index:02}-{}-p{}",
        slug(&spec.label()),
        spec.prompt_len
    ));
    std::fs::create_dir_all(&log_dir).with_context(|| format!("creating {}", log_dir.display()))?;
    let stats_path = log_dir.join("stats.json");
    let _ = std::fs::remove_file(&stats_path);

    let (mut cmd, files): (Command, Vec<PathBuf>) = match &spec.setting {
        Setting::Slipstream {
            slots,
            policy,
            direct_io,
            activations,
        } => {
            let mut c = Command::new(&opts.runner);
            c.arg("run").arg("--model").arg(&opts.model);
            for chunk in ids.chunks(IDS_PER_ARG) {
                let list: Vec<String> = chunk.iter().map(|i| i.to_string()).collect();
                c.arg(format!("--prompt-tokens={}", list.join(",")));
            }
            c.args(["--max-new", &spec.gen.to_string(), "--print-ids"]);
            c.args(["--threads", &opts.threads.to_string()]);
            c.args(["--activations", activations]);
            c.arg("--stats-json").arg(&stats_path);
            match slots {
                Slots::Count(n) => {
                    c.args(["--expert-cache-slots", &n.to_string()]);
                }
                Slots::All => {
                    c.args(["--expert-cache-slots", &ctx.info.num_experts.to_string()]);
                }
                Slots::Resident => {
                    c.arg("--resident");
                }
                Slots::Auto => {}
            }
            if !matches!(slots, Slots::Resident) {
                c.args(["--expert-cache-policy", policy]);
                c.args(["--direct-io", direct_io]);
            }
            (c, ctx.slip_files.to_vec())
        }
        Setting::LlamaCpp { mode } => {
            let bin = ctx.peer_bin.context("a peer row without a peer binary")?;
            let gguf = opts.gguf.as_ref().context("a peer row without --gguf")?;
            (
                peer::command(bin, gguf, *mode, spec.prompt_len, spec.gen, opts.threads),
                vec![gguf.clone()],
            )
        }
    };
    report::write_atomic(&log_dir.join("command.txt"), shell_words(&cmd).as_bytes())?;

    // A capped run always starts cold: pages already cached are charged to
    // another cgroup, and the cap would not bite on them.
    let mode = if spec.memory_cap.is_some() {
        CacheMode::Cold
    } else {
        opts.cache
    };
    // The other runtime's files leave the page cache either way: pages a
    // previous row cached would take memory from this one (a row after a
    // peer row would otherwise start with gigabytes of GGUF cached).
    let mut others = Vec::new();
    if let Some(gguf) = &opts.gguf {
        others.push(gguf.clone());
    }
    others.extend(ctx.slip_files.iter().cloned());
    others.retain(|f| !files.contains(f));
    cache::evict_fadvise(&others)?;
    let cache_report = cache::prepare(&files, mode, opts.evict)?;
    let cgroup = match (spec.memory_cap, ctx.cgroup_parent) {
        (Some(cap), Some(parent)) => Some(cgroup::MemCgroup::create(
            parent,
            &format!("slipstream-bench-{}-{index}", std::process::id()),
            cap,
        )?),
        (Some(_), None) => bail!("a capped run without a cgroup parent"),
        _ => None,
    };
    let load = machine::LoadWatch::start();
    let (started_at, _) = machine::utc_now();
    let stdout = log_dir.join("stdout.txt");
    let stderr = log_dir.join("stderr.txt");
    let outcome = child::run(
        &mut cmd,
        &stdout,
        &stderr,
        cgroup.as_ref().map(|c| c.procs_fd()),
        opts.timeout,
    )?;
    let load = load.finish();
    let (cg_peak, cg_fail, cg_oom) = match &cgroup {
        Some(c) => (c.max_usage(), c.failcnt(), c.oom_kills()),
        None => (None, None, None),
    };
    drop(cgroup);

    let mut rec = Record {
        index,
        repeat_of,
        label: spec.label(),
        runtime: spec.setting.runtime().to_string(),
        setting: spec.setting.clone(),
        prompt_len: spec.prompt_len,
        gen: spec.gen,
        memory_cap_bytes: spec.memory_cap,
        threads: opts.threads,
        status: Status::Ok,
        error: None,
        tokens_done: None,
        ttft_s: None,
        prefill_tok_s: None,
        decode_tok_s: None,
        decode_skip_steps: opts.decode_skip_steps,
        decode_all_tok_s: None,
        vmhwm_bytes: outcome.max_rss_bytes,
        cgroup_max_usage_bytes: cg_peak,
        cgroup_failcnt: cg_fail,
        cgroup_oom_kills: cg_oom,
        peak_memory_bytes: outcome.max_rss_bytes.max(cg_peak.unwrap_or(0)),
        misses_per_token: None,
        expert_bytes_read: None,
        disk_read_bytes: outcome.disk_read_bytes,
        wall_s: outcome.wall_s,
        user_s: outcome.user_s,
        sys_s: outcome.sys_s,
        cache: cache_report,
        load,
        started_at,
        command: shell_words(&cmd),
        log_dir: log_dir.display().to_string(),
    };
    match &outcome.exit {
        child::Exit::Code(0) => {}
        child::Exit::TimedOut => {
            rec.status = Status::DidNotFinish;
            rec.error = Some(format!(
                "killed after the {:.3} s timeout",
                opts.timeout.map_or(0.0, |t| t.as_secs_f64())
            ));
        }
        other => {
            rec.status = Status::Failed;
            let how = match other {
                child::Exit::Signal(s) => format!("killed by signal {s}"),
                child::Exit::Code(c) => format!("exit code {c}"),
                child::Exit::TimedOut => unreachable!("handled above"),
            };
            let oom = match cg_oom {
                Some(n) if n > 0 => format!(" (cgroup OOM kills: {n})"),
                _ => String::new(),
            };
            rec.error = Some(format!("{how}{oom}: {}", tail(&stderr, 3)));
        }
    }
    match &spec.setting {
        Setting::Slipstream { .. } => {
            fill_slipstream(&mut rec, &stats_path, &stdout, opts.decode_skip_steps)
        }
        Setting::LlamaCpp { .. } => fill_peer(&mut rec, &stdout),
    }
    Ok(rec)
}

/// Figures from `slipstream run --stats-json`, or the ids printed so far.
fn fill_slipstream(rec: &mut Record, stats_path: &Path, stdout: &Path, skip: usize) {
    let stats = std::fs::read(stats_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok());
    let Some(j) = stats else {
        let printed = std::fs::read_to_string(stdout)
            .map(|s| {
                s.split_whitespace()
                    .filter(|w| w.parse::<u32>().is_ok())
                    .count()
            })
            .unwrap_or(0);
        rec.tokens_done = Some(printed);
        if rec.status == Status::Ok {
            rec.status = Status::Failed;
            rec.error = Some(format!("no stats file {}", stats_path.display()));
        }
        return;
    };
    let s = &j["stats"];
    let f = |k: &str| s[k].as_f64();
    rec.ttft_s = f("time_to_first_token_s");
    rec.prefill_tok_s = f("prefill_tokens_per_s");
    rec.decode_all_tok_s = f("decode_tokens_per_s");
    rec.misses_per_token = f("decode_misses_per_token");
    rec.expert_bytes_read = s["expert_bytes_read"].as_u64();
    rec.tokens_done = s["generated_tokens"].as_u64().map(|v| v as usize);
    let times: Vec<f64> = j["token_times_s"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_f64()).collect())
        .unwrap_or_default();
    rec.decode_tok_s = sustained_rate(&times, skip);
    if rec.decode_tok_s.is_none() && rec.status == Status::Ok {
        rec.error = Some(format!(
            "{} tokens: too few for a sustained rate after {skip} decode steps",
            times.len()
        ));
    }
}

/// Decode rate over the steps after the first `skip` decode steps:
/// `times[i]` is when token `i` arrived (token 0 ends prefill).
pub fn sustained_rate(times: &[f64], skip: usize) -> Option<f64> {
    let n = times.len();
    if n < skip + 2 {
        return None;
    }
    let steps = (n - 1 - skip) as f64;
    let dt = times[n - 1] - times[skip];
    (dt > 0.0).then(|| steps / dt)
}

/// Figures from llama-bench's output.
fn fill_peer(rec: &mut Record, stdout: &Path) {
    let text = std::fs::read_to_string(stdout).unwrap_or_default();
    match peer::parse_output(&text) {
        Ok(f) => {
            rec.prefill_tok_s = f.pp_tokens_per_s;
            rec.ttft_s = match (f.pp_tokens, f.pp_tokens_per_s) {
                (Some(n), Some(r)) if r > 0.0 => Some(n as f64 / r),
                _ => None,
            };
            rec.decode_tok_s = f.tg_tokens_per_s;
            rec.decode_all_tok_s = f.tg_tokens_per_s;
            rec.tokens_done = f.tg_tokens;
            if rec.status == Status::Ok && rec.decode_tok_s.is_none() {
                rec.status = Status::Failed;
                rec.error = Some("llama-bench printed no tg result".into());
            }
        }
        Err(e) => {
            if rec.status == Status::Ok {
                rec.status = Status::Failed;
                rec.error = Some(format!("{e:#}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sustained_rate_skips_steps() {
        // First token at 10 s, then one token every 0.5 s, the first two slow.
        let times = [10.0, 12.0, 13.0, 13.5, 14.0, 14.5];
        assert_eq!(sustained_rate(&times, 2), Some(3.0 / 1.5));
        assert_eq!(sustained_rate(&times, 0), Some(5.0 / 4.5));
        assert_eq!(sustained_rate(&times, 5), None);
        assert_eq!(sustained_rate(&[1.0], 0), None);
    }

    #[test]
    fn slugs() {
        assert_eq!(
            slug("slipstream, 16 slots, aging, cap 8.0 GiB"),
            "slipstream-16-slots-aging-cap-8-0-gib"
        );
    }
}

//! Result records and what is written from them: CSV, JSON, a markdown
//! table in the seed's form, and the three charts.

use std::fmt::Display;
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::cache::CacheReport;
use crate::chart::{Chart, Series};
use crate::machine::{Load, Stamp};
use crate::matrix::Setting;

/// How a run ended, for the tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    Ok,
    /// Killed at `--timeout-s`.
    DidNotFinish,
    /// Non-zero exit, a signal (an OOM kill under a cap), or no figures.
    Failed,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::DidNotFinish => "did-not-finish",
            Self::Failed => "failed",
        }
    }
}

/// One run's figures. Times in seconds, rates in tokens per second, sizes
/// in bytes.
#[derive(Clone, Debug, Serialize)]
pub struct Record {
    pub index: usize,
    /// Set on the drift repeat: the index of the run it repeats.
    pub repeat_of: Option<usize>,
    /// Setting label with the cap, e.g. `slipstream, 16 slots, aging, cap 8.0 GiB`.
    pub label: String,
    pub runtime: String,
    pub setting: Setting,
    pub prompt_len: usize,
    /// Tokens asked for.
    pub gen: usize,
    pub memory_cap_bytes: Option<u64>,
    pub threads: usize,
    pub status: Status,
    pub error: Option<String>,
    /// Generated tokens seen (slipstream: ids printed; llama-bench: the tg
    /// test's count once it finished).
    pub tokens_done: Option<usize>,
    /// Time to first token: slipstream from the start of generation (model
    /// open excluded) to the first token; llama.cpp prompt tokens / pp rate.
    pub ttft_s: Option<f64>,
    pub prefill_tok_s: Option<f64>,
    /// Sustained decode: tokens after the first `decode_skip_steps` decode
    /// steps over their time (slipstream); the tg rate (llama.cpp).
    pub decode_tok_s: Option<f64>,
    pub decode_skip_steps: usize,
    /// slipstream's own figure over every decode step.
    pub decode_all_tok_s: Option<f64>,
    /// Peak resident set of the child (VmHWM, from wait4).
    pub vmhwm_bytes: u64,
    /// Peak charge of the run's cgroup (anonymous + page cache), capped runs.
    pub cgroup_max_usage_bytes: Option<u64>,
    pub cgroup_failcnt: Option<u64>,
    pub cgroup_oom_kills: Option<u64>,
    /// max(VmHWM, cgroup peak): the figure the tables and charts use.
    pub peak_memory_bytes: u64,
    /// Expert misses per decode token (slipstream).
    pub misses_per_token: Option<f64>,
    /// Expert bytes read, prefill and decode (slipstream).
    pub expert_bytes_read: Option<u64>,
    /// Bytes the child read from storage (`ru_inblock`).
    pub disk_read_bytes: u64,
    pub wall_s: f64,
    pub user_s: f64,
    pub sys_s: f64,
    pub cache: CacheReport,
    #[serde(flatten)]
    pub load: Load,
    pub started_at: String,
    pub command: String,
    pub log_dir: String,
}

/// The repeat of the first run, compared with it.
#[derive(Clone, Debug, Serialize)]
pub struct Drift {
    pub first: usize,
    pub repeat: usize,
    /// Sustained decode tokens/s of each.
    pub first_decode_tok_s: Option<f64>,
    pub repeat_decode_tok_s: Option<f64>,
    /// |repeat - first| / first of the decode rate.
    pub relative: Option<f64>,
    /// Time to first token of each, and its relative change.
    pub first_ttft_s: Option<f64>,
    pub repeat_ttft_s: Option<f64>,
    pub ttft_relative: Option<f64>,
    pub threshold: f64,
    /// True when the relative change exceeds the threshold or could not be
    /// computed (a run that did not finish): the results are still written
    /// but should not be published.
    pub discarded: bool,
    pub note: String,
}

/// Compares the repeat with the first run: both the decode rate and the
/// time to first token must stay within the threshold (a prompt can drift
/// while decode holds: the file cache and memory state reach prefill first).
pub fn drift(records: &[Record], threshold: f64) -> Option<Drift> {
    let rep = records.iter().find(|r| r.repeat_of.is_some())?;
    let first = records.iter().find(|r| Some(r.index) == rep.repeat_of)?;
    let rate = |r: &Record| r.decode_tok_s.or(r.decode_all_tok_s);
    let (a, b) = (rate(first), rate(rep));
    let relative = moved(a, b);
    let ttft_relative = moved(first.ttft_s, rep.ttft_s);
    let (discarded, note) = drift_verdict(relative, ttft_relative, threshold);
    Some(Drift {
        first: first.index,
        repeat: rep.index,
        first_decode_tok_s: a,
        repeat_decode_tok_s: b,
        relative,
        first_ttft_s: first.ttft_s,
        repeat_ttft_s: rep.ttft_s,
        ttft_relative,
        threshold,
        discarded,
        note,
    })
}

/// `|b - a| / a`, when both exist and `a > 0`.
fn moved(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if a > 0.0 => Some((b - a).abs() / a),
        _ => None,
    }
}

/// Whether a run is discarded, and why, from the relative changes of its
/// repeated decode rate (required) and time to first token (counted when
/// both runs have one).
fn drift_verdict(decode: Option<f64>, ttft: Option<f64>, threshold: f64) -> (bool, String) {
    let Some(d) = decode else {
        return (
            true,
            "no decode figure for the first run or its repeat: discarded".to_string(),
        );
    };
    let pct = |x: f64| x * 100.0;
    let mut note = format!("decode moved {:.1} %", pct(d));
    if let Some(t) = ttft {
        note.push_str(&format!(", time to first token {:.1} %", pct(t)));
    }
    let over = d > threshold || ttft.is_some_and(|t| t > threshold);
    if over {
        note.push_str(&format!(" (> {:.1} %): discarded", pct(threshold)));
    } else {
        note.push_str(&format!(" (<= {:.1} %)", pct(threshold)));
    }
    (over, note)
}

#[cfg(test)]
mod drift_tests {
    use super::*;

    #[test]
    fn either_figure_past_the_threshold_discards() {
        assert!(!drift_verdict(Some(0.01), Some(0.04), 0.05).0);
        assert!(drift_verdict(Some(0.06), Some(0.01), 0.05).0);
        // Decode held, the prompt did not (run 12 of 2026-12-04: 0.051 and
        // 0.456).
        let (discarded, note) = drift_verdict(Some(0.01), Some(0.456), 0.05);
        assert!(discarded);
        assert!(note.contains("time to first token 45.6 %"), "{note}");
        // No time to first token on one side: decode alone decides.
        assert!(!drift_verdict(Some(0.01), None, 0.05).0);
        assert!(drift_verdict(None, Some(0.0), 0.05).0);
        assert_eq!(moved(Some(10.0), Some(9.0)), Some(0.1));
        assert_eq!(moved(Some(0.0), Some(9.0)), None);
        assert_eq!(moved(None, Some(9.0)), None);
    }
}

/// Everything about a benchmark run that is not a record.
#[derive(Clone, Debug, Serialize)]
pub struct Meta {
    #[serde(flatten)]
    pub stamp: Stamp,
    pub model: String,
    /// The slipstream binary that ran the slipstream rows.
    pub runner: String,
    pub gguf: Option<String>,
    pub peer: Option<String>,
    pub prompt_source: String,
    pub threads: usize,
    pub gen: usize,
    pub cache_mode: String,
    pub evict: String,
    pub decode_skip_steps: usize,
    pub timeout_s: Option<f64>,
    pub finished: bool,
}

/// The whole result file.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub meta: Meta,
    pub drift: Option<Drift>,
    pub records: Vec<Record>,
}

/// Writes `bytes` to `path` through a temp file and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!(
        "{}.tmp",
        path.extension().and_then(|e| e.to_str()).unwrap_or("")
    ));
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} into place", path.display()))
}

/// Writes a benchmark's files into `dir`: `results.csv`, `results.json`
/// (`report`), `table.md`, and each chart as `{chart_prefix}{name}.svg`
/// and `.png`.
pub(crate) fn write_results(
    dir: &Path,
    report: &impl Serialize,
    csv: &str,
    markdown: &str,
    charts: &[(&str, Chart)],
    chart_prefix: &str,
) -> Result<()> {
    write_atomic(&dir.join("results.csv"), csv.as_bytes())?;
    write_atomic(
        &dir.join("results.json"),
        &serde_json::to_vec_pretty(report).context("serializing results")?,
    )?;
    write_atomic(&dir.join("table.md"), markdown.as_bytes())?;
    for (name, chart) in charts {
        let path = |ext: &str| dir.join(format!("{chart_prefix}{name}.{ext}"));
        write_atomic(&path("svg"), crate::chart::svg(chart).as_bytes())?;
        write_atomic(&path("png"), &crate::chart::png(chart)?)?;
    }
    Ok(())
}

/// `v` with `digits` decimals, or an empty cell.
pub(crate) fn fixed_or_blank(v: Option<f64>, digits: usize) -> String {
    v.map_or(String::new(), |v| format!("{v:.digits$}"))
}

/// `v`, or an empty cell.
pub(crate) fn or_blank(v: Option<impl Display>) -> String {
    v.map_or(String::new(), |v| v.to_string())
}

/// `header` and a line per row of fields (each escaped as it needs:
/// [`csv_field`]).
pub(crate) fn csv_lines<R: AsRef<[String]>>(
    header: &str,
    rows: impl IntoIterator<Item = R>,
) -> String {
    let mut out = format!("{header}\n");
    for fields in rows {
        out.push_str(&fields.as_ref().join(","));
        out.push('\n');
    }
    out
}

pub(crate) fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One CSV line per record, with a header.
pub fn csv(report: &Report) -> String {
    let discarded = report.drift.as_ref().is_some_and(|d| d.discarded);
    let rows = report.records.iter().map(|r| {
        [
            r.index.to_string(),
            or_blank(r.repeat_of),
            csv_field(&r.label),
            r.runtime.clone(),
            r.prompt_len.to_string(),
            r.gen.to_string(),
            or_blank(r.memory_cap_bytes),
            r.threads.to_string(),
            r.status.name().to_string(),
            or_blank(r.tokens_done),
            fixed_or_blank(r.ttft_s, 3),
            fixed_or_blank(r.prefill_tok_s, 3),
            fixed_or_blank(r.decode_tok_s, 3),
            r.decode_skip_steps.to_string(),
            fixed_or_blank(r.decode_all_tok_s, 3),
            r.vmhwm_bytes.to_string(),
            or_blank(r.cgroup_max_usage_bytes),
            r.peak_memory_bytes.to_string(),
            fixed_or_blank(r.misses_per_token, 2),
            or_blank(r.expert_bytes_read),
            r.disk_read_bytes.to_string(),
            format!("{:.3}", r.wall_s),
            r.cache.mode.name().to_string(),
            r.cache.method.clone(),
            fixed_or_blank(r.cache.resident_fraction, 4),
            fixed_or_blank(r.load.load_before.map(|l| l[0]), 2),
            fixed_or_blank(r.load.load_after.map(|l| l[0]), 2),
            fixed_or_blank(r.load.steal_fraction.map(|f| f * 100.0), 2),
            r.started_at.clone(),
            report.meta.stamp.commit.clone(),
            discarded.to_string(),
            csv_field(r.error.as_deref().unwrap_or("")),
        ]
    });
    csv_lines(
        "index,repeat_of,label,runtime,prompt_len,gen,memory_cap_bytes,threads,status,tokens_done,ttft_s,prefill_tok_s,decode_tok_s,decode_skip_steps,decode_all_tok_s,vmhwm_bytes,cgroup_max_usage_bytes,peak_memory_bytes,misses_per_token,expert_bytes_read,disk_read_bytes,wall_s,cache_mode,cache_method,cache_resident_fraction,load_before_1m,load_after_1m,steal_pct,started_at,commit,discarded,error",
        rows,
    )
}

/// `6.04 GB`, or `21 MB` below a gigabyte.
fn gb(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else {
        format!("{:.0} MB", bytes as f64 / 1e6)
    }
}

/// Rows of the tables: every label in first-seen order, the drift repeat left out.
fn labels(report: &Report) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in report.records.iter().filter(|r| r.repeat_of.is_none()) {
        if !out.contains(&r.label) {
            out.push(r.label.clone());
        }
    }
    out
}

fn lens(report: &Report) -> Vec<usize> {
    let mut v: Vec<usize> = report.records.iter().map(|r| r.prompt_len).collect();
    v.sort_unstable();
    v.dedup();
    v
}

fn cell(r: Option<&Record>, value: impl Fn(&Record) -> Option<f64>) -> String {
    match r {
        None => String::new(),
        Some(r) => match (r.status, value(r)) {
            (_, Some(v)) if r.status == Status::Ok => format!("{v:.2}"),
            (Status::DidNotFinish, Some(v)) => format!("{v:.2} (dnf)"),
            (Status::DidNotFinish, None) => match r.tokens_done {
                Some(n) => format!("dnf ({n} tok)"),
                None => "dnf".to_string(),
            },
            (_, Some(v)) => format!("{v:.2} ({})", r.status.name()),
            (s, None) => s.name().to_string(),
        },
    }
}

/// Picks one figure out of a record.
type Figure = fn(&Record) -> Option<f64>;

/// The seed's tables (time to first token and sustained decode, by prompt
/// length, with prefill between them) in markdown, with the date, commit
/// and drift under them.
pub fn markdown(report: &Report) -> String {
    let lens = lens(report);
    let labels = labels(report);
    let head = |what: &str| {
        let mut s = format!("{what}\n\n| runtime and setting | peak memory |");
        for l in &lens {
            s.push_str(&format!(" {} |", prompt_name(*l)));
        }
        s.push_str("\n| --- | ---: |");
        for _ in &lens {
            s.push_str(" ---: |");
        }
        s.push('\n');
        s
    };
    let find = |label: &str, len: usize| {
        report
            .records
            .iter()
            .find(|r| r.repeat_of.is_none() && r.label == label && r.prompt_len == len)
    };
    let peak = |label: &str| {
        report
            .records
            .iter()
            .filter(|r| r.repeat_of.is_none() && r.label == label && r.peak_memory_bytes > 0)
            .map(|r| r.peak_memory_bytes)
            .max()
            .map_or(String::new(), gb)
    };
    let mut out = String::new();
    let tables: [(&str, Figure); 3] = [
        ("Time to first token, seconds, by prompt length:", |r| {
            r.ttft_s
        }),
        ("Prefill, tokens per second, by prompt length:", |r| {
            r.prefill_tok_s
        }),
        (
            "Sustained decode, tokens per second, by prompt length:",
            |r| r.decode_tok_s,
        ),
    ];
    for (title, value) in tables {
        out.push_str(&head(title));
        for label in &labels {
            out.push_str(&format!("| {label} | {} |", peak(label)));
            for &l in &lens {
                out.push_str(&format!(" {} |", cell(find(label, l), value)));
            }
            out.push('\n');
        }
        out.push('\n');
    }
    let m = &report.meta;
    out.push_str(&format!(
        "{}; {} threads, {} generated tokens asked, file cache {} ({}) before each run, decode rate after the first {} decode steps; peak memory is the largest over the prompt lengths of max(VmHWM, the cgroup's peak under a cap, which counts page cache); llama.cpp rows come from llama-bench (pp and tg as separate loops, time to first token = prompt tokens / pp rate). ",
        m.stamp.measured(),
        m.threads,
        m.gen,
        m.cache_mode,
        m.evict,
        m.decode_skip_steps
    ));
    match &report.drift {
        Some(d) => out.push_str(&format!(
            "Drift check (run {} repeated as run {}): {}.\n",
            d.first, d.repeat, d.note
        )),
        None => out.push_str("No drift check.\n"),
    }
    let steal: Vec<f64> = report
        .records
        .iter()
        .filter_map(|r| r.load.steal_fraction)
        .collect();
    if let (Some(lo), Some(hi)) = (
        steal.iter().copied().reduce(f64::min),
        steal.iter().copied().reduce(f64::max),
    ) {
        out.push_str(&format!(
            "CPU time stolen by the hypervisor during a run: {:.1}-{:.1} %.\n",
            lo * 100.0,
            hi * 100.0
        ));
    }
    out
}

/// `1024` -> `1k`, `3072` -> `3k`, `500` -> `500`.
fn prompt_name(n: usize) -> String {
    if n >= 1024 && n.is_multiple_of(1024) {
        format!("{}k", n / 1024)
    } else {
        n.to_string()
    }
}

/// The three charts: time to first token by prompt length, decode by
/// prompt length, decode by peak memory.
pub fn charts(report: &Report) -> Vec<(&'static str, Chart)> {
    let labels = labels(report);
    let series = |x: &dyn Fn(&Record) -> Option<f64>, y: &dyn Fn(&Record) -> Option<f64>| {
        labels
            .iter()
            .map(|label| {
                let mut points: Vec<(f64, f64)> = report
                    .records
                    .iter()
                    .filter(|r| {
                        r.repeat_of.is_none() && &r.label == label && r.status == Status::Ok
                    })
                    .filter_map(|r| Some((x(r)?, y(r)?)))
                    .collect();
                points.sort_by(|a, b| a.0.total_cmp(&b.0));
                Series {
                    name: label.clone(),
                    points,
                }
            })
            .filter(|s| !s.points.is_empty())
            .collect::<Vec<_>>()
    };
    let suffix = match &report.drift {
        Some(d) if d.discarded => " (DISCARDED: drift)".to_string(),
        _ => String::new(),
    };
    let plen = |r: &Record| Some(r.prompt_len as f64);
    vec![
        (
            "ttft",
            Chart {
                title: format!("Time to first token by prompt length{suffix}"),
                x_label: "prompt tokens (log scale)".into(),
                y_label: "seconds".into(),
                x_log: true,
                series: series(&plen, &|r| r.ttft_s),
            },
        ),
        (
            "decode",
            Chart {
                title: format!("Sustained decode by prompt length{suffix}"),
                x_label: "prompt tokens (log scale)".into(),
                y_label: "tokens per second".into(),
                x_log: true,
                series: series(&plen, &|r| r.decode_tok_s),
            },
        ),
        (
            "decode-memory",
            Chart {
                title: format!("Decode by peak memory{suffix}"),
                x_label: "peak memory, GB (VmHWM, or the cgroup's peak under a cap)".into(),
                y_label: "tokens per second".into(),
                x_log: false,
                series: series(&|r| Some(r.peak_memory_bytes as f64 / 1e9), &|r| {
                    r.decode_tok_s
                }),
            },
        ),
    ]
}

//! llama.cpp as a peer: the `llama-bench` command line for each mode and
//! the parse of its output into the harness's figures.
//!
//! Flags as the vendored llama.cpp (llama-cpp-python 0.3.36) spells them in
//! `tools/llama-bench/llama-bench.cpp`: `-lm/--load-mode none|mmap` (there is
//! no `--mmap`/`-mmp` in this build; `none` is "no mmap"), `--repack 0|1`,
//! `--no-warmup`, `-r 1`, `-o jsonl` (one JSON object per finished test,
//! flushed at once, so a killed run keeps the tests it finished).
//!
//! llama-bench times prompt processing (`pp N`, an empty context, N prompt
//! tokens) and generation (`tg N`, N tokens from an empty context) as
//! separate loops; time to first token here is N / pp rate, as in the
//! seed's footnote 9, and decode is the tg rate.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::matrix::PeerMode;

/// The llama-bench binary in a peer directory (`DIR/llama-bench` or
/// `DIR/bin/llama-bench`).
pub fn llama_bench(dir: &Path) -> Result<PathBuf> {
    for cand in [dir.join("llama-bench"), dir.join("bin/llama-bench")] {
        if cand.is_file() {
            return Ok(cand);
        }
    }
    bail!(
        "no llama-bench in {} (nor in its bin/): build one with scripts/build_llama_cpp.sh {}",
        dir.display(),
        dir.display()
    )
}

/// `llama-bench` arguments for one run.
pub fn command(
    bin: &Path,
    gguf: &Path,
    mode: PeerMode,
    prompt_len: usize,
    gen: usize,
    threads: usize,
) -> Command {
    let mut c = Command::new(bin);
    c.arg("-m").arg(gguf);
    c.args(["-p", &prompt_len.to_string(), "-n", &gen.to_string()]);
    c.args([
        "-t",
        &threads.to_string(),
        "-r",
        "1",
        "--no-warmup",
        "-o",
        "jsonl",
    ]);
    let (load, repack) = match mode {
        PeerMode::Mmap => ("mmap", Some("0")),
        PeerMode::MmapRepack => ("mmap", None),
        PeerMode::NoMmap => ("none", Some("0")),
        PeerMode::NoMmapRepack => ("none", None),
    };
    c.args(["-lm", load]);
    if let Some(r) = repack {
        c.args(["--repack", r]);
    }
    c
}

/// Figures parsed from llama-bench output.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PeerFigures {
    /// Prompt processing tokens/s of the `pp` test, if it finished.
    pub pp_tokens_per_s: Option<f64>,
    pub pp_tokens: Option<usize>,
    /// Generation tokens/s of the `tg` test, if it finished.
    pub tg_tokens_per_s: Option<f64>,
    pub tg_tokens: Option<usize>,
    /// `build_commit` llama-bench reports.
    pub build_commit: Option<String>,
    pub load_mode: Option<String>,
    pub repack: Option<bool>,
}

/// Parses llama-bench output: JSON lines (`-o jsonl`), a JSON array
/// (`-o json`), or the default markdown table (`-o md`). Lines that are
/// none of these (log lines) are skipped.
pub fn parse_output(text: &str) -> Result<PeerFigures> {
    let mut tests: Vec<serde_json::Value> = Vec::new();
    let trimmed = text.trim_start();
    if trimmed.starts_with('[') {
        if let Ok(serde_json::Value::Array(a)) = serde_json::from_str(trimmed) {
            tests = a;
        }
    }
    if tests.is_empty() {
        for line in text.lines() {
            let l = line.trim();
            if l.starts_with('{') {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(l) {
                    tests.push(v);
                }
            }
        }
    }
    let mut f = PeerFigures::default();
    if tests.is_empty() {
        return parse_markdown(text);
    }
    for t in &tests {
        let n_prompt = t["n_prompt"].as_u64().unwrap_or(0) as usize;
        let n_gen = t["n_gen"].as_u64().unwrap_or(0) as usize;
        let ts = t["avg_ts"]
            .as_f64()
            .with_context(|| format!("llama-bench test without avg_ts: {t}"))?;
        if n_gen == 0 && n_prompt > 0 {
            f.pp_tokens_per_s = Some(ts);
            f.pp_tokens = Some(n_prompt);
        } else if n_gen > 0 && n_prompt == 0 {
            f.tg_tokens_per_s = Some(ts);
            f.tg_tokens = Some(n_gen);
        }
        if let Some(c) = t["build_commit"].as_str() {
            f.build_commit = Some(c.to_string());
        }
        if let Some(m) = t["load_mode"].as_str() {
            f.load_mode = Some(m.to_string());
        }
        match &t["repack"] {
            serde_json::Value::Bool(b) => f.repack = Some(*b),
            serde_json::Value::Number(n) => f.repack = Some(n.as_u64() != Some(0)),
            serde_json::Value::String(s) => f.repack = Some(s != "0" && s != "false"),
            _ => {}
        }
    }
    Ok(f)
}

/// `| model | size | params | backend | threads | test | t/s |` rows, e.g.
/// `| ... | pp512 | 14.20 ± 0.05 |`.
fn parse_markdown(text: &str) -> Result<PeerFigures> {
    let mut f = PeerFigures::default();
    let mut header: Option<Vec<String>> = None;
    for line in text.lines() {
        let l = line.trim();
        if !l.starts_with('|') {
            continue;
        }
        let cells: Vec<String> = l
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().to_string())
            .collect();
        if cells
            .iter()
            .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
        {
            continue;
        }
        let Some(h) = &header else {
            header = Some(cells);
            continue;
        };
        let col = |name: &str| h.iter().position(|c| c == name).and_then(|i| cells.get(i));
        let (Some(test), Some(ts)) = (col("test"), col("t/s")) else {
            continue;
        };
        let rate: f64 = match ts.split_whitespace().next().and_then(|v| v.parse().ok()) {
            Some(v) => v,
            None => continue,
        };
        if let Some(n) = test.strip_prefix("pp").and_then(|n| n.parse().ok()) {
            f.pp_tokens_per_s = Some(rate);
            f.pp_tokens = Some(n);
        } else if let Some(n) = test.strip_prefix("tg").and_then(|n| n.parse().ok()) {
            f.tg_tokens_per_s = Some(rate);
            f.tg_tokens = Some(n);
        }
    }
    if f.pp_tokens_per_s.is_none() && f.tg_tokens_per_s.is_none() && header.is_none() {
        bail!("no llama-bench results in its output (expected JSON lines or a markdown table)");
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jsonl_and_partial() {
        let out = r#"
{"build_commit": "0c1e570", "n_threads": 2, "load_mode": "mmap", "repack": false, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 36000000000, "avg_ts": 14.2, "stddev_ts": 0.0, "samples_ns": [ 1 ], "samples_ts": [ 14.2 ]}
{"build_commit": "0c1e570", "n_threads": 2, "load_mode": "mmap", "repack": false, "n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ns": 1, "avg_ts": 6.25, "stddev_ts": 0.0, "samples_ns": [ 1 ], "samples_ts": [ 6.25 ]}
"#;
        let f = parse_output(out).unwrap();
        assert_eq!(f.pp_tokens_per_s, Some(14.2));
        assert_eq!(f.pp_tokens, Some(512));
        assert_eq!(f.tg_tokens_per_s, Some(6.25));
        assert_eq!(f.build_commit.as_deref(), Some("0c1e570"));
        assert_eq!(f.repack, Some(false));
        let first_only = out.trim().lines().next().unwrap();
        let f = parse_output(first_only).unwrap();
        assert_eq!(f.tg_tokens_per_s, None);
        assert_eq!(f.pp_tokens_per_s, Some(14.2));
    }

    #[test]
    fn markdown_and_json_array() {
        let md = "| model | size | params | backend | threads | test | t/s |\n| --- | ---: | ---: | --- | ---: | ---: | ---: |\n| qwen35moe 35B Q4_0 | 18.9 GiB | 34.7 B | CPU | 2 | pp1024 | 12.50 ± 0.10 |\n| qwen35moe 35B Q4_0 | 18.9 GiB | 34.7 B | CPU | 2 | tg128 | 6.10 ± 0.02 |\n";
        let f = parse_output(md).unwrap();
        assert_eq!(f.pp_tokens, Some(1024));
        assert_eq!(f.tg_tokens_per_s, Some(6.10));
        let arr = r#"[ {"n_prompt": 0, "n_gen": 16, "avg_ts": 3.5} ]"#;
        assert_eq!(parse_output(arr).unwrap().tg_tokens_per_s, Some(3.5));
        assert!(parse_output("main: error: failed to load model\n").is_err());
    }

    #[test]
    fn command_flags() {
        let c = command(
            Path::new("/x/llama-bench"),
            Path::new("/m.gguf"),
            PeerMode::Mmap,
            1024,
            128,
            2,
        );
        let args: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into()).collect();
        let s = args.join(" ");
        assert!(
            s.contains("-p 1024 -n 128 -t 2 -r 1 --no-warmup -o jsonl -lm mmap --repack 0"),
            "{s}"
        );
        let c = command(Path::new("b"), Path::new("m"), PeerMode::NoMmap, 8, 4, 1);
        let s: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into()).collect();
        assert!(s.join(" ").ends_with("-lm none --repack 0"));
        let c = command(
            Path::new("b"),
            Path::new("m"),
            PeerMode::NoMmapRepack,
            8,
            4,
            1,
        );
        let s: Vec<String> = c.get_args().map(|a| a.to_string_lossy().into()).collect();
        assert!(s.join(" ").ends_with("-lm none"));
    }
}

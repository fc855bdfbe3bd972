//! End-to-end tests of `slipstream bench` on a committed fixture: a tiny
//! matrix writes CSV, JSON, a table and charts with a drift check; the
//! timeout path; a malformed flag; a fake llama-bench peer parsed into the
//! same records; a memory cap where cgroups are writable.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use common::{read_json, utf8};
use slipstream_testkit::bin;
use slipstream_testkit::cli::{self, ok};

/// A temp dir with the repacked fixture model (`m.slip`) in it, and `out`
/// there for the results.
fn model_and_out() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m.slip");
    cli::repack(bin!(), "qwen3_moe", None, &model);
    let out = tmp.path().join("out");
    (tmp, model, out)
}

/// `slipstream bench --model MODEL FLAG VALUE... --out OUT`, which must
/// succeed; its stdout and stderr.
fn bench(model: &Path, flags: &[(&str, &str)], out: &Path) -> (String, String) {
    let mut cmd = bin!();
    cmd.args(["bench", "--model"]).arg(model);
    for (flag, value) in flags {
        cmd.args([flag, value]);
    }
    ok(cmd.arg("--out").arg(out).output().unwrap())
}

/// Stderr of `slipstream ARGS...`, which must fail without a panic.
fn refused(args: &[&str]) -> String {
    let out = bin!().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(!out.status.success(), "{args:?} should fail");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

fn results(dir: &Path) -> serde_json::Value {
    read_json(&dir.join("results.json"))
}

fn check_charts(dir: &Path) {
    for name in ["ttft", "decode", "decode-memory"] {
        let svg = std::fs::read_to_string(dir.join(format!("bench-{name}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        let png = std::fs::read(dir.join(format!("bench-{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
}

/// `slipstream bench` on `model`: 8-token prompts, `gen` tokens, one
/// thread, results in `out`; its stdout (the tables).
fn small_matrix(model: &Path, slots: &str, gen: usize, skip_steps: usize, out: &Path) -> String {
    let (gen, skip_steps) = (gen.to_string(), skip_steps.to_string());
    let flags = [
        ("--slots", slots),
        ("--prompt-lens", "8"),
        ("--gen", &gen),
        ("--skip-steps", &skip_steps),
        ("--threads", "1"),
    ];
    bench(model, &flags, out).0
}

#[test]
fn tiny_matrix_writes_results_with_drift_check() {
    let (_tmp, m, out) = model_and_out();
    let stdout = small_matrix(&m, "1,all", 12, 2, &out);
    assert!(
        stdout.contains("| slipstream, 1 slots, aging |"),
        "{stdout}"
    );
    assert!(stdout.contains("Drift check"), "{stdout}");
    let j = results(&out);
    let recs = j["records"].as_array().unwrap();
    assert_eq!(recs.len(), 3, "two runs and the drift repeat");
    assert_eq!(recs[2]["repeat_of"], 0);
    for r in recs {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["prompt_len"], 8);
        assert!(r["ttft_s"].as_f64().unwrap() > 0.0);
        assert!(r["vmhwm_bytes"].as_u64().unwrap() > 1 << 20);
        assert_eq!(r["cache"]["method"], "fadvise");
        if r["tokens_done"] == 12 {
            assert!(r["decode_tok_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    // The all-slots run asked for as many slots as the model has experts.
    assert!(recs[1]["command"]
        .as_str()
        .unwrap()
        .contains("--expert-cache-slots 8"));
    let d = &j["drift"];
    let (a, b) = (
        d["first_decode_tok_s"].as_f64(),
        d["repeat_decode_tok_s"].as_f64(),
    );
    if let (Some(a), Some(b)) = (a, b) {
        let rel = d["relative"].as_f64().unwrap();
        assert!((rel - (b - a).abs() / a).abs() < 1e-9);
        // Time to first token counts too (it drifts on a busy machine).
        let ttft_over = d["ttft_relative"].as_f64().is_some_and(|t| t > 0.05);
        assert_eq!(d["discarded"].as_bool().unwrap(), rel > 0.05 || ttft_over);
    } else {
        assert_eq!(d["discarded"], true);
    }
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4);
    assert!(csv.starts_with("index,repeat_of,label,"));
    assert!(std::fs::read_to_string(out.join("table.md"))
        .unwrap()
        .contains("Sustained decode"));
    check_charts(&out);
}

/// A GGUF file as `--model`: read in place (its manifest from the importer,
/// the file itself evicted), and `--slots auto` leaves the slot choice to
/// the child's memory plan, which it prints.
#[test]
fn gguf_in_place_with_auto_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    std::fs::copy(
        slipstream_testkit::fixture("gguf_qwen3moe_q4_0").join("model.gguf"),
        &gguf,
    )
    .unwrap();
    let out = tmp.path().join("out");
    let stdout = small_matrix(&gguf, "auto,all", 6, 1, &out);
    assert!(
        stdout.contains("| slipstream, auto slots, aging |"),
        "{stdout}"
    );
    let recs = results(&out)["records"].as_array().unwrap().clone();
    assert_eq!(recs.len(), 3, "two runs and the drift repeat");
    for r in &recs {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["tokens_done"], 6, "{r}");
    }
    let auto = recs[0]["command"].as_str().unwrap();
    assert!(!auto.contains("--expert-cache-slots"), "{auto}");
    assert!(recs[1]["command"]
        .as_str()
        .unwrap()
        .contains("--expert-cache-slots"));
    // Run `i`'s log file `name`.
    let log = |i: usize, name: &str| {
        let dir = std::fs::read_dir(out.join("runs"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(&format!("{i:02}-"))
            })
            .unwrap();
        std::fs::read_to_string(dir.join(name)).unwrap()
    };
    let stderr = log(0, "stderr.txt");
    assert!(stderr.contains("[memory]"), "{stderr}");
    // The same greedy tokens whatever the slot count.
    let ids = |i: usize| log(i, "stdout.txt");
    assert!(ids(0).split_whitespace().count() >= 6, "{}", ids(0));
    assert_eq!(ids(0), ids(1));
}

#[test]
fn timeout_gives_did_not_finish_rows() {
    let (_tmp, m, out) = model_and_out();
    // Enough work that the child is still running when the harness first
    // looks (it polls every 10 ms): 4 tokens could finish first.
    let flags = [
        ("--slots", "2"),
        ("--prompt-lens", "8"),
        ("--gen", "1000"),
        ("--timeout-s", "0.001"),
    ];
    bench(&m, &flags, &out);
    let j = results(&out);
    for r in j["records"].as_array().unwrap() {
        assert_eq!(r["status"], "did-not-finish", "{r}");
        assert!(r["tokens_done"].as_u64().unwrap() < 1000);
        assert!(r["error"].as_str().unwrap().contains("timeout"));
    }
    assert_eq!(j["drift"]["discarded"], true);
    check_charts(&out);
}

#[test]
fn malformed_flags_are_clear_errors() {
    let (tmp, m, _) = model_and_out();
    for (flag, value, expect) in [
        ("--slots", "16,,64", "--slots"),
        ("--slots", "many", "bad slot count"),
        ("--memory-cap", "8X", "--memory-cap"),
        ("--prompt-lens", "0", "prompt length 0"),
        ("--policy", "fifo", "unknown policy"),
    ] {
        let stderr = refused(&["bench", "--model", utf8(&m), flag, value]);
        assert!(stderr.starts_with("error:"), "{stderr}");
        assert!(stderr.contains(expect), "{flag} {value}: {stderr}");
    }
    let stderr = refused(&["bench", "--model", utf8(tmp.path())]);
    assert!(stderr.contains("manifest.json"), "{stderr}");
}

#[test]
fn fake_llama_bench_peer_is_parsed() {
    let (tmp, m, out) = model_and_out();
    let peer = tmp.path().join("peer");
    std::fs::create_dir(&peer).unwrap();
    let script = peer.join("llama-bench");
    // Prints llama-bench's -o jsonl lines; the rates depend on -lm so the
    // rows are told apart; the arguments are kept for inspection.
    std::fs::write(
        &script,
        r#"#!/bin/sh
echo "$@" >> "$(dirname "$0")/args.log"
lm=mmap; p=0; n=0
while [ $# -gt 0 ]; do
  case "$1" in -lm) lm=$2; shift;; -p) p=$2; shift;; -n) n=$2; shift;; esac; shift
done
if [ "$lm" = none ]; then pp=20.5; tg=7.25; else pp=10.0; tg=5.5; fi
echo "llama-bench: some log line" >&2
echo "{\"build_commit\": \"0c1e570\", \"load_mode\": \"$lm\", \"n_prompt\": $p, \"n_gen\": 0, \"avg_ts\": $pp}"
echo "{\"build_commit\": \"0c1e570\", \"load_mode\": \"$lm\", \"n_prompt\": 0, \"n_gen\": $n, \"avg_ts\": $tg}"
"#,
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF fake").unwrap();
    let peer_dir = format!("llama.cpp={}", peer.display());
    let flags = [
        ("--gguf", utf8(&gguf)),
        ("--peer", &peer_dir),
        ("--slots", "2"),
        ("--prompt-lens", "10"),
        ("--gen", "6"),
        ("--threads", "1"),
    ];
    let (stdout, _) = bench(&m, &flags, &out);
    assert!(
        stdout.contains("llama.cpp, --mmap 0, --repack 0"),
        "{stdout}"
    );
    let j = results(&out);
    let recs = j["records"].as_array().unwrap();
    let peer_rows: Vec<&serde_json::Value> = recs
        .iter()
        .filter(|r| r["runtime"] == "llama.cpp")
        .collect();
    assert_eq!(peer_rows.len(), 2);
    let mmap = peer_rows[0];
    assert_eq!(mmap["status"], "ok", "{mmap}");
    assert_eq!(mmap["decode_tok_s"], 5.5);
    assert_eq!(mmap["prefill_tok_s"], 10.0);
    assert!((mmap["ttft_s"].as_f64().unwrap() - 1.0).abs() < 1e-9);
    assert_eq!(mmap["tokens_done"], 6);
    assert_eq!(peer_rows[1]["decode_tok_s"], 7.25);
    let args = std::fs::read_to_string(peer.join("args.log")).unwrap();
    assert!(
        args.contains("-p 10 -n 6 -t 1 -r 1 --no-warmup -o jsonl -lm mmap --repack 0"),
        "{args}"
    );
    assert!(args.contains("-lm none"), "{args}");
    check_charts(&out);
}

#[test]
fn memory_cap_runs_in_a_cgroup_where_allowed() {
    let parent = match std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.split_once(":memory:").map(|(_, p)| p.to_string()))
        }) {
        Some(p) => Path::new("/sys/fs/cgroup/memory").join(p.trim_start_matches('/')),
        None => {
            eprintln!("skipped: no cgroup v1 memory controller");
            return;
        }
    };
    let probe = parent.join(format!("slipstream-test-probe-{}", std::process::id()));
    if std::fs::create_dir(&probe).is_err() {
        eprintln!("skipped: {} is not writable", parent.display());
        return;
    }
    std::fs::remove_dir(&probe).unwrap();
    let (_tmp, m, out) = model_and_out();
    let flags = [
        ("--slots", "2"),
        ("--prompt-lens", "8"),
        ("--gen", "4"),
        ("--memory-cap", "1G"),
        ("--cap-runs", "capped"),
    ];
    bench(&m, &flags, &out);
    let j = results(&out);
    for r in j["records"].as_array().unwrap() {
        assert_eq!(r["status"], "ok", "{r}");
        assert_eq!(r["memory_cap_bytes"], 1u64 << 30);
        let cg = r["cgroup_max_usage_bytes"].as_u64().unwrap();
        assert!(cg > 0 && cg <= 1 << 30, "{r}");
        assert_eq!(r["cache"]["mode"], "cold");
    }
    // Every run's cgroup was removed.
    let left: Vec<_> = std::fs::read_dir(&parent)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("slipstream-bench-")
        })
        .collect();
    assert!(left.is_empty(), "cgroups left behind: {left:?}");
}

/// `bench agent` starting both servers itself: `slipstream serve` on the
/// demo model, and a fake llama-server (a script that records its
/// arguments and serves the same model with `slipstream serve` on the port
/// it was given) on a placeholder GGUF.
#[test]
fn agent_replay_starts_both_servers() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = tmp.path().join("demo.slip");
    ok(bin!()
        .args(["repack", "--input"])
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo"))
        .arg("--output")
        .arg(&demo)
        .output()
        .unwrap());
    let peer = tmp.path().join("llama");
    std::fs::create_dir_all(peer.join("bin")).unwrap();
    let script = peer.join("bin/llama-server");
    std::fs::write(
        &script,
        format!(
            r#"#!/bin/sh
echo "$@" > "$(dirname "$0")/args.log"
port=0
while [ $# -gt 0 ]; do
  case "$1" in --port) port=$2; shift;; esac; shift
done
exec {bin} serve --model {model} --port $port --any-model --threads 1
"#,
            bin = env!("CARGO_BIN_EXE_slipstream"),
            model = demo.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF placeholder").unwrap();
    let out = tmp.path().join("out");
    let (stdout, stderr) = ok(bin!()
        .args(["bench", "agent", "--model"])
        .arg(&demo)
        .arg("--gguf")
        .arg(&gguf)
        .arg("--llama-server")
        .arg(&peer)
        .arg("--transcript")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../bench/tests/fixtures/agent_tiny.json"))
        .args(["--max-tokens", "4", "--threads", "1", "--ctx-size", "4096"])
        .args(["--llama-server-arg=-np", "--llama-server-arg", "1"])
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap());
    assert!(stdout.contains("| 2 | title (side) |"), "{stdout}");
    assert!(
        stderr.contains("[bench agent] slipstream  3 turn 2"),
        "{stderr}"
    );
    let j = results(&out);
    let s = j["sessions"].as_array().unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(
        (s[0]["runtime"].as_str(), s[1]["runtime"].as_str()),
        (Some("slipstream"), Some("llama.cpp"))
    );
    assert!(s[0]["command"].as_str().unwrap().contains("serve --model"));
    let args = std::fs::read_to_string(peer.join("bin/args.log")).unwrap();
    assert!(
        args.contains("--jinja --ctx-checkpoints 32 --cache-ram 8192 --cache-reuse 256 -np 1"),
        "{args}"
    );
    assert!(args.contains("-t 1 -c 4096"), "{args}");
    for session in s {
        assert_eq!(session["failed_requests"], 0, "{session}");
        assert!(session["startup_s"].as_f64().unwrap() > 0.0);
        assert!(session["peak_rss_bytes"].as_u64().unwrap() > 1 << 20);
        assert!(out
            .join("logs")
            .join(format!(
                "{}.log",
                if session["runtime"] == "slipstream" {
                    "slipstream"
                } else {
                    "llama-cpp"
                }
            ))
            .is_file());
    }
    // slipstream serves turn 2 from its state cache.
    assert!(s[0]["rows"][2]["reused_tokens"].as_u64().unwrap() > 0);
    assert_eq!(s[1]["rows"].as_array().unwrap().len(), 4);
    for name in ["agent-ttft", "agent-elapsed"] {
        assert!(out.join(format!("{name}.svg")).is_file());
    }

    // Bad combinations are clear errors.
    for (args, expect) in [
        (vec!["bench", "agent"], "--server URL"),
        (
            vec!["bench", "agent", "--server", "localhost:1"],
            "must start with http://",
        ),
        (
            vec![
                "bench",
                "agent",
                "--server",
                "http://x",
                "--gguf",
                "/nonexistent",
            ],
            "--llama-server",
        ),
        (
            vec![
                "bench",
                "agent",
                "--server",
                "http://x",
                "--max-tokens",
                "0",
            ],
            "--max-tokens",
        ),
    ] {
        let bad = tmp.path().join("bad");
        let stderr = refused(&[&args[..], &["--out", utf8(&bad)]].concat());
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
    }
}

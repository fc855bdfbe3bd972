//! `slipstream run --kv-snapshot / --prompt-cache / --memory-limit` end to end.

mod common;

use std::path::Path;
use std::process::Output;

use common::{read_json, repack_fixture, run_command, utf8};
use slipstream_testkit::cli::ok;

/// A sampled 12-token run of `prompt` (3 expert slots, prefill chunks of
/// 4 tokens) with `extra`.
fn run(model: &Path, prompt: &str, extra: &[&str]) -> Output {
    let mut cmd = run_command(model, &["--prompt-tokens", prompt, "--max-new", "12"]);
    cmd.args(["--temperature", "0.8", "--seed", "5", "--print-ids"])
        .args(["--expert-cache-slots", "3", "--prefill-chunk", "4"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn kv_snapshot_second_run_restores_with_identical_output() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_5_moe_fused", "q4", tmp.path());
    let prompt = "11,48,85,122,159,196,233,270,307,344,381,418,455";
    let (plain, _) = ok(run(&model, prompt, &[]));
    let snap = tmp.path().join("p.snap");
    let s = utf8(&snap);

    let (first, err1) = ok(run(&model, prompt, &["--kv-snapshot", s]));
    assert_eq!(first, plain);
    assert!(err1.contains("does not exist yet"), "{err1}");
    assert!(err1.contains("[snapshot] wrote 13 tokens"), "{err1}");
    assert!(snap.exists());

    let curve = tmp.path().join("curve.csv");
    let stats = tmp.path().join("stats.json");
    let (second, err2) = ok(run(
        &model,
        prompt,
        &[
            "--kv-snapshot",
            s,
            "--decode-curve",
            utf8(&curve),
            "--stats-json",
            utf8(&stats),
        ],
    ));
    assert_eq!(second, plain, "restored output differs");
    assert!(err2.contains("[snapshot] restored 13 of 13"), "{err2}");
    assert!(err2.contains("warmed with"), "{err2}");
    assert!(
        !err2.contains("[snapshot] wrote"),
        "nothing to rewrite: {err2}"
    );
    let csv = std::fs::read_to_string(&curve).unwrap();
    assert_eq!(csv.lines().count(), 13, "{csv}");
    let json = read_json(&stats);
    assert_eq!(json["stats"]["reused_prompt_tokens"], 13);
    assert_eq!(json["restore"]["source"], "kv-snapshot");
    assert_eq!(json["token_times_s"].as_array().unwrap().len(), 12);

    // Cold restore: same output.
    let (cold, err3) = ok(run(
        &model,
        prompt,
        &["--kv-snapshot", s, "--no-warm-experts"],
    ));
    assert_eq!(cold, plain);
    assert!(err3.contains("expert cache cold"), "{err3}");

    // A longer prompt extends the snapshot: only the suffix is prefilled.
    let longer = format!("{prompt},17,19,23");
    let (plain_long, _) = ok(run(&model, &longer, &[]));
    let (ext, err4) = ok(run(&model, &longer, &["--kv-snapshot", s]));
    assert_eq!(ext, plain_long);
    assert!(err4.contains("restored 13 of 16"), "{err4}");
    assert!(err4.contains("[snapshot] wrote 16 tokens"), "{err4}");

    // A corrupted snapshot is a warning and a fresh prefill.
    let mut bytes = std::fs::read(&snap).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&snap, &bytes).unwrap();
    let (again, err5) = ok(run(&model, &longer, &["--kv-snapshot", s]));
    assert_eq!(again, plain_long);
    assert!(err5.contains("warning: ignoring snapshot"), "{err5}");
    assert!(err5.contains("checksum"), "{err5}");

    // Another model's snapshot likewise.
    let other = repack_fixture("qwen3_moe", "q4", tmp.path());
    let (_, _) = ok(run(&other, prompt, &["--kv-snapshot", s]));
    let (again, err6) = ok(run(&model, prompt, &["--kv-snapshot", s]));
    assert_eq!(again, plain);
    assert!(err6.contains("another model"), "{err6}");
}

#[test]
fn prompt_cache_and_memory_limit_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let model = repack_fixture("qwen3_5_moe_fused", "q4", tmp.path());
    let dir = tmp.path().join("pc");
    let d = utf8(&dir);
    let p1 = "11,48,85,122,159,196,233,270,307,344,381";
    let p2 = "11,48,85,122,159,196,233,270,307,1,2,3";
    let (plain2, _) = ok(run(&model, p2, &[]));
    let (_, err) = ok(run(&model, p1, &["--prompt-cache", d]));
    assert!(!err.contains("[prompt-cache] restored"), "{err}");
    let (out2, err2) = ok(run(&model, p2, &["--prompt-cache", d]));
    assert_eq!(out2, plain2);
    assert!(err2.contains("[prompt-cache] restored 8 of 12"), "{err2}");

    // A clear error after the [memory] plan line, not a panic.
    let stderr = slipstream_testkit::cli::failed(run(&model, p1, &["--memory-limit", "1M"]));
    assert!(stderr.contains("memory guard"), "{stderr}");
}

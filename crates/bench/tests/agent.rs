//! `bench agent` end to end against in-process servers on the demo model:
//! a tiny transcript (3 turns, 1 side request) replayed against a server
//! with its state cache and a peer without one; the rows in the CSV and the
//! JSON, the table and the charts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use slipstream_bench::agent::{run_agent_bench, AgentOptions, Target};
use slipstream_engine::{EngineConfig, StoreChoice};
use slipstream_server::{start, BackendSpec, RunningServer, ServerConfig, StateCacheSpec};

fn demo_model(dir: &Path) -> PathBuf {
    let out = dir.join("demo.slip");
    slipstream_repack::repack(
        &slipstream_repack::RepackOptions {
            input: Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/demo"),
            output: out.clone(),
            overwrite: Default::default(),
            quant: slipstream_repack::QuantChoice::Q4,
        },
        &|_| {},
    )
    .expect("repacking the demo model");
    out
}

fn server(model: &Path, states: StateCacheSpec) -> RunningServer {
    start(
        ServerConfig {
            port: 0,
            model_id: "demo".into(),
            ping_interval: Duration::from_millis(200),
            ..Default::default()
        },
        BackendSpec::Model {
            path: model.to_path_buf(),
            engine: EngineConfig {
                prefill_chunk: 16,
                store: StoreChoice::Resident,
                route_trace: None,
            },
            prompt_cache: None,
            state_cache: states,
        },
    )
    .expect("server starts")
}

/// Three turns of a tool-using conversation and a title request after the first.
fn transcript() -> Value {
    let verse = "And it came to pass in those days, that there went out a decree from Caesar Augustus, that all the world should be taxed.";
    let call = |id: &str, path: &str| {
        json!({"id": id, "type": "function",
               "function": {"name": "Read", "arguments": json!({"file_path": path}).to_string()}})
    };
    json!({
        "format": "slipstream-agent-transcript/1",
        "tools": [{"type": "function", "function": {"name": "Read", "description": "Reads a file.",
            "parameters": {"type": "object", "properties": {"file_path": {"type": "string"}},
                           "required": ["file_path"]}}}],
        "requests": [
            {"label": "turn 1", "kind": "turn", "append": [
                {"role": "system", "content": format!("You are a careful agent. {verse}")},
                {"role": "user", "content": format!("Read the book and tell me. {verse}")}]},
            {"label": "title", "kind": "side", "messages": [
                {"role": "system", "content": "Give a title of three words."},
                {"role": "user", "content": "Read the book and tell me."}]},
            {"label": "turn 2", "kind": "turn", "append": [
                {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
                 "tool_calls": [call("c1", "/book/luke.txt")]},
                {"role": "tool", "tool_call_id": "c1", "content": format!("{verse} {verse}")}]},
            {"label": "turn 3", "kind": "turn", "append": [
                {"role": "assistant", "content": "And more.", "reasoning_content": "Next chapter.",
                 "tool_calls": [call("c2", "/book/acts.txt")]},
                {"role": "tool", "tool_call_id": "c2", "content": verse}]}
        ]
    })
}

#[test]
fn replays_a_session_against_two_servers() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo_model(tmp.path());
    let cached = server(
        &model,
        StateCacheSpec {
            max_bytes: Some(1 << 30),
            checkpoint_interval: Some(8),
        },
    );
    let uncached = server(
        &model,
        StateCacheSpec {
            max_bytes: Some(0),
            checkpoint_interval: None,
        },
    );
    let path = tmp.path().join("t.json");
    std::fs::write(&path, transcript().to_string()).unwrap();
    let out = tmp.path().join("out");
    let opts = AgentOptions {
        transcript: Some(path),
        targets: vec![
            ("slipstream".into(), Target::Url(format!("http://{}", cached.addr))),
            ("no cache".into(), Target::Url(format!("http://{}/", uncached.addr))),
        ],
        model_name: None,
        max_tokens: 4,
        threads: 1,
        ctx_size: 4096,
        request_timeout: Duration::from_secs(120),
        startup_timeout: Duration::from_secs(60),
        warmup: true,
        prefill_rate: None,
        out_dir: out.clone(),
        commit: Some("test".into()),
        progress: false,
    };
    let report = run_agent_bench(&opts).unwrap();
    assert_eq!(report.sessions.len(), 2);

    // The JSON rows: every request answered and timed.
    let j: Value = serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
    assert_eq!(j["meta"]["requests"], 4);
    assert_eq!(j["meta"]["finished"], true);
    for s in j["sessions"].as_array().unwrap() {
        assert_eq!(s["model"], "demo");
        assert_eq!(s["failed_requests"], 0, "{s}");
        assert!(s["warmup_s"].as_f64().unwrap() > 0.0);
        let rows = s["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 4);
        let labels: Vec<&str> = rows.iter().map(|r| r["label"].as_str().unwrap()).collect();
        assert_eq!(labels, ["turn 1", "title", "turn 2", "turn 3"]);
        for r in rows {
            let ttft = r["ttft_s"].as_f64().unwrap();
            assert!(ttft > 0.0 && ttft <= r["total_s"].as_f64().unwrap(), "{r}");
            assert!(r["prompt_tokens"].as_u64().unwrap() > 10, "{r}");
            assert_eq!(
                r["new_tokens"].as_u64().unwrap(),
                r["prompt_tokens"].as_u64().unwrap() - r["reused_tokens"].as_u64().unwrap()
            );
        }
        // Turns grow.
        let p = |i: usize| rows[i]["prompt_tokens"].as_u64().unwrap();
        assert!(p(0) < p(2) && p(2) < p(3));
        assert!(s["session_s"].as_f64().unwrap() >= rows[3]["started_s"].as_f64().unwrap());
    }
    // With the state cache, turns 2 and 3 reuse the conversation so far
    // (across the side request); without it, nothing is reused.
    let rows = |i: usize| j["sessions"][i]["rows"].as_array().unwrap().clone();
    let (with, without) = (rows(0), rows(1));
    assert_eq!(with[0]["reused_tokens"], 0);
    for r in &with[2..] {
        let reused = r["reused_tokens"].as_u64().unwrap();
        assert!(reused > 0, "{r}");
        assert!(r["new_tokens"].as_u64().unwrap() < r["prompt_tokens"].as_u64().unwrap() / 2, "{r}");
    }
    assert!(without.iter().all(|r| r["reused_tokens"] == 0));
    assert!(with[2]["new_tokens"].as_u64() < without[2]["new_tokens"].as_u64());
    // The bound is checked on the first server's rows only.
    assert_eq!(j["bound"]["checked"], 4);
    assert!(with.iter().all(|r| r["ttft_bound_s"].as_f64().is_some()));
    assert!(without.iter().all(|r| r["ttft_bound_s"].is_null()));
    assert!(j["speedup"].as_f64().unwrap() > 0.0);

    // The CSV: a header and a row per request per server.
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 1 + 8);
    let head: Vec<&str> = lines[0].split(',').collect();
    let col = |name: &str| head.iter().position(|h| *h == name).unwrap();
    let row3: Vec<&str> = lines[3].split(',').collect();
    assert_eq!(row3[col("runtime")], "slipstream");
    assert_eq!(row3[col("label")], "turn 2");
    assert!(row3[col("reused_tokens")].parse::<u64>().unwrap() > 0);
    assert!(row3[col("ttft_s")].parse::<f64>().unwrap() > 0.0);
    assert!(lines[5].starts_with("no cache,1,turn 1,turn,"));

    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert!(table.contains("| 2 | title (side) |"), "{table}");
    assert!(table.contains("no cache took"), "{table}");
    for name in ["agent-ttft", "agent-elapsed"] {
        let svg = std::fs::read_to_string(out.join(format!("{name}.svg"))).unwrap();
        assert_eq!(svg.matches("<circle").count(), 2 * 4 + 2, "{name}: 4 points a server and the legend");
        let png = std::fs::read(out.join(format!("{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
    cached.shutdown();
    uncached.shutdown();
}

#[test]
fn an_unreachable_server_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let port = slipstream_bench::agent::servers::free_port().unwrap();
    let opts = AgentOptions {
        transcript: None,
        targets: vec![("slipstream".into(), Target::Url(format!("http://127.0.0.1:{port}")))],
        model_name: None,
        max_tokens: 4,
        threads: 1,
        ctx_size: 4096,
        request_timeout: Duration::from_secs(5),
        startup_timeout: Duration::from_secs(5),
        warmup: false,
        prefill_rate: None,
        out_dir: tmp.path().join("out"),
        commit: None,
        progress: false,
    };
    let e = format!("{:#}", run_agent_bench(&opts).unwrap_err());
    assert!(e.contains("/v1/models"), "{e}");
}

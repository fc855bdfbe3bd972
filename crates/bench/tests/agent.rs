//! `bench agent` end to end against in-process servers on the demo model:
//! a tiny transcript (3 turns, 1 side request: `fixtures/agent_tiny.json`) replayed against a server
//! and a second one as the peer; the rows in the CSV and the
//! JSON, the table and the charts.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;
use slipstream_bench::agent::transcript::Api;
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
            ggml_to_affine: false,
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
            opened: None,
            path: model.to_path_buf(),
            engine: EngineConfig {
                prefill_chunk: 16,
                store: StoreChoice::Resident,
                route_trace: None,
                gguf_index_dir: None,
                ..EngineConfig::default()
            },
            prompt_cache: None,
            state_cache: states,
        },
    )
    .expect("server starts")
}

/// A 1 GiB state cache with a checkpoint every 8 tokens: the server whose
/// turns reuse the conversation so far.
fn state_cache() -> StateCacheSpec {
    StateCacheSpec {
        max_bytes: Some(1 << 30),
        checkpoint_interval: Some(8),
        memory: None,
    }
}

/// Three turns of a tool-using conversation and a title request after the first.
fn transcript() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/agent_tiny.json")
}

/// The tiny transcript replayed against `targets` into `out`: OpenAI chat,
/// 4 tokens a request, one thread, no warm-up, no progress lines.
fn options(targets: Vec<(String, Target)>, out: &Path) -> AgentOptions {
    AgentOptions {
        transcript: Some(transcript()),
        targets,
        api: Api::OpenAi,
        model_name: None,
        max_tokens: 4,
        threads: 1,
        ctx_size: 4096,
        request_timeout: Duration::from_secs(120),
        startup_timeout: Duration::from_secs(60),
        warmup: false,
        prefill_rate: None,
        out_dir: out.to_path_buf(),
        commit: None,
        progress: false,
    }
}

#[test]
fn replays_a_session_against_two_servers() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo_model(tmp.path());
    let first = server(&model, state_cache());
    let peer = server(&model, StateCacheSpec::default());
    let out = tmp.path().join("out");
    let targets = vec![
        (
            "slipstream".into(),
            Target::Url(format!("http://{}", first.addr)),
        ),
        ("peer".into(), Target::Url(format!("http://{}/", peer.addr))),
    ];
    let opts = AgentOptions {
        warmup: true,
        commit: Some("test".into()),
        ..options(targets, &out)
    };
    let report = run_agent_bench(&opts).unwrap();
    assert_eq!(report.sessions.len(), 2);

    // The JSON rows: every request answered and timed.
    let j: Value =
        serde_json::from_slice(&std::fs::read(out.join("results.json")).unwrap()).unwrap();
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
    // (across the side request).
    let rows = |i: usize| j["sessions"][i]["rows"].as_array().unwrap().clone();
    let (first_rows, peer_rows) = (rows(0), rows(1));
    assert_eq!(first_rows[0]["reused_tokens"], 0);
    for r in &first_rows[2..] {
        let reused = r["reused_tokens"].as_u64().unwrap();
        assert!(reused > 0, "{r}");
        assert!(
            r["new_tokens"].as_u64().unwrap() < r["prompt_tokens"].as_u64().unwrap() / 2,
            "{r}"
        );
    }
    // The peer got the same requests.
    assert_eq!(
        peer_rows[3]["prompt_tokens"],
        first_rows[3]["prompt_tokens"]
    );
    // The bound is checked on the first server's rows only.
    assert_eq!(j["bound"]["checked"], 4);
    assert!(first_rows
        .iter()
        .all(|r| r["ttft_bound_s"].as_f64().is_some()));
    assert!(peer_rows.iter().all(|r| r["ttft_bound_s"].is_null()));
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
    assert!(lines[5].starts_with("peer,1,turn 1,turn,"));

    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert!(table.contains("| 2 | title (side) |"), "{table}");
    assert!(table.contains("peer took"), "{table}");
    for name in ["agent-ttft", "agent-elapsed"] {
        let svg = std::fs::read_to_string(out.join(format!("{name}.svg"))).unwrap();
        assert_eq!(
            svg.matches("<circle").count(),
            2 * 4 + 2,
            "{name}: 4 points a server and the legend"
        );
        let png = std::fs::read(out.join(format!("{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
    first.shutdown();
    peer.shutdown();
}

#[test]
fn an_unreachable_server_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let port = slipstream_bench::agent::servers::free_port().unwrap();
    let targets = vec![(
        "slipstream".into(),
        Target::Url(format!("http://127.0.0.1:{port}")),
    )];
    let opts = AgentOptions {
        transcript: None,
        request_timeout: Duration::from_secs(5),
        startup_timeout: Duration::from_secs(5),
        ..options(targets, &tmp.path().join("out"))
    };
    let e = format!("{:#}", run_agent_bench(&opts).unwrap_err());
    assert!(e.contains("/v1/models"), "{e}");
}

#[test]
fn replays_over_the_anthropic_api() {
    let tmp = tempfile::tempdir().unwrap();
    let model = demo_model(tmp.path());
    let s = server(&model, state_cache());
    let out = tmp.path().join("out");
    let targets = vec![(
        "slipstream".into(),
        Target::Url(format!("http://{}", s.addr)),
    )];
    let opts = AgentOptions {
        api: Api::Anthropic,
        model_name: Some("demo".into()),
        ..options(targets, &out)
    };
    let report = run_agent_bench(&opts).unwrap();
    let rows = &report.sessions[0].rows;
    assert_eq!(rows.len(), 4);
    assert_eq!(report.sessions[0].failed_requests, 0, "{rows:?}");
    for r in rows {
        assert!(r.measured.ttft_s.unwrap() > 0.0);
        assert!(r.measured.prompt_tokens.unwrap() > 10);
        assert!(r.measured.server_prefill_s.is_some());
    }
    assert!(rows[2].measured.reused_tokens.unwrap() > 0, "{:?}", rows[2]);
    assert!(rows[3].measured.reused_tokens.unwrap() > 0, "{:?}", rows[3]);
    assert!(std::fs::read_to_string(out.join("table.md"))
        .unwrap()
        .contains("Anthropic messages API"));
    assert_eq!(report.speedup, None, "one server: nothing to compare");
    s.shutdown();
}

/// `--model` takes a .slip directory or a GGUF file (served in place, the
/// same bytes the peer reads); anything else is refused before a server starts.
#[test]
fn model_may_be_a_slip_directory_or_a_gguf_file() {
    use clap::Parser;
    use slipstream_bench::cli::{agent_options, AgentArgs};
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        agent: AgentArgs,
    }
    let options = |model: &Path| {
        let cli = Cli::try_parse_from(["bench", "--model", model.to_str().unwrap()]).unwrap();
        agent_options(&cli.agent, PathBuf::from("slipstream"), false)
    };
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tmp.path().join("m.gguf");
    std::fs::write(&gguf, b"GGUF\x03\0\0\0").unwrap();
    let opts = options(&gguf).unwrap();
    assert!(
        matches!(&opts.targets[0].1, Target::Slipstream { model, .. } if model == &gguf),
        "{:?}",
        opts.targets
    );
    let slip = demo_model(tmp.path());
    options(&slip).unwrap();
    let other = tmp.path().join("notes.txt");
    std::fs::write(&other, b"not a model").unwrap();
    let e = format!("{:#}", options(&other).unwrap_err());
    assert!(
        e.contains("neither a .slip model directory nor a GGUF file"),
        "{e}"
    );
}

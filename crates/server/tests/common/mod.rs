//! Helpers of the server's integration tests: real servers on ephemeral
//! loopback ports over the demo model, driven with a plain HTTP client.

#![allow(dead_code)] // each test binary uses its own share of them

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use slipstream_engine::{EngineConfig, StoreChoice};
use slipstream_server::script::Script;
use slipstream_server::{start, BackendSpec, RunningServer, ServerConfig, StateCacheSpec};

/// The demo model, repacked once per test process.
pub fn demo_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
        let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("server-demo-{}.slip", std::process::id()));
        slipstream_repack::repack(
            &slipstream_repack::RepackOptions {
                input: root.join("models/demo"),
                output: target.clone(),
                overwrite: Default::default(),
                quant: slipstream_repack::QuantChoice::Q4,
                ggml_to_affine: false,
            },
            &|_| {},
        )
        .expect("repacking the demo model");
        target
    })
    .clone()
}

pub fn engine() -> EngineConfig {
    EngineConfig {
        prefill_chunk: 16,
        store: StoreChoice::Resident,
        route_trace: None,
        gguf_index_dir: None,
        ..EngineConfig::default()
    }
}

pub fn config() -> ServerConfig {
    ServerConfig {
        port: 0,
        model_id: "demo".into(),
        ping_interval: Duration::from_millis(200),
        ..Default::default()
    }
}

pub fn server(config: ServerConfig) -> RunningServer {
    server_with_states(config, StateCacheSpec::default())
}

/// A server over the demo model with its state cache sized by `states`.
pub fn server_with_states(config: ServerConfig, states: StateCacheSpec) -> RunningServer {
    start(config, model_backend(demo_model(), states)).expect("server starts")
}

/// The model at `path` on the tests' engine, without a prompt cache and
/// with the state cache sized by `states`.
pub fn model_backend(path: PathBuf, states: StateCacheSpec) -> BackendSpec {
    BackendSpec::Model {
        opened: None,
        path,
        engine: engine(),
        prompt_cache: None,
        state_cache: states,
    }
}

pub fn scripted(config: ServerConfig, replies: &[&str]) -> RunningServer {
    start(
        config,
        BackendSpec::Script {
            path: demo_model(),
            engine: engine(),
            script: Script::in_turn(replies.iter().map(|s| s.to_string()).collect()),
        },
    )
    .expect("server starts")
}

pub fn url(s: &RunningServer, path: &str) -> String {
    format!("http://{}{}", s.addr, path)
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `base` (a JSON object) with the fields of `extra` set over its own.
pub fn with_fields(mut base: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().expect("extra fields are an object") {
        base[k] = v.clone();
    }
    base
}

/// The JSON body of a `GET` of `path`.
pub async fn get_json(s: &RunningServer, path: &str) -> Value {
    reqwest::get(url(s, path))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub async fn post(s: &RunningServer, path: &str, body: Value) -> (u16, Value) {
    json_reply(reqwest::Client::new().post(url(s, path)).json(&body)).await
}

pub async fn post_raw(s: &RunningServer, path: &str, body: &'static str) -> (u16, Value) {
    let req = reqwest::Client::new()
        .post(url(s, path))
        .header("content-type", "application/json")
        .body(body);
    json_reply(req).await
}

/// Sends `req`; its status and JSON body.
pub async fn json_reply(req: reqwest::RequestBuilder) -> (u16, Value) {
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")),
    )
}

/// Parses an SSE body into (event name, data) pairs.
pub fn sse(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut name = String::new();
        let mut data = None;
        for line in block.lines() {
            if let Some(n) = line.strip_prefix("event: ") {
                name = n.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data = Some(d.to_string());
            }
        }
        if let Some(d) = data {
            out.push((name, d));
        }
    }
    out
}

pub async fn post_stream(
    s: &RunningServer,
    path: &str,
    body: Value,
) -> (u16, Vec<(String, String)>) {
    let r = reqwest::Client::new()
        .post(url(s, path))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let ct = r
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_string());
    let text = r.text().await.unwrap();
    if status == 200 {
        assert_eq!(ct.as_deref(), Some("text/event-stream"));
    }
    (status, sse(&text))
}

/// The chunks of a streamed OpenAI reply: each event but `[DONE]`, as JSON.
pub fn chat_chunks(events: &[(String, String)]) -> Vec<Value> {
    events
        .iter()
        .filter(|(_, d)| d != "[DONE]")
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect()
}

/// The text of a streamed chat reply: its chunks' `delta.content` joined
/// (events that are not JSON, such as `[DONE]`, are passed over).
pub fn streamed_chat_text(events: &[(String, String)]) -> String {
    events
        .iter()
        .filter_map(|(_, d)| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect()
}

/// Fills a server whose queue holds one: a streamed request of `body` to
/// `path` runs (two chunks read) and a second waits. Both stay open
/// until dropped.
pub async fn fill_queue_of_one(
    s: &RunningServer,
    path: &str,
    body: &Value,
) -> (reqwest::Response, reqwest::Response) {
    let client = reqwest::Client::new();
    let mut running = client.post(url(s, path)).json(body).send().await.unwrap();
    running.chunk().await.unwrap();
    running.chunk().await.unwrap();
    let waiting = client.post(url(s, path)).json(body).send().await.unwrap();
    assert_eq!(waiting.status(), 200);
    (running, waiting)
}

pub fn openai_error(v: &Value) -> &str {
    v["error"]["message"]
        .as_str()
        .unwrap_or_else(|| panic!("not an OpenAI error: {v}"))
}

pub fn anthropic_error(v: &Value) -> (&str, &str) {
    assert_eq!(v["type"], "error", "{v}");
    (
        v["error"]["type"].as_str().unwrap(),
        v["error"]["message"].as_str().unwrap(),
    )
}

//! Tool calls stream as the model writes them, on all three APIs: a long
//! `write_file` (the scripted backend writes a token every 2 ms) arrives in
//! many argument pieces, the first long before the end; the pieces add up
//! to the non-streamed arguments; a call cut by the token limit is
//! reported as cut.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// 150 short lines of a file to write (the demo model's tokens are about
/// a character each), with characters JSON escapes.
fn file_content() -> String {
    (0..150)
        .map(|i| format!("{i}\"\\"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn call_text() -> String {
    format!(
        "I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nbig.py\n</parameter>\n<parameter=content>\n{}\n</parameter>\n</function>\n</tool_call>",
        file_content()
    )
}

fn full_args() -> Value {
    json!({"path": "big.py", "content": file_content()})
}

fn schema() -> Value {
    json!({"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}})
}

/// SSE events of a streamed reply with their arrival times since the
/// request was sent, and the time of the stream's end.
async fn timed_stream(
    s: &slipstream_server::RunningServer,
    path: &str,
    body: Value,
) -> (Vec<(Duration, String, Value)>, Duration) {
    let t0 = Instant::now();
    let mut r = reqwest::Client::new()
        .post(url(s, path))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut buf = String::new();
    let mut out = Vec::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        buf.push_str(std::str::from_utf8(&chunk).unwrap());
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            for (name, data) in sse(&block) {
                if data != "[DONE]" {
                    out.push((t0.elapsed(), name, serde_json::from_str(&data).unwrap()));
                }
            }
        }
    }
    (out, t0.elapsed())
}

/// Asserts the pieces are many and the first came early; their
/// concatenation.
fn check_streamed(pieces: &[(Duration, &str)], end: Duration) -> String {
    assert!(pieces.len() > 10, "{} argument pieces", pieces.len());
    let mut text = String::new();
    let first_content = pieces
        .iter()
        .find(|(_, p)| {
            text.push_str(p);
            text.contains("\"content\":\"0")
        })
        .expect("the content streams")
        .0;
    eprintln!(
        "{} pieces, first content at {first_content:?} of {end:?}",
        pieces.len()
    );
    assert!(
        first_content < end / 3,
        "first content piece at {first_content:?} of {end:?}"
    );
    pieces.iter().map(|(_, p)| *p).collect()
}

#[test]
fn openai_chat_streams_call_arguments() {
    let s = scripted(config(), &[&call_text()]);
    rt().block_on(async {
        let body = json!({"model": "demo", "stream": true,
            "tools": [{"type": "function", "function": {"name": "write_file", "parameters": schema()}}],
            "messages": [{"role": "user", "content": "write big.py"}]});
        let (ev, end) = timed_stream(&s, "/v1/chat/completions", body.clone()).await;
        let deltas: Vec<(Duration, &Value)> = ev
            .iter()
            .filter_map(|(t, _, v)| {
                v["choices"][0]["delta"]["tool_calls"]
                    .get(0)
                    .map(|c| (*t, c))
            })
            .collect();
        assert_eq!(deltas[0].1["function"]["name"], "write_file");
        assert!(deltas[0].1["id"].as_str().unwrap().starts_with("call_"));
        assert!(deltas.iter().all(|(_, c)| c["index"] == 0));
        let pieces: Vec<(Duration, &str)> = deltas
            .iter()
            .map(|(t, c)| (*t, c["function"]["arguments"].as_str().unwrap()))
            .filter(|(_, p)| !p.is_empty())
            .collect();
        let args = check_streamed(&pieces, end);
        assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), full_args());
        let finish = ev.iter().find_map(|(_, _, v)| v["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("tool_calls"));

        let mut whole = body;
        whole["stream"] = json!(false);
        let (st, v) = post(&s, "/v1/chat/completions", whole).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"],
            args
        );
    });
}

#[test]
fn anthropic_streams_call_arguments() {
    let s = scripted(config(), &[&call_text()]);
    rt().block_on(async {
        let body = json!({"model": "demo", "max_tokens": 4000, "stream": true,
            "tools": [{"name": "write_file", "description": "write", "input_schema": schema()}],
            "messages": [{"role": "user", "content": "write big.py"}]});
        let (ev, end) = timed_stream(&s, "/v1/messages", body.clone()).await;
        let pieces: Vec<(Duration, &str)> = ev
            .iter()
            .filter(|(_, n, v)| {
                n == "content_block_delta" && v["delta"]["type"] == "input_json_delta"
            })
            .map(|(t, _, v)| (*t, v["delta"]["partial_json"].as_str().unwrap()))
            .collect();
        let args = check_streamed(&pieces, end);
        assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), full_args());
        let mut whole = body;
        whole["stream"] = json!(false);
        let (st, v) = post(&s, "/v1/messages", whole).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["content"][1]["input"], full_args());
        assert_eq!(v["stop_reason"], "tool_use");
    });
}

#[test]
fn responses_stream_call_arguments() {
    let s = scripted(config(), &[&call_text()]);
    rt().block_on(async {
        let body = json!({"model": "demo", "stream": true, "input": "write big.py",
            "tools": [{"type": "function", "name": "write_file", "parameters": schema()}]});
        let (ev, end) = timed_stream(&s, "/v1/responses", body.clone()).await;
        let pieces: Vec<(Duration, &str)> = ev
            .iter()
            .filter(|(_, n, _)| n == "response.function_call_arguments.delta")
            .map(|(t, _, v)| (*t, v["delta"].as_str().unwrap()))
            .collect();
        let args = check_streamed(&pieces, end);
        let done = ev
            .iter()
            .find(|(_, n, _)| n == "response.function_call_arguments.done")
            .unwrap();
        assert_eq!(done.2["arguments"], args);
        let mut whole = body;
        whole["stream"] = json!(false);
        let (st, v) = post(&s, "/v1/responses", whole).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["output"][1]["arguments"], args);
        assert_eq!(v["output"][1]["status"], "completed");
    });
}

#[test]
fn a_call_cut_by_the_token_limit_is_reported_cut() {
    let s = scripted(config(), &[&call_text()]);
    let full = full_args().to_string();
    rt().block_on(async {
        // Half the reply's tokens: the cut falls inside the content.
        let half = s.app.codec.encode(&call_text()).unwrap().len() / 2;

        // OpenAI: finish_reason `length`, the arguments as far as they went.
        let body = json!({"model": "demo", "max_tokens": half,
            "tools": [{"type": "function", "function": {"name": "write_file", "parameters": schema()}}],
            "messages": [{"role": "user", "content": "write big.py"}]});
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        let args = v["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            full.starts_with(&args) && args.len() > full.len() / 4 && args.len() < full.len(),
            "{args}"
        );
        let mut sb = body;
        sb["stream"] = json!(true);
        let (_, ev) = post_stream(&s, "/v1/chat/completions", sb).await;
        let chunks: Vec<Value> = chat_chunks(&ev);
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].as_str())
            .collect();
        assert_eq!(streamed, args);
        assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));

        // Anthropic: stop_reason `max_tokens`; the input holds what was written.
        let body = json!({"model": "demo", "max_tokens": half,
            "tools": [{"name": "write_file", "description": "write", "input_schema": schema()}],
            "messages": [{"role": "user", "content": "write big.py"}]});
        let (st, v) = post(&s, "/v1/messages", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["stop_reason"], "max_tokens");
        let input = &v["content"][1]["input"];
        assert_eq!(input["path"], "big.py");
        let partial = input["content"].as_str().unwrap();
        assert!(file_content().starts_with(partial) && partial.len() < file_content().len());
        let mut sb = body;
        sb["stream"] = json!(true);
        let (_, ev) = post_stream(&s, "/v1/messages", sb).await;
        let streamed: String = ev
            .iter()
            .filter(|(n, _)| n == "content_block_delta")
            .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|v| v["delta"]["partial_json"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, args);
        let md: Value = serde_json::from_str(&ev.iter().find(|(n, _)| n == "message_delta").unwrap().1).unwrap();
        assert_eq!(md["delta"]["stop_reason"], "max_tokens");

        // Responses: incomplete, the call item too.
        let (st, v) = post(&s, "/v1/responses", json!({"model": "demo", "input": "write big.py",
            "max_output_tokens": half,
            "tools": [{"type": "function", "name": "write_file", "parameters": schema()}]})).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["status"], "incomplete");
        assert_eq!(v["output"][1]["type"], "function_call");
        assert_eq!(v["output"][1]["status"], "incomplete");
        assert_eq!(v["output"][1]["arguments"], args);
    });
}

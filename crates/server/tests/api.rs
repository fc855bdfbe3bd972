//! Starts real servers on ephemeral loopback ports over the demo model and
//! drives them with a plain HTTP client.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use slipstream_server::script::Script;
use slipstream_server::{start, BackendSpec, RunningServer};

#[test]
fn health_models_and_page() {
    let s = server(config());
    rt().block_on(async {
        assert_eq!(get_json(&s, "/health").await["status"], "ok");
        let m = get_json(&s, "/v1/models").await;
        assert_eq!(m["data"][0]["id"], "demo");
        let r = reqwest::get(url(&s, "/")).await.unwrap();
        assert_eq!(r.status(), 200);
        let html = r.text().await.unwrap();
        assert!(html.contains("<script>") && html.contains("/v1/chat/completions"));
        assert!(
            !html.contains("http://") && !html.contains("https://"),
            "no external assets"
        );
        let r = reqwest::get(url(&s, "/nope")).await.unwrap();
        assert_eq!(r.status(), 404);
        let v: Value = r.json().await.unwrap();
        openai_error(&v);
    });
}

#[test]
fn openai_chat_non_streaming_and_streaming() {
    let s = server(config());
    rt().block_on(async {
        let body = json!({"model": "demo", "messages": [{"role": "user", "content": "And it came to pass"}],
            "max_tokens": 8, "temperature": 0, "seed": 1});
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["object"], "chat.completion");
        let u = &v["usage"];
        assert!(u["prompt_tokens"].as_u64().unwrap() > 3);
        let n = u["completion_tokens"].as_u64().unwrap();
        assert!((1..=8).contains(&n));
        assert_eq!(
            u["total_tokens"].as_u64().unwrap(),
            u["prompt_tokens"].as_u64().unwrap() + n
        );
        let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        let fr = v["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(fr == "length" || fr == "stop");

        // The same request streamed: same text (greedy), usage at the end.
        let mut sb = body.clone();
        sb["stream"] = json!(true);
        sb["stream_options"] = json!({"include_usage": true});
        let (st, ev) = post_stream(&s, "/v1/chat/completions", sb).await;
        assert_eq!(st, 200);
        assert_eq!(ev.last().unwrap().1, "[DONE]");
        let mut text = String::new();
        let mut usage = None;
        let mut finish = None;
        for c in chat_chunks(&ev) {
            assert_eq!(c["object"], "chat.completion.chunk");
            if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
                usage = Some(u.clone());
                continue;
            }
            if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
        assert_eq!(text, content);
        assert_eq!(finish.as_deref(), Some(fr));
        let usage = usage.expect("usage chunk");
        assert_eq!(usage["completion_tokens"].as_u64().unwrap(), n);

        // The next turn of the conversation prefills only its new tokens.
        let prompt1 = v["usage"]["prompt_tokens"].as_u64().unwrap();
        let (v, cached) = second_turn(&s, "And it came to pass", &content).await;
        assert!(cached >= prompt1, "cached {cached} of {v}");
        assert!(v["slipstream"]["decode_tokens_per_s"].is_number());
    });
}

/// The second turn of a greedy chat (`first`, the model's `reply`, then
/// "And God said"): the reply, and how many prompt tokens it reused.
async fn second_turn(s: &RunningServer, first: &str, reply: &str) -> (Value, u64) {
    let turn2 = json!({"model": "demo", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": first},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And God said"}]});
    let (st, v) = post(s, "/v1/chat/completions", turn2).await;
    assert_eq!(st, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (v, cached)
}

#[test]
fn openai_completions() {
    let s = server(config());
    rt().block_on(async {
        let (st, v) = post(
            &s,
            "/v1/completions",
            json!({"model": "demo", "prompt": "In the beginning", "max_tokens": 5, "temperature": 0}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["object"], "text_completion");
        assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 5);
        assert!(v["choices"][0]["text"].is_string());
        let (st, ev) = post_stream(
            &s,
            "/v1/completions",
            json!({"model": "demo", "prompt": "In the beginning", "max_tokens": 5, "stream": true}),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(ev.last().unwrap().1, "[DONE]");
    });
}

#[test]
fn anthropic_messages_non_streaming_streaming_and_count() {
    let s = server(config());
    rt().block_on(async {
        let body = json!({"model": "demo", "max_tokens": 6, "system": "You are a scribe.",
            "messages": [{"role": "user", "content": "And God said"}], "temperature": 0});
        let (st, c) = post(&s, "/v1/messages/count_tokens", body.clone()).await;
        assert_eq!(st, 200, "{c}");
        let count = c["input_tokens"].as_u64().unwrap();
        let (st, v) = post(&s, "/v1/messages", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["type"], "message");
        assert_eq!(v["role"], "assistant");
        let u = &v["usage"];
        assert_eq!(
            u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(),
            count
        );
        assert!(u["output_tokens"].as_u64().unwrap() <= 6);
        let sr = v["stop_reason"].as_str().unwrap();
        assert!(sr == "max_tokens" || sr == "end_turn", "{sr}");

        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let (st, ev) = post_stream(&s, "/v1/messages", sb).await;
        assert_eq!(st, 200);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[0], "message_start");
        assert!(names.contains(&"ping"));
        assert_eq!(names[names.len() - 1], "message_stop");
        assert_eq!(names[names.len() - 2], "message_delta");
        let start: Value = serde_json::from_str(&ev[0].1).unwrap();
        assert_eq!(
            start["message"]["usage"]["input_tokens"].as_u64().unwrap(),
            count
        );
        let real: Vec<&str> = names.iter().copied().filter(|n| *n != "ping").collect();
        if real.len() > 3 {
            assert_eq!(real[1], "content_block_start");
            assert_eq!(real[real.len() - 3], "content_block_stop");
        }
        let text: String = ev
            .iter()
            .filter(|(n, _)| n == "content_block_delta")
            .map(|(_, d)| {
                let v: Value = serde_json::from_str(d).unwrap();
                v["delta"]["text"].as_str().unwrap_or("").to_string()
            })
            .collect();
        let whole: String = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect();
        assert_eq!(text, whole);
    });
}

#[test]
fn malformed_requests_get_errors_in_each_apis_shape() {
    let mut c = config();
    c.max_context = Some(64);
    c.max_body_bytes = Some(4096);
    let s = server(c);
    const CHAT: &str = "/v1/chat/completions";
    let hi = json!([{"role": "user", "content": "hi"}]);
    let long = "and it came to pass ".repeat(40);
    let huge = "x".repeat(10_000);
    rt().block_on(async {
        // OpenAI shape: the status, a part of the message ("": any), the
        // error's code if it has one to check.
        let (st, v) = post_raw(&s, CHAT, "{not json").await;
        assert_eq!(st, 400);
        assert!(openai_error(&v).contains("not valid JSON"), "{v}");
        let (st, v) = post_raw(&s, CHAT, "").await;
        assert_eq!(st, 400);
        openai_error(&v);
        for (path, body, status, says, code) in [
            (CHAT, json!({"model": "demo", "messages": "hi"}), 400, "", None),
            (
                CHAT,
                json!({"model": "demo", "messages": hi, "temperature": "hot"}),
                400,
                "",
                None,
            ),
            (
                CHAT,
                json!({"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}),
                400,
                "wizard",
                None,
            ),
            (
                CHAT,
                json!({"model": "gpt-4o", "messages": hi}),
                404,
                "",
                Some("model_not_found"),
            ),
            (
                CHAT,
                json!({"model": "demo", "messages": [{"role": "user", "content": huge}]}),
                413,
                "",
                None,
            ),
            ("/v1/completions", json!({"model": "demo", "prompt": 5}), 400, "", None),
        ] {
            let (st, v) = post(&s, path, body.clone()).await;
            assert_eq!(st, status, "{body}: {v}");
            assert!(openai_error(&v).contains(says), "{v}");
            if let Some(code) = code {
                assert_eq!(v["error"]["code"], code, "{v}");
            }
        }
        let (st, v) = post(
            &s,
            CHAT,
            json!({"model": "demo", "messages": [{"role": "user", "content": long}]}),
        )
        .await;
        assert_eq!(st, 400);
        let e = openai_error(&v);
        assert!(e.contains("at most 63 prompt tokens") && e.contains("cut at least"), "{v}");
        assert!(e.contains("larger --max-context") && e.contains("262144"), "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded");

        // Anthropic shape: the status, the error's type if it has one to
        // check, a part of the message ("": any).
        let (st, v) = post_raw(&s, "/v1/messages", "[1,2").await;
        assert_eq!(st, 400);
        assert_eq!(anthropic_error(&v).0, "invalid_request_error");
        for (body, status, kind, says) in [
            (json!({"model": "demo", "messages": hi}), 400, None, "max_tokens"),
            (
                json!({"model": "demo", "max_tokens": "many", "messages": []}),
                400,
                None,
                "",
            ),
            (
                json!({"model": "claude-x", "max_tokens": 5, "messages": hi}),
                404,
                Some("not_found_error"),
                "",
            ),
            (
                json!({"model": "demo", "max_tokens": 5,
                    "messages": [{"role": "user", "content": [{"type": "video", "source": {}}]}]}),
                400,
                None,
                "`video`",
            ),
        ] {
            let (st, v) = post(&s, "/v1/messages", body.clone()).await;
            assert_eq!(st, status, "{body}: {v}");
            let (t, message) = anthropic_error(&v);
            assert!(message.contains(says), "{v}");
            if let Some(kind) = kind {
                assert_eq!(t, kind, "{v}");
            }
        }
        let (st, v) = post(
            &s,
            "/v1/messages/count_tokens",
            json!({"model": "demo", "messages": [{"role": "user", "content": long}]}),
        )
        .await;
        assert_eq!(st, 200, "count_tokens has no context limit: {v}");
        let n = v["input_tokens"].as_u64().unwrap();
        let (st, v) = post(
            &s,
            "/v1/messages",
            json!({"model": "demo", "max_tokens": 5, "messages": [{"role": "user", "content": long}]}),
        )
        .await;
        assert_eq!(st, 400);
        // Anthropic's wording, which Claude Code matches exactly.
        assert_eq!(
            anthropic_error(&v),
            ("invalid_request_error", format!("prompt is too long: {n} tokens > 63 maximum").as_str())
        );
        let r = reqwest::get(url(&s, "/v1/messages")).await.unwrap();
        assert_eq!(r.status(), 405);
        let v: Value = r.json().await.unwrap();
        anthropic_error(&v);
        // Still serving.
        let (st, _) = post(
            &s,
            CHAT,
            json!({"model": "demo", "messages": hi, "max_tokens": 2}),
        )
        .await;
        assert_eq!(st, 200);
    });
}

#[test]
fn api_key_is_checked() {
    let mut c = config();
    c.api_key = Some("sekrit".into());
    let s = server(c);
    rt().block_on(async {
        let client = reqwest::Client::new();
        let body = json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let chat = || client.post(url(&s, "/v1/chat/completions")).json(&body);
        let messages = || client.post(url(&s, "/v1/messages")).json(&body);
        let health = || client.get(url(&s, "/health"));
        let (st, v) = json_reply(chat()).await;
        assert_eq!(st, 401);
        assert_eq!(v["error"]["type"], "authentication_error");
        let (st, v) = json_reply(messages().header("x-api-key", "wrong")).await;
        assert_eq!(st, 401);
        assert_eq!(anthropic_error(&v).0, "authentication_error");
        let (st, _) = json_reply(chat().bearer_auth("sekrit")).await;
        assert_eq!(st, 200);
        let (st, _) = json_reply(messages().header("x-api-key", "sekrit")).await;
        assert_eq!(st, 200);
        let r = client.get(url(&s, "/v1/models")).send().await.unwrap();
        assert_eq!(r.status(), 401);
        // Liveness and the page stay open (the page asks for the key); the
        // server's details only with the key.
        let (st, h) = json_reply(health()).await;
        assert_eq!(st, 200);
        assert_eq!(h, json!({"status": "ok"}));
        let (_, h) = json_reply(health().header("x-api-key", "wrong")).await;
        assert_eq!(h, json!({"status": "ok"}));
        let (_, h) = json_reply(health().bearer_auth("sekrit")).await;
        assert_eq!(h["model"], "demo");
        assert!(h["max_context"].as_u64().unwrap() > 0, "{h}");
        assert!(h.get("store").is_some() && h.get("last").is_some(), "{h}");
        assert_eq!(client.get(url(&s, "/")).send().await.unwrap().status(), 200);
    });
}

#[test]
fn non_loopback_bind_without_key_is_refused() {
    let mut c = config();
    c.host = "0.0.0.0".into();
    let err = start(c, model_backend(demo_model(), Default::default()))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--api-key"), "{err}");
    assert!(slipstream_server::check_bind("::", Some("")).is_err());
    // A blank key is refused wherever the server listens.
    for blank in ["", "   ", "\t\n"] {
        let e = slipstream_server::check_bind("127.0.0.1", Some(blank)).unwrap_err();
        assert!(e.to_string().contains("empty or only whitespace"), "{e}");
    }
    assert!(slipstream_server::check_bind("192.168.1.5", None).is_err());
    assert!(slipstream_server::check_bind("0.0.0.0", Some("k")).is_ok());
    assert!(slipstream_server::check_bind("127.0.0.1", None).is_ok());
    assert!(slipstream_server::check_bind("::1", None).is_ok());
    assert!(slipstream_server::check_bind("localhost", None).is_ok());
}

/// Polls /health until the engine is idle.
async fn wait_idle(s: &RunningServer, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let h = get_json(s, "/health").await;
        if h["busy"] == false && h["queue"]["pending"] == 0 {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "engine still busy: {h}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn busy(s: &RunningServer) -> bool {
    get_json(s, "/health").await["busy"] == true
}

/// A raw-text completion that runs for a long time (KJV text rarely ends).
fn long_completion(stream: bool) -> Value {
    json!({"model": "demo", "prompt": "And it came to pass, when the king", "max_tokens": 15000,
        "temperature": 1.0, "seed": 7, "stream": stream})
}

#[test]
fn cancel_on_disconnect_frees_the_engine() {
    let mut c = config();
    c.max_context = Some(4096);
    let s = server(c);
    rt().block_on(async {
        // Streaming: read a little, then drop the connection.
        let client = reqwest::Client::new();
        let mut r = client
            .post(url(&s, "/v1/completions"))
            .json(&long_completion(true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        for _ in 0..3 {
            r.chunk().await.unwrap().expect("chunks");
        }
        assert!(busy(&s).await, "the engine should still be generating");
        drop(r);
        drop(client);
        let idle = wait_idle(&s, Duration::from_secs(10)).await;
        eprintln!("streaming disconnect: engine idle after {idle:?}");

        // Non-streaming: a raw connection sends the request and hangs up
        // while the engine generates.
        let body = serde_json::to_string(&long_completion(false)).unwrap();
        let mut t = tokio::net::TcpStream::connect(s.addr).await.unwrap();
        use tokio::io::AsyncWriteExt;
        t.write_all(
            format!(
                "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let t0 = Instant::now();
        while !busy(&s).await {
            assert!(t0.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(busy(&s).await, "the engine should still be generating");
        drop(t);
        let idle = wait_idle(&s, Duration::from_secs(10)).await;
        eprintln!("non-streaming disconnect: engine idle after {idle:?}");

        // The next request is served promptly.
        let t0 = Instant::now();
        let (st, v) = post(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert!(t0.elapsed() < Duration::from_secs(5));
    });
}

#[test]
fn full_queue_is_refused() {
    let mut c = config();
    c.queue = 1;
    c.max_context = Some(4096);
    let s = server(c);
    rt().block_on(async {
        // One running, one waiting...
        let (a, b) = fill_queue_of_one(&s, "/v1/completions", &long_completion(true)).await;
        // ...and the next is refused, in each API's shape.
        let body = json!({"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]});
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 429);
        assert_eq!(v["error"]["code"], "queue_full");
        let (st, v) = post(&s, "/v1/messages", body.clone()).await;
        assert_eq!(st, 529);
        assert_eq!(anthropic_error(&v).0, "overloaded_error");
        drop(a);
        drop(b);
        wait_idle(&s, Duration::from_secs(10)).await;
        let (st, _) = post(&s, "/v1/chat/completions", body).await;
        assert_eq!(st, 200);
    });
}

const QWEN3_CALL: &str = "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
const CODER_CALL: &str = "Checking.\n<tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=limit>\n20\n</parameter>\n</function>\n</tool_call>";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object",
        "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}}}}}])
}

#[test]
fn openai_tool_calls_on_the_wire() {
    let s = scripted(
        config(),
        &[QWEN3_CALL, CODER_CALL, "It is sunny. STOP here"],
    );
    rt().block_on(async {
        let mut body = json!({"model": "demo", "tools": tools(),
            "messages": [{"role": "user", "content": "weather in Paris?"}]});
        let (st, v) = post(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(m["reasoning_content"], "The user wants weather.");
        assert!(m["content"].is_null());
        let call = &m["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        let id = call["id"].as_str().unwrap().to_string();

        // Streamed, XML form.
        body["stream"] = json!(true);
        let (st, ev) = post_stream(&s, "/v1/chat/completions", body.clone()).await;
        assert_eq!(st, 200);
        let chunks: Vec<Value> = chat_chunks(&ev);
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, "Checking.\n");
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .collect();
        // The call's first chunk names it; its arguments follow in pieces.
        assert!(calls.iter().all(|c| c["index"] == 0));
        assert_eq!(calls[0]["function"]["name"], "read_file");
        assert_eq!(calls.iter().filter(|c| c.get("id").is_some()).count(), 1);
        let args: String = calls
            .iter()
            .map(|c| c["function"]["arguments"].as_str().unwrap())
            .collect();
        let args: Value = serde_json::from_str(&args).unwrap();
        assert_eq!(args, json!({"path": "src/main.rs", "limit": 20}));
        assert!(chunks
            .iter()
            .any(|c| c["choices"][0]["finish_reason"] == "tool_calls"));

        // The round trip: results go back, the reply stops at a stop string.
        let body = json!({"model": "demo", "tools": tools(), "stop": ["STOP"], "messages": [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": id, "content": "sunny, 24C"}]});
        let (st, v) = post(&s, "/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"], "It is sunny. ");
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    });
}

#[test]
fn anthropic_tool_use_on_the_wire() {
    let s = scripted(config(), &[QWEN3_CALL, "Sunny.", CODER_CALL]);
    rt().block_on(async {
        let tools = json!([{"name": "get_weather", "description": "weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]);
        let body = json!({"model": "demo", "max_tokens": 200, "tools": tools,
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "messages": [{"role": "user", "content": "weather in Paris?"}]});
        let (st, v) = post(&s, "/v1/messages", body.clone()).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["stop_reason"], "tool_use");
        let content = v["content"].as_array().unwrap();
        assert_eq!(content[0]["type"], "thinking");
        assert_eq!(content[0]["thinking"], "The user wants weather.");
        assert_eq!(content[1]["type"], "tool_use");
        assert_eq!(content[1]["name"], "get_weather");
        assert_eq!(content[1]["input"], json!({"city": "Paris"}));
        let id = content[1]["id"].as_str().unwrap();
        assert!(id.starts_with("toolu_"));

        let body2 = json!({"model": "demo", "max_tokens": 200, "tools": body["tools"],
            "messages": [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": id, "content": "sunny"}]}]});
        let (st, v) = post(&s, "/v1/messages", body2).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["stop_reason"], "end_turn");
        assert_eq!(v["content"][0]["text"], "Sunny.");

        let mut sb = body.clone();
        sb["stream"] = json!(true);
        let (st, ev) = post_stream(&s, "/v1/messages", sb).await;
        assert_eq!(st, 200);
        let mut names: Vec<&str> = ev
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| *n != "ping")
            .collect();
        names.dedup();
        assert_eq!(
            names,
            [
                "message_start", "content_block_start", "content_block_delta",
                "content_block_stop", "content_block_start", "content_block_delta",
                "content_block_stop", "message_delta", "message_stop"
            ]
        );
        let start: Value = serde_json::from_str(&ev.iter().find(|(n, _)| n == "content_block_start").unwrap().1).unwrap();
        assert_eq!(start["content_block"]["type"], "text");
        let tool: Value = serde_json::from_str(
            &ev.iter().filter(|(n, _)| n == "content_block_start").nth(1).unwrap().1,
        )
        .unwrap();
        assert_eq!(tool["content_block"]["name"], "read_file");
        let args: String = ev
            .iter()
            .filter(|(_, d)| d.contains("input_json_delta"))
            .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["delta"]["partial_json"].as_str().unwrap().to_string())
            .collect();
        let args: Value = serde_json::from_str(&args).unwrap();
        assert_eq!(args, json!({"path": "src/main.rs", "limit": 20}));
        let md: Value = serde_json::from_str(&ev.iter().find(|(n, _)| n == "message_delta").unwrap().1).unwrap();
        assert_eq!(md["delta"]["stop_reason"], "tool_use");
    });
}

#[test]
fn script_rules_answer_by_the_prompts_text() {
    let script = Script::from_json(
        r#"[{"when": ["RESULT-7"], "reply": "final", "times": 1},
            {"when": ["<tools>", "task-7"], "reply": "call", "times": 1}]"#,
    )
    .unwrap();
    let s = start(
        config(),
        BackendSpec::Script {
            path: demo_model(),
            engine: engine(),
            script,
        },
    )
    .unwrap();
    rt().block_on(async {
        let ask = |messages: Value, with_tools: bool| {
            let mut body = json!({"model": "demo", "messages": messages});
            if with_tools {
                body["tools"] = tools();
            }
            post(&s, "/v1/chat/completions", body)
        };
        let content = |v: &Value| v["choices"][0]["message"]["content"].clone();
        let user = json!([{"role": "user", "content": "task-7"}]);
        // Without the tool block (a side request): no rule, no plain entry.
        let (st, v) = ask(user.clone(), false).await;
        assert_eq!(st, 500, "{v}");
        assert!(openai_error(&v).contains("no entry answers"), "{v}");
        let (st, v) = ask(user.clone(), true).await;
        assert_eq!((st, content(&v)), (200, json!("call")), "{v}");
        // Spent after one use.
        let (st, _) = ask(user, true).await;
        assert_eq!(st, 500);
        let (st, v) = ask(
            json!([{"role": "user", "content": "task-7"},
                {"role": "tool", "tool_call_id": "c", "content": "RESULT-7"}]),
            true,
        )
        .await;
        assert_eq!((st, content(&v)), (200, json!("final")), "{v}");
    });
}

#[test]
fn requests_are_logged_as_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("requests.jsonl");
    let mut c = config();
    c.log_requests = Some(log.clone());
    c.api_key = Some("k".into());
    let s = scripted(c, &["hi"]);
    rt().block_on(async {
        let client = reqwest::Client::new();
        let body = json!({"model": "demo", "messages": [{"role": "user", "content": "hello"}]});
        let r = client
            .post(url(&s, "/v1/chat/completions?x=1"))
            .bearer_auth("k")
            .header("user-agent", "tester/1")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // A route this server lacks is logged too (what was the client after?).
        let r = client
            .post(url(&s, "/v1/elsewhere"))
            .bearer_auth("k")
            .body("not json")
            .send()
            .await
            .unwrap();
        // Refused as not JSON before routing (a browser form post).
        assert_eq!(r.status(), 415);
        // Without the key: refused, not logged. Outside /v1/: not logged.
        let r = client
            .post(url(&s, "/v1/chat/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401);
        reqwest::get(url(&s, "/health")).await.unwrap();
    });
    let lines: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0]["method"], "POST");
    assert_eq!(lines[0]["path"], "/v1/chat/completions?x=1");
    assert_eq!(lines[0]["user_agent"], "tester/1");
    assert_eq!(
        lines[0]["body"],
        json!({"model": "demo", "messages": [{"role": "user", "content": "hello"}]})
    );
    assert!(lines[0]["time"].as_f64().unwrap() > 1e9);
    assert_eq!(lines[1]["path"], "/v1/elsewhere");
    assert_eq!(lines[1]["body"], "not json");
}

#[test]
fn raw_connection_garbage_does_not_hurt() {
    let s = server(config());
    let mut t = TcpStream::connect(s.addr).unwrap();
    t.write_all(b"GARBAGE / HTTP/9\r\n\r\n\x00\xff").unwrap();
    let mut buf = Vec::new();
    t.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = t.read_to_end(&mut buf);
    rt().block_on(async {
        let r = reqwest::get(url(&s, "/health")).await.unwrap();
        assert_eq!(r.status(), 200);
    });
}

#[test]
fn long_prefill_sends_pings_and_cancels_between_chunks() {
    let mut c = config();
    c.max_context = Some(4096);
    let s = server(c);
    let long = "And it came to pass in those days, that the king went up. ".repeat(180);
    rt().block_on(async {
        let body = json!({"model": "demo", "max_tokens": 1, "stream": true,
            "messages": [{"role": "user", "content": long}]});
        // A whole run: how long the prefill takes, and pings meanwhile.
        let t0 = Instant::now();
        let (st, ev) = post_stream(&s, "/v1/messages", body.clone()).await;
        let full = t0.elapsed();
        assert_eq!(st, 200);
        let first_block = ev
            .iter()
            .position(|(n, _)| n == "content_block_start" || n == "message_delta")
            .unwrap();
        let pings = ev[..first_block]
            .iter()
            .filter(|(n, _)| n == "ping")
            .count();
        eprintln!("prefill run {full:?}, {pings} pings before the first block");
        assert!(pings > (full.as_millis() as usize / 200).saturating_sub(2));

        // Cut off during the prefill: the engine stops at a chunk boundary.
        // (A prompt that shares nothing with the first: the state cache
        // would otherwise resume it and skip the prefill.)
        let client = reqwest::Client::new();
        let mut body = body;
        body["messages"][0]["content"] = json!(format!("Again. {long}"));
        let mut r = client
            .post(url(&s, "/v1/messages"))
            .json(&body)
            .send()
            .await
            .unwrap();
        r.chunk().await.unwrap().expect("message_start");
        tokio::time::sleep(full / 4).await;
        assert!(busy(&s).await, "still in prefill");
        drop(r);
        let idle = wait_idle(&s, Duration::from_secs(30)).await;
        eprintln!("cancelled during prefill: idle after {idle:?} (full run {full:?})");
        assert!(idle < full / 2, "cancel took {idle:?} of a {full:?} run");
    });
}

#[test]
fn prompt_cache_keeps_the_conversation_prefix_across_restarts() {
    let cache = tempfile::tempdir().unwrap();
    let start_server = || {
        start(
            config(),
            BackendSpec::Model {
                opened: None,
                path: demo_model(),
                state_cache: Default::default(),
                engine: engine(),
                prompt_cache: Some((cache.path().to_path_buf(), 1 << 30)),
            },
        )
        .expect("server starts")
    };
    let first = "And it came to pass in those days that the king said";
    let turn1 = json!({"model": "demo", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": first}]});
    let (content, prompt1) = {
        let s = start_server();
        rt().block_on(async {
            let (st, v) = post(&s, "/v1/chat/completions", turn1).await;
            assert_eq!(st, 200, "{v}");
            (
                v["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                v["usage"]["prompt_tokens"].as_u64().unwrap(),
            )
        })
    };
    // A new server process state: nothing kept in memory, only the cache.
    let s = start_server();
    rt().block_on(async {
        let (v, cached) = second_turn(&s, first, &content).await;
        // Snapshots are taken at chunk boundaries (16 tokens here).
        assert!(
            cached >= 16 && cached <= prompt1,
            "cached {cached} of turn 1's {prompt1}: {v}"
        );
    });
}

#[test]
fn a_max_context_above_the_model_is_refused_at_start() {
    let mut c = config();
    c.max_context = Some(300_000);
    let e = match start(c, model_backend(demo_model(), Default::default())) {
        Ok(_) => panic!("a context above the model's positions was accepted"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        e.contains("--max-context 300000") && e.contains("262144 positions"),
        "{e}"
    );
}

//! Every sampling and output field of the three APIs has its effect or is
//! refused by name (issue 31 item 6): structured output and forced tool
//! calls by constrained decoding on the demo model, penalties, log
//! probabilities, the checkpoint's generation_config and the server's
//! flags as defaults, the 400s for what is not supported, and the same
//! replies with speculative decoding on.

mod common;

use std::path::PathBuf;

use common::*;
use serde_json::{json, Value};
use slipstream_engine::GenerationDefaults;
use slipstream_server::{start, RunningServer, ServerConfig, StateCacheSpec};

/// A schema the demo model can finish within a few dozen tokens.
fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "word": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ok": {"type": "boolean"}
        },
        "required": ["word", "n", "ok"],
        "additionalProperties": false
    })
}

/// Whether `text` is JSON that [`schema`] accepts.
fn matches_schema(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text.trim()).map_err(|e| format!("{e}: {text:?}"))?;
    let o = v.as_object().ok_or(format!("not an object: {v}"))?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort();
    if keys != ["n", "ok", "word"] {
        return Err(format!("keys {keys:?}"));
    }
    let w = o["word"].as_str().ok_or("word not a string")?;
    if w.chars().count() > 8 {
        return Err(format!("word too long: {w:?}"));
    }
    let n = o["n"].as_u64().ok_or("n not a non-negative integer")?;
    if n > 99 {
        return Err(format!("n out of range: {n}"));
    }
    o["ok"].as_bool().ok_or("ok not a boolean")?;
    Ok(())
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "read_file", "description": "Read a file",
            "parameters": {"type": "object", "properties": {
                "path": {"type": "string", "maxLength": 12},
                "lines": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["path", "lines"]}}},
        {"type": "function", "function": {"name": "list", "description": "List files",
            "parameters": {"type": "object", "properties": {"all": {"type": "boolean"}},
                "required": ["all"]}}}
    ])
}

/// A greedy request of at most 60 tokens on one user turn, which the chat
/// and the Anthropic APIs both take, with `extra`'s fields set over it.
fn request(extra: Value) -> Value {
    with_fields(
        json!({"model": "demo", "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "And it came to pass"}]}),
        extra,
    )
}

async fn chat_ok(s: &RunningServer, extra: Value) -> Value {
    let (st, v) = post(s, "/v1/chat/completions", request(extra)).await;
    assert_eq!(st, 200, "{v}");
    v
}

fn content(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

#[test]
fn chat_response_format_is_enforced() {
    let s = server(config());
    rt().block_on(async {
        let fmt = json!({"type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema(), "strict": true}});
        let v = chat_ok(&s, json!({"response_format": fmt})).await;
        matches_schema(&content(&v)).unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        // `strict: false` is enforced all the same; sampled too.
        let fmt = json!({"type": "json_schema",
            "json_schema": {"name": "thing", "schema": schema(), "strict": false}});
        for seed in 0..3 {
            let v = chat_ok(
                &s,
                json!({"response_format": fmt, "temperature": 1.0, "seed": seed, "max_tokens": 80}),
            )
            .await;
            matches_schema(&content(&v)).unwrap();
        }
        // Streamed: the pieces join to the same JSON as greedy whole.
        let fmt = json!({"type": "json_schema", "json_schema": {"name": "t", "schema": schema()}});
        let whole = content(&chat_ok(&s, json!({"response_format": fmt})).await);
        let (st, events) = post_stream(
            &s,
            "/v1/chat/completions",
            request(json!({"response_format": fmt, "stream": true})),
        )
        .await;
        assert_eq!(st, 200);
        assert_eq!(streamed_chat_text(&events), whole);
        // json_object: any object.
        let v = chat_ok(&s, json!({"response_format": {"type": "json_object"}})).await;
        let text = content(&v);
        if v["choices"][0]["finish_reason"] == "stop" {
            let parsed: Value = serde_json::from_str(text.trim()).unwrap();
            assert!(parsed.is_object(), "{text}");
        } else {
            assert!(text.trim_start().starts_with('{'), "{text}");
        }
        // Plain text stays plain; a bad format is refused by name.
        let plain = chat_ok(&s, json!({})).await;
        let text = chat_ok(&s, json!({"response_format": {"type": "text"}})).await;
        assert_eq!(content(&plain), content(&text));
        for bad in [
            json!({"type": "yaml"}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"schema": 3}}),
            json!({"type": "json_schema", "json_schema": {"schema": {"type": "object"}, "bogus": 1}}),
        ] {
            let (st, v) =
                post(&s, "/v1/chat/completions", request(json!({"response_format": bad}))).await;
            assert_eq!(st, 400, "{v}");
            assert_eq!(v["error"]["param"], "response_format", "{v}");
        }
    });
}

#[test]
fn forced_tool_calls_follow_the_tools_schema() {
    let s = server(config());
    rt().block_on(async {
        // The demo model would call tools forever: one call (parallel off).
        let v = chat_ok(
            &s,
            json!({"tools": tools(), "tool_choice": "required", "parallel_tool_calls": false}),
        )
        .await;
        let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty(), "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        for c in calls {
            let args: Value =
                serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            match c["function"]["name"].as_str().unwrap() {
                "read_file" => {
                    assert!(args["path"].is_string(), "{args}");
                    let n = args["lines"].as_u64().unwrap();
                    assert!((1..=9).contains(&n), "{args}");
                }
                "list" => assert!(args["all"].is_boolean(), "{args}"),
                other => panic!("called {other}"),
            }
        }
        // Named: that tool, once.
        let v = chat_ok(
            &s,
            json!({"tools": tools(), "tool_choice": {"type": "function", "function": {"name": "list"}}}),
        )
        .await;
        let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(calls[0]["function"]["name"], "list");
        // `auto` leaves the model free (the demo model writes text).
        let v = chat_ok(&s, json!({"tools": tools(), "tool_choice": "auto"})).await;
        assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
        // A name that is no tool, or a choice without tools: refused.
        for (choice, tools) in [
            (json!({"type": "function", "function": {"name": "nope"}}), tools()),
            (json!("required"), json!([])),
            (json!("sometimes"), tools()),
        ] {
            let (st, v) = post(
                &s,
                "/v1/chat/completions",
                request(json!({"tools": tools, "tool_choice": choice})),
            )
            .await;
            assert_eq!(st, 400, "{v}");
            assert_eq!(v["error"]["param"], "tool_choice", "{v}");
        }
    });
}

fn anthropic_tools() -> Value {
    json!([
        {"name": "read_file", "description": "Read a file", "input_schema": {"type": "object",
            "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}},
        {"name": "list", "description": "List files", "input_schema": {"type": "object",
            "properties": {"all": {"type": "boolean"}}, "required": ["all"]}}
    ])
}

/// The content blocks of type `kind` in an Anthropic reply.
fn blocks<'a>(v: &'a Value, kind: &str) -> Vec<&'a Value> {
    v["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == kind)
        .collect()
}

#[test]
fn anthropic_output_format_and_tool_choice_are_enforced() {
    let s = server(config());
    rt().block_on(async {
        let (st, v) = post(
            &s,
            "/v1/messages",
            request(
                json!({"output_config": {"format": {"type": "json_schema", "schema": schema()}}}),
            ),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let text = v["content"][0]["text"].as_str().unwrap();
        matches_schema(text).unwrap();
        assert_eq!(v["stop_reason"], "end_turn");
        let (st, v) = post(
            &s,
            "/v1/messages",
            request(json!({"tools": anthropic_tools(),
                "tool_choice": {"type": "any", "disable_parallel_tool_use": true}})),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let uses = blocks(&v, "tool_use");
        assert_eq!(uses.len(), 1, "{v}");
        assert!(
            blocks(&v, "text")
                .iter()
                .all(|b| b["text"].as_str().unwrap().trim().is_empty()),
            "{v}"
        );
        let (st, v) = post(
            &s,
            "/v1/messages",
            request(json!({"tools": anthropic_tools(),
                "tool_choice": {"type": "tool", "name": "read_file"}})),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let uses = blocks(&v, "tool_use");
        assert_eq!(uses.len(), 1, "{v}");
        assert_eq!(uses[0]["name"], "read_file");
        assert!(uses[0]["input"]["path"].is_string(), "{v}");
        for bad in [
            json!({"tools": anthropic_tools(), "tool_choice": {"type": "tool", "name": "nope"}}),
            json!({"tool_choice": {"type": "any"}}),
            json!({"output_config": {"format": {"type": "xml"}}}),
            json!({"output_config": {"format": {"type": "json_schema"}}}),
        ] {
            let (st, v) = post(&s, "/v1/messages", request(bad.clone())).await;
            assert_eq!(st, 400, "{bad}: {v}");
            let (kind, _) = anthropic_error(&v);
            assert_eq!(kind, "invalid_request_error");
        }
    });
}

#[test]
fn the_constraint_waits_for_the_reasoning_to_close() {
    // The Qwen-like template opens <think>; the demo model never closes it
    // itself, so a thinking budget closes it and the format applies after.
    let s = server(ServerConfig {
        chat_template: Some(include_str!("fixtures/qwen_like_template.jinja").into()),
        ..config()
    });
    rt().block_on(async {
        let (st, v) = post(
            &s,
            "/v1/messages",
            request(json!({"max_tokens": 90,
                "thinking": {"type": "enabled", "budget_tokens": 6},
                "output_config": {"format": {"type": "json_schema", "schema": schema()}}})),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let blocks = v["content"].as_array().unwrap();
        assert_eq!(blocks[0]["type"], "thinking", "{v}");
        let text = blocks
            .iter()
            .find(|b| b["type"] == "text")
            .and_then(|b| b["text"].as_str())
            .unwrap_or_else(|| panic!("no text: {v}"));
        matches_schema(text).unwrap();
        // The thinking itself was free: the same as without a format.
        let (_, free) = post(
            &s,
            "/v1/messages",
            request(json!({"max_tokens": 90,
                "thinking": {"type": "enabled", "budget_tokens": 6}})),
        )
        .await;
        assert_eq!(blocks[0]["thinking"], free["content"][0]["thinking"]);
    });
}

/// The first output item of type `kind` in a Responses reply.
fn output_item<'a>(v: &'a Value, kind: &str) -> &'a Value {
    v["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind}: {v}"))
}

#[test]
fn responses_text_format_and_tool_choice_are_enforced() {
    let s = server(config());
    rt().block_on(async {
        let body = |extra: Value| {
            with_fields(
                json!({"model": "demo", "max_output_tokens": 60, "temperature": 0,
                    "input": "And it came to pass"}),
                extra,
            )
        };
        let (st, v) = post(
            &s,
            "/v1/responses",
            body(
                json!({"text": {"format": {"type": "json_schema", "name": "t",
                "schema": schema(), "strict": true}}}),
            ),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let message = output_item(&v, "message");
        matches_schema(message["content"][0]["text"].as_str().unwrap()).unwrap();
        let flat_tools = json!([{"type": "function", "name": "list", "description": "List",
            "parameters": {"type": "object", "properties": {"all": {"type": "boolean"}},
            "required": ["all"]}}]);
        for choice in [
            json!("required"),
            json!({"type": "function", "name": "list"}),
        ] {
            let (st, v) = post(
                &s,
                "/v1/responses",
                body(json!({"tools": flat_tools, "tool_choice": choice,
                    "parallel_tool_calls": false})),
            )
            .await;
            assert_eq!(st, 200, "{v}");
            let call = output_item(&v, "function_call");
            assert_eq!(call["name"], "list");
            let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
            assert!(args["all"].is_boolean(), "{args}");
        }
        let (st, v) = post(
            &s,
            "/v1/responses",
            body(json!({"text": {"format": {"type": "json_schema"}}})),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "text.format");
    });
}

/// The reply's text for a greedy chat request with these settings.
async fn greedy_text(s: &RunningServer, extra: Value) -> String {
    content(&chat_ok(s, with_fields(json!({"max_tokens": 40, "seed": 3}), extra)).await)
}

#[test]
fn penalties_change_the_output() {
    let s = server(config());
    rt().block_on(async {
        let none = greedy_text(&s, json!({})).await;
        for (field, value) in [
            ("presence_penalty", 2.0),
            ("frequency_penalty", 2.0),
            ("repetition_penalty", 2.0),
        ] {
            let with = greedy_text(&s, json!({ field: value })).await;
            assert_ne!(with, none, "{field} had no effect");
            // Off values are the same as none.
            let off = if field == "repetition_penalty" {
                1.0
            } else {
                0.0
            };
            assert_eq!(
                greedy_text(&s, json!({ field: off })).await,
                none,
                "{field}"
            );
        }
        // Also on text completions.
        let body = |extra: Value| {
            with_fields(
                json!({"model": "demo", "prompt": "And it came to pass", "max_tokens": 30,
                    "temperature": 0}),
                extra,
            )
        };
        let (_, a) = post(&s, "/v1/completions", body(json!({}))).await;
        let (_, b) = post(
            &s,
            "/v1/completions",
            body(json!({"repetition_penalty": 2.0})),
        )
        .await;
        assert_ne!(a["choices"][0]["text"], b["choices"][0]["text"]);
        for (field, bad) in [
            ("presence_penalty", 3.0),
            ("frequency_penalty", -2.5),
            ("repetition_penalty", 0.0),
        ] {
            let (st, v) = post(&s, "/v1/chat/completions", request(json!({ field: bad }))).await;
            assert_eq!(st, 400, "{v}");
            assert_eq!(v["error"]["param"], field);
        }
    });
}

/// The `logprobs.content` entries of a chat reply, streamed or not.
async fn logprob_entries(s: &RunningServer, stream: bool) -> (String, Vec<Value>) {
    let body = request(
        json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 12,
        "stream": stream}),
    );
    if !stream {
        let (st, v) = post(s, "/v1/chat/completions", body).await;
        assert_eq!(st, 200, "{v}");
        let entries = v["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap_or_else(|| panic!("no logprobs: {v}"))
            .clone();
        return (content(&v), entries);
    }
    let (st, events) = post_stream(s, "/v1/chat/completions", body).await;
    assert_eq!(st, 200);
    let (mut text, mut entries) = (String::new(), Vec::new());
    for (_, d) in &events {
        if let Ok(v) = serde_json::from_str::<Value>(d) {
            if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if let Some(c) = v["choices"][0]["logprobs"]["content"].as_array() {
                entries.extend(c.iter().cloned());
            }
        }
    }
    (text, entries)
}

#[test]
fn logprobs_are_returned_and_consistent() {
    let s = server(config());
    rt().block_on(async {
        let (text, entries) = logprob_entries(&s, false).await;
        assert!(!entries.is_empty());
        let mut joined = Vec::new();
        for e in &entries {
            let lp = e["logprob"].as_f64().unwrap();
            assert!(lp <= 0.0, "{e}");
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3, "{e}");
            // Greedy: the chosen token is the most likely one.
            assert_eq!(top[0]["token"], e["token"], "{e}");
            assert!(
                (top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6,
                "{e}"
            );
            let probs: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
            assert!(probs.windows(2).all(|w| w[0] >= w[1]), "{e}");
            assert!(probs.iter().map(|p| p.exp()).sum::<f64>() <= 1.0 + 1e-6);
            let bytes: Vec<u8> = e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
                .collect();
            joined.extend(bytes);
        }
        assert_eq!(String::from_utf8_lossy(&joined), text);
        // Streamed: the same entries.
        let (stext, sentries) = logprob_entries(&s, true).await;
        assert_eq!(stext, text);
        assert_eq!(sentries, entries);
        // Without logprobs there are none; a bad count is refused.
        let v = chat_ok(&s, json!({})).await;
        assert!(v["choices"][0]["logprobs"].is_null());
        for bad in [
            json!({"logprobs": true, "top_logprobs": 21}),
            json!({"top_logprobs": 2}),
        ] {
            let (st, v) = post(&s, "/v1/chat/completions", request(bad)).await;
            assert_eq!(st, 400, "{v}");
            assert_eq!(v["error"]["param"], "top_logprobs");
        }
    });
}

/// The demo model repacked with a generation_config.json holding `gen`.
fn demo_with_generation_config(gen: Value) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/demo");
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sampling-demo-src-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&root).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), dir.join(f.file_name())).unwrap();
    }
    std::fs::write(dir.join("generation_config.json"), gen.to_string()).unwrap();
    let target = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("sampling-demo-{}.slip", std::process::id()));
    slipstream_repack::repack(
        &slipstream_repack::RepackOptions {
            input: dir,
            output: target.clone(),
            overwrite: slipstream_format::Overwrite::Force,
            quant: slipstream_repack::QuantChoice::Q4,
            ggml_to_affine: false,
        },
        &|_| {},
    )
    .expect("repacking the demo model");
    target
}

#[test]
fn generation_config_and_flags_are_the_defaults() {
    let path = demo_with_generation_config(
        json!({"eos_token_id": [2, 0], "repetition_penalty": 2.0, "temperature": 0.0}),
    );
    let model = slipstream_format::SlipModel::open(&path).unwrap();
    assert_eq!(
        model.manifest.generation,
        Some(GenerationDefaults {
            repetition_penalty: Some(2.0),
            temperature: Some(0.0),
            ..Default::default()
        })
    );
    let with_config = start(config(), model_backend(path, StateCacheSpec::default())).unwrap();
    let plain = server(config());
    let flagged = server(ServerConfig {
        sampling: GenerationDefaults {
            repetition_penalty: Some(2.0),
            ..Default::default()
        },
        ..config()
    });
    rt().block_on(async {
        let reference = greedy_text(&plain, json!({"repetition_penalty": 2.0})).await;
        let unpenalised = greedy_text(&plain, json!({})).await;
        assert_ne!(reference, unpenalised);
        // The checkpoint's value applies when the request sets none...
        assert_eq!(greedy_text(&with_config, json!({})).await, reference);
        // ...and its temperature 0 too (no request temperature: greedy).
        let mut body = request(json!({"max_tokens": 40}));
        body.as_object_mut().unwrap().remove("temperature");
        let (_, a) = post(&with_config, "/v1/chat/completions", body.clone()).await;
        let (_, b) = post(&with_config, "/v1/chat/completions", body).await;
        assert_eq!(content(&a), reference);
        assert_eq!(content(&a), content(&b));
        // The request's own value wins.
        assert_eq!(
            greedy_text(&with_config, json!({"repetition_penalty": 1.0})).await,
            unpenalised
        );
        // The flag applies when the request sets none, under the request.
        assert_eq!(greedy_text(&flagged, json!({})).await, reference);
        assert_eq!(
            greedy_text(&flagged, json!({"repetition_penalty": 1.0})).await,
            unpenalised
        );
    });
}

#[test]
fn unknown_and_unsupported_fields_are_refused_by_name() {
    let s = server(config());
    rt().block_on(async {
        for (extra, param) in [
            (json!({"best_of": 2}), "best_of"),
            (json!({"functions": []}), "functions"),
            (json!({"logit_bias": {"12": 5}}), "logit_bias"),
            (json!({"n": 2}), "n"),
            (json!({"modalities": ["audio"]}), "modalities"),
        ] {
            let (st, v) = post(&s, "/v1/chat/completions", request(extra.clone())).await;
            assert_eq!(st, 400, "{extra}: {v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            assert!(openai_error(&v).contains(param), "{v}");
        }
        let (st, v) = post(
            &s,
            "/v1/completions",
            json!({"model": "demo", "prompt": "x", "max_tokens": 2, "echo": true}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "echo");
        let (st, v) = post(&s, "/v1/messages", request(json!({"mcp_servers": []}))).await;
        assert_eq!(st, 400, "{v}");
        assert!(anthropic_error(&v).1.contains("mcp_servers"), "{v}");
        let (st, v) = post(
            &s,
            "/v1/responses",
            json!({"model": "demo", "input": "x", "max_output_tokens": 2, "best_of": 2}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["param"], "best_of");
        // Harmless fields are accepted.
        let v = chat_ok(
            &s,
            json!({"user": "u", "metadata": {"a": "b"}, "store": false, "service_tier": "auto",
                "stream_options": {"include_usage": true}, "parallel_tool_calls": true,
                "logit_bias": {}, "safety_identifier": "x", "prompt_cache_key": "k",
                "presence_penalty": 0, "frequency_penalty": 0, "top_k": 5, "min_p": 0.1,
                "max_completion_tokens": 4}),
        )
        .await;
        assert!(v["choices"][0]["message"].is_object());
        let (st, v) = post(
            &s,
            "/v1/messages",
            request(
                json!({"metadata": {"user_id": "u"}, "service_tier": "auto", "top_k": 3,
                "top_p": 0.9, "max_tokens": 4}),
            ),
        )
        .await;
        assert_eq!(st, 200, "{v}");
    });
}

/// Speculative decoding (`serve --speculate`) changes no reply.
#[test]
fn speculative_decoding_gives_the_plain_replies_and_reports_its_drafts() {
    let plain = server(config());
    let spec = server(ServerConfig {
        speculation: slipstream_engine::Speculation {
            mode: slipstream_engine::SpeculateMode::Both,
            draft_tokens: 4,
            auto_off: false,
        },
        ..config()
    });
    rt().block_on(async {
        let prompt = "Count: one two three, one two three, one two three, one two";
        // Greedy, seeded draws, and constrained decoding (the grammar's
        // mask applies to each verified row in turn).
        for sampling in [
            json!({"temperature": 0}),
            json!({"temperature": 0.8, "top_p": 0.95, "seed": 11}),
            json!({"temperature": 0, "response_format": {"type": "json_schema",
                "json_schema": {"name": "thing", "schema": schema()}}}),
        ] {
            let mut body = with_fields(
                json!({"model": "demo", "max_tokens": 48,
                    "messages": [{"role": "user", "content": prompt}]}),
                sampling.clone(),
            );
            let (st, a) = post(&plain, "/v1/chat/completions", body.clone()).await;
            assert_eq!(st, 200, "{a}");
            let (st, b) = post(&spec, "/v1/chat/completions", body.clone()).await;
            assert_eq!(st, 200, "{b}");
            assert_eq!(content(&a), content(&b), "{sampling}");
            assert!(!content(&a).is_empty());
            assert!(a["slipstream"]["speculation"].is_null());
            let sp = &b["slipstream"]["speculation"];
            assert!(sp["drafted"].as_u64().unwrap() > 0, "{b}");
            assert!(sp["verify_passes"].as_u64().unwrap() > 0, "{b}");
            // Streamed: the same text, drafts accepted in one pass arrive
            // as their own deltas.
            body["stream"] = json!(true);
            let (st, ev) = post_stream(&spec, "/v1/chat/completions", body).await;
            assert_eq!(st, 200);
            assert_eq!(streamed_chat_text(&ev), content(&a));
        }
        let text = reqwest::get(url(&spec, "/metrics"))
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let counter = |name: &str| -> u64 {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("{name} in {text}"))
        };
        let drafted = counter("slipstream_draft_tokens_total");
        assert!(drafted > 0);
        assert!(counter("slipstream_accepted_draft_tokens_total") <= drafted);
    });
}

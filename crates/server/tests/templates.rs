//! Chat templates through real servers over the demo model: requests
//! shaped like Claude Code's (accepted, their prefix reused), system
//! messages anywhere, the thinking switches and template variables, a
//! thinking budget, reasoning read and written under both names.

mod common;

use common::*;
use serde_json::{json, Value};
use slipstream_server::{RunningServer, ServerConfig};

/// A chat template with the Qwen3.5/3.6 rules (one system message, first;
/// a user query; an opened `<think>` unless thinking is off).
const QWEN_LIKE: &str = include_str!("fixtures/qwen_like_template.jinja");

fn qwen_like_config() -> ServerConfig {
    ServerConfig {
        chat_template: Some(QWEN_LIKE.into()),
        ..config()
    }
}

/// [`qwen_like_config`] with `kwargs` as the server's default template
/// variables (`serve --chat-template-kwargs`).
fn qwen_like_with_kwargs(kwargs: Value) -> ServerConfig {
    ServerConfig {
        chat_template_kwargs: kwargs.as_object().unwrap().clone(),
        ..qwen_like_config()
    }
}

/// A request shaped like Claude Code's (2.1.x), small enough for the demo
/// model's 4096 positions.
fn claude_code_like(billing: &str) -> Value {
    json!({
        "model": "demo", "max_tokens": 32000, "temperature": 0,
        "system": [
            {"type": "text", "text": format!("x-anthropic-billing-header: cc_version={billing}; cc_entrypoint=cli;")},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
                {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /w", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Use Bash.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "Hook: ok."}
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
            {"name": "DeferredToolPlaceholder", "description": "never call", "input_schema": {"type": "object", "properties": {}}, "defer_loading": true}
        ],
        "metadata": {"user_id": "{\"device_id\":\"0\"}"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}
    })
}

#[test]
fn claude_code_requests_are_accepted_and_reuse_the_prefix() {
    let s = server(qwen_like_config());
    rt().block_on(async {
        let mut body = claude_code_like("2.1.197.a1");
        let (st, c) = post(&s, "/v1/messages/count_tokens", body.clone()).await;
        assert_eq!(st, 200, "{c}");
        let count = c["input_tokens"].as_u64().unwrap();
        // The billing header, which changes with every client version, is
        // not part of the prompt.
        let (_, c2) = post(&s, "/v1/messages/count_tokens", claude_code_like("9.9.9")).await;
        assert_eq!(c2["input_tokens"].as_u64(), Some(count));

        body["stream"] = json!(true);
        body["max_tokens"] = json!(6);
        let (st, ev) = post_stream(&s, "/v1/messages", body.clone()).await;
        assert_eq!(st, 200, "{ev:?}");
        let data: Vec<Value> = ev
            .iter()
            .filter(|(n, _)| n != "ping")
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        assert_eq!(
            data[0]["message"]["usage"]["input_tokens"].as_u64(),
            Some(count)
        );
        assert_eq!(data.last().unwrap()["type"], "message_stop");
        // Adaptive thinking is on (the template opens <think>), shown
        // "omitted": the reasoning comes back in the signature only.
        assert_eq!(data[1]["content_block"]["type"], "thinking");
        assert!(data.iter().all(|d| d["delta"].get("thinking").is_none()));
        let sig = data
            .iter()
            .find(|d| d["delta"]["type"] == "signature_delta")
            .unwrap();
        assert!(sig["delta"]["signature"]
            .as_str()
            .unwrap()
            .starts_with("slipstream-reasoning:"));

        // One token of reply keeps the state at the prompt's end: another
        // client version sends the same conversation, and all of it is
        // reused.
        let mut a = claude_code_like("2.1.197.a1");
        a["max_tokens"] = json!(1);
        let (st, v) = post(&s, "/v1/messages", a).await;
        assert_eq!(st, 200, "{v}");
        let mut b = claude_code_like("2.1.198.b2");
        b["max_tokens"] = json!(1);
        let (st, v) = post(&s, "/v1/messages", b).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(
            v["usage"]["cache_read_input_tokens"].as_u64(),
            Some(count),
            "{v}"
        );
        assert_eq!(v["usage"]["input_tokens"], 0, "{v}");
    });
}

#[test]
fn the_captured_claude_code_request_is_read_and_its_overflow_worded_as_anthropic_does() {
    let mut c = config();
    c.max_context = Some(4096);
    let s = server(c);
    let body: Value =
        serde_json::from_str(include_str!("fixtures/claude_code_request.json")).unwrap();
    rt().block_on(async {
        let (st, c) = post(&s, "/v1/messages/count_tokens", body.clone()).await;
        assert_eq!(st, 200, "{c}");
        let n = c["input_tokens"].as_u64().unwrap();
        assert!(
            n > 4096,
            "Claude Code's prompt is larger than the demo model: {n}"
        );
        let (st, v) = post(&s, "/v1/messages", body).await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(
            anthropic_error(&v),
            (
                "invalid_request_error",
                format!("prompt is too long: {n} tokens > 4095 maximum").as_str()
            )
        );
    });
}

#[test]
fn system_messages_anywhere_on_chat_completions() {
    let s = server(qwen_like_config());
    rt().block_on(async {
        for messages in [
            json!([{"role": "system", "content": "one"}, {"role": "developer", "content": "two"},
                {"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                {"role": "assistant", "content": "yes"}, {"role": "developer", "content": "later"},
                {"role": "user", "content": "go on"}, {"role": "system", "content": "last"}]),
            json!([{"role": "system", "content": "Say hi."}]),
            json!([{"role": "developer", "content": "Say hi."}, {"role": "system", "content": "Briefly."}]),
        ] {
            let (st, v) = post(
                &s,
                "/v1/chat/completions",
                json!({"model": "demo", "max_tokens": 2, "messages": messages}),
            )
            .await;
            assert_eq!(st, 200, "{messages}: {v}");
        }
    });
}

/// Prompt tokens of a chat request (one token of reply).
async fn prompt_tokens(s: &RunningServer, mut body: Value) -> Result<u64, Value> {
    body["max_tokens"] = json!(1);
    body["model"] = json!("demo");
    let (st, v) = post(s, "/v1/chat/completions", body).await;
    if st != 200 {
        return Err(v);
    }
    Ok(v["usage"]["prompt_tokens"].as_u64().unwrap())
}

#[test]
fn thinking_switches_and_server_default_template_variables() {
    let s = server(qwen_like_with_kwargs(json!({"enable_thinking": false})));
    rt().block_on(async {
        let msgs = json!([{"role": "user", "content": "hi"}]);
        let off = prompt_tokens(&s, json!({"messages": msgs})).await.unwrap();
        let on = prompt_tokens(&s, json!({"messages": msgs, "enable_thinking": true})).await.unwrap();
        // The template writes an empty think block when thinking is off.
        assert!(off > on, "off {off}, on {on}");
        for (body, want) in [
            (json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": true}}), on),
            (json!({"messages": msgs, "reasoning_effort": "high"}), on),
            (json!({"messages": msgs, "reasoning_effort": "none"}), off),
            (json!({"messages": msgs, "reasoning_effort": "minimal"}), off),
            (json!({"messages": msgs, "enable_thinking": false, "reasoning_effort": "high"}), off),
            (json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": true}, "enable_thinking": false}), on),
        ] {
            assert_eq!(prompt_tokens(&s, body.clone()).await.unwrap(), want, "{body}");
        }
        for body in [
            json!({"messages": msgs, "reasoning_effort": "huge"}),
            json!({"messages": msgs, "chat_template_kwargs": {"enable_thinking": "yes"}}),
            json!({"messages": msgs, "chat_template_kwargs": [1]}),
        ] {
            let e = prompt_tokens(&s, body.clone()).await.unwrap_err();
            assert!(openai_error(&e).contains("reasoning_effort") || openai_error(&e).contains("chat_template_kwargs"), "{e}");
        }

        // Anthropic: adaptive follows the server's default (off here),
        // enabled and disabled are the request's.
        let count = |thinking: Value| {
            let s = &s;
            async move {
                let mut body = json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]});
                if !thinking.is_null() {
                    body["thinking"] = thinking;
                }
                let (st, v) = post(s, "/v1/messages/count_tokens", body).await;
                assert_eq!(st, 200, "{v}");
                v["input_tokens"].as_u64().unwrap()
            }
        };
        let adaptive = count(json!({"type": "adaptive"})).await;
        let enabled = count(json!({"type": "enabled", "budget_tokens": 1024})).await;
        let disabled = count(json!({"type": "disabled"})).await;
        assert_eq!(count(Value::Null).await, disabled);
        assert_eq!(adaptive, disabled);
        assert!(enabled < disabled);
        let (st, v) = post(
            &s,
            "/v1/messages",
            json!({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                "output_config": {"format": {"type": "json_schema"}}}),
        )
        .await;
        // A format is enforced (tests/sampling.rs); one without a schema is refused.
        assert_eq!(st, 400);
        assert!(anthropic_error(&v).1.contains("output_config.format"), "{v}");
    });
}

#[test]
fn a_thinking_budget_closes_the_reasoning_and_the_reply_goes_on() {
    let s = server(qwen_like_config());
    rt().block_on(async {
        let ask = |budget: u64| {
            let s = &s;
            async move {
                let (st, v) = post(
                    s,
                    "/v1/messages",
                    json!({"model": "demo", "max_tokens": 24,
                    "temperature": 0, "thinking": {"type": "enabled", "budget_tokens": budget},
                    "messages": [{"role": "user", "content": "In the beginning"}]}),
                )
                .await;
                assert_eq!(st, 200, "{v}");
                v
            }
        };
        let free = ask(1000).await;
        let capped = ask(4).await;
        let blocks = |v: &Value| -> Vec<(String, String)> {
            v["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| {
                    let t = b["type"].as_str().unwrap().to_string();
                    let text = b[if t == "thinking" { "thinking" } else { "text" }]
                        .as_str()
                        .unwrap_or("")
                        .to_string();
                    (t, text)
                })
                .collect()
        };
        let (free, capped_b) = (blocks(&free), blocks(&capped));
        assert_eq!(
            free.len(),
            1,
            "the demo model never closes its reasoning: {free:?}"
        );
        assert_eq!(capped_b.len(), 2, "{capped_b:?}");
        assert_eq!(capped_b[0].0, "thinking");
        assert_eq!(capped_b[1].0, "text");
        assert!(!capped_b[1].1.is_empty());
        // Greedy: the same first tokens of reasoning, then the close.
        assert!(
            free[0].1.starts_with(capped_b[0].1.trim_end()),
            "{free:?} / {capped_b:?}"
        );
        assert!(capped_b[0].1.len() < free[0].1.len());
        assert_eq!(capped["usage"]["output_tokens"], 24, "{capped}");
    });
}

#[test]
fn reasoning_is_read_and_written_under_both_names() {
    let c = qwen_like_with_kwargs(json!({"preserve_thinking": true}));
    let s = scripted(c, &["hmm\n</think>\n\nhello"]);
    rt().block_on(async {
        let (st, v) = post(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let m = &v["choices"][0]["message"];
        assert_eq!(m["reasoning_content"], "hmm", "{v}");
        assert_eq!(m["reasoning"], "hmm", "{v}");
        assert_eq!(m["content"], "hello");
        let (st, ev) = post_stream(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
        assert_eq!(st, 200);
        let deltas: Vec<Value> = chat_chunks(&ev)
            .into_iter()
            .map(|c| c["choices"][0]["delta"].clone())
            .collect();
        let both: String = deltas.iter().filter_map(|d| d["reasoning"].as_str()).collect();
        let named: String = deltas.iter().filter_map(|d| d["reasoning_content"].as_str()).collect();
        assert_eq!(both, named);
        assert!(both.contains("hmm"), "{deltas:?}");

        // On input, `reasoning` is `reasoning_content` (rendered here as
        // preserve_thinking asks).
        let turn = |key: &str| {
            let mut a = json!({"role": "assistant", "content": "yes"});
            if !key.is_empty() {
                a[key] = json!("a long line of earlier reasoning");
            }
            json!({"messages": [{"role": "user", "content": "hi"}, a, {"role": "user", "content": "and?"}]})
        };
        let none = prompt_tokens(&s, turn("")).await.unwrap();
        let named = prompt_tokens(&s, turn("reasoning_content")).await.unwrap();
        let short = prompt_tokens(&s, turn("reasoning")).await.unwrap();
        assert_eq!(named, short);
        assert!(named > none);
    });
}

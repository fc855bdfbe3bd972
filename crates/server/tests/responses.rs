//! `POST /v1/responses` against real servers over the demo model: plain
//! text, the event stream, a function call round trip through the scripted
//! backend, instructions and developer messages, reasoning items, and the
//! fields that are refused by name.

mod common;

use common::*;
use serde_json::{json, Value};
use slipstream_server::ServerConfig;

const CALL: &str = "<think>\nI should list the files.\n</think>\n\n<tool_call>\n<function=exec_command>\n<parameter=cmd>\nls\n</parameter>\n</function>\n</tool_call>";
const ANSWER: &str = "There is one file.";

fn exec_tool() -> Value {
    json!([{"type": "function", "name": "exec_command", "description": "run a command", "strict": false,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "web_search", "external_web_access": false}])
}

fn output_text(r: &Value) -> String {
    r["output"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "message")
        .flat_map(|i| i["content"].as_array().unwrap())
        .map(|p| p["text"].as_str().unwrap())
        .collect()
}

#[test]
fn plain_text_non_streaming_and_cut_by_max_output_tokens() {
    let s = server(config());
    rt().block_on(async {
        let (st, r) = post(
            &s,
            "/v1/responses",
            json!({"model": "demo", "input": "Once upon a time",
            "max_output_tokens": 8, "temperature": 0, "store": false, "metadata": {"k": "v"}}),
        )
        .await;
        assert_eq!(st, 200, "{r}");
        assert_eq!(r["object"], "response");
        assert!(r["id"].as_str().unwrap().starts_with("resp_"));
        assert_eq!(r["model"], "demo");
        assert_eq!(r["metadata"], json!({"k": "v"}));
        assert_eq!(r["max_output_tokens"], 8);
        let u = &r["usage"];
        assert_eq!(u["output_tokens"], 8);
        assert_eq!(
            u["total_tokens"].as_u64().unwrap(),
            u["input_tokens"].as_u64().unwrap() + 8
        );
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert!(!output_text(&r).is_empty());
        let (st, v) = post(
            &s,
            "/v1/responses",
            json!({"input": "Hi", "max_output_tokens": 3}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        let id = v["id"].as_str().unwrap();
        let r = reqwest::get(url(&s, &format!("/v1/responses/{id}")))
            .await
            .unwrap();
        assert_eq!(r.status(), 404);
        let v: Value = r.json().await.unwrap();
        assert!(v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not store"));
    });
}

#[test]
fn streamed_events_come_in_order_and_agree_with_the_final_response() {
    let s = scripted(config(), &[CALL]);
    rt().block_on(async {
        let (st, ev) = post_stream(
            &s,
            "/v1/responses",
            json!({"model": "demo", "stream": true,
            "input": "list files", "tools": exec_tool()}),
        )
        .await;
        assert_eq!(st, 200);
        let data: Vec<Value> = ev
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect();
        for ((name, _), d) in ev.iter().zip(&data) {
            assert_eq!(name, d["type"].as_str().unwrap());
        }
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names[..2], ["response.created", "response.in_progress"]);
        assert_eq!(names.last(), Some(&"response.completed"));
        // Each item is announced, then finished, before the next one starts.
        let items: Vec<(&str, &Value)> = data
            .iter()
            .filter_map(|d| {
                let t = d["type"].as_str()?;
                t.starts_with("response.output_item.")
                    .then(|| (t, &d["item"]))
            })
            .collect();
        assert_eq!(items.len(), 4, "{names:?}");
        for (i, pair) in items.chunks(2).enumerate() {
            assert_eq!(pair[0].0, "response.output_item.added");
            assert_eq!(pair[1].0, "response.output_item.done");
            assert_eq!(pair[0].1["id"], pair[1].1["id"]);
            assert_eq!(pair[1].1["status"], "completed", "item {i}");
        }
        assert_eq!(items[0].1["type"], "reasoning");
        assert_eq!(items[2].1["type"], "function_call");
        let seq: Vec<u64> = data
            .iter()
            .map(|d| d["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seq, (0..data.len() as u64).collect::<Vec<_>>());
        let reasoning: String = data
            .iter()
            .filter(|d| d["type"] == "response.reasoning_text.delta")
            .map(|d| d["delta"].as_str().unwrap())
            .collect();
        assert_eq!(reasoning, "I should list the files.");
        let done = data.last().unwrap();
        let r = &done["response"];
        assert_eq!(r["id"], data[0]["response"]["id"]);
        assert_eq!(r["status"], "completed");
        let call = &r["output"][1];
        assert_eq!(call["type"], "function_call");
        assert_eq!(call["name"], "exec_command");
        assert_eq!(call["arguments"], "{\"cmd\":\"ls\"}");
        assert!(
            r["usage"]["output_tokens_details"]["reasoning_tokens"]
                .as_u64()
                .unwrap()
                > 0
        );
        assert_eq!(r["tools"], exec_tool(), "tools are echoed as sent");
    });
}

#[test]
fn a_function_call_round_trip() {
    let s = scripted(config(), &[CALL, ANSWER, ANSWER]);
    rt().block_on(async {
        let first = json!({"model": "demo", "tools": exec_tool(), "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use exec_command."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]}]});
        let (st, r) = post(&s, "/v1/responses", first.clone()).await;
        assert_eq!(st, 200, "{r}");
        let out = r["output"].as_array().unwrap();
        assert_eq!(out[0]["type"], "reasoning");
        assert_eq!(out[0]["content"][0]["text"], "I should list the files.");
        let call = out.iter().find(|i| i["type"] == "function_call").unwrap();
        assert_eq!(call["name"], "exec_command");
        assert_eq!(call["status"], "completed");
        let call_id = call["call_id"].as_str().unwrap();

        // The client runs the tool and sends the whole conversation back,
        // the output items first, as Codex does.
        let next = |result: &str| {
            let mut body = first.clone();
            let input = body["input"].as_array_mut().unwrap();
            input.extend(out.iter().cloned());
            input.push(json!({"type": "function_call_output", "call_id": call_id, "output": result}));
            body
        };
        let (st, short) = post(&s, "/v1/responses", next("a.txt")).await;
        assert_eq!(st, 200, "{short}");
        assert_eq!(output_text(&short), ANSWER);
        assert_eq!(short["status"], "completed");
        // The tool's output reaches the prompt: a longer one makes it longer.
        let (st, long) = post(&s, "/v1/responses", next(&"a.txt b.txt c.txt ".repeat(20))).await;
        assert_eq!(st, 200, "{long}");
        let tokens = |r: &Value| r["usage"]["input_tokens"].as_u64().unwrap();
        assert!(tokens(&long) > tokens(&short) + 40, "{} vs {}", tokens(&long), tokens(&short));
        assert!(tokens(&short) > tokens(&r), "the result and the call are in the prompt");
    });
}

#[test]
fn instructions_developer_messages_and_reasoning_items_render() {
    let s = server(config());
    rt().block_on(async {
        let base = |extra: Value| {
            with_fields(
                json!({"model": "demo", "max_output_tokens": 1, "temperature": 0,
                    "input": [{"role": "user", "content": "hello"}]}),
                extra,
            )
        };
        let tokens = |r: &Value| r["usage"]["input_tokens"].as_u64().unwrap();
        let (st, plain) = post(&s, "/v1/responses", base(json!({}))).await;
        assert_eq!(st, 200, "{plain}");
        let (st, instructed) =
            post(&s, "/v1/responses", base(json!({"instructions": "Answer in one word."}))).await;
        assert_eq!(st, 200, "{instructed}");
        assert!(tokens(&instructed) > tokens(&plain));
        assert_eq!(instructed["instructions"], "Answer in one word.");
        // A developer message after the first turn is kept, as a user note.
        let mut turns = vec![
            json!({"role": "user", "content": "hello"}),
            json!({"role": "assistant", "content": [{"type": "output_text", "text": "hi"}]}),
            json!({"role": "user", "content": "again"}),
        ];
        let (st, without) = post(&s, "/v1/responses", base(json!({"input": turns}))).await;
        assert_eq!(st, 200, "{without}");
        turns.insert(2, json!({"role": "developer", "content": "Be brief from now on."}));
        let (st, late) = post(&s, "/v1/responses", base(json!({"input": turns}))).await;
        assert_eq!(st, 200, "{late}");
        assert!(tokens(&late) > tokens(&without));
        // A reasoning item before an assistant message is accepted and
        // rendered (the demo template shows reasoning only through content,
        // so its length is not compared here).
        let (st, v) = post(&s, "/v1/responses", base(json!({"input": [
            {"role": "user", "content": "hello"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "again"}]})))
        .await;
        assert_eq!(st, 200, "{v}");
    });
}

#[test]
fn refused_fields_name_themselves() {
    let s = server(config());
    rt().block_on(async {
        for (extra, param) in [
            (
                json!({"previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"text": {"format": {"type": "yaml"}}}), "text.format"),
            (json!({"presence_penalty": 1}), "presence_penalty"),
            (json!({"max_output_tokens": 0}), "max_output_tokens"),
            (json!({"input": [{"type": "input_image"}]}), "input[0].type"),
        ] {
            let body = with_fields(json!({"model": "demo", "input": "hi"}), extra);
            let (st, v) = post(&s, "/v1/responses", body).await;
            assert_eq!(st, 400, "{v}");
            assert_eq!(v["error"]["param"], param, "{v}");
            assert_eq!(v["error"]["type"], "invalid_request_error");
        }
        let (st, v) = post(
            &s,
            "/v1/responses",
            json!({"model": "gpt-9", "input": "hi"}),
        )
        .await;
        assert_eq!(st, 404);
        assert_eq!(v["error"]["code"], "model_not_found");
        let (st, v) = post(&s, "/v1/responses", json!({"model": "demo"})).await;
        assert_eq!(st, 400);
        assert_eq!(v["error"]["param"], "input");
    });
}

#[test]
fn the_api_key_is_checked() {
    let s = server(ServerConfig {
        api_key: Some("sekrit".into()),
        ..config()
    });
    rt().block_on(async {
        let (st, v) = post(&s, "/v1/responses", json!({"input": "hi"})).await;
        assert_eq!(st, 401);
        assert_eq!(v["error"]["code"], "invalid_api_key");
        let r = reqwest::Client::new()
            .post(url(&s, "/v1/responses"))
            .bearer_auth("sekrit")
            .json(&json!({"input": "hi", "max_output_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    });
}

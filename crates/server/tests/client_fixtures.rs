//! Requests real coding-agent clients sent (recorded by tests/clients with
//! `UPDATE_FIXTURES=1`; `{"path", "body"}` per client under
//! `fixtures/clients/`) go through the server's own request parsing and
//! prompt rendering: fast checks of the wire shapes the clients use, with
//! no client or server running.
//!
//! The tool clients' fixtures are their follow-up turn: it carries the
//! tool call the scripted model made and the tool's result, a marker
//! `tool-result-<hex>` the client read from a file.

use std::path::PathBuf;

use serde_json::Value;
use slipstream_engine::ChatTemplate;
use slipstream_server::anthropic::MessagesRequest;
use slipstream_server::error::Flavor;
use slipstream_server::fields::{refuse_unknown, ANTHROPIC_IGNORED, OPENAI_IGNORED};
use slipstream_server::openai::{conversation, ChatRequest};
use slipstream_server::prompt::{render, Conversation};

const MARKER: &str = "tool-result-";

fn fixture(client: &str) -> (String, Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/clients")
        .join(format!("{client}.json"));
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let v: Value = serde_json::from_str(&text).unwrap();
    (v["path"].as_str().unwrap().to_string(), v["body"].clone())
}

/// The demo model's chat template (ChatML; tools go through the server's
/// fallback block).
fn demo_template() -> ChatTemplate {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/demo/tokenizer_config.json");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    ChatTemplate::new(cfg["chat_template"].as_str().unwrap()).unwrap()
}

/// Parses and renders an OpenAI Chat Completions fixture.
fn chat(client: &str) -> (Conversation, String) {
    let (path, body) = fixture(client);
    assert_eq!(path, "/v1/chat/completions", "{client}");
    let req: ChatRequest = serde_json::from_value(body)
        .unwrap_or_else(|e| panic!("{client}: the request does not parse: {e}"));
    // No field the client sends is refused as unknown.
    refuse_unknown(Flavor::OpenAi, &req.unknown, OPENAI_IGNORED)
        .unwrap_or_else(|e| panic!("{client}: refused: {e:?}"));
    let conv = conversation(&req).unwrap_or_else(|e| panic!("{client}: refused: {e:?}"));
    let text = render(&conv, Some(&demo_template()))
        .unwrap_or_else(|e| panic!("{client}: does not render: {e}"))
        .text;
    (conv, text)
}

fn tool_names(conv: &Conversation) -> Vec<&str> {
    conv.tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect()
}

/// A tool client's follow-up: the call it ran and the result it sent back,
/// both in the conversation and in the rendered prompt.
fn check_tool_round_trip(client: &str, tool: &str) {
    let (conv, text) = chat(client);
    assert!(
        tool_names(&conv).contains(&tool),
        "{client}: {:?}",
        tool_names(&conv)
    );
    let n = conv.messages.len();
    let (call, result) = (&conv.messages[n - 2], &conv.messages[n - 1]);
    assert_eq!(call["role"], "assistant", "{client}");
    assert_eq!(call["tool_calls"][0]["function"]["name"], tool, "{client}");
    assert!(
        call["tool_calls"][0]["function"]["arguments"].is_object(),
        "{client}: arguments become an object for the template"
    );
    assert_eq!(result["role"], "tool", "{client}");
    assert_eq!(
        result["tool_call_id"], call["tool_calls"][0]["id"],
        "{client}"
    );
    assert!(
        result["content"].as_str().unwrap().contains(MARKER),
        "{client}: {result}"
    );
    assert!(text.contains("<tools>") && text.contains(&format!("\"name\":\"{tool}\"")));
    let response = text.rfind("<tool_response>").expect("a tool response");
    assert!(text[response..].contains(MARKER), "{client}");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{client}");
}

#[test]
fn qwen_code_follow_up_parses() {
    check_tool_round_trip("qwen", "run_shell_command");
}

#[test]
fn opencode_follow_up_parses() {
    check_tool_round_trip("opencode", "bash");
}

#[test]
fn aider_request_parses() {
    // aider sends no tools: the file to edit travels in a user message.
    let (conv, text) = chat("aider");
    assert!(conv.tools.is_empty());
    assert_eq!(conv.messages[0]["role"], "system");
    assert!(text.contains(MARKER) && text.contains("SEARCH/REPLACE"));
}

/// Claude Code (Anthropic Messages) and Codex (OpenAI Responses): their
/// follow-up turns, recorded against this server with those APIs' handlers
/// merged in; the checks through those handlers belong with them. Here:
/// the recorded round trip itself (the call, and the result holding the
/// marker, in each API's shape).
#[test]
fn claude_code_and_codex_follow_ups_are_recorded() {
    let (path, body) = fixture("claude");
    assert!(path.starts_with("/v1/messages"), "{path}");
    let req: MessagesRequest = serde_json::from_value(body.clone()).unwrap();
    refuse_unknown(Flavor::Anthropic, &req.unknown, ANTHROPIC_IGNORED).unwrap();
    assert!(body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["name"] == "Bash"));
    let messages = body["messages"].as_array().unwrap();
    let (call, result) = (
        &messages[messages.len() - 2]["content"][0],
        &messages[messages.len() - 1]["content"][0],
    );
    assert_eq!(
        (&call["type"], &call["name"]),
        (&"tool_use".into(), &"Bash".into())
    );
    assert_eq!(result["type"], "tool_result");
    assert_eq!(result["tool_use_id"], call["id"]);
    assert!(result["content"].as_str().unwrap().contains(MARKER));

    let (path, body) = fixture("codex");
    assert_eq!(path, "/v1/responses");
    let input = body["input"].as_array().unwrap();
    let (call, output) = (&input[input.len() - 2], &input[input.len() - 1]);
    assert_eq!(
        (&call["type"], &call["name"]),
        (&"function_call".into(), &"exec_command".into())
    );
    assert_eq!(output["type"], "function_call_output");
    assert_eq!(output["call_id"], call["call_id"]);
    assert!(output["output"].as_str().unwrap().contains(MARKER));
}

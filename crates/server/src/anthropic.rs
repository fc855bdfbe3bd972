//! Anthropic API: `/v1/messages` (streaming and not) and
//! `/v1/messages/count_tokens`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use slipstream_engine::FinishReason;
use tokio::sync::mpsc;

use crate::error::{parse_body, ApiError, Flavor};
use crate::gen::{next_or_ping, sse_body, sse_response, submit, Gen, GenParams, Outcome, Step};
use crate::openai::{new_id, sampling};
use crate::parse::{OutputEvent, ToolCall};
use crate::prompt::{render, Conversation, Rendered};
use crate::App;

const F: Flavor = Flavor::Anthropic;

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Value,
}

#[derive(Debug, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    /// Required by `/v1/messages`, absent from `count_tokens`.
    pub max_tokens: Option<usize>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub system: Value,
    pub stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    pub stream: bool,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub thinking: Option<Value>,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(F, msg)
}

/// Text of a `tool_result` content (string or blocks).
fn tool_result_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .map(|b| match b.get("type").and_then(Value::as_str) {
                Some("text") => b
                    .get("text")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                Some(t) => format!("[{t} omitted]"),
                None => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

fn system_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for b in blocks {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => parts.push(t.clone()),
                    _ => {
                        return Err(bad(
                            "system: blocks must be {\"type\": \"text\", \"text\": ...}",
                        ))
                    }
                }
            }
            Ok(parts.join("\n\n"))
        }
        _ => Err(bad("system must be a string or a list of text blocks")),
    }
}

/// Maps an Anthropic request to a conversation.
pub fn conversation(req: &MessagesRequest) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    let system = system_text(&req.system)?;
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    for (i, m) in req.messages.iter().enumerate() {
        let what = format!("messages.{i}");
        let blocks: Vec<Value> = match &m.content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(b) => b.clone(),
            _ => {
                return Err(bad(format!(
                    "{what}.content must be a string or a list of blocks"
                )))
            }
        };
        match m.role.as_str() {
            "user" => {
                let mut text = String::new();
                for (j, b) in blocks.iter().enumerate() {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            let t = b.get("text").and_then(Value::as_str).ok_or_else(|| {
                                bad(format!("{what}.content.{j}: text block without string `text`"))
                            })?;
                            if !text.is_empty() {
                                text.push('\n');
                            }
                            text.push_str(t);
                        }
                        Some("tool_result") => {
                            let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                                bad(format!("{what}.content.{j}: tool_result without `tool_use_id`"))
                            })?;
                            let mut content =
                                tool_result_text(b.get("content").unwrap_or(&Value::Null));
                            if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                                content = format!("Error: {content}");
                            }
                            messages.push(
                                json!({"role": "tool", "content": content, "tool_call_id": id}),
                            );
                        }
                        Some(t @ ("image" | "document")) => {
                            return Err(bad(format!(
                                "{what}.content.{j}: {t} blocks are not supported by this model (text only)"
                            )))
                        }
                        Some(t) => {
                            return Err(bad(format!(
                                "{what}.content.{j}: unknown block type `{t}` in a user message"
                            )))
                        }
                        None => return Err(bad(format!("{what}.content.{j}: block without `type`"))),
                    }
                }
                if !text.is_empty()
                    || !blocks
                        .iter()
                        .any(|b| b.get("type").and_then(Value::as_str) == Some("tool_result"))
                {
                    messages.push(json!({"role": "user", "content": text}));
                }
            }
            "assistant" => {
                let mut text = String::new();
                let mut reasoning = String::new();
                let mut calls = Vec::new();
                for (j, b) in blocks.iter().enumerate() {
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            text.push_str(b.get("text").and_then(Value::as_str).unwrap_or(""))
                        }
                        Some("thinking") => reasoning
                            .push_str(b.get("thinking").and_then(Value::as_str).unwrap_or("")),
                        Some("redacted_thinking") => {}
                        Some("tool_use") => {
                            let name = b.get("name").and_then(Value::as_str).ok_or_else(|| {
                                bad(format!("{what}.content.{j}: tool_use without `name`"))
                            })?;
                            let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                            if !input.is_object() {
                                return Err(bad(format!(
                                    "{what}.content.{j}: tool_use `input` must be an object"
                                )));
                            }
                            calls.push(json!({"type": "function", "id": b.get("id"),
                                "function": {"name": name, "arguments": input}}));
                        }
                        Some(t) => {
                            return Err(bad(format!(
                            "{what}.content.{j}: unknown block type `{t}` in an assistant message"
                        )))
                        }
                        None => {
                            return Err(bad(format!("{what}.content.{j}: block without `type`")))
                        }
                    }
                }
                let mut msg = Map::new();
                msg.insert("role".into(), "assistant".into());
                msg.insert("content".into(), text.into());
                if !reasoning.is_empty() {
                    msg.insert("reasoning_content".into(), reasoning.into());
                }
                if !calls.is_empty() {
                    msg.insert("tool_calls".into(), Value::Array(calls));
                }
                messages.push(Value::Object(msg));
            }
            r => {
                return Err(bad(format!(
                    "{what}.role: unknown role `{r}` (user or assistant)"
                )))
            }
        }
    }
    if req.messages.is_empty() {
        return Err(bad("messages: at least one message is required"));
    }
    let none = req
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
        == Some("none");
    let mut tools = Vec::new();
    if !none {
        for (i, t) in req.tools.iter().flatten().enumerate() {
            let Some(name) = t.get("name").and_then(Value::as_str) else {
                return Err(bad(format!("tools.{i}: a tool needs a `name`")));
            };
            // Server tools (web search etc.) have no schema: not ours to run.
            let Some(schema) = t.get("input_schema") else {
                continue;
            };
            tools.push(json!({"type": "function", "function": {
                "name": name,
                "description": t.get("description").cloned().unwrap_or_else(|| "".into()),
                "parameters": schema,
            }}));
        }
    }
    let thinking = req
        .thinking
        .as_ref()
        .and_then(|t| t.get("type"))
        .and_then(Value::as_str)
        == Some("enabled");
    Ok(Conversation {
        messages,
        tools,
        enable_thinking: Some(thinking),
        extra: Map::new(),
    })
}

fn rendered(app: &App, req: &MessagesRequest) -> Result<(Rendered, Conversation), ApiError> {
    app.check_model(&req.model, F)?;
    let conv = conversation(req)?;
    let r = render(&conv, app.info.template.as_deref()).map_err(bad)?;
    Ok((r, conv))
}

pub async fn count_tokens(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let req: MessagesRequest = parse_body(F, body)?;
        let (r, _) = rendered(&app, &req)?;
        let n = app
            .codec
            .encode(&r.text)
            .map_err(|e| bad(e.to_string()))?
            .len();
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

fn stop_reason(o: &Outcome, tool_calls: usize) -> &'static str {
    match o.finish {
        FinishReason::Length => "max_tokens",
        _ if o.stop_string.is_some() => "stop_sequence",
        _ if tool_calls > 0 => "tool_use",
        _ => "end_turn",
    }
}

fn usage(o: &Outcome) -> Value {
    let reused = o.stats.reused_prompt_tokens.min(o.prompt_tokens);
    json!({
        "input_tokens": o.prompt_tokens - reused,
        "output_tokens": o.completion_tokens,
        "cache_read_input_tokens": reused,
        "cache_creation_input_tokens": 0,
    })
}

/// A finished call's block (a cut call's `input` holds what was written,
/// the last value as far as it went).
fn tool_use_block(c: &ToolCall) -> Value {
    json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": c.arguments})
}

pub async fn messages(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match messages_inner(app, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn messages_inner(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(F, body)?;
    let Some(max_tokens) = req.max_tokens else {
        return Err(bad("max_tokens: field required"));
    };
    if max_tokens == 0 {
        return Err(bad("max_tokens: must be at least 1"));
    }
    let (r, conv) = rendered(&app, &req)?;
    let stop = req.stop_sequences.clone().unwrap_or_default();
    let params = GenParams {
        prompt_text: r.text,
        max_tokens: Some(max_tokens),
        sampling: sampling(F, req.temperature, req.top_p, req.top_k, None, None)?,
        stop,
        parse: true,
        parse_tools: !conv.tools.is_empty(),
        in_reasoning: r.in_reasoning,
        tools: conv.tools.clone(),
    };
    let gen = submit(&app, F, params)?;
    let model = app.config.model_id.clone();
    let id = new_id("msg_");
    if req.stream {
        let (tx, rx) = mpsc::channel::<String>(64);
        tokio::spawn(stream_messages(app, gen, tx, model, id));
        return Ok(sse_response(sse_body(rx)));
    }
    let mut gen = gen;
    let mut content: Vec<Value> = Vec::new();
    let mut calls = 0;
    let outcome = loop {
        match gen.next().await {
            Some(Step::Started) => {}
            Some(Step::Output(evs)) => {
                for ev in evs {
                    let last_type = content
                        .last()
                        .and_then(|b| b.get("type"))
                        .and_then(Value::as_str)
                        .map(str::to_string);
                    match ev {
                        OutputEvent::Content(t) => {
                            if last_type.as_deref() == Some("text") {
                                append(content.last_mut(), "text", &t);
                            } else {
                                content.push(json!({"type": "text", "text": t}));
                            }
                        }
                        OutputEvent::Reasoning(t) => {
                            if last_type.as_deref() == Some("thinking") {
                                append(content.last_mut(), "thinking", &t);
                            } else {
                                content.push(
                                    json!({"type": "thinking", "thinking": t, "signature": ""}),
                                );
                            }
                        }
                        OutputEvent::ToolCallEnd(c) => {
                            calls += 1;
                            content.push(tool_use_block(&c));
                        }
                        OutputEvent::ToolCallStart { .. } | OutputEvent::ToolCallArgs(_) => {}
                    }
                }
            }
            Some(Step::Done(o)) => break o,
            Some(Step::Failed(e)) => return Err(ApiError::internal(F, e)),
            None => return Err(ApiError::internal(F, "generation ended early")),
        }
    };
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(&outcome, calls),
        "stop_sequence": outcome.stop_string,
        "usage": usage(&outcome),
        "slipstream": outcome.figures(),
    }))
    .into_response())
}

fn append(block: Option<&mut Value>, key: &str, t: &str) {
    if let Some(Value::String(s)) = block.and_then(|b| b.get_mut(key)) {
        s.push_str(t);
    }
}

fn event(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

#[derive(PartialEq, Clone, Copy)]
enum Open {
    None,
    Text,
    Thinking,
    ToolUse,
}

/// Builds the event sequence of a streamed message.
pub struct EventWriter {
    index: usize,
    open: Open,
    pub tool_calls: usize,
}

impl Default for EventWriter {
    fn default() -> Self {
        EventWriter {
            index: 0,
            open: Open::None,
            tool_calls: 0,
        }
    }
}

impl EventWriter {
    fn close(&mut self, out: &mut Vec<String>) {
        if self.open == Open::None {
            return;
        }
        if self.open == Open::Thinking {
            out.push(event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "signature_delta", "signature": ""}}),
            ));
        }
        out.push(event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": self.index}),
        ));
        self.index += 1;
        self.open = Open::None;
    }

    fn open(&mut self, kind: Open, out: &mut Vec<String>) {
        if self.open == kind {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Text => json!({"type": "text", "text": ""}),
            _ => json!({"type": "thinking", "thinking": "", "signature": ""}),
        };
        out.push(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = kind;
    }

    /// The events of parsed output.
    pub fn output(&mut self, ev: OutputEvent) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            OutputEvent::Content(t) => {
                self.open(Open::Text, &mut out);
                out.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": t}}),
                ));
            }
            OutputEvent::Reasoning(t) => {
                self.open(Open::Thinking, &mut out);
                out.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                ));
            }
            OutputEvent::ToolCallStart { name } => {
                self.close(&mut out);
                self.tool_calls += 1;
                let block =
                    json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}});
                out.push(event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
                ));
                self.open = Open::ToolUse;
            }
            OutputEvent::ToolCallArgs(piece) => out.push(event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": piece}}),
            )),
            OutputEvent::ToolCallEnd(_) => self.close(&mut out),
        }
        out
    }

    /// The closing events.
    pub fn finish(&mut self, o: &Outcome) -> Vec<String> {
        let mut out = Vec::new();
        self.close(&mut out);
        out.push(event(
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(o, self.tool_calls), "stop_sequence": o.stop_string},
                "usage": usage(o), "slipstream": o.figures()}),
        ));
        out.push(event("message_stop", &json!({"type": "message_stop"})));
        out
    }
}

/// `message_start` of a stream.
pub fn message_start(id: &str, model: &str, prompt_tokens: usize) -> String {
    event(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        }}),
    )
}

async fn stream_messages(
    app: Arc<App>,
    mut gen: Gen,
    tx: mpsc::Sender<String>,
    model: String,
    id: String,
) {
    let ping = event("ping", &json!({"type": "ping"}));
    let start = message_start(&id, &model, gen.prompt_tokens);
    if tx.send(start).await.is_err() || tx.send(ping.clone()).await.is_err() {
        return;
    }
    let mut w = EventWriter::default();
    let interval = app.config.ping_interval;
    loop {
        let Some(step) = next_or_ping(&mut gen, &tx, &ping, interval).await else {
            return; // client gone: dropping `gen` cancels
        };
        let (msgs, end) = match step {
            None => return,
            Some(Step::Started) => continue,
            Some(Step::Output(evs)) => (evs.into_iter().flat_map(|e| w.output(e)).collect(), false),
            Some(Step::Done(o)) => (w.finish(&o), true),
            Some(Step::Failed(e)) => {
                let err = ApiError::internal(F, e);
                (vec![event("error", &err.body())], true)
            }
        };
        for m in msgs {
            if tx.send(m).await.is_err() {
                return;
            }
        }
        if end {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_engine::GenerationStats;

    fn parse_events(s: &[String]) -> Vec<(String, Value)> {
        s.iter()
            .map(|e| {
                let mut lines = e.lines();
                let name = lines.next().unwrap().strip_prefix("event: ").unwrap();
                let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
                (name.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    #[test]
    fn stream_event_sequence_with_thinking_text_and_tool_use() {
        let mut p = crate::parse::OutputParser::new(true, true);
        let mut w = EventWriter::default();
        let mut out = Vec::new();
        for piece in [
            "pondering",
            "\n</thi",
            "nk>\n\nLet me look.\n<tool_",
            "call>\n<function=ls>\n<parameter=path>\n/tmp\n</parameter>\n</function>\n</tool_call>",
        ] {
            for ev in p.push(piece) {
                out.extend(w.output(ev));
            }
        }
        for ev in p.finish() {
            out.extend(w.output(ev));
        }
        let o = Outcome {
            finish: FinishReason::Stop,
            stop_string: None,
            prompt_tokens: 10,
            completion_tokens: 5,
            stats: GenerationStats::default(),
        };
        out.extend(w.finish(&o));
        let ev = parse_events(&out);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(ev[0].1["content_block"]["type"], "thinking");
        assert_eq!(ev[1].1["delta"]["thinking"], "pondering");
        assert_eq!(ev[4].1["content_block"]["type"], "text");
        assert_eq!(ev[5].1["delta"]["text"], "Let me look.\n");
        assert_eq!(ev[7].1["index"], 2);
        assert_eq!(ev[7].1["content_block"]["name"], "ls");
        let args: Value =
            serde_json::from_str(ev[8].1["delta"]["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"path": "/tmp"}));
        assert_eq!(ev[10].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(ev[10].1["usage"]["output_tokens"], 5);
    }

    #[test]
    fn maps_tool_use_and_results_to_messages() {
        let req: MessagesRequest = serde_json::from_value(json!({
            "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": "list /tmp"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "/tmp"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a b"}]},
                    {"type": "text", "text": "thanks"}]}
            ],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]
        }))
        .unwrap();
        let c = conversation(&req).unwrap();
        assert_eq!(c.messages[0], json!({"role": "system", "content": "sys"}));
        assert_eq!(
            c.messages[2]["tool_calls"][0]["function"]["arguments"],
            json!({"path": "/tmp"})
        );
        assert_eq!(c.messages[2]["reasoning_content"], "hmm");
        assert_eq!(
            c.messages[3],
            json!({"role": "tool", "content": "a b", "tool_call_id": "t1"})
        );
        assert_eq!(c.messages[4], json!({"role": "user", "content": "thanks"}));
        assert_eq!(c.tools[0]["function"]["name"], "ls");
        assert_eq!(c.enable_thinking, Some(false));
    }
}

//! Reads an Anthropic Messages request, as Claude Code and the SDKs send
//! it today, into a [`Conversation`] and the thinking it asks for.
//!
//! What is accepted and what it does:
//! - `system` (string or text blocks) and `system`-role messages anywhere
//!   in `messages` (Claude Code's mid-conversation system turns): joined or
//!   moved by [`merge_system_messages`]. A text starting with
//!   `x-anthropic-billing-header:` (Claude Code's first system block, which
//!   changes with every client version) is left out of the prompt, so it
//!   cannot end the reusable prefix at the prompt's first tokens.
//! - `thinking`: `enabled` (thinking on; `budget_tokens` ends the reasoning
//!   after that many tokens), `adaptive` (the server's default, which is
//!   the template's: on for Qwen3.x), `disabled` (off); absent: off, the
//!   API's default. `display: "omitted"` returns the reasoning in the
//!   block's `signature` instead of its text (see [`REASONING_SIGNATURE`]).
//! - `output_config.effort`: `low` turns adaptive thinking off (a local
//!   model's reasoning costs seconds per hundred tokens; low effort asks for
//!   the quickest answer); other levels leave thinking as asked.
//!   `output_config.format` (structured output) is refused by name: this
//!   server has no constrained decoding.
//! - `context_management`: accepted, nothing applied. Its edits (clearing
//!   old tool results or thinking) ask the API to cut the context the
//!   client sent; this server renders what the client sent, unedited, and
//!   the client's own compaction keeps a long session in bounds.
//! - `cache_control` on any block, `metadata`: accepted, nothing to do
//!   (the prompt prefix is reused automatically).
//! - Blocks: `image` becomes "[image omitted: ...]" (the models served are
//!   text only; refusing would make every later request of a session that
//!   once held an image fail), a text `document` its text, `search_result`
//!   its title, source and text; `thinking` the turn's reasoning,
//!   `redacted_thinking` nothing (it is encrypted for another model),
//!   `tool_use`/`tool_result` (`is_error` marks the text) the template's
//!   tool calls and results, `server_tool_use`/`mcp_tool_use` and their
//!   `*_tool_result` a note in the assistant's text. Tools with
//!   `defer_loading` stay out of the prompt until a `tool_reference`
//!   brings one in (written where the reference is).

use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{ApiError, Flavor};
use crate::prompt::{merge_system_messages, Conversation};

const F: Flavor = Flavor::Anthropic;

/// Start of a system text that is Claude Code's billing/attribution header.
pub const BILLING_HEADER: &str = "x-anthropic-billing-header:";

/// Start of a thinking block's `signature` that carries the block's
/// reasoning (`display: "omitted"`): clients return signatures unchanged,
/// so the next request renders the reasoning the model wrote and the kept
/// prefix stays reusable.
pub const REASONING_SIGNATURE: &str = "slipstream-reasoning:";

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
    pub output_config: Option<Value>,
    pub context_management: Option<Value>,
}

/// What `thinking` and `output_config` ask for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Thinking {
    /// `None`: the server's default (adaptive thinking).
    pub enable: Option<bool>,
    /// Most tokens of reasoning (`budget_tokens` of enabled thinking).
    pub budget: Option<usize>,
    /// `display: "omitted"`: reasoning goes in the signature, not the text.
    pub omit: bool,
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(F, msg)
}

/// Reads `thinking` and `output_config`.
pub fn thinking(req: &MessagesRequest) -> Result<Thinking, ApiError> {
    let mut out = Thinking {
        enable: Some(false),
        ..Default::default()
    };
    if let Some(t) = req.thinking.as_ref().filter(|t| !t.is_null()) {
        let Some(obj) = t.as_object() else {
            return Err(bad("thinking must be an object, e.g. {\"type\": \"adaptive\"}"));
        };
        match obj.get("type").and_then(Value::as_str) {
            Some("enabled") => {
                out.enable = Some(true);
                let budget = obj.get("budget_tokens").and_then(Value::as_u64);
                match budget {
                    Some(b) if b >= 1 => out.budget = Some(b as usize),
                    _ => {
                        return Err(bad(
                            "thinking.budget_tokens: a positive integer is required with {\"type\": \"enabled\"}",
                        ))
                    }
                }
            }
            Some("adaptive") => out.enable = None,
            Some("disabled") => out.enable = Some(false),
            Some(other) => {
                return Err(bad(format!(
                    "thinking.type: unknown `{other}` (enabled, adaptive, disabled)"
                )))
            }
            None => return Err(bad("thinking.type: field required")),
        }
        match obj.get("display").map(|d| (d, d.as_str())) {
            None | Some((Value::Null, _)) | Some((_, Some("summarized"))) => {}
            Some((_, Some("omitted"))) => out.omit = true,
            Some((d, _)) => {
                return Err(bad(format!(
                    "thinking.display: unknown {d} (summarized, omitted)"
                )))
            }
        }
    }
    if let Some(cfg) = req.output_config.as_ref().filter(|c| !c.is_null()) {
        let Some(cfg) = cfg.as_object() else {
            return Err(bad("output_config must be an object"));
        };
        for (key, v) in cfg {
            match (key.as_str(), v) {
                ("effort", Value::Null) => {}
                ("effort", v) => match v.as_str() {
                    Some("low") => {
                        if out.enable.is_none() {
                            out.enable = Some(false);
                        }
                    }
                    Some("medium" | "high" | "xhigh" | "max") => {}
                    _ => {
                        return Err(bad(format!(
                            "output_config.effort: unknown {v} (low, medium, high, xhigh, max)"
                        )))
                    }
                },
                ("format", Value::Null) => {}
                ("format", _) => {
                    return Err(bad(
                        "output_config.format: structured outputs are not supported by this server (it has no constrained decoding); ask for the format in the prompt instead",
                    ))
                }
                (other, _) => {
                    return Err(bad(format!(
                        "output_config.{other}: not supported by this server (effort only)"
                    )))
                }
            }
        }
    }
    if let Some(cm) = &req.context_management {
        if !cm.is_object() && !cm.is_null() {
            return Err(bad("context_management must be an object"));
        }
    }
    Ok(out)
}

/// A text's part that reaches the prompt: without Claude Code's billing
/// header line, which changes with every client version.
fn without_billing_header(text: &str) -> &str {
    if !text.starts_with(BILLING_HEADER) {
        return text;
    }
    match text.split_once('\n') {
        Some((_, rest)) => rest,
        None => "",
    }
}

/// A system prompt's text (`system` or a `system`-role message's content):
/// a string or text blocks, joined by newlines, the billing header left out.
pub fn system_text(v: &Value, what: &str) -> Result<String, ApiError> {
    let parts: Vec<&str> = match v {
        Value::Null => Vec::new(),
        Value::String(s) => vec![s.as_str()],
        Value::Array(blocks) => {
            let mut parts = Vec::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => parts.push(t.as_str()),
                    _ => {
                        return Err(bad(format!(
                            "{what}.{j}: system blocks must be {{\"type\": \"text\", \"text\": ...}}"
                        )))
                    }
                }
            }
            parts
        }
        _ => return Err(bad(format!("{what} must be a string or a list of text blocks"))),
    };
    Ok(parts
        .into_iter()
        .map(without_billing_header)
        .filter(|t| !t.is_empty())
        .collect::<Vec<_>>()
        .join("\n"))
}

/// What the model reads in place of a block it cannot take.
fn omitted(kind: &str) -> String {
    format!("[{kind} omitted: this model reads text only]")
}

/// Text blocks' texts (a string, or blocks whose other types are noted).
fn texts(v: &Value) -> String {
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
                Some(t) => omitted(t),
                None => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// A `document` block's text: the text of a text or content source, else a
/// note (PDF, URL and file sources are not read).
fn document_text(b: &Value) -> String {
    let source = b.get("source").unwrap_or(&Value::Null);
    let body = match source.get("type").and_then(Value::as_str) {
        Some("text") => source
            .get("data")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        Some("content") => texts(source.get("content").unwrap_or(&Value::Null)),
        _ => return omitted("document"),
    };
    match b.get("title").and_then(Value::as_str) {
        Some(title) if !title.is_empty() => format!("{title}\n\n{body}"),
        _ => body,
    }
}

/// A `search_result` block: title, source, then its text.
fn search_result_text(b: &Value) -> String {
    let field = |k: &str| b.get(k).and_then(Value::as_str).unwrap_or("");
    format!(
        "{} ({})\n{}",
        field("title"),
        field("source"),
        texts(b.get("content").unwrap_or(&Value::Null))
    )
}

/// Text of a `tool_result`'s content (string or blocks). A
/// `tool_reference` brings in the definition of a deferred tool.
fn tool_result_text(v: &Value, deferred: &Map<String, Value>) -> String {
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
                Some("document") => document_text(b),
                Some("search_result") => search_result_text(b),
                Some("tool_reference") => {
                    let name = b.get("tool_name").and_then(Value::as_str).unwrap_or("");
                    match deferred.get(name) {
                        Some(def) => format!("<function>{def}</function>"),
                        None => format!("[tool {name}]"),
                    }
                }
                Some(t) => omitted(t),
                None => String::new(),
            })
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The reasoning of a `thinking` block: its text, or what its signature
/// carries (`display: "omitted"` replies).
fn thinking_text(b: &Value) -> &str {
    let text = b.get("thinking").and_then(Value::as_str).unwrap_or("");
    if !text.is_empty() {
        return text;
    }
    b.get("signature")
        .and_then(Value::as_str)
        .and_then(|s| s.strip_prefix(REASONING_SIGNATURE))
        .unwrap_or("")
}

/// The user turn of `blocks`: its text, and tool results as `tool`
/// messages, in order.
fn user_messages(
    blocks: &[Value],
    what: &str,
    deferred: &Map<String, Value>,
    messages: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let mut text = String::new();
    let mut results = 0;
    let push_text = |text: &mut String, t: &str| {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(t);
    };
    for (j, b) in blocks.iter().enumerate() {
        match b.get("type").and_then(Value::as_str) {
            Some("text") => {
                let t = b.get("text").and_then(Value::as_str).ok_or_else(|| {
                    bad(format!("{what}.content.{j}: text block without string `text`"))
                })?;
                push_text(&mut text, t);
            }
            Some("image") => push_text(&mut text, &omitted("image")),
            Some("document") => push_text(&mut text, &document_text(b)),
            Some("search_result") => push_text(&mut text, &search_result_text(b)),
            Some("tool_result") => {
                let id = b.get("tool_use_id").and_then(Value::as_str).ok_or_else(|| {
                    bad(format!("{what}.content.{j}: tool_result without `tool_use_id`"))
                })?;
                let mut content =
                    tool_result_text(b.get("content").unwrap_or(&Value::Null), deferred);
                if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    content = format!("Error: {content}");
                }
                messages.push(json!({"role": "tool", "content": content, "tool_call_id": id}));
                results += 1;
            }
            Some(t) => {
                return Err(bad(format!(
                    "{what}.content.{j}: unknown block type `{t}` in a user message"
                )))
            }
            None => return Err(bad(format!("{what}.content.{j}: block without `type`"))),
        }
    }
    if !text.is_empty() || results == 0 {
        messages.push(json!({"role": "user", "content": text}));
    }
    Ok(())
}

/// The assistant turn of `blocks`.
fn assistant_message(blocks: &[Value], what: &str) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let kind = b.get("type").and_then(Value::as_str);
        match kind {
            Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
            Some("thinking") => reasoning.push_str(thinking_text(b)),
            Some("redacted_thinking") => {}
            Some("tool_use") => {
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("{what}.content.{j}: tool_use without `name`")))?;
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                if !input.is_object() {
                    return Err(bad(format!(
                        "{what}.content.{j}: tool_use `input` must be an object"
                    )));
                }
                calls.push(json!({"type": "function", "id": b.get("id"),
                    "function": {"name": name, "arguments": input}}));
            }
            // Tools the API runs itself: this server runs none, but a
            // session may hold earlier calls; the model reads a note.
            Some(t @ ("server_tool_use" | "mcp_tool_use")) => {
                let name = b.get("name").and_then(Value::as_str).unwrap_or("");
                let input = b.get("input").cloned().unwrap_or(Value::Null);
                text.push_str(&format!("\n[{t} {name}: {input}]\n"));
            }
            Some(t) if t.ends_with("_tool_result") => {
                text.push_str(&format!("\n[{t} omitted]\n"));
            }
            Some(t) => {
                return Err(bad(format!(
                    "{what}.content.{j}: unknown block type `{t}` in an assistant message"
                )))
            }
            None => return Err(bad(format!("{what}.content.{j}: block without `type`"))),
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
    Ok(Value::Object(msg))
}

/// The tools of a request: `(rendered, deferred)`, both in the OpenAI
/// form, `deferred` (tools with `defer_loading`) by name. Tools the API
/// runs itself (no `input_schema`) are not the model's to call here.
fn tools(req: &MessagesRequest) -> Result<(Vec<Value>, Map<String, Value>), ApiError> {
    let none = req
        .tool_choice
        .as_ref()
        .and_then(|c| c.get("type"))
        .and_then(Value::as_str)
        == Some("none");
    let mut rendered = Vec::new();
    let mut deferred = Map::new();
    for (i, t) in req.tools.iter().flatten().enumerate() {
        let Some(name) = t.get("name").and_then(Value::as_str) else {
            return Err(bad(format!("tools.{i}: a tool needs a `name`")));
        };
        let Some(schema) = t.get("input_schema") else {
            continue;
        };
        let tool = json!({"type": "function", "function": {
            "name": name,
            "description": t.get("description").cloned().unwrap_or_else(|| "".into()),
            "parameters": schema,
        }});
        if t.get("defer_loading").and_then(Value::as_bool) == Some(true) {
            deferred.insert(name.to_string(), tool["function"].clone());
        } else if !none {
            rendered.push(tool);
        }
    }
    Ok((rendered, deferred))
}

/// What a request maps to.
#[derive(Debug, Clone)]
pub struct Mapped {
    /// System messages merged (see [`merge_system_messages`]).
    pub conv: Conversation,
    pub thinking: Thinking,
    /// Tools with `defer_loading`, OpenAI form: not in the prompt, but the
    /// model may call one once a tool search brought it in.
    pub deferred_tools: Vec<Value>,
}

/// Maps an Anthropic request to a conversation and the thinking it asks for.
pub fn conversation(req: &MessagesRequest) -> Result<Mapped, ApiError> {
    if req.messages.is_empty() {
        return Err(bad("messages: at least one message is required"));
    }
    let thinking = thinking(req)?;
    let (tools, deferred) = tools(req)?;
    let mut messages = Vec::new();
    let system = system_text(&req.system, "system")?;
    if !system.is_empty() {
        messages.push(json!({"role": "system", "content": system}));
    }
    for (i, m) in req.messages.iter().enumerate() {
        let what = format!("messages.{i}");
        if m.role == "system" {
            let text = system_text(&m.content, &format!("{what}.content"))?;
            messages.push(json!({"role": "system", "content": text}));
            continue;
        }
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
            "user" => user_messages(&blocks, &what, &deferred, &mut messages)?,
            "assistant" => messages.push(assistant_message(&blocks, &what)?),
            r => {
                return Err(bad(format!(
                    "{what}.role: unknown role `{r}` (user, assistant or system)"
                )))
            }
        }
    }
    Ok(Mapped {
        conv: Conversation {
            messages: merge_system_messages(messages),
            tools,
            enable_thinking: thinking.enable,
            extra: Map::new(),
        },
        thinking,
        deferred_tools: deferred
            .into_iter()
            .map(|(_, f)| json!({"type": "function", "function": f}))
            .collect(),
    })
}

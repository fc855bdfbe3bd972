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
    /// Fields not named here: refused unless in
    /// [`crate::fields::ANTHROPIC_IGNORED`].
    #[serde(flatten)]
    pub unknown: Map<String, Value>,
}

/// `output_config.format` (`{"type": "json_schema", "schema": ...}`) as a
/// constraint; `None` when absent.
pub fn output_format(
    req: &MessagesRequest,
) -> Result<Option<crate::constrain::Constraint>, ApiError> {
    let Some(f) = req
        .output_config
        .as_ref()
        .and_then(|c| c.get("format"))
        .filter(|f| !f.is_null())
    else {
        return Ok(None);
    };
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => {}
        _ => return Err(bad("output_config.format.type: must be `json_schema`")),
    }
    if let Some(k) = f
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .find(|k| !matches!(k.as_str(), "type" | "schema"))
    {
        return Err(bad(format!("output_config.format.{k}: unknown field")));
    }
    match f.get("schema") {
        Some(s) if s.is_object() => Ok(Some(crate::constrain::Constraint::Json(s.clone()))),
        _ => Err(bad(
            "output_config.format.schema: a JSON schema object is required",
        )),
    }
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
            return Err(bad(
                "thinking must be an object, e.g. {\"type\": \"adaptive\"}",
            ));
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
                // Checked and enforced by `output_format`.
                ("format", _) => {}
                (other, _) => {
                    return Err(bad(format!(
                    "output_config.{other}: not supported by this server (effort and format only)"
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
        _ => {
            return Err(bad(format!(
                "{what} must be a string or a list of text blocks"
            )))
        }
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

/// A text block's text; for a block of another `kind`, a note that it was
/// omitted.
fn text_block(kind: &str, b: &Value) -> String {
    match kind {
        "text" => b
            .get("text")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string(),
        other => omitted(other),
    }
}

/// The blocks' texts, a line apart: `text_of` reads each block by its
/// type (a block without one reads as nothing).
fn joined_blocks(blocks: &[Value], text_of: impl Fn(&str, &Value) -> String) -> String {
    blocks
        .iter()
        .map(|b| match b.get("type").and_then(Value::as_str) {
            Some(kind) => text_of(kind, b),
            None => String::new(),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Text blocks' texts (a string, or blocks whose other types are noted).
fn texts(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(blocks) => joined_blocks(blocks, text_block),
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
        Value::Array(blocks) => joined_blocks(blocks, |kind, b| match kind {
            "document" => document_text(b),
            "search_result" => search_result_text(b),
            "tool_reference" => {
                let name = b.get("tool_name").and_then(Value::as_str).unwrap_or("");
                match deferred.get(name) {
                    Some(def) => format!("<function>{def}</function>"),
                    None => format!("[tool {name}]"),
                }
            }
            _ => text_block(kind, b),
        }),
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
                    bad(format!(
                        "{what}.content.{j}: text block without string `text`"
                    ))
                })?;
                push_text(&mut text, t);
            }
            Some("image") => push_text(&mut text, &omitted("image")),
            Some("document") => push_text(&mut text, &document_text(b)),
            Some("search_result") => push_text(&mut text, &search_result_text(b)),
            Some("tool_result") => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        bad(format!(
                            "{what}.content.{j}: tool_result without `tool_use_id`"
                        ))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prompt::render;
    use crate::prompt::tests::QWEN_LIKE;
    use slipstream_engine::ChatTemplate;

    fn request(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    fn qwen_like(m: &Mapped) -> String {
        let t = ChatTemplate::new(QWEN_LIKE).unwrap();
        render(&m.conv, Some(&t)).unwrap().text
    }

    fn err(v: Value) -> String {
        conversation(&request(v)).unwrap_err().message
    }

    #[test]
    fn maps_tool_use_and_results_to_messages() {
        let req = request(json!({
            "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "sys"}],
            "messages": [
                {"role": "user", "content": "list /tmp"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "x"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"path": "/tmp"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "a b"}]},
                    {"type": "tool_result", "tool_use_id": "t2", "content": "no such file", "is_error": true},
                    {"type": "text", "text": "thanks"}]}
            ],
            "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}]
        }));
        let c = conversation(&req).unwrap().conv;
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
        assert_eq!(c.messages[4]["content"], "Error: no such file");
        assert_eq!(c.messages[5], json!({"role": "user", "content": "thanks"}));
        assert_eq!(c.tools[0]["function"]["name"], "ls");
        assert_eq!(c.enable_thinking, Some(false));
    }

    /// The shape Claude Code sends (2.1.x): billing header block, cached
    /// system blocks, system turns in `messages`, adaptive thinking,
    /// context management, effort, a deferred tool, a tool round.
    fn claude_code_like() -> Value {
        json!({
            "model": "m", "max_tokens": 32000, "stream": true,
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a1; cc_entrypoint=cli;"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be concise.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}
            ],
            "messages": [
                {"role": "system", "content": "Early note."},
                {"role": "user", "content": [
                    {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                    {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": [{"type": "text", "text": "# Environment\ncwd: /w", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "", "signature": "slipstream-reasoning:Use Bash."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt", "cache_control": {"type": "ephemeral"}}]},
                {"role": "system", "content": "Hook: tests passed."}
            ],
            "tools": [
                {"name": "Bash", "description": "Run a command", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}, "cache_control": {"type": "ephemeral"}},
                {"name": "Later", "description": "deferred", "input_schema": {"type": "object"}, "defer_loading": true}
            ],
            "metadata": {"user_id": "u"},
            "thinking": {"type": "adaptive", "display": "omitted"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}
        })
    }

    #[test]
    fn a_claude_code_request_renders_every_system_text_once() {
        let m = conversation(&request(claude_code_like())).unwrap();
        assert_eq!(
            m.conv.enable_thinking, None,
            "adaptive: the server's default"
        );
        assert!(m.thinking.omit);
        assert_eq!(m.conv.tools.len(), 1);
        assert_eq!(m.deferred_tools[0]["function"]["name"], "Later");
        let text = qwen_like(&m);
        assert!(text.starts_with("<|im_start|>system\n# Tools"), "{text}");
        for s in [
            "You are Claude Code.",
            "Be concise.",
            "Early note.",
            "# Environment\ncwd: /w",
            "Hook: tests passed.",
            "<system-reminder>ctx</system-reminder>",
        ] {
            assert_eq!(text.matches(s).count(), 1, "{s:?} once in:\n{text}");
        }
        assert!(!text.contains("billing"), "{text}");
        assert!(!text.contains("cc_version"), "{text}");
        // The leading system turn holds the top-level system and the note
        // before the first user turn; later ones sit where they were sent.
        let sys_end = text.find("<|im_end|>").unwrap();
        assert!(text[..sys_end].contains("Early note."));
        assert!(text.find("list files").unwrap() < text.find("# Environment").unwrap());
        assert!(text.find("# Environment").unwrap() < text.find("<tool_call>").unwrap());
        assert!(text.contains("<think>\nUse Bash.\n</think>"), "{text}");
        // After a tool result the note joins it (a user turn there would
        // be a new query to the template, dropping the loop's reasoning).
        assert!(
            text.contains("a.txt\n\n<system>\nHook: tests passed.\n</system>\n</tool_response>"),
            "{text}"
        );
        assert!(text.ends_with("<|im_start|>assistant\n<think>\n"), "{text}");
    }

    #[test]
    fn the_billing_header_does_not_change_the_prompt() {
        let with = claude_code_like();
        let mut other = with.clone();
        other["system"][0]["text"] =
            "x-anthropic-billing-header: cc_version=9.9.9; cc_entrypoint=sdk-cli;".into();
        let mut without = with.clone();
        without["system"].as_array_mut().unwrap().remove(0);
        let render = |v: &Value| qwen_like(&conversation(&request(v.clone())).unwrap());
        assert_eq!(render(&with), render(&other));
        assert_eq!(render(&with), render(&without));
        // A header line heading a string system prompt goes too.
        let s = system_text(
            &json!("x-anthropic-billing-header: cc_version=1;\nYou help."),
            "system",
        )
        .unwrap();
        assert_eq!(s, "You help.");
    }

    #[test]
    fn the_captured_claude_code_request_maps_and_renders() {
        let v: Value =
            serde_json::from_str(include_str!("../tests/fixtures/claude_code_request.json"))
                .unwrap();
        let header = v["system"][0]["text"].as_str().unwrap().to_string();
        assert!(header.starts_with(BILLING_HEADER));
        let env = v["messages"][1]["content"].as_str().unwrap().to_string();
        let m = conversation(&request(v.clone())).unwrap();
        let text = qwen_like(&m);
        assert!(!text.contains(&header));
        assert_eq!(text.matches(env.as_str()).count(), 1);
        for block in v["system"].as_array().unwrap().iter().skip(1) {
            let t = block["text"].as_str().unwrap();
            assert_eq!(text.matches(t).count(), 1, "{t:?}");
        }
        let tools = v["tools"].as_array().unwrap();
        let deferred = tools.iter().filter(|t| t["defer_loading"] == true).count();
        assert_eq!(m.conv.tools.len() + m.deferred_tools.len(), tools.len());
        assert_eq!(m.deferred_tools.len(), deferred);
        assert!(text.contains("<function=Read>"), "the tool call renders");
        assert!(text.contains("secret notes"), "the tool result renders");
    }

    #[test]
    fn thinking_and_effort() {
        let base = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        let with = |k: &str, v: Value| {
            let mut r = base.clone();
            r[k] = v;
            r
        };
        let t = |v: Value| thinking(&request(v)).map_err(|e| e.message);
        assert_eq!(t(base.clone()).unwrap().enable, Some(false), "absent: off");
        let on = t(with(
            "thinking",
            json!({"type": "enabled", "budget_tokens": 2048}),
        ))
        .unwrap();
        assert_eq!((on.enable, on.budget), (Some(true), Some(2048)));
        assert_eq!(
            t(with("thinking", json!({"type": "disabled"})))
                .unwrap()
                .enable,
            Some(false)
        );
        assert_eq!(
            t(with("thinking", json!({"type": "adaptive"})))
                .unwrap()
                .enable,
            None
        );
        let mut low = with("thinking", json!({"type": "adaptive"}));
        low["output_config"] = json!({"effort": "low"});
        assert_eq!(t(low.clone()).unwrap().enable, Some(false));
        low["thinking"] = json!({"type": "enabled", "budget_tokens": 10});
        assert_eq!(
            t(low).unwrap().enable,
            Some(true),
            "enabled wins over low effort"
        );
        for (k, v, says) in [
            ("thinking", json!({"type": "enabled"}), "budget_tokens"),
            ("thinking", json!({"type": "sometimes"}), "thinking.type"),
            (
                "thinking",
                json!({"type": "adaptive", "display": "full"}),
                "thinking.display",
            ),
            ("thinking", json!("on"), "thinking must be an object"),
            (
                "output_config",
                json!({"effort": "extreme"}),
                "output_config.effort",
            ),
            (
                "output_config",
                json!({"verbosity": 1}),
                "output_config.verbosity",
            ),
            ("context_management", json!(7), "context_management"),
        ] {
            let e = t(with(k, v)).unwrap_err();
            assert!(e.contains(says), "{k}: {e}");
        }
        // A format is read by `output_format` (and enforced), a bad one refused.
        let fmt = |f: Value| {
            output_format(&request(json!({"model": "m", "max_tokens": 1,
                "messages": [{"role": "user", "content": "x"}], "output_config": {"format": f}})))
        };
        assert!(
            fmt(json!({"type": "json_schema", "schema": {"type": "object"}}))
                .unwrap()
                .is_some()
        );
        for bad in [
            json!({"type": "json_schema"}),
            json!({"type": "xml", "schema": {}}),
            json!({"type": "json_schema", "schema": {}, "extra": 1}),
        ] {
            assert!(fmt(bad)
                .unwrap_err()
                .message
                .contains("output_config.format"));
        }
    }

    #[test]
    fn other_blocks_claude_code_sends() {
        let m = conversation(&request(json!({"model": "m", "messages": [
            {"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}},
                {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain", "data": "line"}},
                {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AA=="}},
                {"type": "search_result", "source": "https://x", "title": "X", "content": [{"type": "text", "text": "found"}]},
                {"type": "text", "text": "look"}]},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "q"}},
                {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
                {"type": "text", "text": "ok", "citations": []},
                {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "select:Later"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "tool_reference", "tool_name": "Later"},
                    {"type": "image", "source": {}}]}]}
        ], "tools": [{"name": "Later", "description": "d", "input_schema": {"type": "object"}, "defer_loading": true}]})))
        .unwrap();
        let msgs = &m.conv.messages;
        let user = msgs[0]["content"].as_str().unwrap();
        assert!(
            user.starts_with("[image omitted: this model reads text only]"),
            "{user}"
        );
        assert!(user.contains("Notes\n\nline"), "{user}");
        assert!(user.contains("[document omitted"), "{user}");
        assert!(user.contains("X (https://x)\nfound"), "{user}");
        assert!(user.ends_with("look"));
        let a = msgs[1]["content"].as_str().unwrap();
        assert!(
            a.contains("[server_tool_use web_search: {\"query\":\"q\"}]"),
            "{a}"
        );
        assert!(a.contains("[web_search_tool_result omitted]"), "{a}");
        assert!(msgs[1].get("reasoning_content").is_none());
        let r = msgs[2]["content"].as_str().unwrap();
        assert!(
            r.starts_with("<function>{") && r.contains("\"name\":\"Later\""),
            "{r}"
        );
        assert!(
            r.ends_with("[image omitted: this model reads text only]"),
            "{r}"
        );
        assert!(m.conv.tools.is_empty());

        let e = err(
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "video"}]}]}),
        );
        assert!(
            e.contains("messages.0.content.0") && e.contains("`video`"),
            "{e}"
        );
        let e = err(json!({"model": "m", "messages": [{"role": "robot", "content": "x"}]}));
        assert!(e.contains("messages.0.role"), "{e}");
    }
}

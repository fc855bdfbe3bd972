//! The recorded agent session `slipstream bench agent` replays: its file
//! format and its expansion into OpenAI chat requests.
//!
//! Format `slipstream-agent-transcript/1` (written by
//! `crates/bench/transcripts/make_agent_session.py`): `tools` (OpenAI
//! function tools) and `requests`, replayed in order, each one of
//! - `{"label", "kind": "turn", "append": [messages]}`: the conversation grows
//!   by these messages and is sent whole, with the tools;
//! - `{"label", "kind": "side", "messages": [messages]}`: sent alone, no tools;
//! - `{"label", "kind": "side", "extend": [messages]}`: the conversation plus
//!   these messages, with the tools; the conversation does not keep them.
//!
//! The recorded replies are part of the next turn's `append`: the replay
//! sends them whatever the server generated, so every run sends the same
//! requests.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::{json, Value};

/// The format name a transcript must declare.
pub const FORMAT: &str = "slipstream-agent-transcript/1";

/// The committed session (`crates/bench/transcripts/agent_session.json`).
pub const BUNDLED: &str = include_str!("../../transcripts/agent_session.json");

/// What a request is to the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A turn of the conversation.
    Turn,
    /// A request between turns (title, summary, command check).
    Side,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Turn => "turn",
            Kind::Side => "side",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTranscript {
    format: String,
    #[serde(default)]
    about: Option<String>,
    #[serde(default)]
    tools: Vec<Value>,
    requests: Vec<RawRequest>,
    #[serde(default)]
    #[allow(dead_code)] // recorded for readers; never sent
    final_reply: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRequest {
    label: String,
    kind: String,
    #[serde(default)]
    append: Option<Vec<Value>>,
    #[serde(default)]
    messages: Option<Vec<Value>>,
    #[serde(default)]
    extend: Option<Vec<Value>>,
}

/// One request of the replay, ready to send.
#[derive(Clone, Debug)]
pub struct Request {
    pub label: String,
    pub kind: Kind,
    /// OpenAI chat messages, the whole conversation for a turn.
    pub messages: Vec<Value>,
    /// Whether the transcript's tools go with it.
    pub with_tools: bool,
}

/// A loaded transcript: the requests in replay order.
#[derive(Clone, Debug)]
pub struct Transcript {
    pub about: Option<String>,
    pub tools: Vec<Value>,
    pub requests: Vec<Request>,
}

impl Transcript {
    /// Reads and checks a transcript file.
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading transcript {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in transcript {}", path.display()))
    }

    /// Parses and checks a transcript; every message must be an object with
    /// a known role, and a request must have exactly one of `append`,
    /// `messages`, `extend` as its kind allows.
    pub fn parse(text: &str) -> Result<Self> {
        let raw: RawTranscript = serde_json::from_str(text).context("parsing the transcript")?;
        if raw.format != FORMAT {
            bail!("format is `{}`, expected `{FORMAT}`", raw.format);
        }
        for (i, t) in raw.tools.iter().enumerate() {
            if t.pointer("/function/name")
                .and_then(Value::as_str)
                .is_none()
            {
                bail!(
                    "tools[{i}] is not {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}"
                );
            }
        }
        if raw.requests.is_empty() {
            bail!("the transcript has no requests");
        }
        let mut conversation: Vec<Value> = Vec::new();
        let mut requests = Vec::with_capacity(raw.requests.len());
        for (i, r) in raw.requests.into_iter().enumerate() {
            let what = format!("requests[{i}] ({})", r.label);
            let kind = match r.kind.as_str() {
                "turn" => Kind::Turn,
                "side" => Kind::Side,
                k => bail!("{what}: kind `{k}` is neither `turn` nor `side`"),
            };
            let (messages, with_tools) = match (kind, r.append, r.messages, r.extend) {
                (Kind::Turn, Some(add), None, None) => {
                    check_messages(&add, &what)?;
                    conversation.extend(add);
                    (conversation.clone(), true)
                }
                (Kind::Side, None, Some(alone), None) => {
                    check_messages(&alone, &what)?;
                    (alone, false)
                }
                (Kind::Side, None, None, Some(add)) => {
                    check_messages(&add, &what)?;
                    if conversation.is_empty() {
                        bail!("{what}: `extend` before the first turn");
                    }
                    let mut m = conversation.clone();
                    m.extend(add);
                    (m, true)
                }
                (Kind::Turn, ..) => bail!("{what}: a turn has `append` and nothing else"),
                (Kind::Side, ..) => {
                    bail!("{what}: a side request has either `messages` or `extend`")
                }
            };
            if messages.is_empty() {
                bail!("{what}: no messages to send");
            }
            requests.push(Request {
                label: r.label,
                kind,
                messages,
                with_tools,
            });
        }
        Ok(Self {
            about: raw.about,
            tools: raw.tools,
            requests,
        })
    }

    /// The OpenAI chat-completions body of request `index`: streamed, with
    /// usage, greedy, at most `max_tokens` generated.
    pub fn chat_body(&self, index: usize, model: &str, max_tokens: usize) -> Value {
        let r = &self.requests[index];
        let mut body = json!({
            "model": model,
            "messages": r.messages,
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_tokens": max_tokens,
            "temperature": 0,
            "seed": 1,
        });
        if r.with_tools && !self.tools.is_empty() {
            body["tools"] = Value::Array(self.tools.clone());
        }
        body
    }
}

/// The wire API a replay speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Api {
    /// `POST /v1/chat/completions`.
    OpenAi,
    /// `POST /v1/messages`.
    Anthropic,
}

impl Api {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "openai" => Ok(Api::OpenAi),
            "anthropic" => Ok(Api::Anthropic),
            _ => bail!("--api `{s}`: openai or anthropic"),
        }
    }

    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Api::OpenAi => "/v1/chat/completions",
            Api::Anthropic => "/v1/messages",
        }
    }
}

impl Transcript {
    /// Request `index` in `api`'s form (see [`Transcript::chat_body`] and
    /// [`Transcript::messages_body`]).
    pub fn body(&self, api: Api, index: usize, model: &str, max_tokens: usize) -> Value {
        match api {
            Api::OpenAi => self.chat_body(index, model, max_tokens),
            Api::Anthropic => self.messages_body(index, model, max_tokens),
        }
    }

    /// The Anthropic messages body of request `index`, translated from the
    /// OpenAI form: system messages become `system`, reasoning a `thinking`
    /// block, tool calls `tool_use` blocks (arguments parsed), consecutive
    /// tool results one user message of `tool_result` blocks; tools take
    /// `input_schema`. Streamed, greedy, at most `max_tokens` generated.
    pub fn messages_body(&self, index: usize, model: &str, max_tokens: usize) -> Value {
        let r = &self.requests[index];
        let mut system: Vec<Value> = Vec::new();
        let mut messages: Vec<Value> = Vec::new();
        for m in &r.messages {
            let text = m["content"].as_str().unwrap_or("").to_string();
            match m["role"].as_str().unwrap_or("user") {
                "system" => system.push(json!({"type": "text", "text": text})),
                "assistant" => {
                    let mut blocks = Vec::new();
                    if let Some(r) = m["reasoning_content"].as_str().filter(|r| !r.is_empty()) {
                        blocks.push(json!({"type": "thinking", "thinking": r, "signature": ""}));
                    }
                    if !text.is_empty() {
                        blocks.push(json!({"type": "text", "text": text}));
                    }
                    for c in m["tool_calls"].as_array().into_iter().flatten() {
                        let args = &c["function"]["arguments"];
                        let input = match args {
                            Value::String(s) => {
                                serde_json::from_str(s).unwrap_or_else(|_| json!({}))
                            }
                            Value::Object(_) => args.clone(),
                            _ => json!({}),
                        };
                        blocks.push(json!({"type": "tool_use", "id": c["id"],
                            "name": c["function"]["name"], "input": input}));
                    }
                    messages.push(json!({"role": "assistant", "content": blocks}));
                }
                "tool" => {
                    let block = json!({"type": "tool_result", "tool_use_id": m["tool_call_id"],
                        "content": text});
                    let merge = messages.last().is_some_and(|l| {
                        l["role"] == "user"
                            && l["content"]
                                .as_array()
                                .is_some_and(|b| b.iter().all(|b| b["type"] == "tool_result"))
                    });
                    match messages.last_mut().filter(|_| merge) {
                        Some(last) => {
                            if let Some(b) = last["content"].as_array_mut() {
                                b.push(block);
                            }
                        }
                        None => messages.push(json!({"role": "user", "content": [block]})),
                    }
                }
                _ => messages.push(json!({"role": "user", "content": text})),
            }
        }
        let mut body = json!({
            "model": model,
            "messages": messages,
            "stream": true,
            "max_tokens": max_tokens,
            "temperature": 0,
        });
        if !system.is_empty() {
            body["system"] = Value::Array(system);
        }
        if r.with_tools && !self.tools.is_empty() {
            let tools: Vec<Value> = self
                .tools
                .iter()
                .map(|t| {
                    let f = &t["function"];
                    json!({"name": f["name"], "description": f["description"],
                        "input_schema": f["parameters"]})
                })
                .collect();
            body["tools"] = Value::Array(tools);
        }
        body
    }
}

fn check_messages(messages: &[Value], what: &str) -> Result<()> {
    for (j, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        match role {
            Some("system" | "user" | "assistant" | "tool") => {}
            Some(r) => bail!("{what}: message {j} has role `{r}`"),
            None => bail!("{what}: message {j} has no role"),
        }
        if role == Some("tool") && m.get("tool_call_id").and_then(Value::as_str).is_none() {
            bail!("{what}: tool message {j} has no tool_call_id");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bundled_session_has_the_issue_shape() {
        let t = Transcript::parse(BUNDLED).unwrap();
        assert_eq!(t.tools.len(), 24);
        let turns: Vec<&Request> = t.requests.iter().filter(|r| r.kind == Kind::Turn).collect();
        assert_eq!(turns.len(), 12);
        assert!(t.requests.iter().filter(|r| r.kind == Kind::Side).count() >= 3);
        // Each turn extends the previous one.
        for w in turns.windows(2) {
            assert!(w[1].messages.len() > w[0].messages.len());
            assert_eq!(w[1].messages[..w[0].messages.len()], w[0].messages[..]);
        }
        // Recorded replies carry reasoning and tool calls.
        let replies: Vec<&Value> = turns[11]
            .messages
            .iter()
            .filter(|m| m["role"] == "assistant")
            .collect();
        assert_eq!(replies.len(), 11);
        assert!(replies.iter().all(|m| m["reasoning_content"]
            .as_str()
            .is_some_and(|r| r.len() > 40)
            && m["tool_calls"].as_array().is_some_and(|c| !c.is_empty())));
        // The first request: ~16k tokens at ~3.6 characters a token.
        let first = t.chat_body(0, "m", 8).to_string().len();
        assert!((45_000..75_000).contains(&first), "{first} characters");
        // Tool results of 200-3,000 tokens.
        for m in turns[11].messages.iter().filter(|m| m["role"] == "tool") {
            let n = m["content"].as_str().unwrap().len();
            assert!((720..12_000).contains(&n), "{n} characters");
        }
        let body = t.chat_body(1, "m", 8);
        assert!(
            body.get("tools").is_none(),
            "a lone side request has no tools"
        );
        assert_eq!(body["max_tokens"], 8);
        assert_eq!(body["stream"], true);
    }

    #[test]
    fn anthropic_form() {
        let t = Transcript::parse(BUNDLED).unwrap();
        let last = t
            .requests
            .iter()
            .rposition(|r| r.kind == Kind::Turn)
            .unwrap();
        let b = t.body(Api::Anthropic, last, "m", 8);
        assert_eq!(b["system"][0]["type"], "text");
        assert!(b["system"][0]["text"].as_str().unwrap().len() > 10_000);
        let tools = b["tools"].as_array().unwrap();
        assert_eq!(tools.len(), 24);
        assert_eq!(tools[1]["name"], "Bash");
        assert_eq!(tools[1]["input_schema"]["required"][0], "command");
        let msgs = b["messages"].as_array().unwrap();
        // user, then (assistant, tool results) per turn: alternating roles.
        assert_eq!(msgs.len(), 1 + 2 * 11);
        for (i, m) in msgs.iter().enumerate() {
            assert_eq!(m["role"], if i % 2 == 0 { "user" } else { "assistant" });
        }
        let a = &msgs[msgs.len() - 2]["content"];
        assert_eq!(a[0]["type"], "thinking");
        let uses: Vec<&Value> = a
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert_eq!(uses.len(), 2);
        assert_eq!(uses[1]["input"]["command"], "git diff");
        let results = msgs.last().unwrap()["content"].as_array().unwrap();
        assert_eq!(results.len(), 2, "parallel results share one user message");
        assert_eq!(results[1]["tool_use_id"], uses[1]["id"]);
        assert_eq!(Api::parse("anthropic").unwrap().path(), "/v1/messages");
        assert!(Api::parse("gemini").is_err());
    }

    #[test]
    fn malformed_transcripts_are_refused() {
        let bad = [
            (r#"{"format": "x", "requests": []}"#, "format"),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": []}"#,
                "no requests",
            ),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": [{"label": "a", "kind": "side", "extend": [{"role": "user", "content": "x"}]}]}"#,
                "before the first turn",
            ),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": [{"label": "a", "kind": "turn", "messages": [{"role": "user", "content": "x"}]}]}"#,
                "nothing else",
            ),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": [{"label": "a", "kind": "turn", "append": [{"role": "robot", "content": "x"}]}]}"#,
                "role `robot`",
            ),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": [{"label": "a", "kind": "turn", "append": [{"role": "tool", "content": "x"}]}]}"#,
                "tool_call_id",
            ),
            (
                r#"{"format": "slipstream-agent-transcript/1", "requests": [{"label": "a", "kind": "chat", "append": []}]}"#,
                "kind `chat`",
            ),
        ];
        for (text, want) in bad {
            let e = format!("{:#}", Transcript::parse(text).unwrap_err());
            assert!(e.contains(want), "{e} (wanted {want})");
        }
    }
}

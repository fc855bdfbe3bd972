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

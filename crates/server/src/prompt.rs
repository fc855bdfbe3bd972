//! Renders a conversation (both APIs map theirs to this) into prompt text
//! with the checkpoint's chat template: tools through the template when it
//! reads `tools`, else as a system-prompt block in the Qwen3 form.

use serde_json::{json, Map, Value};
use slipstream_engine::ChatTemplate;

/// A conversation in the form chat templates read (`transformers`'
/// `apply_chat_template` context).
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// `{"role", "content": string, "tool_calls"?: [{"type":"function",
    /// "id", "function": {"name", "arguments": object}}],
    /// "reasoning_content"?, "tool_call_id"?, "name"?}`.
    pub messages: Vec<Value>,
    /// OpenAI form: `{"type":"function","function":{"name","description","parameters"}}`.
    pub tools: Vec<Value>,
    /// `None`: the template's default.
    pub enable_thinking: Option<bool>,
    /// Other template variables (`chat_template_kwargs`).
    pub extra: Map<String, Value>,
}

impl Conversation {
    /// Fills what the request left unset from the server's default template
    /// variables (`--chat-template-kwargs`): the request's own values win.
    pub fn with_defaults(mut self, defaults: &Map<String, Value>) -> Self {
        for (k, v) in defaults {
            if k == "enable_thinking" {
                if self.enable_thinking.is_none() {
                    self.enable_thinking = v.as_bool();
                }
            } else if !self.extra.contains_key(k) {
                self.extra.insert(k.clone(), v.clone());
            }
        }
        self
    }
}

/// A rendered prompt.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub text: String,
    /// The end of `text` the template adds to open the reply
    /// (`add_generation_prompt`; empty where the rendering without it is
    /// not a prefix of `text`): the state cache checkpoints before it.
    pub reply_opening: String,
    /// The prompt ends inside an opened `<think>` block.
    pub in_reasoning: bool,
}

/// The tool block used when the template does not render tools (the
/// Qwen3 template's own wording).
pub fn tools_system_block(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&serde_json::to_string(t).unwrap_or_default());
    }
    s.push_str("\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    s
}

/// Rewrites tool calls and results as plain text messages, for templates
/// that know nothing of tools.
fn flatten_tools(conv: &Conversation) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let block = (!conv.tools.is_empty()).then(|| tools_system_block(&conv.tools));
    let mut system_done = false;
    for m in &conv.messages {
        let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
        let content = m.get("content").and_then(Value::as_str).unwrap_or("");
        match role {
            "system" if !system_done => {
                system_done = true;
                let text = match &block {
                    Some(b) if content.is_empty() => b.clone(),
                    Some(b) => format!("{content}\n\n{b}"),
                    None => content.to_string(),
                };
                out.push(json!({"role": "system", "content": text}));
            }
            "assistant" => {
                let mut text = content.to_string();
                for c in m
                    .get("tool_calls")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let f = c.get("function").unwrap_or(c);
                    let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(json!({"role": "assistant", "content": text}));
            }
            "tool" => {
                let text = format!("<tool_response>\n{content}\n</tool_response>");
                // Consecutive results share one user turn.
                let merge = out.last().is_some_and(|l| {
                    l.get("role").and_then(Value::as_str) == Some("user")
                        && l.get("content")
                            .and_then(Value::as_str)
                            .is_some_and(|c| c.ends_with("</tool_response>"))
                });
                if merge {
                    if let Some(Value::String(c)) =
                        out.last_mut().and_then(|l| l.get_mut("content"))
                    {
                        c.push('\n');
                        c.push_str(&text);
                    }
                } else {
                    out.push(json!({"role": "user", "content": text}));
                }
            }
            _ => out.push(json!({"role": role, "content": content})),
        }
    }
    if let (Some(b), false) = (&block, system_done) {
        out.insert(0, json!({"role": "system", "content": b}));
    }
    out
}

/// Renders `conv` with `template` (ChatML written by hand when the model
/// has none), ending with the assistant turn's opening.
pub fn render(conv: &Conversation, template: Option<&ChatTemplate>) -> Result<Rendered, String> {
    let native_tools = template.is_some_and(ChatTemplate::supports_tools);
    let messages = if native_tools {
        conv.messages.clone()
    } else {
        flatten_tools(conv)
    };
    let (text, reply_opening) = match template {
        Some(t) => {
            let mut ctx = conv.extra.clone();
            ctx.insert("messages".into(), Value::Array(messages));
            if native_tools && !conv.tools.is_empty() {
                ctx.insert("tools".into(), Value::Array(conv.tools.clone()));
            }
            if let Some(t) = conv.enable_thinking {
                ctx.insert("enable_thinking".into(), Value::Bool(t));
            }
            ctx.insert("add_generation_prompt".into(), Value::Bool(true));
            let mut ctx = Value::Object(ctx);
            let text = t.render_json(&ctx).map_err(|e| e.to_string())?;
            // Without the opening; a template that refuses (some want the
            // last message to be the user's) leaves the opening unknown.
            ctx["add_generation_prompt"] = Value::Bool(false);
            let history = t.render_json(&ctx).unwrap_or_default();
            let opening = match text.strip_prefix(history.as_str()) {
                Some(rest) if !history.is_empty() => rest.to_string(),
                _ => String::new(),
            };
            (text, opening)
        }
        None => {
            let mut s = String::new();
            for m in &messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = m.get("content").and_then(Value::as_str).unwrap_or("");
                s.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
            }
            let opening = "<|im_start|>assistant\n";
            s.push_str(opening);
            (s, opening.to_string())
        }
    };
    let tail = text.trim_end();
    let in_reasoning = match (tail.rfind("<think>"), tail.rfind("</think>")) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => tail.ends_with("<think>"),
        _ => false,
    };
    Ok(Rendered {
        text,
        reply_opening,
        in_reasoning,
    })
}

/// Opens a system message that [`merge_system_messages`] moved into a
/// user turn; [`MOVED_SYSTEM_CLOSE`] closes it.
pub const MOVED_SYSTEM_OPEN: &str = "<system>\n";
/// Closes a moved system message.
pub const MOVED_SYSTEM_CLOSE: &str = "\n</system>";

fn role_of(m: &Value) -> &str {
    m.get("role").and_then(Value::as_str).unwrap_or("")
}

fn is_system(m: &Value) -> bool {
    matches!(role_of(m), "system" | "developer")
}

/// A chat-form message's text: a string, or the texts of a list of parts.
fn message_text(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

fn marked(texts: &[String]) -> String {
    texts
        .iter()
        .map(|t| format!("{MOVED_SYSTEM_OPEN}{t}{MOVED_SYSTEM_CLOSE}"))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// Gives a conversation the shape chat templates accept: at most one
/// system message, first (Qwen3.5/3.6 templates raise "System message must
/// be at the beginning" on any other), and a user turn (they raise "No user
/// query found" without one), losing no text. `developer` is `system`.
///
/// - System messages before the first user message are joined, in order
///   and a blank line apart, into the leading system message.
/// - A later system message is written, between [`MOVED_SYSTEM_OPEN`] and
///   [`MOVED_SYSTEM_CLOSE`], at the end of the user turn or tool result
///   just before it; when an assistant turn is before it, at the start of
///   the user turn just after it; else as a user turn of its own. Each
///   stays where the client put it, so the turns before it render as in
///   the client's previous request and the server's kept prefix stays
///   reusable (merging it into the leading system message would change
///   the prompt's first tokens at every such message). After a tool result
///   it does not become a user turn of its own: Qwen3.x templates take
///   such a turn for a new query and stop rendering the reasoning of the
///   tool loop before it, which would also change those turns' tokens.
/// - With no user message at all (a system-only request), the leading
///   system text becomes the user turn, marked the same way.
///
/// Messages: `{"role", "content": string | [{"text"}], ...}` as in
/// [`Conversation::messages`]; a merged message's content is a string.
pub fn merge_system_messages(messages: Vec<Value>) -> Vec<Value> {
    let first_user = messages
        .iter()
        .position(|m| role_of(m) == "user")
        .unwrap_or(messages.len());
    let mut leading: Vec<String> = Vec::new();
    // Late system texts waiting for the turn after them.
    let mut waiting: Vec<String> = Vec::new();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    for (i, mut m) in messages.into_iter().enumerate() {
        if is_system(&m) {
            let text = message_text(&m);
            if text.is_empty() {
                continue;
            }
            if i < first_user {
                leading.push(text);
                continue;
            }
            match out.last_mut() {
                Some(prev) if waiting.is_empty() && matches!(role_of(prev), "user" | "tool") => {
                    let joined = format!("{}\n\n{}", message_text(prev), marked(&[text]));
                    prev["content"] = joined.into();
                }
                _ => waiting.push(text),
            }
            continue;
        }
        if !waiting.is_empty() {
            let note = marked(&std::mem::take(&mut waiting));
            if role_of(&m) == "user" {
                let own = message_text(&m);
                m["content"] = if own.is_empty() {
                    note
                } else {
                    format!("{note}\n\n{own}")
                }
                .into();
            } else {
                out.push(json!({"role": "user", "content": note}));
            }
        }
        out.push(m);
    }
    if !waiting.is_empty() {
        out.push(json!({"role": "user", "content": marked(&waiting)}));
    }
    if !leading.is_empty() {
        if out.iter().any(|m| role_of(m) == "user") {
            out.insert(
                0,
                json!({"role": "system", "content": leading.join("\n\n")}),
            );
        } else {
            out.insert(0, json!({"role": "user", "content": marked(&leading)}));
        }
    }
    out
}

/// Reads template variables given as a JSON object (`--chat-template-kwargs`,
/// a request's `chat_template_kwargs`); `enable_thinking` and
/// `preserve_thinking`, when present, must be booleans.
pub fn template_kwargs(v: Value, what: &str) -> Result<Map<String, Value>, String> {
    let Value::Object(map) = v else {
        return Err(format!(
            "{what} must be a JSON object, e.g. {{\"enable_thinking\": false}}"
        ));
    };
    for key in ["enable_thinking", "preserve_thinking"] {
        if map
            .get(key)
            .is_some_and(|v| !v.is_boolean() && !v.is_null())
        {
            return Err(format!("{what}: `{key}` must be true or false"));
        }
    }
    Ok(map)
}

/// Content given as a string or as a list of parts (`{"type":"text",
/// "text"}`), as one string. Other part types are an error.
pub fn content_text(v: &Value, what: &str) -> Result<String, String> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("text") | Some("input_text") | Some("output_text") => s.push_str(
                        p.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| format!("{what}: a text part has no string `text`"))?,
                    ),
                    Some(t) => {
                        return Err(format!(
                            "{what}: content parts of type `{t}` are not supported (text only)"
                        ))
                    }
                    None => return Err(format!("{what}: a content part has no `type`")),
                }
            }
            Ok(s)
        }
        _ => Err(format!(
            "{what}: content must be a string or a list of parts"
        )),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

    #[test]
    fn the_reply_opening_is_what_the_generation_prompt_adds() {
        let conv = Conversation {
            messages: vec![json!({"role": "user", "content": "hi"})],
            ..Default::default()
        };
        let t = ChatTemplate::new(CHATML).unwrap();
        for r in [
            render(&conv, Some(&t)).unwrap(),
            render(&conv, None).unwrap(),
        ] {
            assert_eq!(r.reply_opening, "<|im_start|>assistant\n");
            assert!(r.text.ends_with(&r.reply_opening));
        }
        // A template that adds nothing for the reply: no opening.
        let bare = ChatTemplate::new("{% for m in messages %}{{ m.content }}{% endfor %}").unwrap();
        assert_eq!(render(&conv, Some(&bare)).unwrap().reply_opening, "");
    }

    #[test]
    fn fallback_tools_block_and_flattened_calls() {
        let t = ChatTemplate::new(CHATML).unwrap();
        let conv = Conversation {
            messages: vec![
                json!({"role": "user", "content": "weather?"}),
                json!({"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "id": "c1", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]}),
                json!({"role": "tool", "content": "cold", "tool_call_id": "c1"}),
            ],
            tools: vec![json!({"type": "function", "function": {"name": "w", "parameters": {}}})],
            ..Default::default()
        };
        let r = render(&conv, Some(&t)).unwrap();
        assert!(r.text.starts_with("<|im_start|>system\n# Tools"));
        assert!(
            r.text.contains(
                "<tool_call>\n{\"arguments\":{\"city\":\"Oslo\"},\"name\":\"w\"}\n</tool_call>"
            ) || r.text.contains("<tool_call>\n{\"name\":\"w\"")
        );
        assert!(r
            .text
            .contains("<|im_start|>user\n<tool_response>\ncold\n</tool_response><|im_end|>"));
        assert!(r.text.ends_with("<|im_start|>assistant\n"));
        assert!(!r.in_reasoning);
    }

    #[test]
    fn detects_an_opened_think_block() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}<|im_start|>assistant\n{% if enable_thinking is not defined or enable_thinking %}<think>\n{% else %}<think>\n\n</think>\n\n{% endif %}",
        )
        .unwrap();
        let mut conv = Conversation {
            messages: vec![json!({"role": "user", "content": "x"})],
            ..Default::default()
        };
        assert!(render(&conv, Some(&t)).unwrap().in_reasoning);
        conv.enable_thinking = Some(false);
        assert!(!render(&conv, Some(&t)).unwrap().in_reasoning);
    }

    /// The Qwen3.5/3.6 template's rules (tests/fixtures).
    pub(crate) const QWEN_LIKE: &str = include_str!("../tests/fixtures/qwen_like_template.jinja");

    fn roles(m: &[Value]) -> Vec<&str> {
        m.iter().map(role_of).collect()
    }

    #[test]
    fn qwen_like_template_refuses_what_the_real_one_refuses() {
        let t = ChatTemplate::new(QWEN_LIKE).unwrap();
        let late = Conversation {
            messages: vec![
                json!({"role": "user", "content": "hi"}),
                json!({"role": "system", "content": "late"}),
            ],
            ..Default::default()
        };
        let e = render(&late, Some(&t)).unwrap_err();
        assert!(e.contains("System message must be at the beginning"), "{e}");
        let alone = Conversation {
            messages: vec![json!({"role": "system", "content": "only"})],
            ..Default::default()
        };
        let e = render(&alone, Some(&t)).unwrap_err();
        assert!(e.contains("No user query"), "{e}");
    }

    #[test]
    fn system_messages_before_the_first_user_turn_join_the_leading_one() {
        let out = merge_system_messages(vec![
            json!({"role": "system", "content": "one"}),
            json!({"role": "developer", "content": "two"}),
            json!({"role": "system", "content": ""}),
            json!({"role": "system", "content": [{"type": "text", "text": "three"}]}),
            json!({"role": "user", "content": "hi"}),
        ]);
        assert_eq!(
            out,
            vec![
                json!({"role": "system", "content": "one\n\ntwo\n\nthree"}),
                json!({"role": "user", "content": "hi"}),
            ]
        );
    }

    #[test]
    fn later_system_messages_move_into_a_user_turn_in_place() {
        let out = merge_system_messages(vec![
            json!({"role": "system", "content": "first"}),
            json!({"role": "user", "content": "q1"}),
            json!({"role": "system", "content": "after user"}),
            json!({"role": "assistant", "content": "a1"}),
            json!({"role": "developer", "content": "after assistant"}),
            json!({"role": "user", "content": "q2"}),
            json!({"role": "assistant", "content": "a2", "tool_calls": []}),
            json!({"role": "tool", "content": "r", "tool_call_id": "c"}),
            json!({"role": "system", "content": "after tool"}),
            json!({"role": "assistant", "content": "a3"}),
            json!({"role": "system", "content": "last"}),
        ]);
        assert_eq!(
            roles(&out),
            [
                "system",
                "user",
                "assistant",
                "user",
                "assistant",
                "tool",
                "assistant",
                "user"
            ]
        );
        assert_eq!(out[0]["content"], "first");
        assert_eq!(out[1]["content"], "q1\n\n<system>\nafter user\n</system>");
        assert_eq!(
            out[3]["content"],
            "<system>\nafter assistant\n</system>\n\nq2"
        );
        assert_eq!(out[5]["content"], "r\n\n<system>\nafter tool\n</system>");
        assert_eq!(out[5]["tool_call_id"], "c");
        assert_eq!(out[7]["content"], "<system>\nlast\n</system>");
        let t = ChatTemplate::new(QWEN_LIKE).unwrap();
        let conv = Conversation {
            messages: out,
            ..Default::default()
        };
        let text = render(&conv, Some(&t)).unwrap().text;
        for s in [
            "first",
            "after user",
            "after assistant",
            "after tool",
            "last",
        ] {
            assert_eq!(text.matches(s).count(), 1, "{s} once in {text}");
        }
    }

    #[test]
    fn a_system_only_conversation_becomes_a_user_turn() {
        let out = merge_system_messages(vec![
            json!({"role": "system", "content": "Say hi."}),
            json!({"role": "developer", "content": "Be brief."}),
        ]);
        assert_eq!(
            out,
            vec![json!({"role": "user",
                "content": "<system>\nSay hi.\n</system>\n\n<system>\nBe brief.\n</system>"})]
        );
        let t = ChatTemplate::new(QWEN_LIKE).unwrap();
        let conv = Conversation {
            messages: out,
            ..Default::default()
        };
        assert!(render(&conv, Some(&t)).unwrap().in_reasoning);
    }

    #[test]
    fn request_settings_win_over_server_defaults() {
        let defaults = template_kwargs(
            json!({"enable_thinking": false, "preserve_thinking": true, "x": 1}),
            "d",
        )
        .unwrap();
        let mut conv = Conversation::default().with_defaults(&defaults);
        assert_eq!(conv.enable_thinking, Some(false));
        assert_eq!(conv.extra["preserve_thinking"], true);
        conv = Conversation {
            enable_thinking: Some(true),
            extra: json!({"x": 2}).as_object().unwrap().clone(),
            ..Default::default()
        }
        .with_defaults(&defaults);
        assert_eq!(conv.enable_thinking, Some(true));
        assert_eq!(conv.extra["x"], 2);
        assert_eq!(conv.extra["preserve_thinking"], true);
        assert!(template_kwargs(json!([1]), "k").is_err());
        let e = template_kwargs(json!({"enable_thinking": "yes"}), "k").unwrap_err();
        assert!(e.contains("enable_thinking"), "{e}");
    }

    #[test]
    fn content_parts() {
        assert_eq!(
            content_text(
                &json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                "m"
            )
            .unwrap(),
            "ab"
        );
        assert!(content_text(&json!([{"type": "image_url"}]), "m").is_err());
        assert!(content_text(&json!(5), "m").is_err());
    }
}

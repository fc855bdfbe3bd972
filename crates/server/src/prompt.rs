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

/// A rendered prompt.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub text: String,
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
    let text = match template {
        Some(t) => {
            let mut ctx = conv.extra.clone();
            ctx.insert("messages".into(), Value::Array(messages));
            if native_tools && !conv.tools.is_empty() {
                ctx.insert("tools".into(), Value::Array(conv.tools.clone()));
            }
            ctx.insert("add_generation_prompt".into(), Value::Bool(true));
            if let Some(t) = conv.enable_thinking {
                ctx.insert("enable_thinking".into(), Value::Bool(t));
            }
            t.render_json(&Value::Object(ctx))
                .map_err(|e| e.to_string())?
        }
        None => {
            let mut s = String::new();
            for m in &messages {
                let role = m.get("role").and_then(Value::as_str).unwrap_or("user");
                let content = m.get("content").and_then(Value::as_str).unwrap_or("");
                s.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
            }
            s.push_str("<|im_start|>assistant\n");
            s
        }
    };
    let tail = text.trim_end();
    let in_reasoning = match (tail.rfind("<think>"), tail.rfind("</think>")) {
        (Some(o), Some(c)) => o > c,
        (Some(_), None) => tail.ends_with("<think>"),
        _ => false,
    };
    Ok(Rendered { text, in_reasoning })
}

/// Words that introduce a system message moved into a user turn by
/// [`normalize_system_messages`].
pub const SYSTEM_NOTE_PREFIX: &str = "[System message]";

/// Makes a conversation acceptable to templates that take one system
/// message, first (Qwen3.5/3.6 raise "System message must be at the
/// beginning" otherwise), without losing any text. `developer` counts as
/// `system`. The system messages before the first user message become one
/// leading system message, their texts in order, joined by blank lines
/// (empty ones dropped); a later system message becomes a user turn that
/// starts with [`SYSTEM_NOTE_PREFIX`] on a line of its own, in place.
/// Messages: `{"role", "content": string, ...}` as in [`Conversation`].
pub fn normalize_system_messages(messages: Vec<Value>) -> Vec<Value> {
    let is_system = |m: &Value| {
        matches!(
            m.get("role").and_then(Value::as_str),
            Some("system" | "developer")
        )
    };
    let first_user = messages
        .iter()
        .position(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        .unwrap_or(messages.len());
    let mut leading: Vec<String> = Vec::new();
    let mut rest = Vec::with_capacity(messages.len());
    for (i, m) in messages.into_iter().enumerate() {
        if !is_system(&m) {
            rest.push(m);
            continue;
        }
        let text = m.get("content").and_then(Value::as_str).unwrap_or("");
        if i < first_user {
            if !text.is_empty() {
                leading.push(text.to_string());
            }
        } else {
            rest.push(json!({"role": "user", "content": format!("{SYSTEM_NOTE_PREFIX}\n{text}")}));
        }
    }
    if !leading.is_empty() {
        rest.insert(
            0,
            json!({"role": "system", "content": leading.join("\n\n")}),
        );
    }
    rest
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
mod tests {
    use super::*;

    const CHATML: &str = "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

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

    /// Raises, as the Qwen3.5/3.6 templates do, on a system message that
    /// is not first.
    const SYSTEM_FIRST_ONLY: &str = "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}{{- '<|im_start|>assistant\\n' }}";

    #[test]
    fn system_messages_merge_first_and_later_ones_become_user_notes() {
        let messages = vec![
            json!({"role": "developer", "content": "be brief"}),
            json!({"role": "system", "content": ""}),
            json!({"role": "system", "content": "use tools"}),
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "hello"}),
            json!({"role": "developer", "content": "now in French"}),
            json!({"role": "user", "content": "again"}),
        ];
        let t = ChatTemplate::new(SYSTEM_FIRST_ONLY).unwrap();
        let raw = Conversation {
            messages: messages.clone(),
            ..Default::default()
        };
        assert!(
            render(&raw, Some(&t)).is_err(),
            "the template refuses the raw form"
        );
        let out = normalize_system_messages(messages);
        assert_eq!(
            out,
            vec![
                json!({"role": "system", "content": "be brief\n\nuse tools"}),
                json!({"role": "user", "content": "hi"}),
                json!({"role": "assistant", "content": "hello"}),
                json!({"role": "user", "content": format!("{SYSTEM_NOTE_PREFIX}\nnow in French")}),
                json!({"role": "user", "content": "again"}),
            ]
        );
        let conv = Conversation {
            messages: out,
            ..Default::default()
        };
        let text = render(&conv, Some(&t)).unwrap().text;
        assert!(text.starts_with("<|im_start|>system\nbe brief\n\nuse tools<|im_end|>"));
        assert!(text.contains("<|im_start|>user\n[System message]\nnow in French<|im_end|>"));
    }

    #[test]
    fn system_only_and_no_system_conversations() {
        let only = vec![json!({"role": "developer", "content": "rules"})];
        assert_eq!(
            normalize_system_messages(only),
            vec![json!({"role": "system", "content": "rules"})]
        );
        let none = vec![json!({"role": "user", "content": "x"})];
        assert_eq!(normalize_system_messages(none.clone()), none);
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

//! Responses API input (`instructions`, `input` items) and tools, mapped to
//! the [`Conversation`] the renderer reads.

use std::collections::HashMap;

use serde_json::{json, Map, Value};

use crate::error::{ApiError, Flavor};
use crate::prompt::{content_text, merge_system_messages};

const F: Flavor = Flavor::OpenAi;

/// How a tool offered to the model is named on the wire: nested tools of a
/// `namespace` tool are offered as `{namespace}__{name}` (one flat list is
/// all a chat template knows) and their calls go back as
/// `{"namespace", "name"}`, which is how the Responses API reports them.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ToolRoutes(HashMap<String, (String, String)>);

/// Joins a namespace and a tool name into the name the model sees.
fn flat_name(namespace: &str, name: &str) -> String {
    format!("{namespace}__{name}")
}

impl ToolRoutes {
    /// `(namespace, name)` of a call the model wrote as `flat`; `None` for a
    /// tool outside any namespace (or one the model made up).
    pub fn route(&self, flat: &str) -> Option<(&str, &str)> {
        self.0.get(flat).map(|(ns, n)| (ns.as_str(), n.as_str()))
    }
}

fn bad(msg: impl Into<String>, param: impl Into<String>) -> ApiError {
    ApiError::bad_request(F, msg).param(param)
}

/// One function tool of the request in the chat form
/// (`{"type":"function","function":{"name","description","parameters"}}`).
fn chat_tool(t: &Value, name: String, what: &str) -> Result<Value, ApiError> {
    let parameters = t
        .get("parameters")
        .cloned()
        .filter(|p| !p.is_null())
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    if !parameters.is_object() {
        return Err(bad(
            format!("{what}.parameters must be a JSON schema object"),
            format!("{what}.parameters"),
        ));
    }
    let mut f = Map::new();
    f.insert("name".into(), name.into());
    if let Some(d) = t.get("description").filter(|d| d.is_string()) {
        f.insert("description".into(), d.clone());
    }
    f.insert("parameters".into(), parameters);
    Ok(json!({"type": "function", "function": f}))
}

fn tool_name<'a>(t: &'a Value, what: &str) -> Result<&'a str, ApiError> {
    t.get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad(format!("{what} needs a `name`"), format!("{what}.name")))
}

/// The tools the model is offered, in chat form, and how to route their
/// calls back.
///
/// Function tools are offered as they are and `namespace` tools are
/// flattened (see [`ToolRoutes`]). Every other tool type (`web_search`,
/// `local_shell`, `custom` freeform tools, `file_search`, `mcp`, ...) is
/// left out with a debug log: the server cannot run hosted tools and the
/// model's tool-call format has no freeform form, and Codex sends several
/// of them by default, so refusing them would refuse every Codex request.
/// `strict` is accepted; arguments are parsed with the schema's types (see
/// [`crate::parse`]) but not constrained to it while generating.
pub fn tools(list: &[Value]) -> Result<(Vec<Value>, ToolRoutes), ApiError> {
    let mut out = Vec::new();
    let mut routes = HashMap::new();
    for (i, t) in list.iter().enumerate() {
        let what = format!("tools[{i}]");
        match t.get("type").and_then(Value::as_str) {
            Some("function") => out.push(chat_tool(t, tool_name(t, &what)?.to_string(), &what)?),
            Some("namespace") => {
                let ns = tool_name(t, &what)?;
                let nested = t.get("tools").and_then(Value::as_array).ok_or_else(|| {
                    bad(
                        format!("{what}: a namespace tool needs a `tools` list"),
                        format!("{what}.tools"),
                    )
                })?;
                for (j, n) in nested.iter().enumerate() {
                    let what = format!("{what}.tools[{j}]");
                    if n.get("type").and_then(Value::as_str) != Some("function") {
                        tracing::debug!("{what}: not a function tool; not offered to the model");
                        continue;
                    }
                    let name = tool_name(n, &what)?;
                    let flat = flat_name(ns, name);
                    out.push(chat_tool(n, flat.clone(), &what)?);
                    routes.insert(flat, (ns.to_string(), name.to_string()));
                }
            }
            Some(other) => {
                tracing::debug!("{what}: `{other}` tools cannot run here; not offered to the model")
            }
            None => {
                return Err(bad(
                    format!("{what} needs a `type`"),
                    format!("{what}.type"),
                ))
            }
        }
    }
    Ok((out, ToolRoutes(routes)))
}

/// Text of a `function_call_output`'s `output`: a string, or content parts
/// whose text is kept and whose images or files are replaced by a marker
/// (the model reads text only; refusing would end an agent's session at
/// its first screenshot).
fn output_text(v: &Value, what: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for p in parts {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text") => texts.push(
                        p.get("text")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                    ),
                    Some(t) => texts.push(format!("[{t} omitted: this model reads text only]")),
                    None => {
                        return Err(bad(
                            format!("{what}: an output part has no `type`"),
                            format!("{what}.output"),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(bad(
            format!("{what}.output must be a string or a list of content parts"),
            format!("{what}.output"),
        )),
    }
}

/// Text of a `reasoning` item: its `reasoning_text` content, else its
/// summary. `encrypted_content` is opaque and has no text to give.
fn reasoning_text(item: &Value) -> String {
    let texts = |key: &str| -> Vec<String> {
        item.get(key)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("text").and_then(Value::as_str).map(str::to_string))
            .collect()
    };
    let content = texts("content");
    if content.is_empty() {
        texts("summary").join("\n\n")
    } else {
        content.join("\n\n")
    }
}

/// The last message when it is an assistant turn that `accepts` more;
/// otherwise a new, empty assistant turn.
fn assistant_turn(messages: &mut Vec<Value>, accepts: impl Fn(&Value) -> bool) -> &mut Value {
    let reuse = messages
        .last()
        .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("assistant") && accepts(m));
    if !reuse {
        messages.push(json!({"role": "assistant", "content": ""}));
    }
    let last = messages.len() - 1;
    &mut messages[last]
}

fn has_text(m: &Value, key: &str) -> bool {
    m.get(key)
        .and_then(Value::as_str)
        .is_some_and(|s| !s.is_empty())
}

/// The conversation of `instructions` and `input`: message items become
/// messages; a `reasoning` item, the assistant message and the
/// `function_call` items after it form one assistant turn (reasoning as
/// `reasoning_content`, calls as `tool_calls`); `function_call_output`
/// items become tool messages. System and developer messages are then
/// normalized ([`merge_system_messages`]).
pub fn messages(instructions: Option<&str>, input: &Value) -> Result<Vec<Value>, ApiError> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(i) = instructions.filter(|i| !i.is_empty()) {
        messages.push(json!({"role": "system", "content": i}));
    }
    let items = match input {
        Value::String(s) => {
            messages.push(json!({"role": "user", "content": s}));
            return Ok(merge_system_messages(messages));
        }
        Value::Array(items) => items,
        _ => return Err(bad("input must be a string or a list of items", "input")),
    };
    for (i, item) in items.iter().enumerate() {
        let what = format!("input[{i}]");
        let kind = item.get("type").and_then(Value::as_str);
        match kind {
            Some("message") | None if item.get("role").is_some() => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
                let text = content_text(item.get("content").unwrap_or(&Value::Null), &what)
                    .map_err(|e| bad(e, format!("{what}.content")))?;
                match role {
                    "user" | "system" | "developer" => {
                        messages.push(json!({"role": role, "content": text}))
                    }
                    "assistant" => {
                        let turn = assistant_turn(&mut messages, |m| m.get("tool_calls").is_none());
                        if let Some(Value::String(c)) = turn.get_mut("content") {
                            if !c.is_empty() && !text.is_empty() {
                                c.push_str("\n\n");
                            }
                            c.push_str(&text);
                        }
                    }
                    r => {
                        return Err(bad(
                            format!("{what}: unknown role `{r}` (user, assistant, system, developer)"),
                            format!("{what}.role"),
                        ))
                    }
                }
            }
            Some("reasoning") => {
                let text = reasoning_text(item);
                let turn = assistant_turn(&mut messages, |m| {
                    !has_text(m, "content")
                        && !has_text(m, "reasoning_content")
                        && m.get("tool_calls").is_none()
                });
                turn["reasoning_content"] = text.into();
            }
            Some("function_call") => {
                let field = |k: &str| {
                    item.get(k).and_then(Value::as_str).ok_or_else(|| {
                        bad(format!("{what}: a function_call needs a string `{k}`"), format!("{what}.{k}"))
                    })
                };
                let (call_id, name, arguments) = (field("call_id")?, field("name")?, field("arguments")?);
                let args: Value = serde_json::from_str(arguments)
                    .ok()
                    .filter(Value::is_object)
                    .ok_or_else(|| {
                        bad(
                            format!("{what}.arguments must be a JSON object in a string"),
                            format!("{what}.arguments"),
                        )
                    })?;
                // The name the model saw (see `ToolRoutes`).
                let name = match item.get("namespace").and_then(Value::as_str) {
                    Some(ns) => flat_name(ns, name),
                    None => name.to_string(),
                };
                let turn = assistant_turn(&mut messages, |_| true);
                let call = json!({"type": "function", "id": call_id,
                    "function": {"name": name, "arguments": args}});
                match turn.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => turn["tool_calls"] = json!([call]),
                }
            }
            Some("function_call_output") => {
                let call_id = item.get("call_id").and_then(Value::as_str).ok_or_else(|| {
                    bad(
                        format!("{what}: a function_call_output needs a string `call_id`"),
                        format!("{what}.call_id"),
                    )
                })?;
                let output = output_text(item.get("output").unwrap_or(&Value::Null), &what)?;
                messages.push(json!({"role": "tool", "content": output, "tool_call_id": call_id}));
            }
            Some("item_reference") => {
                return Err(bad(
                    format!("{what}: item references need stored responses, and this server stores none; send the items themselves"),
                    format!("{what}.type"),
                ))
            }
            Some("message") => {
                return Err(bad(
                    format!("{what}: a message needs a `role`"),
                    format!("{what}.role"),
                ))
            }
            Some(t) => {
                return Err(bad(
                    format!("{what}: input items of type `{t}` are not supported (message, function_call, function_call_output, reasoning)"),
                    format!("{what}.type"),
                ))
            }
            None => {
                return Err(bad(
                    format!("{what} needs a `type` (or a `role`, for a message)"),
                    format!("{what}.type"),
                ))
            }
        }
    }
    if messages.is_empty() {
        return Err(bad("input must not be empty", "input"));
    }
    Ok(merge_system_messages(messages))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_codex_turn_with_reasoning_calls_and_outputs() {
        let input = json!([
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox rules"}]},
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "skills"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": null,
                "content": [{"type": "reasoning_text", "text": "run ls"}]},
            {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": "{\"cmd\":\"ls\"}"},
            {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "done"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "One file."}]},
            {"role": "user", "content": "thanks"},
        ]);
        let m = messages(Some("be terse"), &input).unwrap();
        assert_eq!(
            m[0],
            json!({"role": "system", "content": "be terse\n\nsandbox rules\n\nskills"})
        );
        assert_eq!(m[1], json!({"role": "user", "content": "list files"}));
        assert_eq!(m[2]["role"], "assistant");
        assert_eq!(m[2]["reasoning_content"], "run ls");
        assert_eq!(m[2]["tool_calls"][0]["id"], "c1");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"cmd": "ls"})
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "content": "a.txt", "tool_call_id": "c1"})
        );
        assert_eq!(m[4]["reasoning_content"], "done");
        assert_eq!(m[4]["content"], "One file.");
        assert_eq!(m[5], json!({"role": "user", "content": "thanks"}));
        assert_eq!(m.len(), 6);
    }

    #[test]
    fn namespaced_tools_are_flattened_and_routed() {
        let (tools, routes) = tools(&[
            json!({"type": "function", "name": "exec", "strict": false,
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}),
            json!({"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
                {"type": "function", "name": "spawn", "description": "start one"},
                {"type": "custom", "name": "freeform"}]}),
            json!({"type": "web_search", "external_web_access": false}),
        ])
        .unwrap();
        assert_eq!(tools.len(), 2);
        assert_eq!(tools[0]["function"]["name"], "exec");
        assert_eq!(tools[1]["function"]["name"], "agents__spawn");
        assert_eq!(tools[1]["function"]["description"], "start one");
        assert_eq!(routes.route("agents__spawn"), Some(("agents", "spawn")));
        assert_eq!(routes.route("exec"), None);
        // A call sent back with its namespace is rendered under the name the model saw.
        let m = messages(None, &json!([{"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c", "namespace": "agents", "name": "spawn", "arguments": "{}"}]))
        .unwrap();
        assert_eq!(m[1]["tool_calls"][0]["function"]["name"], "agents__spawn");
    }

    #[test]
    fn bad_items_name_their_place() {
        let err = |input: Value| messages(None, &input).unwrap_err();
        let e = err(
            json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}]),
        );
        assert_eq!(e.param.as_deref(), Some("input[0].arguments"));
        let e = err(json!([{"type": "item_reference", "id": "msg_1"}]));
        assert!(e.message.contains("stores none"), "{}", e.message);
        let e =
            err(json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]));
        assert_eq!(e.param.as_deref(), Some("input[0].content"));
        let e = err(json!([{"role": "tool", "content": "x"}]));
        assert_eq!(e.param.as_deref(), Some("input[0].role"));
        assert_eq!(err(json!([])).param.as_deref(), Some("input"));
        assert!(tools(&[json!({"name": "f"})]).is_err());
    }

    #[test]
    fn tool_outputs_keep_text_and_mark_what_they_drop() {
        let m = messages(None, &json!([{"role": "user", "content": "look"},
            {"type": "function_call_output", "call_id": "c", "output": [
                {"type": "input_text", "text": "screenshot:"}, {"type": "input_image", "image_url": "data:"}]}]))
        .unwrap();
        assert_eq!(
            m[1]["content"],
            "screenshot:\n[input_image omitted: this model reads text only]"
        );
    }
}

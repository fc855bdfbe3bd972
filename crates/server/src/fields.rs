//! Request fields that are accepted and have nothing to do here, each with
//! why ignoring it is harmless, and the refusal of every other field a
//! request struct does not name: nothing is accepted and silently ignored.
//! (The Responses API keeps its own list: `responses::IGNORED`.)

use serde_json::{Map, Value};

use crate::constrain::{ToolChoice, ToolForm};
use crate::error::{ApiError, Flavor};
use crate::App;

/// Chat and text completions: fields accepted and ignored, and why.
pub const OPENAI_IGNORED: &[(&str, &str)] = &[
    (
        "user",
        "an end-user id for abuse monitoring; there is none here",
    ),
    ("safety_identifier", "as user"),
    (
        "metadata",
        "tags for the provider's dashboards; nothing is stored",
    ),
    ("store", "nothing is stored either way"),
    ("service_tier", "there is one tier"),
    (
        "prompt_cache_key",
        "prefix reuse needs no key: the server keeps the last conversation's state",
    ),
];

/// Anthropic messages: fields accepted and ignored, and why.
pub const ANTHROPIC_IGNORED: &[(&str, &str)] = &[
    (
        "metadata",
        "`user_id` for abuse monitoring (Claude Code sends it); there is none here",
    ),
    ("service_tier", "there is one tier"),
];

/// Drops the `ignored` fields of a request body and refuses the first of
/// `unknown` (what the request struct did not name), by name.
pub fn refuse_unknown(
    flavor: Flavor,
    unknown: &Map<String, Value>,
    ignored: &[(&str, &str)],
) -> Result<(), ApiError> {
    match unknown
        .keys()
        .find(|k| !ignored.iter().any(|(name, _)| name == k))
    {
        None => Ok(()),
        Some(field) => Err(ApiError::bad_request(
            flavor,
            format!("unknown parameter `{field}`: this server does not support it"),
        )
        .param(field.clone())
        .code("unknown_parameter")),
    }
}

/// A refusal of a field this server knows but cannot honour.
pub fn unsupported(flavor: Flavor, field: &str, why: &str) -> ApiError {
    ApiError::bad_request(
        flavor,
        format!("`{field}` is not supported by this server: {why}"),
    )
    .param(field)
    .code("unsupported_parameter")
}

/// OpenAI's `tool_choice`: `"auto"`, `"none"`, `"required"`, or a named
/// function: chat's `{"type": "function", "function": {"name": ...}}`,
/// with `flat` the Responses API's `{"type": "function", "name": ...}`.
pub fn openai_tool_choice(v: Option<&Value>, flat: bool) -> Result<ToolChoice, String> {
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(format!("unknown `{other}` (auto, none, required)")),
        },
        Some(c) if c.get("type").and_then(Value::as_str) == Some("function") => {
            let name = if flat {
                c.get("name")
            } else {
                c.get("function").and_then(|f| f.get("name"))
            };
            match name.and_then(Value::as_str) {
                Some(n) => Ok(ToolChoice::Named(n.to_string())),
                None if flat => {
                    Err("a named choice is {\"type\": \"function\", \"name\": ...}".into())
                }
                None => Err(
                    "a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}"
                        .into(),
                ),
            }
        }
        Some(c) => Err(format!(
            "{c} is not supported (auto, none, required, or a function by name)"
        )),
    }
}

/// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "none"}` or
/// `{"type": "tool", "name": ...}`, with `disable_parallel_tool_use`;
/// returns the choice and whether calls are limited to one.
pub fn anthropic_tool_choice(v: Option<&Value>) -> Result<(ToolChoice, bool), String> {
    let Some(c) = v.filter(|c| !c.is_null()) else {
        return Ok((ToolChoice::Auto, false));
    };
    let Some(obj) = c.as_object() else {
        return Err("must be an object, e.g. {\"type\": \"auto\"}".into());
    };
    for key in obj.keys() {
        if !matches!(
            key.as_str(),
            "type" | "name" | "disable_parallel_tool_use" | "cache_control"
        ) {
            return Err(format!("unknown field `{key}`"));
        }
    }
    let single = obj
        .get("disable_parallel_tool_use")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let choice = match obj.get("type").and_then(Value::as_str) {
        Some("auto") => ToolChoice::Auto,
        Some("none") => ToolChoice::None,
        Some("any") => ToolChoice::Required,
        Some("tool") => match obj.get("name").and_then(Value::as_str) {
            Some(n) => ToolChoice::Named(n.to_string()),
            None => return Err("{\"type\": \"tool\"} needs a `name`".into()),
        },
        Some(other) => return Err(format!("unknown type `{other}` (auto, any, tool, none)")),
        None => return Err("`type` is required (auto, any, tool, none)".into()),
    };
    Ok((choice, single))
}

/// The tool-call form of the template the server renders with.
pub fn tool_form(app: &App) -> ToolForm {
    ToolForm::of_template(
        app.config
            .chat_template
            .as_deref()
            .or(app.info.template_source.as_deref()),
    )
}

/// `top_logprobs` checked: at most 20 (OpenAI's limit).
pub fn top_logprobs(flavor: Flavor, n: Option<usize>) -> Result<usize, ApiError> {
    match n.unwrap_or(0) {
        n @ 0..=20 => Ok(n),
        n => Err(ApiError::bad_request(
            flavor,
            format!("top_logprobs must be at most 20, got {n}"),
        )
        .param("top_logprobs")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_choices_parse_or_name_the_problem() {
        let named = json!({"type": "function", "function": {"name": "f"}});
        assert_eq!(
            openai_tool_choice(Some(&named), false),
            Ok(ToolChoice::Named("f".into()))
        );
        assert_eq!(
            openai_tool_choice(Some(&json!({"type": "function", "name": "g"})), true),
            Ok(ToolChoice::Named("g".into()))
        );
        assert_eq!(
            openai_tool_choice(Some(&json!("required")), false),
            Ok(ToolChoice::Required)
        );
        assert!(openai_tool_choice(Some(&json!("sometimes")), false).is_err());
        assert_eq!(
            anthropic_tool_choice(Some(
                &json!({"type": "any", "disable_parallel_tool_use": true})
            )),
            Ok((ToolChoice::Required, true))
        );
        assert_eq!(
            anthropic_tool_choice(Some(&json!({"type": "tool", "name": "x"}))),
            Ok((ToolChoice::Named("x".into()), false))
        );
        assert!(anthropic_tool_choice(Some(&json!({"type": "tool"}))).is_err());
        assert!(anthropic_tool_choice(Some(&json!({"type": "any", "bogus": 1}))).is_err());
    }

    #[test]
    fn unknown_fields_are_refused_by_name_ignored_ones_pass() {
        let mut m = Map::new();
        m.insert("user".into(), json!("u"));
        assert!(refuse_unknown(Flavor::OpenAi, &m, OPENAI_IGNORED).is_ok());
        m.insert("best_of".into(), json!(2));
        let e = refuse_unknown(Flavor::OpenAi, &m, OPENAI_IGNORED).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("best_of"));
        assert!(e.message.contains("best_of"));
    }
}

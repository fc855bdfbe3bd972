//! OpenAI Responses API: `POST /v1/responses`, streaming and not, as Codex
//! CLI and the official SDKs' `responses.create` / `responses.stream` use
//! it. Stateless: every request carries its whole conversation, nothing is
//! stored (`previous_response_id` is refused, `GET /v1/responses/{id}` is a
//! 404 that says so). Every field either has its effect, is refused by name,
//! or is in [`IGNORED`] with the reason ignoring it is harmless. Structured
//! output (`text.format`) and forced tool calls (`tool_choice` required or
//! named) are enforced by constrained decoding (`constrain.rs`).

mod events;
pub mod input;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::constrain::{openai_format, tool_constraint, Constraint, ToolChoice};
use crate::error::{parse_body, ApiError, Flavor};
use crate::fields::{openai_tool_choice, tool_form};
use crate::gen::{pump, spawn_sse, submit, GenParams, Step};
use crate::openai::{new_id, now};
use crate::prompt::Conversation;
use crate::sampling::{resolve, RequestSampling};
use crate::App;
use events::{sse, ResponseWriter};

const F: Flavor = Flavor::OpenAi;

/// Fields accepted and ignored, with why ignoring each is harmless here.
pub const IGNORED: &[(&str, &str)] = &[
    (
        "prompt_cache_key",
        "prefix reuse needs no key: the server keeps the last conversation's state",
    ),
    ("prompt_cache_retention", "as prompt_cache_key"),
    ("prompt_cache_options", "as prompt_cache_key"),
    ("user", "an end-user id for abuse monitoring; there is none here"),
    ("safety_identifier", "as user"),
    ("service_tier", "there is one tier"),
    ("client_metadata", "Codex's tracing tags, for the provider's logs"),
    (
        "stream_options",
        "only `include_obfuscation`, padding against network side channels; this server's events are not padded",
    ),
];

/// `POST /v1/responses` body. Fields not named here or in [`IGNORED`] are
/// refused (`unknown_parameter`), as OpenAI does.
#[derive(Debug, Deserialize)]
pub struct ResponsesRequest {
    #[serde(default)]
    pub model: String,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub max_output_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `false`: at most one function call per response.
    pub parallel_tool_calls: Option<bool>,
    pub max_tool_calls: Option<usize>,
    /// `{"effort", "summary"}`: effort `none`/`minimal` turns thinking off.
    pub reasoning: Option<Map<String, Value>>,
    /// `{"format": {"type": "text"}, "verbosity"}`.
    pub text: Option<Map<String, Value>>,
    /// Echoed; nothing is retrievable later either way.
    pub store: Option<bool>,
    /// Echoed.
    pub metadata: Option<Value>,
    /// Extra output to include. Log probabilities are refused (not
    /// returned yet); the rest is accepted with nothing to add:
    /// `reasoning.encrypted_content` because the reasoning comes in clear
    /// in the item itself, the others because they belong to hosted tools
    /// this server never runs.
    pub include: Option<Vec<String>>,
    /// `disabled` (the default) only: a conversation over the context
    /// limit is an error, never silently cut (`auto`).
    pub truncation: Option<String>,
    // Refused when set: they need stored state or features this server lacks.
    pub previous_response_id: Option<Value>,
    pub conversation: Option<Value>,
    pub prompt: Option<Value>,
    pub background: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub context_management: Option<Value>,
    #[serde(flatten)]
    pub unknown: Map<String, Value>,
}

fn refuse(field: &str, why: &str) -> ApiError {
    ApiError::bad_request(
        F,
        format!("`{field}` is not supported by this server: {why}"),
    )
    .param(field)
    .code("unsupported_parameter")
}

/// Reads the body, leaving out [`IGNORED`] fields.
fn parse(body: Result<Bytes, BytesRejection>) -> Result<ResponsesRequest, ApiError> {
    let mut map: Map<String, Value> = parse_body(F, body)?;
    for (field, _) in IGNORED {
        map.remove(*field);
    }
    let req: ResponsesRequest = serde_json::from_value(Value::Object(map))
        .map_err(|e| ApiError::bad_request(F, format!("invalid request: {e}")))?;
    if let Some(field) = req.unknown.keys().next() {
        return Err(
            ApiError::bad_request(F, format!("unknown parameter `{field}`"))
                .param(field.clone())
                .code("unknown_parameter"),
        );
    }
    Ok(req)
}

/// Refuses what this server cannot do, by name.
fn check_supported(req: &ResponsesRequest) -> Result<(), ApiError> {
    let set = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    if set(&req.previous_response_id) {
        return Err(refuse(
            "previous_response_id",
            "responses are not stored; send the whole conversation in `input`",
        ));
    }
    if set(&req.conversation) {
        return Err(refuse(
            "conversation",
            "conversations are not stored; send the whole conversation in `input`",
        ));
    }
    if set(&req.prompt) {
        return Err(refuse("prompt", "there are no stored prompt templates"));
    }
    if req.background == Some(true) {
        return Err(refuse(
            "background",
            "responses run while the request is open",
        ));
    }
    if req.top_logprobs.unwrap_or(0) > 0 {
        return Err(refuse(
            "top_logprobs",
            "log probabilities are not returned yet",
        ));
    }
    let empty = |v: &Value| v.is_null() || v.as_array().is_some_and(Vec::is_empty);
    if req.context_management.as_ref().is_some_and(|v| !empty(v)) {
        return Err(refuse(
            "context_management",
            "the server does not compact conversations",
        ));
    }
    if let Some(t) = req.truncation.as_deref().filter(|t| *t != "disabled") {
        return Err(refuse(
            "truncation",
            &format!("`{t}`: a conversation over the context limit is an error, never cut"),
        ));
    }
    if req.include.iter().flatten().any(|i| i.contains("logprobs")) {
        return Err(refuse("include", "log probabilities are not returned yet"));
    }
    if req
        .metadata
        .as_ref()
        .is_some_and(|m| !m.is_object() && !m.is_null())
    {
        return Err(ApiError::bad_request(F, "metadata must be an object").param("metadata"));
    }
    Ok(())
}

/// `enable_thinking` from `reasoning`: `Some(false)` for effort `none` or
/// `minimal`, else the template's default. `summary` (also
/// `generate_summary`) is accepted and has nothing to do: the model's
/// reasoning is returned whole, as `reasoning_text`, never summarized.
fn thinking(reasoning: Option<&Map<String, Value>>) -> Result<Option<bool>, ApiError> {
    let Some(r) = reasoning else {
        return Ok(None);
    };
    if let Some(k) = r
        .keys()
        .find(|k| !matches!(k.as_str(), "effort" | "summary" | "generate_summary"))
    {
        return Err(refuse(
            &format!("reasoning.{k}"),
            "only `effort` and `summary` are",
        ));
    }
    match r.get("effort").filter(|e| !e.is_null()) {
        None => Ok(None),
        Some(e) => match e.as_str() {
            Some("none" | "minimal") => Ok(Some(false)),
            Some("low" | "medium" | "high" | "xhigh" | "max") => Ok(None),
            _ => Err(ApiError::bad_request(
                F,
                format!("reasoning.effort {e} is not one of none, minimal, low, medium, high, xhigh, max"),
            )
            .param("reasoning.effort")),
        },
    }
}

/// Reads `text`: its `format` (`text`, `json_object`, `json_schema`) as a
/// constraint. `verbosity` is accepted and has nothing to do: a length
/// hint this model has no control for.
fn text_format(text: Option<&Map<String, Value>>) -> Result<Option<Constraint>, ApiError> {
    let Some(t) = text else {
        return Ok(None);
    };
    if let Some(k) = t
        .keys()
        .find(|k| !matches!(k.as_str(), "format" | "verbosity"))
    {
        return Err(refuse(
            &format!("text.{k}"),
            "only `format` and `verbosity` are",
        ));
    }
    match t.get("format") {
        None => Ok(None),
        Some(f) => openai_format(f, true).map_err(|e| {
            ApiError::bad_request(F, format!("text.format: {e}")).param("text.format")
        }),
    }
}

/// `tool_choice`: `auto` (the default), `none`, `required` or a function
/// by name (the last two enforced by constrained decoding).
fn tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ApiError> {
    openai_tool_choice(choice, true)
        .map_err(|e| ApiError::bad_request(F, format!("tool_choice: {e}")).param("tool_choice"))
}

/// The Response before any output: the request's settings echoed.
fn base(req: &ResponsesRequest, model: &str, temperature: f32, top_p: f32) -> Value {
    json!({
        "id": new_id("resp_"),
        "object": "response",
        "created_at": now(),
        "status": "in_progress",
        "background": false,
        "error": null,
        "incomplete_details": null,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": null,
        "reasoning": req.reasoning.clone().unwrap_or_default(),
        "store": req.store.unwrap_or(true),
        "temperature": temperature,
        "text": req.text.clone().unwrap_or_else(|| {
            let mut m = Map::new();
            m.insert("format".into(), json!({"type": "text"}));
            m
        }),
        "tool_choice": req.tool_choice.clone().filter(|c| !c.is_null()).unwrap_or_else(|| "auto".into()),
        "tools": req.tools.clone().unwrap_or_default(),
        "top_p": top_p,
        "truncation": "disabled",
        "usage": null,
        "metadata": req.metadata.clone().filter(|m| !m.is_null()).unwrap_or_else(|| json!({})),
    })
}

/// Tokens of the reasoning written so far, counted by encoding its text
/// (the output parser sees text, not tokens).
fn reasoning_tokens(app: &App, w: &ResponseWriter) -> usize {
    let text = w.reasoning_text();
    if text.is_empty() {
        return 0;
    }
    app.codec.encode(&text).map(|t| t.len()).unwrap_or(0)
}

pub async fn create(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req = parse(body)?;
    app.check_model(&req.model, F)?;
    check_supported(&req)?;
    let format = text_format(req.text.as_ref())?;
    let choice = tool_choice(req.tool_choice.as_ref())?;
    let enable_thinking = thinking(req.reasoning.as_ref())?;
    if req.max_output_tokens == Some(0) {
        return Err(
            ApiError::bad_request(F, "max_output_tokens must be at least 1")
                .param("max_output_tokens"),
        );
    }
    let input = req
        .input
        .as_ref()
        .ok_or_else(|| ApiError::bad_request(F, "`input` is required").param("input"))?;
    let messages = input::messages(req.instructions.as_deref(), input)?;
    let (tools, routes) = if choice != ToolChoice::None {
        input::tools(req.tools.as_deref().unwrap_or_default())?
    } else {
        (Vec::new(), Default::default())
    };
    let conv = Conversation {
        messages,
        tools,
        enable_thinking,
        extra: Map::new(),
    };
    let rendered = app.render(&conv, F)?;
    let sampling = resolve(
        F,
        &RequestSampling {
            temperature: req.temperature,
            top_p: req.top_p,
            ..Default::default()
        },
        &app.config.sampling,
        &app.info.generation,
    )?;
    let single = req.parallel_tool_calls == Some(false) || req.max_tool_calls == Some(1);
    let constraint = match tool_constraint(&choice, &conv.tools, single, tool_form(&app))
        .map_err(|e| ApiError::bad_request(F, format!("tool_choice {e}")).param("tool_choice"))?
    {
        Some(c) => Some(c),
        None => format,
    };
    let params = GenParams {
        prompt_text: rendered.text,
        reply_opening: rendered.reply_opening,
        max_tokens: req.max_output_tokens,
        sampling: sampling.clone(),
        stop: Vec::new(),
        parse: true,
        parse_tools: !conv.tools.is_empty(),
        in_reasoning: rendered.in_reasoning,
        reasoning_budget: None,
        tools: conv.tools,
        constraint,
        logprobs: None,
    };
    let mut gen = submit(&app, F, params)?;
    let max_calls = match req.parallel_tool_calls {
        Some(false) => 1,
        _ => usize::MAX,
    }
    .min(req.max_tool_calls.unwrap_or(usize::MAX));
    let base = base(
        &req,
        &app.config.model_id,
        sampling.temperature,
        sampling.top_p,
    );
    let mut w = ResponseWriter::new(base, routes, max_calls);
    if !req.stream {
        let outcome = gen
            .collect(|ev| drop(w.output(ev)))
            .await
            .map_err(|e| ApiError::internal(F, e))?;
        let (_, response) = w.finish(&outcome, reasoning_tokens(&app, &w));
        return Ok(Json(response).into_response());
    }
    let start: Vec<String> = w.start().iter().map(sse).collect();
    let interval = app.config.ping_interval;
    Ok(spawn_sse(move |tx| async move {
        for m in start {
            if tx.send(m).await.is_err() {
                return;
            }
        }
        pump(gen, tx, ": ping\n\n", interval, |step, _| {
            let (events, end) = match step {
                Step::Started => (Vec::new(), false),
                Step::Output(evs) => (evs.into_iter().flat_map(|e| w.output(e)).collect(), false),
                Step::Done(o) => (w.finish(&o, reasoning_tokens(&app, &w)).0, true),
                Step::Failed(e) => (w.fail(&e), true),
            };
            (events.iter().map(sse).collect(), end)
        })
        .await;
    }))
}

/// `GET`/`DELETE /v1/responses/{id}`: nothing is stored, so nothing is found.
pub async fn stored(Path(id): Path<String>) -> Response {
    ApiError::not_found(
        F,
        format!("no response `{id}`: this server does not store responses (each request carries its whole conversation)"),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(v: Value) -> Result<ResponsesRequest, ApiError> {
        let r = parse(Ok(Bytes::from(v.to_string())))?;
        check_supported(&r)?;
        text_format(r.text.as_ref())?;
        thinking(r.reasoning.as_ref())?;
        tool_choice(r.tool_choice.as_ref())?;
        Ok(r)
    }

    fn refused(v: Value) -> String {
        req(v).unwrap_err().param.unwrap_or_default()
    }

    /// The fixture is Codex CLI 0.171.0's second request of `codex exec
    /// "list the files here"` (after it ran `ls` for the scripted model),
    /// long texts trimmed.
    #[test]
    fn the_captured_codex_request_is_accepted() {
        let body: Value = serde_json::from_str(include_str!(
            "../tests/fixtures/codex_responses_request.json"
        ))
        .unwrap();
        let r = req(body).unwrap();
        assert!(r.stream);
        let messages =
            input::messages(r.instructions.as_deref(), r.input.as_ref().unwrap()).unwrap();
        assert_eq!(messages[0]["role"], "system");
        assert_eq!(messages.iter().filter(|m| m["role"] == "system").count(), 1);
        // Its second turn: the reasoning and the call form one assistant
        // turn, the command's output a tool message answering it.
        let n = messages.len();
        let (turn, result) = (&messages[n - 2], &messages[n - 1]);
        assert_eq!(turn["role"], "assistant");
        assert!(!turn["reasoning_content"].as_str().unwrap().is_empty());
        let call = &turn["tool_calls"][0];
        assert_eq!(call["function"]["name"], "exec_command");
        assert_eq!(call["function"]["arguments"], json!({"cmd": "ls"}));
        assert_eq!(result["role"], "tool");
        assert_eq!(result["tool_call_id"], call["id"]);
        assert!(result["content"].as_str().unwrap().contains("hello.txt"));
        let (tools, routes) = input::tools(r.tools.as_deref().unwrap()).unwrap();
        assert!(tools
            .iter()
            .any(|t| t["function"]["name"] == "exec_command"));
        assert!(routes.route("multi_agent_v1__spawn_agent").is_some());
        assert!(!tools.iter().any(|t| t["type"] != "function"));
    }

    #[test]
    fn unsupported_fields_are_refused_by_name() {
        assert_eq!(
            refused(json!({"input": "x", "previous_response_id": "resp_1"})),
            "previous_response_id"
        );
        assert_eq!(
            refused(json!({"input": "x", "tool_choice": "sometimes"})),
            "tool_choice"
        );
        assert_eq!(
            refused(json!({"input": "x", "tool_choice": {"type": "function"}})),
            "tool_choice"
        );
        assert_eq!(
            refused(
                json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}})
            ),
            "text.format"
        );
        assert_eq!(
            refused(json!({"input": "x", "text": {"format": {"type": "yaml"}}})),
            "text.format"
        );
        // Structured output and forced calls are enforced, not refused.
        let r = req(json!({"input": "x", "tool_choice": "required",
            "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}}}))
        .unwrap();
        assert_eq!(
            tool_choice(r.tool_choice.as_ref()).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            text_format(r.text.as_ref()).unwrap(),
            Some(Constraint::Json(json!({"type": "object"})))
        );
        assert_eq!(
            refused(json!({"input": "x", "truncation": "auto"})),
            "truncation"
        );
        assert_eq!(
            refused(json!({"input": "x", "background": true})),
            "background"
        );
        assert_eq!(
            refused(json!({"input": "x", "include": ["message.output_text.logprobs"]})),
            "include"
        );
        assert_eq!(
            refused(json!({"input": "x", "reasoning": {"effort": "huge"}})),
            "reasoning.effort"
        );
        assert_eq!(
            refused(json!({"input": "x", "frequency_penalty": 1})),
            "frequency_penalty"
        );
        let ok = req(json!({"input": "x", "prompt_cache_key": "k", "user": "u", "truncation": "disabled",
            "text": {"format": {"type": "text"}, "verbosity": "low"}, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "minimal", "summary": "auto"}, "store": false, "tool_choice": "none"}))
        .unwrap();
        assert_eq!(thinking(ok.reasoning.as_ref()).unwrap(), Some(false));
        assert_eq!(
            tool_choice(ok.tool_choice.as_ref()).unwrap(),
            ToolChoice::None
        );
    }
}

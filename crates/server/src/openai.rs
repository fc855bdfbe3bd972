//! OpenAI API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use slipstream_engine::FinishReason;
use tokio::sync::mpsc;

use crate::constrain::{openai_format, openai_logprobs, tool_constraint, Constraint};
use crate::error::{parse_body, ApiError, Flavor};
use crate::fields::{
    openai_tool_choice, refuse_unknown, tool_form, top_logprobs, unsupported, OPENAI_IGNORED,
};
use crate::gen::{pump, spawn_sse, submit, Gen, GenParams, Outcome, Step};
use crate::parse::{OutputEvent, ToolCall};
use crate::prompt::{content_text, merge_system_messages, template_kwargs, Conversation};
use crate::sampling::{resolve, RequestSampling};
use crate::App;

const F: Flavor = Flavor::OpenAi;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    One(String),
    Many(Vec<String>),
}

impl StopSpec {
    fn into_vec(self) -> Vec<String> {
        match self {
            StopSpec::One(s) => vec![s],
            StopSpec::Many(v) => v,
        }
    }
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    #[serde(default)]
    pub content: Value,
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
    /// The turn's reasoning, as vLLM/SGLang/llama.cpp name it...
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// ...and as OpenRouter/Ollama and newer vLLM name it.
    #[serde(default)]
    pub reasoning: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// `temperature`, `top_p`, `top_k`, `min_p`, the penalties and `seed`.
    #[serde(flatten)]
    pub sampling: RequestSampling,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub stop: Option<StopSpec>,
    pub n: Option<u32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub chat_template_kwargs: Option<Value>,
    /// Thinking on or off (vLLM/SGLang's top-level form).
    pub enable_thinking: Option<bool>,
    /// `none` or `minimal`: thinking off; `low`, `medium`, `high`,
    /// `xhigh`: on (this server has no finer control of its length).
    pub reasoning_effort: Option<String>,
    /// Return each output token's log probability.
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely tokens per position (0-20).
    pub top_logprobs: Option<usize>,
    /// `text`, `json_object` or `json_schema`: enforced by constrained
    /// decoding (see `constrain.rs`).
    pub response_format: Option<Value>,
    /// `false`: a forced tool call is exactly one call.
    pub parallel_tool_calls: Option<bool>,
    /// Refused unless empty: token biases are not applied.
    pub logit_bias: Option<Map<String, Value>>,
    /// Fields not named here: refused unless in `OPENAI_IGNORED`.
    #[serde(flatten)]
    pub unknown: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptSpec {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    #[serde(default)]
    pub model: String,
    pub prompt: PromptSpec,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// `temperature`, `top_p`, `top_k`, `min_p`, the penalties and `seed`.
    #[serde(flatten)]
    pub sampling: RequestSampling,
    pub max_tokens: Option<usize>,
    pub stop: Option<StopSpec>,
    pub n: Option<u32>,
    /// Refused unless empty: token biases are not applied.
    pub logit_bias: Option<Map<String, Value>>,
    /// Fields not named here (`best_of`, `echo`, `suffix`, `logprobs`):
    /// refused unless in `OPENAI_IGNORED`.
    #[serde(flatten)]
    pub unknown: Map<String, Value>,
}

/// What both endpoints refuse: fields they do not know, another model,
/// more than one choice (`n`) and a non-empty `logit_bias`.
fn check_request(
    app: &App,
    model: &str,
    unknown: &Map<String, Value>,
    n: Option<u32>,
    logit_bias: Option<&Map<String, Value>>,
) -> Result<(), ApiError> {
    refuse_unknown(F, unknown, OPENAI_IGNORED)?;
    app.check_model(model, F)?;
    if n.unwrap_or(1) != 1 {
        return Err(ApiError::bad_request(F, "only n = 1 is supported").param("n"));
    }
    match logit_bias {
        Some(b) if !b.is_empty() => Err(unsupported(
            F,
            "logit_bias",
            "token biases are not applied; send an empty object or leave it out",
        )),
        _ => Ok(()),
    }
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A fresh random-looking id.
pub fn new_id(prefix: &str) -> String {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    format!("{prefix}{:016x}", h.finish())
}

/// The request's stop sequences (at most 16).
fn stops(spec: Option<StopSpec>) -> Result<Vec<String>, ApiError> {
    let stops = spec.map(StopSpec::into_vec).unwrap_or_default();
    if stops.len() > 16 {
        return Err(ApiError::bad_request(F, "at most 16 stop sequences").param("stop"));
    }
    Ok(stops)
}

fn finish_reason(o: &Outcome, tool_calls: usize) -> &'static str {
    match o.finish {
        FinishReason::Length => "length",
        _ if tool_calls > 0 => "tool_calls",
        _ => "stop",
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.completion_tokens,
        "total_tokens": o.prompt_tokens + o.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": o.stats.reused_prompt_tokens},
    })
}

/// The OpenAI wire form of a parsed tool call (the arguments as the stream
/// wrote them: unfinished JSON for a call the token limit cut).
pub fn tool_call_json(call: &ToolCall, index: usize, id: &str) -> Value {
    json!({
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments_json},
    })
}

/// Maps an OpenAI chat request to a conversation.
pub fn conversation(req: &ChatRequest) -> Result<Conversation, ApiError> {
    let mut messages = Vec::new();
    for (i, m) in req.messages.iter().enumerate() {
        let what = format!("messages[{i}]");
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            r => {
                return Err(ApiError::bad_request(
                    F,
                    format!(
                        "{what}: unknown role `{r}` (system, developer, user, assistant, tool)"
                    ),
                )
                .param(format!("{what}.role")))
            }
        };
        let content = content_text(&m.content, &what)
            .map_err(|e| ApiError::bad_request(F, e).param(format!("{what}.content")))?;
        let mut msg = Map::new();
        msg.insert("role".into(), role.into());
        msg.insert("content".into(), content.into());
        if let Some(calls) = &m.tool_calls {
            let mut out = Vec::new();
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").ok_or_else(|| {
                    ApiError::bad_request(F, format!("{what}.tool_calls[{j}] has no `function`"))
                })?;
                let name = f.get("name").and_then(Value::as_str).ok_or_else(|| {
                    ApiError::bad_request(
                        F,
                        format!("{what}.tool_calls[{j}].function has no `name`"),
                    )
                })?;
                // Templates iterate arguments as a mapping: parse the string.
                let args = match f.get("arguments") {
                    Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                        .ok()
                        .filter(Value::is_object)
                        .unwrap_or_else(|| json!({})),
                    Some(o @ Value::Object(_)) => o.clone(),
                    _ => json!({}),
                };
                out.push(json!({
                    "type": "function",
                    "id": c.get("id").cloned().unwrap_or(Value::Null),
                    "function": {"name": name, "arguments": args},
                }));
            }
            msg.insert("tool_calls".into(), Value::Array(out));
        }
        if let Some(id) = &m.tool_call_id {
            msg.insert("tool_call_id".into(), id.clone().into());
        }
        if let Some(n) = &m.name {
            msg.insert("name".into(), n.clone().into());
        }
        if let Some(r) = m.reasoning_content.as_ref().or(m.reasoning.as_ref()) {
            msg.insert("reasoning_content".into(), r.clone().into());
        }
        messages.push(Value::Object(msg));
    }
    if messages.is_empty() {
        return Err(ApiError::bad_request(F, "messages must not be empty").param("messages"));
    }
    let messages = merge_system_messages(messages);
    let tool_choice_none = req
        .tool_choice
        .as_ref()
        .is_some_and(|c| c.as_str() == Some("none"));
    let mut tools = Vec::new();
    if !tool_choice_none {
        for (i, t) in req.tools.iter().flatten().enumerate() {
            let name = t
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            if name.is_none() {
                return Err(ApiError::bad_request(
                    F,
                    format!("tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                )
                .param(format!("tools[{i}]")));
            }
            tools.push(t.clone());
        }
    }
    let mut extra = match &req.chat_template_kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(v) => template_kwargs(v.clone(), "chat_template_kwargs")
            .map_err(|e| ApiError::bad_request(F, e).param("chat_template_kwargs"))?,
    };
    let effort_thinking = match req.reasoning_effort.as_deref() {
        None => None,
        Some("none" | "minimal") => Some(false),
        Some("low" | "medium" | "high" | "xhigh") => Some(true),
        Some(other) => {
            return Err(ApiError::bad_request(
                F,
                format!(
                    "reasoning_effort: unknown `{other}` (none, minimal, low, medium, high, xhigh)"
                ),
            )
            .param("reasoning_effort"))
        }
    };
    // The most specific setting wins: the template's own variable, then
    // the top-level switch, then the effort.
    let enable_thinking = extra
        .remove("enable_thinking")
        .and_then(|v| v.as_bool())
        .or(req.enable_thinking)
        .or(effort_thinking);
    Ok(Conversation {
        messages,
        tools,
        enable_thinking,
        extra,
    })
}

/// What a chat request forces: a tool call (`tool_choice` required or
/// named) over a `response_format`.
fn chat_constraint(
    app: &App,
    req: &ChatRequest,
    tools: &[Value],
) -> Result<Option<Constraint>, ApiError> {
    let choice = openai_tool_choice(req.tool_choice.as_ref(), false)
        .map_err(|e| ApiError::bad_request(F, format!("tool_choice: {e}")).param("tool_choice"))?;
    let single = req.parallel_tool_calls == Some(false);
    if let Some(c) = tool_constraint(&choice, tools, single, tool_form(app))
        .map_err(|e| ApiError::bad_request(F, format!("tool_choice {e}")).param("tool_choice"))?
    {
        return Ok(Some(c));
    }
    match &req.response_format {
        None => Ok(None),
        Some(f) => openai_format(f, false).map_err(|e| {
            ApiError::bad_request(F, format!("response_format: {e}")).param("response_format")
        }),
    }
}

pub async fn chat_completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: ChatRequest = parse_body(F, body)?;
    check_request(
        &app,
        &req.model,
        &req.unknown,
        req.n,
        req.logit_bias.as_ref(),
    )?;
    let conv = conversation(&req)?;
    let rendered = app.render(&conv, F)?;
    let constraint = chat_constraint(&app, &req, &conv.tools)?;
    let stop = stops(req.stop)?;
    let top = top_logprobs(F, req.top_logprobs)?;
    let logprobs = req.logprobs.unwrap_or(false).then_some(top);
    if logprobs.is_none() && top > 0 {
        return Err(
            ApiError::bad_request(F, "top_logprobs needs logprobs: true").param("top_logprobs"),
        );
    }
    let params = GenParams {
        prompt_text: rendered.text,
        reply_opening: rendered.reply_opening,
        max_tokens: req.max_completion_tokens.or(req.max_tokens),
        sampling: resolve(F, &req.sampling, &app.config.sampling, &app.info.generation)?,
        stop,
        parse: true,
        parse_tools: !conv.tools.is_empty(),
        in_reasoning: rendered.in_reasoning,
        reasoning_budget: None,
        tools: conv.tools.clone(),
        constraint,
        logprobs,
    };
    let mut gen = submit(&app, F, params)?;
    let model = app.config.model_id.clone();
    let with_logprobs = logprobs.is_some();
    if req.stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        return Ok(spawn_sse(|tx| {
            stream_chat(app, gen, tx, model, include_usage, with_logprobs)
        }));
    }
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    let outcome = gen
        .collect(|ev| match ev {
            OutputEvent::Content(t) => content.push_str(&t),
            OutputEvent::Reasoning(t) => reasoning.push_str(&t),
            OutputEvent::ToolCallEnd(c) => {
                let i = calls.len();
                calls.push(tool_call_json(&c, i, &new_id("call_")));
            }
            OutputEvent::ToolCallStart { .. } | OutputEvent::ToolCallArgs(_) => {}
        })
        .await
        .map_err(|e| ApiError::internal(F, e))?;
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        // Clients read one name or the other.
        message["reasoning_content"] = reasoning.clone().into();
        message["reasoning"] = reasoning.into();
    }
    if !calls.is_empty() {
        if content.is_empty() {
            message["content"] = Value::Null;
        }
        for c in calls.iter_mut() {
            if let Some(o) = c.as_object_mut() {
                o.remove("index");
            }
        }
        message["tool_calls"] = Value::Array(calls.clone());
    }
    let logprobs = if with_logprobs {
        let entries = gen.take_logprobs();
        json!({"content": openai_logprobs(&entries, &|id| gen.token_bytes(id)), "refusal": null})
    } else {
        Value::Null
    };
    Ok(Json(json!({
        "id": new_id("chatcmpl-"),
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason(&outcome, calls.len()),
        }],
        "usage": usage(&outcome),
        "slipstream": outcome.figures(),
    }))
    .into_response())
}

fn data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// A stream's last messages: the chunk with the finish reason, the usage
/// chunk when the client asked for it, then `[DONE]`.
fn stream_end(last: String, usage: Option<Value>) -> Vec<String> {
    let mut v = vec![last];
    v.extend(usage.as_ref().map(data));
    v.push("data: [DONE]\n\n".into());
    v
}

async fn stream_chat(
    app: Arc<App>,
    gen: Gen,
    tx: mpsc::Sender<String>,
    model: String,
    include_usage: bool,
    with_logprobs: bool,
) {
    let id = new_id("chatcmpl-");
    let created = now();
    let chunk_with = |delta: Value, finish: Value, logprobs: Value| {
        data(&json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }))
    };
    let chunk = |delta: Value, finish: Value| chunk_with(delta, finish, Value::Null);
    if tx
        .send(chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        ))
        .await
        .is_err()
    {
        return;
    }
    let mut calls = 0usize;
    let interval = app.config.ping_interval;
    pump(gen, tx, ": ping\n\n", interval, |step, gen| match step {
        Step::Started => (Vec::new(), false),
        Step::Output(evs) => {
            // The tokens since the last chunk ride on its first piece.
            let entries = gen.take_logprobs();
            let mut logprobs = (with_logprobs && !entries.is_empty()).then(|| {
                json!({"content": openai_logprobs(&entries, &|i| gen.token_bytes(i)), "refusal": null})
            });
            let deltas: Vec<Value> = evs
                .into_iter()
                .filter_map(|ev| match ev {
                    OutputEvent::Content(t) => Some(json!({"content": t})),
                    OutputEvent::Reasoning(t) => {
                        Some(json!({"reasoning_content": t, "reasoning": t}))
                    }
                    OutputEvent::ToolCallStart { name } => {
                        calls += 1;
                        let call = json!({"index": calls - 1, "id": new_id("call_"),
                            "type": "function", "function": {"name": name, "arguments": ""}});
                        Some(json!({"tool_calls": [call]}))
                    }
                    OutputEvent::ToolCallArgs(piece) => {
                        let call = json!({"index": calls.saturating_sub(1),
                            "function": {"arguments": piece}});
                        Some(json!({"tool_calls": [call]}))
                    }
                    OutputEvent::ToolCallEnd(_) => None,
                })
                .collect();
            let msgs = deltas
                .into_iter()
                .map(|d| chunk_with(d, Value::Null, logprobs.take().unwrap_or(Value::Null)))
                .collect();
            (msgs, false)
        }
        Step::Done(o) => {
            let last = chunk(json!({}), finish_reason(&o, calls).into());
            let usage = include_usage.then(|| {
                json!({
                    "id": id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [], "usage": usage(&o),
                    "slipstream": o.figures(),
                })
            });
            (stream_end(last, usage), true)
        }
        Step::Failed(e) => (vec![data(&ApiError::internal(F, e).body())], true),
    })
    .await;
}

pub async fn completions(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(F, body)?;
    check_request(
        &app,
        &req.model,
        &req.unknown,
        req.n,
        req.logit_bias.as_ref(),
    )?;
    let prompt = match req.prompt {
        PromptSpec::One(s) => s,
        PromptSpec::Many(mut v) if v.len() == 1 => v.remove(0),
        PromptSpec::Many(_) => {
            return Err(
                ApiError::bad_request(F, "only one prompt per request is supported")
                    .param("prompt"),
            )
        }
    };
    let params = GenParams {
        prompt_text: prompt,
        reply_opening: String::new(),
        max_tokens: Some(req.max_tokens.unwrap_or(16)),
        sampling: resolve(F, &req.sampling, &app.config.sampling, &app.info.generation)?,
        stop: stops(req.stop)?,
        parse: false,
        parse_tools: false,
        in_reasoning: false,
        reasoning_budget: None,
        tools: Vec::new(),
        constraint: None,
        logprobs: None,
    };
    let mut gen = submit(&app, F, params)?;
    let model = app.config.model_id.clone();
    let id = new_id("cmpl-");
    let created = now();
    if req.stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let interval = app.config.ping_interval;
        return Ok(spawn_sse(move |tx| async move {
            let chunk = |text: &str, finish: Value| {
                data(
                    &json!({"id": id, "object": "text_completion", "created": created,
                    "model": model, "choices": [{"index": 0, "text": text, "logprobs": null,
                    "finish_reason": finish}]}),
                )
            };
            pump(gen, tx, ": ping\n\n", interval, |step, _| match step {
                Step::Started => (Vec::new(), false),
                Step::Output(evs) => {
                    let msgs = evs
                        .into_iter()
                        .filter_map(|e| match e {
                            OutputEvent::Content(t) => Some(chunk(&t, Value::Null)),
                            _ => None,
                        })
                        .collect();
                    (msgs, false)
                }
                Step::Done(o) => {
                    let last = chunk("", finish_reason(&o, 0).into());
                    let usage = include_usage.then(|| {
                        json!({"id": id, "object": "text_completion", "created": created,
                            "model": model, "choices": [], "usage": usage(&o)})
                    });
                    (stream_end(last, usage), true)
                }
                Step::Failed(e) => (vec![data(&ApiError::internal(F, e).body())], true),
            })
            .await;
        }));
    }
    let mut text = String::new();
    let outcome = gen
        .collect(|e| {
            if let OutputEvent::Content(t) = e {
                text.push_str(&t);
            }
        })
        .await
        .map_err(|e| ApiError::internal(F, e))?;
    Ok(Json(json!({
        "id": id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": null,
            "finish_reason": finish_reason(&outcome, 0)}],
        "usage": usage(&outcome),
        "slipstream": outcome.figures(),
    }))
    .into_response())
}

fn model_json(app: &App) -> Value {
    json!({
        "id": app.config.model_id,
        "object": "model",
        "created": now(),
        "owned_by": "slipstream",
        "max_context": app.max_context,
    })
}

pub async fn models(State(app): State<Arc<App>>) -> Response {
    Json(json!({"object": "list", "data": [model_json(&app)]})).into_response()
}

pub async fn model(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.config.model_id || app.config.any_model {
        Json(model_json(&app)).into_response()
    } else {
        ApiError::not_found(F, format!("the model `{id}` does not exist"))
            .code("model_not_found")
            .into_response()
    }
}

//! Anthropic API: `/v1/messages` (streaming and not) and
//! `/v1/messages/count_tokens`. What a request may hold and how it maps to
//! a conversation: `anthropic_request.rs`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use slipstream_engine::{Bounded, FinishReason};
use tokio::sync::mpsc;

use crate::anthropic_request::output_format;
use crate::anthropic_request::REASONING_SIGNATURE;
pub use crate::anthropic_request::{conversation, Mapped, Message, MessagesRequest, Thinking};
use crate::constrain::tool_constraint;
use crate::error::{parse_body, ApiError, Flavor};
use crate::fields::{anthropic_tool_choice, refuse_unknown, tool_form, ANTHROPIC_IGNORED};
use crate::gen::{pump, spawn_sse, submit, Gen, GenParams, Outcome, Step};
use crate::openai::new_id;
use crate::parse::{OutputEvent, ToolCall};
use crate::prompt::Rendered;
use crate::sampling::{resolve, RequestSampling};
use crate::App;

const F: Flavor = Flavor::Anthropic;

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(F, msg)
}

fn rendered(app: &App, req: &MessagesRequest) -> Result<(Rendered, Mapped), ApiError> {
    app.check_model(&req.model, F)?;
    let mapped = conversation(req)?;
    let r = app.render(&mapped.conv, F)?;
    Ok((r, mapped))
}

pub async fn count_tokens(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let r = (|| {
        let req: MessagesRequest = parse_body(F, body)?;
        let (r, _) = rendered(&app, &req)?;
        // Counts past the context are useful (a client sizes its
        // compaction by them), but bounded: twice the model's positions.
        let most = app.info.max_position.saturating_mul(2);
        let n = match app
            .codec
            .encode_within(&r.text, most)
            .map_err(|e| bad(e.to_string()))?
        {
            Bounded::Fits(ids) => ids.len(),
            Bounded::TooLong { .. } => {
                return Err(bad(format!(
                    "the prompt is more than {most} tokens, twice what this model can take; not counted further"
                ))
                .code("context_length_exceeded"))
            }
        };
        Ok::<_, ApiError>(Json(json!({"input_tokens": n})).into_response())
    })();
    r.unwrap_or_else(IntoResponse::into_response)
}

fn stop_reason(o: &Outcome, tool_calls: usize) -> &'static str {
    match o.finish {
        FinishReason::Length => "max_tokens",
        _ if o.stop_string.is_some() => "stop_sequence",
        _ if tool_calls > 0 => "tool_use",
        _ => "end_turn",
    }
}

fn usage(o: &Outcome) -> Value {
    let reused = o.stats.reused_prompt_tokens.min(o.prompt_tokens);
    json!({
        "input_tokens": o.prompt_tokens - reused,
        "output_tokens": o.completion_tokens,
        "cache_read_input_tokens": reused,
        "cache_creation_input_tokens": 0,
    })
}

/// A finished call's block (a cut call's `input` holds what was written,
/// the last value as far as it went).
fn tool_use_block(c: &ToolCall) -> Value {
    json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name, "input": c.arguments})
}

pub async fn messages(
    State(app): State<Arc<App>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(F, body)?;
    refuse_unknown(F, &req.unknown, ANTHROPIC_IGNORED)?;
    let Some(max_tokens) = req.max_tokens else {
        return Err(bad("max_tokens: field required"));
    };
    if max_tokens == 0 {
        return Err(bad("max_tokens: must be at least 1"));
    }
    let (r, mapped) = rendered(&app, &req)?;
    let stop = req.stop_sequences.clone().unwrap_or_default();
    let mut tools = mapped.conv.tools.clone();
    tools.extend(mapped.deferred_tools.iter().cloned());
    let omit = mapped.thinking.omit;
    let (choice, single) = anthropic_tool_choice(req.tool_choice.as_ref())
        .map_err(|e| bad(format!("tool_choice: {e}")))?;
    // A forced call goes to the tools in the prompt (deferred ones are
    // not the model's to call until a search brings them in).
    let constraint = match tool_constraint(&choice, &mapped.conv.tools, single, tool_form(&app))
        .map_err(|e| bad(format!("tool_choice {e}")))?
    {
        Some(c) => Some(c),
        None => output_format(&req)?,
    };
    let params = GenParams {
        prompt_text: r.text,
        reply_opening: r.reply_opening,
        max_tokens: Some(max_tokens),
        sampling: resolve(
            F,
            &RequestSampling {
                temperature: req.temperature,
                top_p: req.top_p,
                top_k: req.top_k,
                ..Default::default()
            },
            &app.config.sampling,
            &app.info.generation,
        )?,
        stop,
        parse: true,
        parse_tools: !tools.is_empty(),
        in_reasoning: r.in_reasoning,
        reasoning_budget: mapped.thinking.budget.filter(|_| r.in_reasoning),
        tools,
        constraint,
        logprobs: None,
    };
    let mut gen = submit(&app, F, params)?;
    let model = app.config.model_id.clone();
    let id = new_id("msg_");
    if req.stream {
        let writer = EventWriter {
            omit_reasoning: omit,
            ..Default::default()
        };
        return Ok(spawn_sse(|tx| {
            stream_messages(app, gen, tx, model, id, writer)
        }));
    }
    let mut content: Vec<Value> = Vec::new();
    let mut calls = 0;
    let outcome = gen
        .collect(|ev| {
            let last_type = content
                .last()
                .and_then(|b| b.get("type"))
                .and_then(Value::as_str)
                .map(str::to_string);
            match ev {
                OutputEvent::Content(t) => {
                    if last_type.as_deref() == Some("text") {
                        append(content.last_mut(), "text", &t);
                    } else {
                        content.push(json!({"type": "text", "text": t}));
                    }
                }
                OutputEvent::Reasoning(t) => {
                    // Omitted reasoning travels in the signature.
                    let key = if omit { "signature" } else { "thinking" };
                    if last_type.as_deref() == Some("thinking") {
                        append(content.last_mut(), key, &t);
                    } else {
                        let mut block =
                            json!({"type": "thinking", "thinking": "", "signature": ""});
                        block[key] = if omit {
                            format!("{REASONING_SIGNATURE}{t}").into()
                        } else {
                            t.into()
                        };
                        content.push(block);
                    }
                }
                OutputEvent::ToolCallEnd(c) => {
                    calls += 1;
                    content.push(tool_use_block(&c));
                }
                OutputEvent::ToolCallStart { .. } | OutputEvent::ToolCallArgs(_) => {}
            }
        })
        .await
        .map_err(|e| ApiError::internal(F, e))?;
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(&outcome, calls),
        "stop_sequence": outcome.stop_string,
        "usage": usage(&outcome),
        "slipstream": outcome.figures(),
    }))
    .into_response())
}

fn append(block: Option<&mut Value>, key: &str, t: &str) {
    if let Some(Value::String(s)) = block.and_then(|b| b.get_mut(key)) {
        s.push_str(t);
    }
}

fn event(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

#[derive(PartialEq, Clone, Copy)]
enum Open {
    None,
    Text,
    Thinking,
    ToolUse,
}

/// Builds the event sequence of a streamed message.
pub struct EventWriter {
    index: usize,
    open: Open,
    pub tool_calls: usize,
    /// `display: "omitted"`: reasoning is sent in the block's signature at
    /// its end (see [`REASONING_SIGNATURE`]), not as thinking deltas.
    pub omit_reasoning: bool,
    /// Reasoning of the open block, kept while `omit_reasoning`.
    reasoning: String,
}

impl Default for EventWriter {
    fn default() -> Self {
        EventWriter {
            index: 0,
            open: Open::None,
            tool_calls: 0,
            omit_reasoning: false,
            reasoning: String::new(),
        }
    }
}

impl EventWriter {
    fn close(&mut self, out: &mut Vec<String>) {
        if self.open == Open::None {
            return;
        }
        if self.open == Open::Thinking {
            let signature = if self.omit_reasoning {
                format!(
                    "{REASONING_SIGNATURE}{}",
                    std::mem::take(&mut self.reasoning)
                )
            } else {
                String::new()
            };
            out.push(event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "signature_delta", "signature": signature}}),
            ));
        }
        out.push(event(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": self.index}),
        ));
        self.index += 1;
        self.open = Open::None;
    }

    fn open(&mut self, kind: Open, out: &mut Vec<String>) {
        if self.open == kind {
            return;
        }
        self.close(out);
        let block = match kind {
            Open::Text => json!({"type": "text", "text": ""}),
            _ => json!({"type": "thinking", "thinking": "", "signature": ""}),
        };
        out.push(event(
            "content_block_start",
            &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
        ));
        self.open = kind;
    }

    /// The events of parsed output.
    pub fn output(&mut self, ev: OutputEvent) -> Vec<String> {
        let mut out = Vec::new();
        match ev {
            OutputEvent::Content(t) => {
                self.open(Open::Text, &mut out);
                out.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": t}}),
                ));
            }
            OutputEvent::Reasoning(t) => {
                self.open(Open::Thinking, &mut out);
                if self.omit_reasoning {
                    self.reasoning.push_str(&t);
                    return out;
                }
                out.push(event(
                    "content_block_delta",
                    &json!({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": t}}),
                ));
            }
            OutputEvent::ToolCallStart { name } => {
                self.close(&mut out);
                self.tool_calls += 1;
                let block =
                    json!({"type": "tool_use", "id": new_id("toolu_"), "name": name, "input": {}});
                out.push(event(
                    "content_block_start",
                    &json!({"type": "content_block_start", "index": self.index, "content_block": block}),
                ));
                self.open = Open::ToolUse;
            }
            OutputEvent::ToolCallArgs(piece) => out.push(event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": self.index,
                    "delta": {"type": "input_json_delta", "partial_json": piece}}),
            )),
            OutputEvent::ToolCallEnd(_) => self.close(&mut out),
        }
        out
    }

    /// The closing events.
    pub fn finish(&mut self, o: &Outcome) -> Vec<String> {
        let mut out = Vec::new();
        self.close(&mut out);
        out.push(event(
            "message_delta",
            &json!({"type": "message_delta",
                "delta": {"stop_reason": stop_reason(o, self.tool_calls), "stop_sequence": o.stop_string},
                "usage": usage(o), "slipstream": o.figures()}),
        ));
        out.push(event("message_stop", &json!({"type": "message_stop"})));
        out
    }
}

/// `message_start` of a stream.
pub fn message_start(id: &str, model: &str, prompt_tokens: usize) -> String {
    event(
        "message_start",
        &json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        }}),
    )
}

async fn stream_messages(
    app: Arc<App>,
    gen: Gen,
    tx: mpsc::Sender<String>,
    model: String,
    id: String,
    mut w: EventWriter,
) {
    let ping = event("ping", &json!({"type": "ping"}));
    let start = message_start(&id, &model, gen.prompt_tokens);
    if tx.send(start).await.is_err() || tx.send(ping.clone()).await.is_err() {
        return;
    }
    let interval = app.config.ping_interval;
    pump(gen, tx, &ping, interval, |step, _| match step {
        Step::Started => (Vec::new(), false),
        Step::Output(evs) => (evs.into_iter().flat_map(|e| w.output(e)).collect(), false),
        Step::Done(o) => (w.finish(&o), true),
        Step::Failed(e) => {
            let err = ApiError::internal(F, e);
            (vec![event("error", &err.body())], true)
        }
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use slipstream_engine::GenerationStats;

    fn parse_events(s: &[String]) -> Vec<(String, Value)> {
        s.iter()
            .map(|e| {
                let mut lines = e.lines();
                let name = lines.next().unwrap().strip_prefix("event: ").unwrap();
                let data = lines.next().unwrap().strip_prefix("data: ").unwrap();
                (name.to_string(), serde_json::from_str(data).unwrap())
            })
            .collect()
    }

    #[test]
    fn stream_event_sequence_with_thinking_text_and_tool_use() {
        let mut p = crate::parse::OutputParser::new(true, true);
        let mut w = EventWriter::default();
        let mut out = Vec::new();
        for piece in [
            "pondering",
            "\n</thi",
            "nk>\n\nLet me look.\n<tool_",
            "call>\n<function=ls>\n<parameter=path>\n/tmp\n</parameter>\n</function>\n</tool_call>",
        ] {
            for ev in p.push(piece) {
                out.extend(w.output(ev));
            }
        }
        for ev in p.finish() {
            out.extend(w.output(ev));
        }
        let o = Outcome {
            finish: FinishReason::Stop,
            stop_string: None,
            prompt_tokens: 10,
            completion_tokens: 5,
            stats: GenerationStats::default(),
        };
        out.extend(w.finish(&o));
        let ev = parse_events(&out);
        let names: Vec<&str> = ev.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(ev[0].1["content_block"]["type"], "thinking");
        assert_eq!(ev[1].1["delta"]["thinking"], "pondering");
        assert_eq!(ev[4].1["content_block"]["type"], "text");
        assert_eq!(ev[5].1["delta"]["text"], "Let me look.\n");
        assert_eq!(ev[7].1["index"], 2);
        assert_eq!(ev[7].1["content_block"]["name"], "ls");
        let args: Value =
            serde_json::from_str(ev[8].1["delta"]["partial_json"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"path": "/tmp"}));
        assert_eq!(ev[10].1["delta"]["stop_reason"], "tool_use");
        assert_eq!(ev[10].1["usage"]["output_tokens"], 5);
    }

    #[test]
    fn omitted_reasoning_travels_in_the_signature() {
        let mut w = EventWriter {
            omit_reasoning: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        out.extend(w.output(OutputEvent::Reasoning("step one, ".into())));
        out.extend(w.output(OutputEvent::Reasoning("step two".into())));
        out.extend(w.output(OutputEvent::Content("Done.".into())));
        let ev = parse_events(&out);
        let deltas: Vec<&Value> = ev.iter().map(|(_, v)| &v["delta"]).collect();
        assert!(deltas.iter().all(|d| d.get("thinking").is_none()), "{ev:?}");
        assert_eq!(ev[0].1["content_block"]["type"], "thinking");
        assert_eq!(ev[1].1["delta"]["type"], "signature_delta");
        assert_eq!(
            ev[1].1["delta"]["signature"],
            format!("{REASONING_SIGNATURE}step one, step two")
        );
        assert_eq!(ev[4].1["delta"]["text"], "Done.");
    }
}

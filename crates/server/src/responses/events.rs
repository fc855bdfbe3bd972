//! Builds a Response from parsed model output, item by item, with the
//! stream events that announce each step. The non-streaming handler runs
//! the same writer and keeps only the final Response, so both forms agree.

use serde_json::{json, Value};
use slipstream_engine::FinishReason;

use super::input::ToolRoutes;
use crate::gen::Outcome;
use crate::openai::{new_id, now};
use crate::parse::{OutputEvent, ToolCall};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    /// A `message` item with one `output_text` part.
    Message,
    /// A `reasoning` item with one `reasoning_text` part.
    Reasoning,
}

/// The item being written.
#[derive(Debug)]
struct Open {
    kind: Kind,
    id: String,
    text: String,
}

/// The function call being written: its item, arguments so far in
/// `item["arguments"]`.
#[derive(Debug)]
struct OpenCall {
    item: Value,
    arguments: String,
}

/// One Response as it is written. Events are JSON objects with `type` and
/// `sequence_number` (see [`sse`]).
#[derive(Debug)]
pub struct ResponseWriter {
    /// The Response with the request's settings echoed and no output yet.
    base: Value,
    seq: u64,
    /// Finished items, in output order.
    output: Vec<Value>,
    open: Option<Open>,
    routes: ToolRoutes,
    /// Function calls that may still be returned (`parallel_tool_calls`,
    /// `max_tool_calls`); later ones are dropped.
    calls_left: usize,
    /// The call being written; `None` inside a dropped one.
    call: Option<OpenCall>,
}

/// An event as an SSE message.
pub fn sse(event: &Value) -> String {
    let kind = event.get("type").and_then(Value::as_str).unwrap_or("error");
    format!("event: {kind}\ndata: {event}\n\n")
}

fn usage(o: &Outcome, reasoning_tokens: usize) -> Value {
    json!({
        "input_tokens": o.prompt_tokens,
        "input_tokens_details": {"cached_tokens": o.stats.reused_prompt_tokens.min(o.prompt_tokens)},
        "output_tokens": o.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens.min(o.completion_tokens)},
        "total_tokens": o.prompt_tokens + o.completion_tokens,
    })
}

impl ResponseWriter {
    /// `base`: a Response object (`id`, `status`, echoed settings...).
    pub fn new(base: Value, routes: ToolRoutes, max_calls: usize) -> Self {
        ResponseWriter {
            base,
            seq: 0,
            output: Vec::new(),
            open: None,
            routes,
            calls_left: max_calls,
            call: None,
        }
    }

    fn push(&mut self, out: &mut Vec<Value>, kind: &str, mut body: Value) {
        body["type"] = kind.into();
        body["sequence_number"] = self.seq.into();
        self.seq += 1;
        out.push(body);
    }

    /// `response.output_item.added` or `.done` of `item`, the next output.
    fn item_event(&mut self, out: &mut Vec<Value>, kind: &str, item: &Value) {
        let index = self.output.len();
        self.push(out, kind, json!({"output_index": index, "item": item}));
    }

    /// The Response in its present state.
    fn response(&self, status: &str) -> Value {
        let mut r = self.base.clone();
        r["status"] = status.into();
        r["output"] = Value::Array(self.output.clone());
        r
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        let r = self.response("in_progress");
        self.push(&mut out, "response.created", json!({"response": r}));
        self.push(&mut out, "response.in_progress", json!({"response": r}));
        out
    }

    fn item_json(&self, open: &Open, status: &str) -> Value {
        match open.kind {
            Kind::Message => json!({
                "id": open.id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": open.text, "annotations": [], "logprobs": []}],
            }),
            Kind::Reasoning => json!({
                "id": open.id, "type": "reasoning", "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": open.text}],
                "encrypted_content": null,
            }),
        }
    }

    /// Ends the open item, if any, with `status`.
    fn close(&mut self, status: &str, out: &mut Vec<Value>) {
        let Some(open) = self.open.take() else {
            return;
        };
        let index = self.output.len();
        let item = self.item_json(&open, status);
        let part = item["content"][0].clone();
        let done = match open.kind {
            Kind::Message => "response.output_text.done",
            Kind::Reasoning => "response.reasoning_text.done",
        };
        let at = json!({"item_id": open.id, "output_index": index, "content_index": 0});
        let mut d = at.clone();
        d["text"] = open.text.clone().into();
        if open.kind == Kind::Message {
            d["logprobs"] = json!([]);
        }
        self.push(out, done, d);
        let mut p = at;
        p["part"] = part;
        self.push(out, "response.content_part.done", p);
        self.item_event(out, "response.output_item.done", &item);
        self.output.push(item);
    }

    /// Appends text to an item of `kind`, opening one when needed.
    fn text(&mut self, kind: Kind, delta: String, out: &mut Vec<Value>) {
        if self.open.as_ref().is_some_and(|o| o.kind != kind) {
            self.close("completed", out);
        }
        let index = self.output.len();
        if self.open.is_none() {
            let prefix = if kind == Kind::Message { "msg_" } else { "rs_" };
            let open = Open {
                kind,
                id: new_id(prefix),
                text: String::new(),
            };
            let mut item = self.item_json(&open, "in_progress");
            let part = item["content"][0].clone();
            item["content"] = json!([]);
            self.item_event(out, "response.output_item.added", &item);
            self.push(
                out,
                "response.content_part.added",
                json!({"item_id": open.id, "output_index": index, "content_index": 0, "part": part}),
            );
            self.open = Some(open);
        }
        let Some(open) = self.open.as_mut() else {
            return;
        };
        open.text.push_str(&delta);
        let id = open.id.clone();
        let mut d =
            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta});
        let kind = match kind {
            Kind::Message => {
                d["logprobs"] = json!([]);
                "response.output_text.delta"
            }
            Kind::Reasoning => "response.reasoning_text.delta",
        };
        self.push(out, kind, d);
    }

    /// A call begins: `output_item.added`, unless it is over the limit.
    fn call_start(&mut self, name: String, out: &mut Vec<Value>) {
        if self.calls_left == 0 {
            tracing::debug!("dropped a call to `{name}`: over the request's tool call limit");
            return;
        }
        self.calls_left -= 1;
        self.close("completed", out);
        let mut item = json!({"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
            "call_id": new_id("call_"), "name": name, "arguments": ""});
        if let Some((namespace, name)) = self.routes.route(&name) {
            item["namespace"] = namespace.into();
            item["name"] = name.into();
        }
        self.item_event(out, "response.output_item.added", &item);
        self.call = Some(OpenCall {
            item,
            arguments: String::new(),
        });
    }

    fn call_args(&mut self, piece: String, out: &mut Vec<Value>) {
        let index = self.output.len();
        let Some(call) = self.call.as_mut() else {
            return;
        };
        call.arguments.push_str(&piece);
        let id = call.item["id"].clone();
        self.push(
            out,
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": index, "delta": piece}),
        );
    }

    /// A call ends: its arguments are done; a cut call's item is
    /// `incomplete`, its arguments unfinished JSON, as streamed.
    fn call_end(&mut self, c: &ToolCall, out: &mut Vec<Value>) {
        let Some(OpenCall {
            mut item,
            arguments,
        }) = self.call.take()
        else {
            return;
        };
        let index = self.output.len();
        self.push(
            out,
            "response.function_call_arguments.done",
            json!({"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": arguments}),
        );
        item["arguments"] = arguments.into();
        item["status"] = if c.cut { "incomplete" } else { "completed" }.into();
        self.item_event(out, "response.output_item.done", &item);
        self.output.push(item);
    }

    /// The events of one piece of parsed output.
    pub fn output(&mut self, ev: OutputEvent) -> Vec<Value> {
        let mut out = Vec::new();
        match ev {
            OutputEvent::Content(t) => self.text(Kind::Message, t, &mut out),
            OutputEvent::Reasoning(t) => self.text(Kind::Reasoning, t, &mut out),
            OutputEvent::ToolCallStart { name } => self.call_start(name, &mut out),
            OutputEvent::ToolCallArgs(piece) => self.call_args(piece, &mut out),
            OutputEvent::ToolCallEnd(c) => self.call_end(&c, &mut out),
        }
        out
    }

    /// All reasoning text written so far (to count its tokens).
    pub fn reasoning_text(&self) -> String {
        let mut s = String::new();
        for item in self.output.iter().filter(|i| i["type"] == "reasoning") {
            s.push_str(item["content"][0]["text"].as_str().unwrap_or_default());
        }
        if let Some(o) = self.open.as_ref().filter(|o| o.kind == Kind::Reasoning) {
            s.push_str(&o.text);
        }
        s
    }

    /// The closing events and the final Response: `completed`, or
    /// `incomplete` (`max_output_tokens`) when the token limit cut the
    /// output, the item it cut marked `incomplete`.
    pub fn finish(&mut self, o: &Outcome, reasoning_tokens: usize) -> (Vec<Value>, Value) {
        let mut out = Vec::new();
        let cut = o.finish == FinishReason::Length;
        self.close(if cut { "incomplete" } else { "completed" }, &mut out);
        let (status, kind) = if cut {
            ("incomplete", "response.incomplete")
        } else {
            ("completed", "response.completed")
        };
        let mut r = self.response(status);
        r["usage"] = usage(o, reasoning_tokens);
        if cut {
            r["incomplete_details"] = json!({"reason": "max_output_tokens"});
        } else {
            r["completed_at"] = now().into();
        }
        r["slipstream"] = o.figures();
        self.push(&mut out, kind, json!({"response": r}));
        (out, r)
    }

    /// `response.failed` for a generation that failed after it started.
    pub fn fail(&mut self, message: &str) -> Vec<Value> {
        let mut out = Vec::new();
        let mut r = self.response("failed");
        r["error"] = json!({"code": "server_error", "message": message});
        self.push(&mut out, "response.failed", json!({"response": r}));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse::OutputParser;
    use slipstream_engine::GenerationStats;

    fn outcome(finish: FinishReason) -> Outcome {
        Outcome {
            finish,
            stop_string: None,
            prompt_tokens: 10,
            completion_tokens: 7,
            stats: GenerationStats {
                reused_prompt_tokens: 4,
                ..Default::default()
            },
        }
    }

    fn run(pieces: &[&str], routes: ToolRoutes, finish: FinishReason) -> (Vec<Value>, Value) {
        let mut p = OutputParser::new(true, true);
        let mut w = ResponseWriter::new(json!({"id": "resp_1", "object": "response"}), routes, 8);
        let mut ev = w.start();
        for piece in pieces {
            for e in p.push(piece) {
                ev.extend(w.output(e));
            }
        }
        for e in p.finish() {
            ev.extend(w.output(e));
        }
        let (end, r) = w.finish(&outcome(finish), 2);
        ev.extend(end);
        (ev, r)
    }

    fn types(ev: &[Value]) -> Vec<&str> {
        ev.iter().map(|e| e["type"].as_str().unwrap()).collect()
    }

    #[test]
    fn reasoning_text_and_a_call_in_order() {
        let (ev, r) = run(
            &["thin", "king</think>\n\nLet me", " look.<tool_call>\n<function=ls>\n<parameter=path>\n/tmp\n</parameter>\n</function>\n</tool_call>"],
            ToolRoutes::default(),
            FinishReason::Stop,
        );
        assert_eq!(
            types(&ev),
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        let seqs: Vec<u64> = ev
            .iter()
            .map(|e| e["sequence_number"].as_u64().unwrap())
            .collect();
        assert_eq!(seqs, (0..ev.len() as u64).collect::<Vec<_>>());
        let out = r["output"].as_array().unwrap();
        assert_eq!(out[0]["type"], "reasoning");
        assert_eq!(out[0]["content"][0]["text"], "thinking");
        assert_eq!(out[1]["content"][0]["text"], "Let me look.");
        assert_eq!(out[1]["status"], "completed");
        assert_eq!(out[2]["name"], "ls");
        assert_eq!(out[2]["arguments"], "{\"path\":\"/tmp\"}");
        assert_eq!(ev[18]["arguments"], out[2]["arguments"]);
        assert_eq!(ev[16]["item"]["id"], out[2]["id"]);
        assert_eq!(r["status"], "completed");
        assert_eq!(
            r["usage"],
            json!({"input_tokens": 10, "input_tokens_details": {"cached_tokens": 4},
                "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 2},
                "total_tokens": 17})
        );
    }

    #[test]
    fn a_cut_reply_is_incomplete_and_namespaced_calls_route_back() {
        let (_, r) = run(
            &["</think>partial"],
            ToolRoutes::default(),
            FinishReason::Length,
        );
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["status"], "incomplete");

        let (_, routes) =
            super::super::input::tools(&[json!({"type": "namespace", "name": "agents",
            "description": "", "tools": [{"type": "function", "name": "spawn"}]})])
            .unwrap();
        let (_, r) = run(
            &["</think><tool_call>{\"name\": \"agents__spawn\", \"arguments\": {}}</tool_call>"],
            routes,
            FinishReason::Stop,
        );
        assert_eq!(r["output"][0]["name"], "spawn");
        assert_eq!(r["output"][0]["namespace"], "agents");
    }

    #[test]
    fn calls_over_the_limit_are_dropped() {
        let mut w = ResponseWriter::new(json!({}), ToolRoutes::default(), 1);
        let mut call = || {
            let mut p = OutputParser::new(false, true);
            let mut ev = p.push("<tool_call>\n<function=f>\n</function>\n</tool_call>");
            ev.extend(p.finish());
            ev.into_iter().flat_map(|e| w.output(e)).collect::<Vec<_>>()
        };
        assert_eq!(call().len(), 4);
        assert!(call().is_empty());
        let (_, r) = w.finish(&outcome(FinishReason::Stop), 0);
        assert_eq!(r["output"].as_array().unwrap().len(), 1);
    }
}
